"""The heal transport of strategy=ft (``pitstop.strategy.heal_transport``) over real HTTP on loopback: a peer's state
arrives bit for bit, nothing is unpickled, and a request or an answer without the job's secret is refused in one
line: a stranger gets 403 (and the server goes on serving the right peer), a byte flipped in transit, another step,
or a leaf that is no tensor and no JSON scalar never becomes a state; a group of a job of several without the
secret is refused in one line."""

from __future__ import annotations

import math
import socket
import threading
import urllib.error
import urllib.request
from collections import OrderedDict
from datetime import timedelta
from typing import Callable

import pytest
import torch

from pitstop.strategy import heal_transport
from pitstop.strategy.heal_transport import HealTransportError, RawHTTPTransport

SECRET = "ab" * 32
T = timedelta(seconds=5)


def pitstop_like_state() -> dict:
    """The shape of what torchft sends for pitstop: the live state under "user", torchft's counters beside it."""
    g = torch.Generator().manual_seed(0)
    conv = torch.randn(4, 3, 2, 2, generator=g).to(memory_format=torch.channels_last)
    weird = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45])
    model = OrderedDict(
        [
            ("conv.weight", conv),
            ("fc.weight", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
            ("fc.bias", torch.randn(5, generator=g).t()),
            ("bn.num_batches_tracked", torch.tensor(7, dtype=torch.int64)),
            ("transposed", torch.arange(12, dtype=torch.int64).reshape(3, 4).t()),
            ("expanded", torch.ones(1, 3).expand(2, 3)),  # (not dense: travels as a contiguous copy)
            ("empty", torch.empty(0, 3)),
            ("mask", torch.tensor([True, False, True])),
            ("weird", weird),
            ("half", torch.randn(2, 2, generator=g).to(torch.float16)),
        ]
    )
    optimizer = {
        "state": {
            0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros_like(conv), "exp_avg_sq": torch.ones_like(conv)},
            1: {"step": torch.tensor(3.0), "momentum_buffer": None},
        },
        "param_groups": [
            {"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False, "foreach": None, "params": [0, 1]}
        ],
    }
    train = {
        "step": 7,
        "samples_seen": 2**70,  # (a Python int beyond int64)
        "loader": {"kind": "replica", "epoch": 1, "position": 448, "stats": {}},
        "scheduler": {"base_lrs": [0.1], "last_epoch": 7, "_last_lr": [0.0999], "lr_lambdas": [{"anchor": 0.0}]},
        "rng": {"python": [3, list(range(5)), None], "numpy": ["MT19937", [1, 2], 3, 0, -0.0], "torch": "QUJD"},
        "fingerprint": {"data": "digits ✓", "seed": 0},
        "empty": [],
        "nested": ((), {}),
    }
    return {"user": {"pitstop": {"model": model, "optimizer": optimizer, "train": train}},
            "torchft": {"step": 7, "batches_committed": 14}}  # fmt: skip


def assert_same(a, b, where: str = "") -> None:
    """Bit for bit: the same containers (types included), keys, scalars, and tensors (dtype, shape, bytes)."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.device.type) == (b.dtype, b.shape, "cpu"), where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b and (not isinstance(a, float) or math.copysign(1, a) == math.copysign(1, b)), where


@pytest.fixture
def transports():
    made: list[RawHTTPTransport] = []

    def make(secret: str = SECRET, timeout: timedelta = T) -> RawHTTPTransport:
        made.append(RawHTTPTransport(secret, timeout))
        return made[-1]

    yield make
    for t in made:
        t.shutdown()


def test_a_pitstop_state_arrives_bit_for_bit_from_a_server_on_loopback(transports):
    sender, receiver = transports(), transports()
    state = pitstop_like_state()
    sender.send_checkpoint([1], 7, state, T)
    url = sender.metadata()
    assert url.startswith("http://127.0.0.1:") and url.endswith("/heal/") and SECRET not in url
    assert sender._server.server_address[0] == "127.0.0.1"  # (no other interface)
    got = receiver.recv_checkpoint(0, url, 7, T)
    assert_same(state, got)
    conv = got["user"]["pitstop"]["model"]["conv.weight"]
    assert conv.is_contiguous(memory_format=torch.channels_last)  # (the memory order travels too)
    assert got["user"]["pitstop"]["optimizer"]["state"][0]["step"].dim() == 0
    # the same state again (another healing peer), then none once torchft disallows it
    assert_same(state, transports().recv_checkpoint(0, url, 7, T))
    sender.disallow_checkpoint()
    assert sender._served is None


def test_a_request_without_the_jobs_secret_gets_403_and_the_right_peer_is_served_after(transports):
    sender, stranger, peer = transports(), transports(secret="cd" * 32), transports()
    state = {"w": torch.arange(6.0)}
    sender.send_checkpoint([1], 3, state, T)
    with pytest.raises(HealTransportError) as e:
        stranger.recv_checkpoint(0, sender.metadata(), 3, T)
    assert "403" in str(e.value) and "\n" not in str(e.value)
    # someone who only knows the port: no token, or a wrong one, or the secret itself as the token
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Bearer {SECRET}"}):
        request = urllib.request.Request(sender.metadata() + "3", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=5)
        assert refused.value.code == 403
    assert_same(state, peer.recv_checkpoint(0, sender.metadata(), 3, T))


class Proxy:
    """A man in the middle on loopback: one request at a time, ``request(bytes)`` and ``response(bytes)`` may
    change what passes (the server answers one request per connection: HTTP/1.0)."""

    def __init__(
        self, target: str, request: Callable[[bytes], bytes] = bytes, response: Callable[[bytes], bytes] = bytes
    ):
        self.port = int(target.split(":")[2].split("/")[0])
        self.request, self.response = request, response
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/heal/"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            with client, socket.create_connection(("127.0.0.1", self.port)) as server:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += client.recv(65536)
                server.sendall(self.request(data))
                answer = b""
                while chunk := server.recv(1 << 20):
                    answer += chunk
                client.sendall(self.response(answer))

    def close(self) -> None:
        self.sock.close()


def flip(offset_from_end: int) -> Callable[[bytes], bytes]:
    def change(answer: bytes) -> bytes:
        b = bytearray(answer)
        b[len(b) - offset_from_end] ^= 0x01
        return bytes(b)

    return change


def test_a_byte_flipped_in_transit_is_refused_before_the_tree_is_rebuilt(transports, monkeypatch):
    sender, receiver = transports(), transports()
    sender.send_checkpoint([1], 5, {"a": torch.arange(64, dtype=torch.int64), "b": 1.5}, T)
    rebuilt = []
    unflatten = heal_transport.tree_unflatten
    monkeypatch.setattr(heal_transport, "tree_unflatten", lambda *a: rebuilt.append(a) or unflatten(*a))
    body_start = lambda answer: answer.index(b"\r\n\r\n") + 4  # noqa: E731
    cases = {
        "in a tensor's bytes": flip(32 + 100),  # (the last 32 bytes are the tag)
        "in the tag": flip(1),
        # (in the structure: "builtins.dict" -> "builtins.dicu", which torch would refuse to rebuild if it ever read it)
        "in the manifest": lambda a: a[: a.index(b"builtins.dict") + 12] + b"u" + a[a.index(b"builtins.dict") + 13 :],
        "in the magic": lambda a: a[: body_start(a)] + b"X" + a[body_start(a) + 1 :],
    }
    for case, change in cases.items():
        proxy = Proxy(sender.metadata(), response=change)
        try:
            with pytest.raises(HealTransportError) as e:
                receiver.recv_checkpoint(0, proxy.url, 5, T)
        finally:
            proxy.close()
        text = str(e.value)
        assert "failed verification" in text and "\n" not in text and proxy.url in text, (case, text)
        if case != "in the magic":
            assert "HMAC mismatch" in text and "a peer without this job's secret" in text, (case, text)
    assert rebuilt == []  # none of them got as far as the tree
    proxy = Proxy(sender.metadata())  # (the same proxy, passing everything: the state arrives)
    try:
        assert receiver.recv_checkpoint(0, proxy.url, 5, T)["b"] == 1.5 and len(rebuilt) == 1
    finally:
        proxy.close()


def test_another_step_is_refused_by_the_server_and_by_the_receiver(transports):
    sender, receiver = transports(), transports()
    sender.send_checkpoint([1], 5, {"a": torch.ones(2)}, T)
    with pytest.raises(HealTransportError, match=r"HTTP 409"):  # the server serves step 5, not 6
        receiver.recv_checkpoint(0, sender.metadata(), 6, T)
    # a man in the middle asks for step 5 where the receiver asked for 6: the manifest's step gives it away
    proxy = Proxy(sender.metadata(), request=lambda r: r.replace(b"GET /heal/6 ", b"GET /heal/5 "))
    try:
        with pytest.raises(HealTransportError, match=r"failed verification: the peer sent step 5, not step 6"):
            receiver.recv_checkpoint(0, proxy.url, 6, T)
    finally:
        proxy.close()


def test_the_sender_refuses_a_leaf_that_is_neither_a_tensor_nor_a_json_scalar(transports):
    sender = transports()
    for leaf, name in ((object(), "object"), ({1, 2}, "set"), (b"raw", "bytes"), (torch.float32, "dtype")):
        with pytest.raises(HealTransportError) as e:
            sender.send_checkpoint([1], 1, {"user": {"pitstop": {"train": {"x": leaf}}}}, T)
        text = str(e.value)
        assert f"['user']['pitstop']['train']['x'] is a {name}" in text and "\n" not in text, text
    for tensor, why in (
        (torch.ones(2).to_sparse(), "of layout torch.sparse_coo"),
        (torch.ones(2, device="meta"), "on the meta device"),
    ):
        with pytest.raises(HealTransportError, match=rf"the heal state's tensor \['q'\] is {why}"):
            sender.send_checkpoint([1], 1, {"q": tensor}, T)
    with pytest.raises(HealTransportError, match=r"structure"):  # a key JSON cannot carry back
        sender.send_checkpoint([1], 1, {(1, 2): torch.ones(1)}, T)
    assert sender._served is None  # nothing is served after a refusal


def test_nothing_is_served_before_send_checkpoint(transports):
    sender, receiver = transports(timeout=timedelta(seconds=0.3)), transports()
    with pytest.raises(HealTransportError, match=r"HTTP 503"):  # (the request waited for a state, in vain)
        receiver.recv_checkpoint(0, sender.metadata(), 0, T)
    with pytest.raises(HealTransportError, match=r"not a pitstop heal address"):  # torchft's own transport's address
        receiver.recv_checkpoint(0, "http://127.0.0.1:1/checkpoint/", 0, T)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_tensors_arrive_on_the_cpu_bit_for_bit(transports):
    sender, receiver = transports(), transports()
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {"w": torch.randn(64, 64, device="cuda", generator=g).to(torch.bfloat16), "n": torch.arange(5).cuda()}
    sender.send_checkpoint([1], 2, state, T)
    got = receiver.recv_checkpoint(0, sender.metadata(), 2, T)
    assert_same({k: v.cpu() for k, v in state.items()}, got)


def test_a_group_of_a_job_of_several_without_the_jobs_secret_is_refused_in_one_line(monkeypatch):
    from pitstop.errors import ConfigError
    from conftest import ft_strategy

    monkeypatch.delenv("PITSTOP_FT_SECRET", raising=False)
    group = ft_strategy(replicas=2, replica_id=1, lighthouse="10.0.0.1:29510", cpu_threads=torch.get_num_threads(),
                        device="cpu")  # fmt: skip
    with pytest.raises(ConfigError) as e:  # (before it builds anything: no Lighthouse is asked)
        group.setup()
    text = str(e.value)
    assert text.startswith("strategy=ft: PITSTOP_FT_SECRET is not set") and "\n" not in text
    assert "the launcher makes one; for several machines export the same value on each" in text
