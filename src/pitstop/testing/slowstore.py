"""A remote-storage emulator: serves a directory over HTTP with added latency, limited bandwidth and faults.

    python -m pitstop.testing.slowstore DIR --port 8000 --latency-ms 50 --mbps 100
    python -m recipe.train data.root=http://127.0.0.1:8000/digits loader=cached
    python -m pitstop.testing.slowstore --upstream http://127.0.0.1:9000 --port 8001   # in front of an S3 API

Every response waits ``--latency-ms`` before its first byte and then streams at most ``--mbps`` megabytes
per second (1 MB = 1e6 bytes) per connection, like a request to an object store; ``--link-mbps`` caps all
connections together (a machine's network link: they share it, first come first served).  A ``Range:
bytes=A-B`` request gets that range (206), as from an object store (``--no-ranges``: the whole file, 200).
``--fail-every N`` answers every Nth request with HTTP 503; ``--truncate-every N`` cuts every Nth response in
half (the connection closes early, as a flaky network does); ``--drop-upload-every N`` (with ``--upstream``)
reads half of every Nth request that has a body (a PUT of an object or a part) and closes the connection
without an answer (an upload cut off mid-way); ``--stall-after N`` stops answering after N requests (a hung
backend: each later request waits ``--stall-seconds``; ``--stall-count K``: only the K requests after those).
``--fault-glob '*.tar'`` limits these to matching paths, ``--fault-methods PUT`` to those methods.
``GET /__stats`` returns JSON counters (requests, ranged requests and bytes per path; the faults injected),
which tests use to check how often each shard was downloaded.  Threaded: one thread per connection.

``--upstream URL`` serves no directory: every request (any method, headers and body as sent) is passed to
another HTTP server, an S3 API server for instance (``AWS_ENDPOINT_URL`` then points at the slowstore), and
its answer comes back with the same latency, bandwidth and faults.
"""

from __future__ import annotations

