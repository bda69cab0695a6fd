"""How a healing replica group receives a live peer's state (``strategy=ft``): raw tensor bytes over HTTP, with a
JSON manifest, authenticated by the job's secret. Nothing is unpickled.

torchft's default transport (``HTTPTransport``) listens on every interface and decodes what it receives with
``torch.load(weights_only=False)``: anyone who can reach the port of a group that is healing can run code in it.
:class:`RawHTTPTransport` takes its place:

- **Where it listens.** ``bind_host``: ``127.0.0.1`` when the whole job is on this machine (pitstop started its
  Lighthouse, on loopback); every interface (``::``) when groups run on several machines.
- **Who may read.** Each request is signed: ``Authorization: PitstopHeal t=TIME,n=NONCE,m=MAC``, the MAC an
  HMAC-SHA256 (keyed by a key derived from the job's secret, ``PITSTOP_FT_SECRET``) over the method, the path (which
  names this server's instance and the step), the step, a fresh random nonce and the time (Unix seconds). The server
  accepts a request only if its MAC matches (``hmac.compare_digest``), its time is within ``WINDOW_S`` (30 s) of
  the server's clock either way (the clocks of a job's machines must agree to within that: NTP does), its nonce was
  not seen before (nonces are remembered until their request expires, at most ``MAX_NONCES``), it names this server
  and the step it serves now. Refused: 401 (no signed request: none, or the static bearer token of earlier
  versions) or 403 (a MAC that does not match, an expired or replayed request, another server's), with no state in
  the body, and a warning naming the peer's address (once per address and reason). A request seen on the wire is
  worth nothing later: it cannot be replayed, nor changed to ask for another step or another group's state. The
  secret itself never travels, and the address that torchft hands around (:meth:`RawHTTPTransport.metadata`) never
  holds it. There is no TLS: whoever reads the wire reads the state in flight; the tags below keep them from
  changing it.
- **What travels.** One response: ``PSH1``, the manifest's length (8 bytes, big-endian), the manifest (JSON: the
  step, the requester's nonce, the tree's structure as ``treespec_dumps`` writes it, and per leaf either a tensor's
  dtype name, shape, byte count and memory order, or a JSON scalar's value), an HMAC-SHA256 tag of all that, every
  tensor's raw bytes in leaf order, and an HMAC-SHA256 tag of everything before it. Both tags are keyed by another
  key derived from the secret (not the requests' key) and computed while streaming: the answer is authenticated too,
  and bound to its request by the nonce. The sender refuses a leaf that is neither a tensor nor a JSON scalar
  (``None``, bool, int, float, str), in one line naming it.
- **What the receiver accepts.** A manifest of bounded size whose tag matches, for the step it asked for and with
  its own nonce (no replay of an earlier answer), dtypes from an allowlist, byte counts that agree with the shapes,
  and a structure of plain containers only (dict, OrderedDict, list, tuple, torch.Size); the bytes are read into
  preallocated uint8 tensors, and the final tag is checked (``hmac.compare_digest``) before the tree is rebuilt.
  Any failure is one line naming what failed; torchft reports it and the group tries the next quorum.

Received tensors are CPU tensors (as torchft's transport delivered them): pitstop's load path copies them into
the model and the optimizer, on their devices. A tensor keeps its memory order (channels_last travels as such).
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import logging
import math
import re
import secrets
import socket
import struct
import sys
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import urlsplit

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten, treespec_dumps, treespec_loads

from pitstop.errors import PitstopError

try:
    from torchft.checkpointing import CheckpointTransport
except ImportError:  # (torchft is optional: FT.setup refuses in one line without it)
    CheckpointTransport = object  # type: ignore[assignment,misc]

log = logging.getLogger("pitstop.strategy")

MAGIC = b"PSH1"
MAX_MANIFEST_BYTES = 64 << 20  # a manifest is ~100 bytes a leaf: room for ~500k leaves
CHUNK = 4 << 20  # bytes per write of a tensor's data
# A signed request is accepted for WINDOW_S seconds after its time, and as long before it (the clocks of a job's
# machines may differ by that much); its nonce is remembered as long. MAX_NONCES bounds that memory: only requests
# with a valid MAC are remembered, so only a holder of the secret could fill it (then 503 until they expire).
WINDOW_S = 30
MAX_NONCES = 16384
SCHEME = "PitstopHeal"
AUTH = re.compile(rf"{SCHEME} t=([0-9]{{1,12}}),n=([0-9a-f]{{32}}),m=([0-9a-f]{{64}})")
PATH = re.compile(r"/heal/([0-9a-f]{16})/([0-9]{1,19})")
# Plain containers only: a structure naming anything else (defaultdict's factory, an enum: both imported by name when
# torch rebuilds them) is refused before torch reads it.
CONTAINERS = ("builtins.dict", "collections.OrderedDict", "builtins.list", "builtins.tuple", "torch.Size")
DTYPES = frozenset(
    name
    for name in (
        "float64 float32 float16 bfloat16 complex128 complex64 int64 int32 int16 int8 uint8 uint16 uint32 uint64 bool "
        "float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz float8_e8m0fnu"
    ).split()
    if isinstance(getattr(torch, name, None), torch.dtype)  # (torch's dtypes, by name: those of this version)
)
SCALARS = (bool, int, float, str)


class HealTransportError(PitstopError):
    """A heal's state could not be sent or received: refused, unverifiable, or not plain tensors and scalars."""


