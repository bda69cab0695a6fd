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
import secrets
import socket
import struct
import sys
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import torch
from torch.utils._pytree import tree_unflatten, treespec_loads

from pitstop.strategy.heal_auth import (
    AUTH,
    MAX_NONCES,
    PATH,
    WINDOW_S,
    Nonces,
    authorization,
    derive_keys,
    request_mac,
)
from pitstop.strategy.heal_manifest import (
    HealTransportError,
    check_manifest,
    inverse,
    prepare,
    Served,
)

try:
    from torchft.checkpointing import CheckpointTransport
except ImportError:  # (torchft is optional: FT.setup refuses in one line without it)
    CheckpointTransport = object  # type: ignore[assignment,misc]

log = logging.getLogger("pitstop.strategy")

MAGIC = b"PSH1"
MAX_MANIFEST_BYTES = 64 << 20  # a manifest is ~100 bytes a leaf: room for ~500k leaves
CHUNK = 4 << 20  # bytes per write of a tensor's data


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
        self._served: Served | None = None
        # (in the path, hence under each request's MAC: a request signed for another group's server, serving the same
        # step, is refused here)
        self._instance = secrets.token_hex(8)
        self._nonces = Nonces()
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
        served = prepare(int(step), state_dict)
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
def _stream(req: BaseHTTPRequestHandler, served: Served, nonce: str, key: bytes) -> None:
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
    spec, leaves = check_manifest(manifest, step, nonce, failed)
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
            value = value.view(getattr(torch, leaf["t"])).reshape([shape[d] for d in order]).permute(inverse(order))
        out.append(value)
    return tree_unflatten(out, treespec_loads(spec))


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
