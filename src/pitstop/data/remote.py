"""Reading shards from where they live: a local path, ``http(s)://``, or any fsspec URL (``s3://``, ``gs://``...).

:func:`fetch` reads one shard with a per-request timeout, retries with exponential backoff, and checks
what arrived against the index (byte size, and sha256 when asked), so a truncated or corrupted response
is retried and then reported — naming the URL — instead of being decoded.  HTTP goes through the
standard library (``urllib``); other schemes through fsspec, whose backend the user installs
(``pip install s3fs``).  ``pipe:`` URLs (a shell command whose stdout is the shard, a webdataset
convention) run a command from the data index, so they are refused unless explicitly allowed.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import BinaryIO, Callable

from pitstop.errors import DataError
from pitstop.fsurl import is_url

CHUNK = 1 << 20
PART_BYTES = 2 << 20  # download_parts=auto: one ranged request per this many bytes of a shard ...
MAX_PARTS = 8  # ... and at most this many at once


@dataclass(frozen=True)
class ShardRef:
    """What a reader needs to fetch and verify one shard (picklable, sent to DataLoader workers)."""

    url: str
    bytes: int
    sha256: str
    samples: int


@dataclass(frozen=True)
class FetchPolicy:
    retries: int = 3  # attempts after the first
    backoff: float = 0.5  # seconds before the first retry; doubles each time
    timeout: float = 60.0  # seconds per request (connect + each read)
    allow_pipe: bool = False
    storage_options: dict = field(default_factory=dict, hash=False)  # fsspec options (loader.storage_options)
    parts: int | str = "auto"  # ranged requests per download in parallel: auto (by size), or N (1 = one request)

    def parts_for(self, ref: "ShardRef") -> int:
        """How many ranged requests fetch ``ref`` at once: one for a local file, a ``pipe:`` command, a shard of
        unknown size or a small one; else ``parts`` (auto: one per ``PART_BYTES``, at most ``MAX_PARTS``)."""
        if not ref.bytes or not is_url(ref.url) or ref.url.startswith("pipe:"):
            return 1
        if urllib.parse.urlsplit(ref.url).netloc in _NO_RANGES:
            return 1
        want = min(MAX_PARTS, ref.bytes // PART_BYTES) if self.parts == "auto" else int(self.parts)
        return max(1, min(want, ref.bytes // (64 << 10)))  # (never parts under 64 KB)


_NO_RANGES: set[str] = set()  # the HTTP hosts (of this process) that answered a range request with the whole file


def open_source(url: str, policy: FetchPolicy) -> tuple[BinaryIO, Callable[[], None]]:
    """A readable stream of ``url`` and a function to call once it is read to the end (a ``pipe:`` command's
    exit status)."""
    if url.startswith("pipe:"):
        if not policy.allow_pipe:
            raise DataError(
                f"refusing shell-command shard URL {url!r}: pipe: runs a command from the data index; "
                f"set loader.allow_pipe=true if you trust it"
            )
        proc = subprocess.Popen(url[len("pipe:") :], shell=True, stdout=subprocess.PIPE)  # noqa: S602 - opted in

        def done() -> None:
            if proc.wait() != 0:
                raise OSError(f"command exited with status {proc.returncode}")

        return proc.stdout, done  # type: ignore[return-value]
    if url.startswith(("http://", "https://")):
        return urllib.request.urlopen(url, timeout=policy.timeout), lambda: None  # noqa: S310 - the user's data URL
    if "://" not in url or url.startswith("file://"):
        return open(url.removeprefix("file://"), "rb"), lambda: None
    import fsspec

    return fsspec.open(url, "rb", **policy.storage_options).open(), lambda: None


class SinkError(Exception):
    """Writing what was read failed (e.g. the cache's disk is full): not the source's fault, not retried."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


def _copy(url: str, sink: BinaryIO, policy: FetchPolicy, progress: list[int]) -> tuple[int, str]:
    f, done = open_source(url, policy)
    h, n = hashlib.sha256(), 0
    ok = False
    try:
        while True:
            block = f.read(CHUNK)
            if not block:
                short = getattr(f, "length", None)  # HTTP: bytes still due by Content-Length (urllib does
                if short:  # not fail a body cut short by a closed connection)
                    raise ConnectionError(f"connection closed at byte offset {n}, {short} bytes short")
                break
            h.update(block)
            try:
                sink.write(block)
            except OSError as e:
                raise SinkError(e) from e
            n += len(block)
            progress[0] += len(block)
        ok = True
    finally:
        f.close()
        if not ok:
            try:
                done()  # reap a pipe: command
            except OSError:
                pass
    done()
    return n, h.hexdigest()


def _ranges(size: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[start, end)`` byte ranges covering ``size`` bytes."""
    cuts = [size * i // parts for i in range(parts + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(parts)]


def _request_range(
    url: str, start: int, end: int, size: int, policy: FetchPolicy
) -> Callable[[list[int], Callable[[int, bytes], None]], int]:
    """Ask for bytes ``[start, end)`` of ``url`` (``size`` bytes long, as the index says); returns the function
    that reads them, counting into its first argument and handing each block to ``put(offset, block)``, and
    returns how many came. An HTTP server that ignores the range (answers 200) raises :class:`_NoRanges` here,
    before any body is read; one whose object is not ``size`` bytes long (``Content-Range``) fails the part."""
    if url.startswith(("http://", "https://")):
        req = urllib.request.Request(url, headers={"Range": f"bytes={start}-{end - 1}"})
        f = urllib.request.urlopen(req, timeout=policy.timeout)  # noqa: S310 - the user's data URL
        if f.status != 206:
            f.close()
            raise _NoRanges(f"HTTP {f.status} to a range request")
        total = (f.headers.get("Content-Range") or "").rpartition("/")[2]
        if total.isdigit() and int(total) != size:
            f.close()
            raise ValueError(f"truncated or changed shard: the store has {total} bytes, the index says {size} bytes")

        def body(progress: list[int], put: Callable[[int, bytes], None]) -> int:
            n = 0
            try:
                while block := f.read(CHUNK):
                    put(start + n, block)
                    n += len(block)
                    progress[0] += len(block)
                if getattr(f, "length", None):
                    raise ConnectionError(f"connection closed at byte offset {start + n}")
            finally:
                f.close()
            return n

        return body
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **policy.storage_options)

    def cat(progress: list[int], put: Callable[[int, bytes], None]) -> int:
        # (the last part reads to the end: an object longer than the index says shows in its length)
        data = fs.cat_file(path, start=start, end=end if end < size else None)
        progress[0] += len(data)
        put(start, data[: end - start])
        return len(data)

    return cat


class _NoRanges(ValueError):
    """The source did not answer a range request with that range."""


class _PartFailed(Exception):
    """A ranged part failed on every one of its attempts (``last``: why, the last time)."""

    def __init__(self, last: str):
        super().__init__(last)
        self.last = last


def _copy_parts(
    url: str,
    sink: BinaryIO,
    policy: FetchPolicy,
    size: int,
    parts: int,
    progress: list[int],
    retries: int,
    on_retry: Callable[[str], None] | None,
) -> tuple[int, str]:
    """Read ``size`` bytes of ``url`` as ``parts`` ranged requests at once, written where they belong in ``sink``
    (a file, by ``pwrite``, or a :class:`_Buffer`); the sink's position ends at ``size``. Each part is retried on
    its own (``retries`` times, with the policy's backoff): a flaky store costs a part, not the whole shard.
    Returns the byte count and sha256, like :func:`_copy`."""
    from concurrent.futures import ThreadPoolExecutor

    ranges = _ranges(size, parts)
    fileno = getattr(sink, "fileno", None)
    if fileno is None:
        sink.allocate(size)  # type: ignore[attr-defined]
    counts = [[0] for _ in ranges]
    first = _request_range(url, *ranges[0], size, policy)  # (alone: a server without ranges costs one request)

    def put(offset: int, block: bytes) -> None:
        try:
            if fileno is None:
                sink.write_at(offset, block)  # type: ignore[attr-defined]
                return
            view = memoryview(block)
            while view:  # (pwrite may write less than asked: a nearly full disk, or over 2 GiB at once)
                n = os.pwrite(fileno(), view, offset)
                view, offset = view[n:], offset + n
        except OSError as e:
            raise SinkError(e) from e

    def one(i: int) -> None:
        start, end = ranges[i]
        delay = policy.backoff
        for attempt in range(retries + 1):
            try:
                got = (first if i == 0 and attempt == 0 else _request_range(url, start, end, size, policy))(
                    counts[i], put
                )
                if got != end - start:
                    raise ConnectionError(f"{got} bytes for the range [{start}, {end}) of {size}")
                return
            except _NoRanges:
                raise
            except Exception as e:  # noqa: BLE001 - classified: fatal ones raise, the rest are retried
                last = _failure(e, url)
            if attempt == retries:
                raise _PartFailed(last)
            if on_retry is not None:
                on_retry(last)
            time.sleep(delay)
            delay *= 2

    try:
        with ThreadPoolExecutor(parts, thread_name_prefix="pitstop-part") as pool:
            for fut in [pool.submit(one, i) for i in range(parts)]:
                fut.result()  # (the first failure; the others finish or fail on their own)
    finally:
        progress[0] += sum(c[0] for c in counts)
    h = hashlib.sha256()
    if fileno is not None:
        for start in range(0, size, CHUNK):
            h.update(os.pread(fileno(), min(CHUNK, size - start), start))
        sink.seek(size)
    else:
        h.update(sink.view())  # type: ignore[attr-defined]
    return size, h.hexdigest()


def _failure(e: BaseException, url: str) -> str:
    """Why a read of ``url`` failed, for a retry; raises :class:`DataError` (or ``e`` itself) where retrying cannot
    help: a missing file, HTTP 403/404/410, a sink that cannot be written, anything that is no I/O error."""
    if isinstance(e, (DataError, SinkError)):
        raise e
    if isinstance(e, FileNotFoundError):
        raise DataError(f"shard not found: {url} — re-run recipe.prepare for this data dir") from e
    if isinstance(e, urllib.error.HTTPError):
        last = f"HTTP {e.code} {e.reason}"
        e.close()
        if e.code in (403, 404, 410):
            raise DataError(f"cannot read shard {url}: {last} — check data.root") from e
        return last
    if isinstance(e, (OSError, ValueError, http.client.HTTPException)):  # URLError, timeouts, resets, short reads
        return f"{type(e).__name__}: {getattr(e, 'reason', None) or e}"
    raise e


def fetch(
    ref: ShardRef,
    sink_factory: Callable[[], BinaryIO],
    policy: FetchPolicy,
    *,
    verify_sha: bool,
    on_retry: Callable[[str], None] | None = None,
) -> int:
    """Copy the shard at ``ref.url`` into a fresh sink from ``sink_factory`` (one per attempt) and verify it.

    Returns the bytes read from the source over all attempts. Raises :class:`DataError` naming the URL once
    the retries are spent; a missing local file or a refused ``pipe:`` fails at once (retrying cannot help).
    """
    delay, transferred, last = policy.backoff, 0, ""
    retries = policy.retries if is_url(ref.url) else 0  # a local file reads the same the second time
    parts = policy.parts_for(ref)
    for attempt in range(retries + 1):
        sink = sink_factory()
        progress = [0]  # bytes received in this attempt, also when it fails half-way
        try:
            n = -1
            if parts > 1:
                try:
                    n, digest = _copy_parts(ref.url, sink, policy, ref.bytes, parts, progress, retries, on_retry)
                except _NoRanges:  # the source does not serve ranges: one request per download from now on
                    parts, sink = 1, sink_factory()
                    _NO_RANGES.add(urllib.parse.urlsplit(ref.url).netloc)
                except _PartFailed as e:  # (its own retries are spent)
                    last = e.last
                    break
            if n < 0:
                n, digest = _copy(ref.url, sink, policy, progress)
            if ref.bytes and n != ref.bytes:
                last = f"truncated or changed shard: it ends at byte offset {n}, the index says {ref.bytes} bytes"
            elif verify_sha and ref.sha256 and digest != ref.sha256:
                last = f"sha256 {digest[:12]}... does not match the index ({ref.sha256[:12]}...)"
            else:
                return transferred + progress[0]
        except Exception as e:  # noqa: BLE001 - classified: fatal ones raise, the rest are retried
            last = _failure(e, ref.url)
        finally:
            transferred += progress[0]
        if attempt < retries:
            if on_retry is not None:
                on_retry(last)
            time.sleep(delay)
            delay *= 2
    if not retries:
        raise DataError(f"cannot read shard {ref.url}: {last}")
    raise DataError(
        f"cannot read shard {ref.url} after {retries + 1} attempts: {last} "
        f"(loader.retries={retries}, loader.read_timeout={policy.timeout:g}s)"
    )


class _Buffer:
    """A growable in-memory sink; ranged parts are written where they belong (``write_at``)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.placed: bytearray | None = None

    def write(self, b: bytes) -> int:
        self.parts.append(b)
        return len(b)

    def allocate(self, size: int) -> None:
        self.placed = bytearray(size)

    def write_at(self, offset: int, b: bytes) -> None:  # (threads write disjoint ranges of the allocated bytes)
        if offset + len(b) > len(self.placed):  # type: ignore[arg-type]
            raise ValueError(f"{offset + len(b)} bytes for a {len(self.placed)}-byte shard")  # type: ignore[arg-type]
        self.placed[offset : offset + len(b)] = b  # type: ignore[index]

    def view(self) -> memoryview:
        return memoryview(self.placed if self.placed is not None else b"")

    def seek(self, offset: int) -> None:  # (the position after ranged parts: their bytes are all there is)
        pass

    def getvalue(self) -> bytes:
        return bytes(self.placed) if self.placed is not None else b"".join(self.parts)


def fetch_bytes(
    ref: ShardRef, policy: FetchPolicy, *, verify_sha: bool = False, on_retry: Callable[[str], None] | None = None
) -> tuple[bytes, int]:
    """The shard's bytes (verified) and the bytes transferred from the source (> size after retries)."""
    sinks: list[_Buffer] = []

    def factory() -> _Buffer:
        sinks.append(_Buffer())
        return sinks[-1]

    transferred = fetch(ref, factory, policy, verify_sha=verify_sha, on_retry=on_retry)  # type: ignore[arg-type]
    return sinks[-1].getvalue(), transferred


class Counters:
    """A reader's I/O counters (thread-safe: prefetch threads count too); ``take`` returns and resets them,
    so each batch carries the counts since the previous one."""

    def __init__(self, *names: str):
        self._lock, self._counts = threading.Lock(), dict.fromkeys(names, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def take(self) -> dict[str, int]:
        with self._lock:
            out, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        return out

    def __getstate__(self) -> dict:
        return {"names": list(self._counts)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(*state["names"])


def fetch_counted(ref: ShardRef, policy: FetchPolicy, counters: Counters, *, verify_sha: bool = False) -> bytes:
    """:func:`fetch_bytes`, counting retries and the bytes read from the source."""
    data, transferred = fetch_bytes(
        ref, policy, verify_sha=verify_sha, on_retry=lambda _: counters.add("fetch_retries")
    )
    counters.add("bytes_from_source", transferred)
    return data