def derive_keys(secret: str) -> tuple[bytes, bytes]:
    """(the key of the requests' MACs, the key of the answers' tags): both from the job's secret, neither is it,
    and neither is the other (a tag an answer carried is no request's MAC)."""
    key = secret.encode()
    request_key = hmac.new(key, b"pitstop heal: request key", hashlib.sha256).digest()
    return request_key, hmac.new(key, b"pitstop heal: tag key", hashlib.sha256).digest()


def request_mac(key: bytes, method: str, path: str, step: int, nonce: str, when: int) -> str:
    """The MAC of one request: what it asks for (method, path, step), once (nonce), now (time)."""
    message = f"pitstop heal request v1\n{method}\n{path}\n{step}\n{nonce}\n{when}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def authorization(key: bytes, path: str, step: int, nonce: str, when: int) -> str:
    """The ``Authorization`` header of a GET of ``path`` for ``step``, signed at ``when`` (Unix seconds)."""
    return f"{SCHEME} t={when},n={nonce},m={request_mac(key, 'GET', path, step, nonce, when)}"


class _Nonces:
    """The nonces of the requests accepted within the window: a nonce is accepted once."""

    def __init__(self, window: float = WINDOW_S, limit: int = MAX_NONCES):
        self.window, self.limit = window, limit
        self._lock = threading.Lock()
        self._expiry: dict[str, float] = {}  # nonce -> when its request expires (insertion order ~ expiry order)

    def first_use(self, nonce: str, when: float, now: float) -> bool | None:
        """True the first time (remembered until ``when`` + the window), False again; None when full."""
        with self._lock:
            # (a request's time can be up to a window ahead of this clock: prune all that expired, not only the head)
            if len(self._expiry) >= self.limit or next(iter(self._expiry.values()), now) < now:
                self._expiry = {n: t for n, t in self._expiry.items() if t >= now}
            if nonce in self._expiry:
                return False
            if len(self._expiry) >= self.limit:
                return None
            self._expiry[nonce] = when + self.window
            return True


