"""The heal transport of strategy=ft (``pitstop.strategy.heal_transport``) over real HTTP on loopback: a peer's state
arrives bit for bit, nothing is unpickled, and a request or an answer without the job's secret is refused in one
line: a stranger gets 403 (and the server goes on serving the right peer); a request seen on the wire is worth
nothing later (replayed, sent to another group's server, changed to another step, expired: refused); the static
bearer token of earlier versions gets 401; a byte flipped in transit, another step, or a leaf that is no tensor and
no JSON scalar never becomes a state; a group of a job of several without the secret is refused in one line."""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import re
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from datetime import timedelta
from typing import Callable

import pytest
import torch

from pitstop.strategy import heal_auth, heal_transport
from pitstop.strategy.heal_transport import HealTransportError, RawHTTPTransport, authorization, derive_keys

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
    assert re.fullmatch(r"http://127\.0\.0\.1:[0-9]+/heal/[0-9a-f]{16}/", url) and SECRET not in url
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


def get(url: str, headers: dict) -> tuple[int, bytes]:
    """A raw GET: the status and the body (the state's stream when 200, the error page otherwise)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def signed(url: str, step: int, when: float | None = None, secret: str = SECRET, nonce: str | None = None) -> dict:
    """The headers of a request for ``step`` at ``url`` signed as the transport signs it (at ``when``)."""
    path = url.split(":", 2)[2].split("/", 1)[1]
    when = int(time.time() if when is None else when)
    key = derive_keys(secret)[0]
    return {"Authorization": authorization(key, f"/{path}{step}", step, nonce or secrets.token_hex(16), when)}


def test_a_request_without_the_jobs_secret_gets_403_and_the_right_peer_is_served_after(transports, caplog):
    sender, stranger, peer = transports(), transports(secret="cd" * 32), transports()
    state = {"w": torch.arange(6.0)}
    sender.send_checkpoint([1], 3, state, T)
    with caplog.at_level(logging.WARNING, logger="pitstop.strategy"), pytest.raises(HealTransportError) as e:
        stranger.recv_checkpoint(0, sender.metadata(), 3, T)
    text = str(e.value)
    assert "answered 403 (a request not signed with this job's secret)" in text and "\n" not in text, text
    # the refusal is logged once, naming the peer's address and not what it sent
    (record,) = [r for r in caplog.records if "refused" in r.getMessage()]
    assert record.getMessage() == (
        "heal transport: refused a request from 127.0.0.1: a request not signed with this job's secret (403)"
    )
    # someone who only knows the port: no token, a wrong one, the secret itself, or the static bearer token earlier
    # versions sent with every request (whoever saw it once could fetch any later state): 401, no state
    old_token = hmac.new(SECRET.encode(), b"pitstop heal: bearer token", hashlib.sha256).hexdigest()
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Bearer {SECRET}"},
                    {"Authorization": f"Bearer {old_token}"}):  # fmt: skip
        code, body = get(sender.metadata() + "3", headers)
        assert code == 401 and b"PSH1" not in body, (headers, code)
    assert get(sender.metadata() + "3", signed(sender.metadata(), 3, secret="cd" * 32))[0] == 403
    assert get(sender.metadata() + "3", signed(sender.metadata(), 3))[0] == 200  # (the same, with the job's secret)
    assert_same(state, peer.recv_checkpoint(0, sender.metadata(), 3, T))


def test_a_request_seen_on_the_wire_cannot_be_replayed_nor_sent_to_another_group(transports):
    sender, other, receiver = transports(), transports(), transports()
    state = {"w": torch.arange(6.0)}
    sender.send_checkpoint([1], 4, state, T)
    other.send_checkpoint([1], 4, state, T)  # (another group, serving the same step)
    seen: list[bytes] = []
    proxy = Proxy(sender.metadata(), request=lambda r: seen.append(r) or r)
    try:
        assert_same(state, receiver.recv_checkpoint(0, proxy.url, 4, T))  # the genuine request
    finally:
        proxy.close()
    (request,) = seen
    assert b"Authorization: PitstopHeal t=" in request

    def send(port: int, raw: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(raw)
            answer = b""
            while chunk := s.recv(1 << 16):
                answer += chunk
            return answer

    port = lambda t: int(t.metadata().split(":")[2].split("/")[0])  # noqa: E731
    again = send(port(sender), request)
    assert again.startswith(b"HTTP/1.0 403 a replayed request (its nonce was seen before)\r\n"), again[:200]
    assert b"PSH1" not in again
    # to another group's server, whose path names another instance: the same request is not its own
    elsewhere = request.replace(
        sender.metadata().split("/heal/")[1].encode(), other.metadata().split("/heal/")[1].encode()
    )
    assert send(port(other), elsewhere).startswith(b"HTTP/1.0 403 a request not signed with this job's secret")
    assert send(port(other), request).startswith(b"HTTP/1.0 403 a request signed for another group's server")


def test_a_request_outside_its_validity_window_is_refused(transports):
    sender = transports()
    sender.send_checkpoint([1], 2, {"w": torch.ones(3)}, T)
    url, now = sender.metadata(), time.time()
    window = heal_transport.WINDOW_S
    # (the time is signed in whole seconds: 5 s beyond the window reads as 4 to 6)
    cases = {window + 5: rf"an expired request \(signed ({window + 5}|{window + 6})s ago, at most {window}s\)",
             -(window + 5): rf"a request signed ({window + 4}|{window + 5})s ahead of this machine's clock \(at most "
                            rf"{window}s\)"}  # fmt: skip
    for late, why in cases.items():
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(url + "2", headers=signed(url, 2, now - late)), timeout=5)
        assert refused.value.code == 403 and re.fullmatch(why, refused.value.reason), refused.value.reason
        assert b"PSH1" not in refused.value.read()
    # within the window either way (clocks that differ by less): served
    for late in (window - 5, -(window - 5)):
        code, body = get(url + "2", signed(url, 2, now - late))
        assert code == 200 and body.startswith(b"PSH1"), (late, code)


def test_the_nonces_remembered_are_bounded_and_forgotten_only_once_their_request_expired():
    nonces = heal_auth.Nonces(window=30, limit=3)
    assert [nonces.first_use(n, 100, 100) for n in "abc"] == [True, True, True]
    assert nonces.first_use("a", 100, 110) is False  # (a replay, within the window)
    assert nonces.first_use("d", 100, 110) is None  # full: refused, nothing forgotten early
    assert nonces.first_use("a", 100, 130) is False  # (still within its window: 100 + 30)
    assert nonces.first_use("d", 131, 131) is True and len(nonces._expiry) == 1  # (a, b, c expired: forgotten)


class Proxy:
    """A man in the middle on loopback: one request at a time, ``request(bytes)`` and ``response(bytes)`` may
    change what passes (the server answers one request per connection: HTTP/1.0)."""

    def __init__(
        self, target: str, request: Callable[[bytes], bytes] = bytes, response: Callable[[bytes], bytes] = bytes
    ):
        self.port = int(target.split(":")[2].split("/")[0])
        self.request, self.response = request, response
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/{target.split('/', 3)[3]}"  # (the same path)
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


def test_another_step_is_refused_by_the_server_and_a_changed_step_or_path_too(transports):
    sender, receiver = transports(), transports()
    sender.send_checkpoint([1], 5, {"a": torch.ones(2)}, T)
    with pytest.raises(HealTransportError, match=r"HTTP 409 serving step 5, not 6"):  # signed for 6, 5 is served
        receiver.recv_checkpoint(0, sender.metadata(), 6, T)
    # a man in the middle changes what a request asks for: step 6 -> 5 (served), or its path (/06, the same step
    # number): the MAC the request carries is not theirs
    for change in (lambda r: r.replace(b"/6 HTTP", b"/5 HTTP"), lambda r: r.replace(b"/6 HTTP", b"/06 HTTP")):
        proxy = Proxy(sender.metadata(), request=change)
        try:
            with pytest.raises(HealTransportError) as e:
                receiver.recv_checkpoint(0, proxy.url, 6, T)
        finally:
            proxy.close()
        assert "answered 403 (a request not signed with this job's secret)" in str(e.value), str(e.value)


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