import argparse
import fnmatch
import http.client
import json
import os
import posixpath
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class SlowStore(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # (socketserver's default listen backlog is 5: a cached loader's readers open up to 8 ranged downloads at once, and
    # with the plain loader's workers beside them a connection could be refused and retried, as no object store does)
    request_queue_size = 128

    def __init__(
        self,
        root: str,
        host: str = "127.0.0.1",
        port: int = 0,
        latency_ms: float = 0.0,
        mbps: float | None = None,
        fail_every: int = 0,
        truncate_every: int = 0,
        fault_glob: str = "*",
        stall_after: int = 0,
        stall_seconds: float = 3600.0,
        stall_count: int = 0,
        upstream: str | None = None,
        link_mbps: float | None = None,
        ranges: bool = True,
        drop_upload_every: int = 0,
        fault_methods: str = "",
    ):
        super().__init__((host, port), _Handler)
        self.root = os.path.abspath(root) if root else ""
        self.upstream = urllib.parse.urlsplit(upstream) if upstream else None
        self.latency, self.rate = latency_ms / 1000.0, (mbps * 1e6 if mbps else None)
        self.fail_every, self.truncate_every, self.fault_glob = int(fail_every), int(truncate_every), fault_glob
        self.stall_after, self.stall_seconds, self.stall_count = (
            int(stall_after),
            float(stall_seconds),
            int(stall_count),
        )
        self.drop_upload_every = int(drop_upload_every)
        self.fault_methods = {m.strip().upper() for m in fault_methods.split(",") if m.strip()}  # empty: every one
        self.ranges = bool(ranges)  # False: a Range header is ignored (the whole file, 200), as some servers do
        self.link_rate = link_mbps * 1e6 if link_mbps else None
        self.link_free = 0.0  # (monotonic) when the link has sent every block handed to it so far
        self.lock = threading.Lock()
        self.requests = self.faultable = self.uploads = 0
        self.injected = {"failed": 0, "truncated": 0, "dropped_uploads": 0}
        self.per_path: dict[str, dict[str, int]] = {}

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "SlowStore":
        # (polled every 50 ms for stop(), not socketserver's 0.5 s: each test that stops a store waited that long)
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True, name="slowstore").start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def faults(self, method: str, path: str) -> bool:
        """Whether a request may get an injected fault (``fault_glob``, ``fault_methods``)."""
        return fnmatch.fnmatch(path, self.fault_glob) and (not self.fault_methods or method in self.fault_methods)

    def stats(self) -> dict:
        with self.lock:
            return {
                "requests": self.requests,
                "paths": json.loads(json.dumps(self.per_path)),
                "injected": dict(self.injected),
            }

    def __enter__(self) -> "SlowStore":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    server: SlowStore
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet: tests and benchmarks read /__stats instead
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        srv = self.server
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        if path == "/__stats":
            return self._send(200, json.dumps(srv.stats()).encode(), "application/json")
        if srv.upstream is not None:
            return self._proxy()
        if self.command not in ("GET", "HEAD"):
            return self._send(405, b"slowstore: read-only\n", "text/plain")
        admitted = self._admit(path)
        if admitted is None:
            return
        n, entry = admitted
        rel = posixpath.normpath(path).lstrip("/")
        full = os.path.join(srv.root, rel)
        if rel.startswith("..") or not os.path.isfile(full):
            return self._send(404, b"not found\n", "text/plain")
        size = os.path.getsize(full)
        span = _byte_range(self.headers.get("Range"), size) if srv.ranges else None
        with open(full, "rb") as f:
            if span is None:
                return self._stream(200, [("Content-Type", "application/octet-stream")], f, size, n, entry)
            start, end = span
            if start == end:
                return self._send(416, f"slowstore: range not satisfiable ({size} bytes)\n".encode(), "text/plain")
            f.seek(start)
            headers = [
                ("Content-Type", "application/octet-stream"),
                ("Content-Range", f"bytes {start}-{end - 1}/{size}"),
            ]
            self._stream(206, headers, f, end - start, n, entry)

    def _admit(self, path: str) -> tuple[int, dict] | None:
        """Count the request, wait its latency, inject its fault; None when the fault already answered it."""
        srv = self.server
        with srv.lock:
            srv.requests += 1
            faultable = srv.faults(self.command, path)
            srv.faultable += faultable
            n = srv.faultable if faultable else 0
            entry = srv.per_path.setdefault(path, {"requests": 0, "bytes": 0, "ranged": 0})
            entry["requests"] += 1
            entry["ranged"] += "Range" in self.headers
        if srv.latency:
            time.sleep(srv.latency)
        if (
            n
            and srv.stall_after
            and n > srv.stall_after
            and (not srv.stall_count or n <= srv.stall_after + srv.stall_count)
        ):
            # the store stops answering (a hung backend), for good or for stall_count requests
            time.sleep(srv.stall_seconds)
        if n and srv.fail_every and n % srv.fail_every == 0:
            with srv.lock:
                srv.injected["failed"] += 1
            self._send(503, b"slowstore: injected failure\n", "text/plain")
            return None
        return n, entry

    def _stream(self, code: int, headers: list[tuple[str, str]], body, size: int, n: int, entry: dict) -> None:
        """Send ``size`` bytes of ``body`` (a file) at most at the store's rate; cut short on a truncate fault."""
        srv = self.server
        send = size // 2 if n and srv.truncate_every and n % srv.truncate_every == 0 else size
        if send < size:
            with srv.lock:
                srv.injected["truncated"] += 1
        self.send_response(code)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(size))
        self.end_headers()
        t0, sent = time.monotonic(), 0
        try:
            while sent < send and self.command != "HEAD":
                block = body.read(min(1 << 16, send - sent))
                if not block:
                    break
                self.wfile.write(block)
                sent += len(block)
                wait = sent / srv.rate - (time.monotonic() - t0) if srv.rate else 0.0
                if srv.link_rate:  # the shared link: this block leaves after every block queued before it
                    with srv.lock:
                        now = time.monotonic()
                        srv.link_free = max(srv.link_free, now) + len(block) / srv.link_rate
                        wait = max(wait, srv.link_free - now)
                if wait > 0:
                    time.sleep(wait)
        except (BrokenPipeError, ConnectionResetError):
            pass
        with srv.lock:
            entry["bytes"] += sent
        if send < size:
            self.close_connection = True

    def _proxy(self) -> None:
        """Pass this request to the upstream server; its answer comes back through latency, rate and faults."""
        import io

        srv, up = self.server, self.server.upstream
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        length = int(self.headers.get("Content-Length") or 0)
        if length and srv.drop_upload_every and srv.faults(self.command, path):
            with srv.lock:
                srv.uploads += 1
                drop = srv.uploads % srv.drop_upload_every == 0
                srv.injected["dropped_uploads"] += drop
            if drop:  # half the body arrives, then the connection is gone: no answer at all
                self.rfile.read(length // 2)
                self.close_connection = True
                return
        body = self.rfile.read(length)
        admitted = self._admit(path)
        if admitted is None:
            return
        conn = http.client.HTTPConnection(up.hostname, up.port or 80, timeout=300)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in self.headers.items():
                if k.lower() not in ("connection", "keep-alive", "proxy-connection", "transfer-encoding"):
                    conn.putheader(k, v)
            conn.endheaders(body or None)
            resp = conn.getresponse()
            data = resp.read()
            headers = [
                (k, v)
                for k, v in resp.getheaders()
                if k.lower()
                not in ("content-length", "connection", "transfer-encoding", "keep-alive", "date", "server")
            ]
        except OSError as e:
            return self._send(502, f"slowstore: upstream {up.geturl()}: {e}\n".encode(), "text/plain")
        finally:
            conn.close()
        size = int(resp.getheader("Content-Length") or len(data)) if self.command == "HEAD" else len(data)
        self.close_connection = True  # one request per client connection, as the upstream gets them
        self._stream(resp.status, [*headers, ("Connection", "close")], io.BytesIO(data), size, *admitted)

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET  # noqa: N815 - proxied (a directory answers GET and HEAD)

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``[start, end)`` of a single ``bytes=A-B`` (or ``A-``, ``-N``) range within ``size``; None: the whole file
    (no range, or one this does not parse); ``(0, 0)``: a range that is not satisfiable (HTTP 416)."""
    if not header or not header.startswith("bytes=") or "," in header:
        return None
    first, _, last = header[len("bytes=") :].strip().partition("-")
    try:
        if not first:
            start, end = max(0, size - int(last)), size
        else:
            start, end = int(first), min(int(last) + 1 if last else size, size)
    except ValueError:
        return None
    return (start, end) if start < end else (0, 0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pitstop.testing.slowstore", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", nargs="?", help="directory to serve (e.g. data/)")
    p.add_argument("--upstream", help="instead of a directory: pass every request to this server (an S3 API)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--latency-ms", type=float, default=50.0, help="delay before each response (default 50)")
    p.add_argument("--mbps", type=float, default=100.0, help="MB/s per connection, 0 = unlimited (default 100)")
    p.add_argument("--link-mbps", type=float, default=0.0, help="MB/s of all connections together, 0 = unlimited")
    p.add_argument("--no-ranges", action="store_true", help="ignore Range headers (answer 200, the whole file)")
    p.add_argument("--fail-every", type=int, default=0, help="answer every Nth request with HTTP 503")
    p.add_argument("--truncate-every", type=int, default=0, help="cut every Nth response short")
    p.add_argument("--drop-upload-every", type=int, default=0, help="(--upstream) cut every Nth upload off mid-way")
    p.add_argument("--stall-after", type=int, default=0, help="stop answering after N requests")
    p.add_argument("--stall-seconds", type=float, default=3600.0, help="how long a stalled request waits")
    p.add_argument("--stall-count", type=int, default=0, help="stall only this many requests (0 = all after N)")
    p.add_argument("--fault-glob", default="*", help="faults only for paths matching this (e.g. '*.tar')")
    p.add_argument("--fault-methods", default="", help="faults only for these methods (e.g. PUT,POST; default: all)")
    a = p.parse_args(argv)
    if bool(a.dir) == bool(a.upstream):
        p.error("give a directory to serve or --upstream URL, not both")
    if a.dir and not os.path.isdir(a.dir):
        p.error(f"{a.dir} is not a directory")
    try:
        srv = SlowStore(
            a.dir,
            a.host,
            a.port,
            a.latency_ms,
            a.mbps or None,
            a.fail_every,
            a.truncate_every,
            a.fault_glob,
            a.stall_after,
            a.stall_seconds,
            a.stall_count,
            a.upstream,
            a.link_mbps or None,
            not a.no_ranges,
            a.drop_upload_every,
            a.fault_methods,
        )
    except OSError as e:
        p.error(f"cannot listen on {a.host}:{a.port}: {e.strerror}; pick another --port")
    print(
        f"slowstore: serving {srv.root or a.upstream} at {srv.url} (latency {a.latency_ms:g} ms, "
        f"{a.mbps or 'unlimited'} MB/s per connection, {a.link_mbps or 'unlimited'} MB/s in all)",
        flush=True,
    )
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