class _Gate:
    """Serving allowed for one step, or not: torchft allows it from ``send_checkpoint`` until
    ``disallow_checkpoint``, after which the live state may change; that waits for the reads in progress."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._cond = threading.Condition()
        self._step: int | None = None
        self._readers = 0

    def enter(self) -> int:
        with self._cond:
            if not self._cond.wait_for(lambda: self._step is not None, self.timeout):
                raise TimeoutError
            self._readers += 1
            return self._step  # type: ignore[return-value]

    def leave(self) -> None:
        with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    def allow(self, step: int) -> None:
        with self._cond:
            self._step = step
            self._cond.notify_all()

    def disallow(self) -> None:
        with self._cond:
            self._step = None
            if not self._cond.wait_for(lambda: self._readers == 0, self.timeout):
                raise HealTransportError(
                    f"a healing peer still reads this group's state after {self.timeout:g}s (strategy.timeout); "
                    f"the state cannot change under it"
                )


class _Served:
    """One step's state, ready to stream: the manifest's parts and each tensor's bytes (CPU, in memory order)."""

    def __init__(self, step: int, spec: str, leaves: list[dict], data: list[torch.Tensor]):
        self.step, self.spec, self.leaves, self.data = step, spec, leaves, data
        self.data_bytes = sum(int(d.numel()) for d in data)


class RawHTTPTransport(CheckpointTransport):
    """torchft's ``CheckpointTransport``: a peer's live state as raw tensor bytes over HTTP, authenticated by the
    job's secret (see the module's docstring)."""

    def __init__(self, secret: str, timeout: timedelta, bind_host: str = "127.0.0.1", host: str | None = None):
        """``bind_host``: where the server listens (``127.0.0.1``: one machine; ``::``: every interface); ``host``:
        the name peers reach it by (default: ``bind_host``, or this machine's host name when that is a wildcard)."""
        if not secret:
            raise HealTransportError("the heal transport needs the job's secret (PITSTOP_FT_SECRET)")
        self._request_key, self._key = derive_keys(secret)
        self._timeout = timeout.total_seconds()
        self._gate = _Gate(self._timeout)
        self._served: _Served | None = None
        # (in the path, hence under each request's MAC: a request signed for another group's server, serving the same
        # step, is refused here)
        self._instance = secrets.token_hex(8)
        self._nonces = _Nonces()
        self._warned: set[tuple[str, str]] = set()  # (peer address, reason) already logged as a warning
        wildcard = bind_host in ("", "::", "0.0.0.0")
        host = host or (socket.gethostname() if wildcard else bind_host)
        try:
            self._server = _server(self, bind_host)
        except OSError:  # (every interface, on a machine without IPv6: IPv4's)
            if bind_host != "::":
                raise
            self._server = _server(self, "0.0.0.0")
        port = self._server.server_address[1]
        self._url = f"http://{f'[{host}]' if ':' in host else host}:{port}/heal/{self._instance}/"
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.1,), name="pitstop-heal-server", daemon=True
        )  # (0.1 s: how long a shutdown waits for the loop)
        self._thread.start()
        log.debug("heal transport on %s", self._url)

    # ---- torchft's interface ----------------------------------------------------------------------------------
    def metadata(self) -> str:
        return self._url

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: object, timeout: timedelta) -> None:
        served = _prepare(int(step), state_dict)
        self._gate.disallow()  # (a state served before, still read: the reads end first)
        self._served = served
        self._gate.allow(int(step))

    def disallow_checkpoint(self) -> None:
        self._gate.disallow()
        self._served = None  # (the CPU copies of device tensors go)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        return fetch(metadata, int(step), self._request_key, self._key, timeout.total_seconds())

    def shutdown(self, wait: bool = True) -> None:
        def stop() -> None:
            self._server.shutdown()
            self._server.server_close()

        if wait:
            stop()
            self._thread.join()
        else:
            threading.Thread(target=stop, name="pitstop-heal-server-stop", daemon=True).start()

    # ---- the server's side --------------------------------------------------------------------------------------
    def _answer(self, req: BaseHTTPRequestHandler) -> None:
        signed = AUTH.fullmatch(req.headers.get("Authorization", ""))
        if signed is None:
            return self._refuse(req, 401, "no signed request (PitstopHeal): this job's secret is required")
        when, nonce, mac = int(signed.group(1)), signed.group(2), signed.group(3)
        path = PATH.fullmatch(req.path)
        if path is None:
            return self._refuse(req, 403, "a request for no heal state")
        step_asked = int(path.group(2))
        expected = request_mac(self._request_key, req.command, req.path, step_asked, nonce, when)
        if not hmac.compare_digest(expected.encode(), mac.encode()):
            return self._refuse(req, 403, "a request not signed with this job's secret")
        now = time.time()
        if now - when > WINDOW_S:
            return self._refuse(req, 403, f"an expired request (signed {now - when:.0f}s ago, at most {WINDOW_S}s)")
        if when - now > WINDOW_S:
            return self._refuse(
                req, 403, f"a request signed {when - now:.0f}s ahead of this machine's clock (at most {WINDOW_S}s)"
            )
        if path.group(1) != self._instance:
            return self._refuse(req, 403, "a request signed for another group's server")
        first = self._nonces.first_use(nonce, when, now)
        if first is None:
            return self._refuse(req, 503, f"{MAX_NONCES} requests within {WINDOW_S}s: try again later")
        if not first:
            return self._refuse(req, 403, "a replayed request (its nonce was seen before)")
        try:
            step = self._gate.enter()
        except TimeoutError:
            req.send_error(503, f"no state is served within {self._timeout:g}s")
            return
        try:
            served = self._served
            if served is None or step != step_asked:
                req.send_error(409, f"serving step {step}, not {step_asked}")
                return
            _stream(req, served, nonce, self._key)
        finally:
            self._gate.leave()

    def _refuse(self, req: BaseHTTPRequestHandler, code: int, why: str) -> None:
        """Refused without a byte of the state; a warning naming the peer's address (never what it sent), once per
        address and reason (a peer that keeps trying fills no log)."""
        peer = str(req.client_address[0])
        if (peer, why) not in self._warned and len(self._warned) < 1024:
            self._warned.add((peer, why))
            log.warning("heal transport: refused a request from %s: %s (%d)", peer, why, code)
        else:
            log.debug("heal transport: refused a request from %s: %s (%d)", peer, why, code)
        req.send_error(code, why)


def _server(transport: RawHTTPTransport, bind_host: str) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        timeout = transport._timeout  # (a peer that stalls mid-request cannot hold a thread for longer)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            try:
                transport._answer(self)
            except (BrokenPipeError, ConnectionResetError, TimeoutError, socket.timeout) as e:
                log.warning("heal transport: the reader went away (%s)", type(e).__name__)

        def log_message(self, format: str, *args: object) -> None:  # (debug, not stderr)
            log.debug("heal transport: " + format, *args)

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        daemon_threads = True
        request_queue_size = 128

    return Server((bind_host, 0), Handler)


# ---- sending ---------------------------------------------------------------------------------------------------
def _prepare(step: int, state: object) -> _Served:
    """The state flattened and checked; device tensors copied to CPU now (the server's threads touch no device)."""
    pairs, spec = tree_flatten_with_path(state)
    try:
        spec_text = treespec_dumps(spec)
        structure_ok = _check_spec(json.loads(spec_text)) == len(pairs) and treespec_loads(spec_text) == spec
    except (TypeError, ValueError, NotImplementedError, HealTransportError) as e:
        raise HealTransportError(
            f"the heal state's structure cannot travel as JSON ({str(e).splitlines()[0][:200]}): only dicts "
            f"(str/int/float/bool/None keys), OrderedDicts, lists and tuples"
        ) from None
    if not structure_ok:
        raise HealTransportError(
            "the heal state's structure does not survive JSON (a dict key that is not a str, int, float, bool or "
            "None?): only plain keys travel"
        )
    devices = {v.device for _, v in pairs if isinstance(v, torch.Tensor) and v.device.type not in ("cpu", "meta")}
    for device in devices:  # (the copies below must see the step's last kernels)
        sync = getattr(getattr(torch, device.type, None), "synchronize", None)
        if sync is not None:
            sync(device)
    leaves: list[dict] = []
    data: list[torch.Tensor] = []
    for path, value in pairs:
        if isinstance(value, torch.Tensor):
            meta, raw = _tensor_leaf(keystr(path), value)
            leaves.append(meta)
            data.append(raw)
        elif value is None or isinstance(value, SCALARS):
            base = next(t for t in SCALARS if isinstance(value, t)) if value is not None else None
            leaves.append({"v": base(value) if base is not None and type(value) is not base else value})
        else:
            raise HealTransportError(
                f"the heal state's leaf {keystr(path) or '(the root)'} is a {type(value).__name__}: only tensors and "
                f"JSON scalars (None, bool, int, float, str) travel to a healing peer"
            )
    return _Served(step, spec_text, leaves, data)


def _tensor_leaf(where: str, value: torch.Tensor) -> tuple[dict, torch.Tensor]:
    t = value.detach()
    name = str(t.dtype).removeprefix("torch.")
    why = (
        f"a {type(t).__name__} (a tensor subclass)"
        if type(t) is not torch.Tensor
        else f"of dtype {name}"
        if name not in DTYPES
        else f"of layout {t.layout}"
        if t.layout != torch.strided
        else "on the meta device (no data)"
        if t.device.type == "meta"
        else None
    )
    if why:
        raise HealTransportError(f"the heal state's tensor {where} is {why}: it cannot travel to a healing peer")
    t = t.resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.to("cpu")
    order = _memory_order(t)
    dense = t.permute(order) if order is not None else t.contiguous()
    raw = dense.reshape(-1).view(torch.uint8)
    meta = {"t": name, "shape": list(t.shape), "nbytes": int(raw.numel())}
    if order is not None and order != list(range(t.dim())):
        meta["order"] = order
    return meta, raw


def _memory_order(t: torch.Tensor) -> list[int] | None:
    """The dims from outermost to innermost in memory when ``t`` is dense (a permutation of a contiguous tensor:
    channels_last, a transpose); None when it is not (it travels as a contiguous copy)."""
    if t.dim() == 0:
        return None
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    return order if t.permute(order).is_contiguous() else None


def _stream(req: BaseHTTPRequestHandler, served: _Served, nonce: str, key: bytes) -> None:
    manifest = json.dumps(
        {"step": served.step, "nonce": nonce, "byteorder": sys.byteorder, "spec": served.spec, "leaves": served.leaves},
        separators=(",", ":"),
    ).encode()
    head = MAGIC + struct.pack(">Q", len(manifest)) + manifest
    mac = hmac.new(key, head, hashlib.sha256)
    head += mac.copy().digest()
    mac.update(head[-32:])
    req.send_response(200)
    req.send_header("Content-Type", "application/octet-stream")
    req.send_header("Content-Length", str(len(head) + served.data_bytes + 32))
    req.end_headers()
    req.wfile.write(head)
    for raw in served.data:
        view = memoryview(raw.numpy()) if raw.numel() else memoryview(b"")
        for at in range(0, len(view), CHUNK):
            piece = view[at : at + CHUNK]
            mac.update(piece)
            req.wfile.write(piece)
    req.wfile.write(mac.digest())


# ---- receiving -------------------------------------------------------------------------------------------------
def fetch(metadata: str, step: int, request_key: bytes, key: bytes, timeout: float) -> Any:
    """The state a peer serves at ``metadata`` for ``step``, asked for by a signed request and verified (see the
    module's docstring)."""
    try:
        url = urlsplit(metadata)
        port = url.port
    except ValueError:
        port = None
    if port is None or url.scheme != "http" or not PATH.fullmatch(f"{url.path}0") or not url.hostname:
        raise HealTransportError(
            f"the peer serves its state at {metadata!r}, not a pitstop heal address: every replica group of a job "
            f"must run the same pitstop"
        )
    nonce = secrets.token_hex(16)
    path = f"{url.path}{step}"
    signed = authorization(request_key, path, step, nonce, int(time.time()))
    conn = http.client.HTTPConnection(url.hostname, port, timeout=timeout)
    try:
        try:
            conn.request("GET", path, headers={"Authorization": signed})
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            raise HealTransportError(f"heal state from {metadata} unreachable ({type(e).__name__}: {e})") from None
        if resp.status in (401, 403):
            raise HealTransportError(
                f"heal state from {metadata} refused: the peer answered {resp.status} ({resp.reason}); every "
                f"machine of a job needs the same PITSTOP_FT_SECRET and clocks within {WINDOW_S}s of each other"
            )
        if resp.status != 200:
            raise HealTransportError(f"heal state from {metadata} refused: HTTP {resp.status} {resp.reason}")
        try:
            return _receive(resp, metadata, step, nonce, key)
        except (OSError, http.client.HTTPException) as e:
            raise HealTransportError(
                f"heal state from {metadata} broke off ({type(e).__name__}: {str(e)[:200]})"
            ) from None
    finally:
        conn.close()


def _receive(resp: http.client.HTTPResponse, metadata: str, step: int, nonce: str, key: bytes) -> Any:
    def failed(what: str) -> HealTransportError:
        return HealTransportError(f"heal state from {metadata} failed verification: {what}")

    head = _read(resp, len(MAGIC) + 8, metadata)
    if head[:4] != MAGIC:
        raise failed("not a pitstop heal stream (another transport, or another version of pitstop)")
    (size,) = struct.unpack(">Q", head[4:])
    if size > MAX_MANIFEST_BYTES:
        raise failed(f"a manifest of {size} bytes (at most {MAX_MANIFEST_BYTES})")
    manifest = _read(resp, size, metadata)
    mac = hmac.new(key, head + manifest, hashlib.sha256)
    tag = _read(resp, 32, metadata)
    if not hmac.compare_digest(mac.digest(), tag):
        raise failed("HMAC mismatch in the manifest (corrupted in transit, or a peer without this job's secret)")
    mac.update(tag)
    spec, leaves = _check_manifest(manifest, step, nonce, failed)
    length = resp.getheader("Content-Length")
    expected = len(head) + size + 32 + sum(leaf["nbytes"] for leaf in leaves if "t" in leaf) + 32
    if length is not None and length.isdigit() and int(length) != expected:
        raise failed(f"{length} bytes announced, the manifest says {expected}")
    values: list[Any] = []
    for leaf in leaves:
        if "t" not in leaf:
            values.append(leaf["v"])
            continue
        buf = torch.empty(leaf["nbytes"], dtype=torch.uint8)
        if leaf["nbytes"]:
            view = memoryview(buf.numpy())
            for at in range(0, len(view), CHUNK):
                piece = view[at : at + CHUNK]
                _read_into(resp, piece, metadata)
                mac.update(piece)
        values.append(buf)
    tag = _read(resp, 32, metadata)
    if not hmac.compare_digest(mac.digest(), tag):
        raise failed("HMAC mismatch (corrupted in transit, or a peer without this job's secret)")
    out = []
    for leaf, value in zip(leaves, values):
        if "t" in leaf:  # (the bytes in memory order, viewed back in the dims' order)
            shape = leaf["shape"]
            order = leaf.get("order", list(range(len(shape))))
            value = value.view(getattr(torch, leaf["t"])).reshape([shape[d] for d in order]).permute(_inverse(order))
        out.append(value)
    return tree_unflatten(out, treespec_loads(spec))


def _check_manifest(
    manifest: bytes, step: int, nonce: str, failed: Callable[[str], HealTransportError]
) -> tuple[str, list[dict]]:
    try:
        m = json.loads(manifest)
        if not isinstance(m, dict) or set(m) != {"step", "nonce", "byteorder", "spec", "leaves"}:
            raise ValueError("not the manifest's keys")
        if m["step"] != step or type(m["step"]) is not int:
            raise failed(f"the peer sent step {m['step']!r}, not step {step}")
        if m["nonce"] != nonce:
            raise failed("an answer to another request (a replay)")
        if m["byteorder"] != sys.byteorder:
            raise failed(f"the peer's byte order is {m['byteorder']!r}, this machine's {sys.byteorder}")
        leaves = m["leaves"]
        if not isinstance(m["spec"], str) or not isinstance(leaves, list):
            raise ValueError("spec or leaves of the wrong type")
        if _check_spec(json.loads(m["spec"])) != len(leaves):
            raise ValueError("the structure and the leaves disagree in number")
        for leaf in leaves:
            _check_leaf(leaf)
        return m["spec"], leaves
    except HealTransportError:
        raise
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        raise failed(f"a malformed manifest ({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})") from None


def _check_leaf(leaf: object) -> None:
    if not isinstance(leaf, dict):
        raise ValueError("a leaf that is not an object")
    if set(leaf) == {"v"}:
        if leaf["v"] is not None and type(leaf["v"]) not in SCALARS:
            raise ValueError("a scalar leaf that is not a JSON scalar")
        return
    if not {"t", "shape", "nbytes"} <= set(leaf) <= {"t", "shape", "nbytes", "order"}:
        raise ValueError(f"a leaf with keys {sorted(leaf)}")
    name, shape, nbytes = leaf["t"], leaf["shape"], leaf["nbytes"]
    if name not in DTYPES or not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"dtype {str(name)[:40]!r} is not one that travels")
    if not isinstance(shape, list) or len(shape) > 64 or any(type(n) is not int or n < 0 for n in shape):
        raise ValueError("a shape that is not a list of sizes")
    if type(nbytes) is not int or nbytes != math.prod(shape) * getattr(torch, name).itemsize:
        raise ValueError(f"{nbytes!r} bytes for a {name} tensor of shape {shape}")
    order = leaf.get("order", list(range(len(shape))))
    if (
        not isinstance(order, list)
        or sorted(order) != list(range(len(shape)))
        or any(type(d) is not int for d in order)
    ):
        raise ValueError("a memory order that is not a permutation of the dims")


def _check_spec(node: object) -> int:
    """The number of leaves of a ``treespec_dumps`` structure made of plain containers (refused otherwise, before
    torch reads it: its loader imports the names a defaultdict or an enum carries)."""
    if not (isinstance(node, list) and len(node) == 2 and node[0] == 1):
        raise ValueError("a structure of another format")
    return _spec_leaves(node[1])


def _spec_leaves(node: object) -> int:
    if not isinstance(node, dict) or set(node) != {"type", "context", "children_spec"}:
        raise ValueError("a structure node of another form")
    kind, context, children = node["type"], node["context"], node["children_spec"]
    if not isinstance(children, list):
        raise ValueError("a structure node's children are no list")
    if kind is None:
        if context is not None or children:
            raise ValueError("a leaf with a context")
        return 1
    if kind not in CONTAINERS or not isinstance(context, str):
        raise ValueError(f"a container of type {str(kind)[:60]!r}")
    keys = json.loads(context)
    if kind in ("builtins.dict", "collections.OrderedDict"):
        plain = isinstance(keys, list) and all(k is None or type(k) in SCALARS for k in keys)
        if not plain or len(set(keys)) != len(keys) or len(keys) != len(children):
            raise ValueError("a dict whose keys are not distinct plain keys, one per child")
    elif keys is not None:
        raise ValueError(f"a {kind} with a context")
    return sum(_spec_leaves(child) for child in children)


def _inverse(order: list[int]) -> list[int]:
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    return inverse


def _read(resp: http.client.HTTPResponse, n: int, metadata: str) -> bytes:
    buf = bytearray(n)
    _read_into(resp, memoryview(buf), metadata)
    return bytes(buf)


def _read_into(resp: http.client.HTTPResponse, view: memoryview, metadata: str) -> None:
    at = 0
    while at < len(view):
        got = resp.readinto(view[at:])
        if not got:
            raise HealTransportError(f"heal state from {metadata} ended early ({at} of {len(view)} bytes of a part)")
        at += got
