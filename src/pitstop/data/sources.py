"""How a shard's bytes are read from where they live (the retries and the checks are :func:`remote.fetch`'s).

- :func:`open_source`: a stream of a local path, ``http(s)://``, a ``pipe:`` command or any fsspec URL.
- :func:`copy_whole`: one request, copied into a sink while hashed.
- :func:`copy_parts`: ``parts`` ranged requests at once, each retried on its own, written where they belong.
- :func:`classify`: why a read failed, for a retry, or the error to raise where retrying cannot help.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import subprocess
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, BinaryIO, Callable

from pitstop.errors import DataError

if TYPE_CHECKING:
    from pitstop.data.remote import FetchPolicy

CHUNK = 1 << 20
NO_RANGES: set[str] = set()  # the HTTP hosts (of this process) that answered a range request with the whole file


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


def copy_whole(url: str, sink: BinaryIO, policy: FetchPolicy, progress: list[int]) -> tuple[int, str]:
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


def split_ranges(size: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[start, end)`` byte ranges covering ``size`` bytes."""
    cuts = [size * i // parts for i in range(parts + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(parts)]


def request_range(
    url: str, start: int, end: int, size: int, policy: FetchPolicy
) -> Callable[[list[int], Callable[[int, bytes], None]], int]:
    """Ask for bytes ``[start, end)`` of ``url`` (``size`` bytes long, as the index says); returns the function
    that reads them, counting into its first argument and handing each block to ``put(offset, block)``, and
    returns how many came. An HTTP server that ignores the range (answers 200) raises :class:`NoRanges` here,
    before any body is read; one whose object is not ``size`` bytes long (``Content-Range``) fails the part."""
    if url.startswith(("http://", "https://")):
        req = urllib.request.Request(url, headers={"Range": f"bytes={start}-{end - 1}"})
        f = urllib.request.urlopen(req, timeout=policy.timeout)  # noqa: S310 - the user's data URL
        if f.status != 206:
            f.close()
            raise NoRanges(f"HTTP {f.status} to a range request")
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


class NoRanges(ValueError):
    """The source did not answer a range request with that range."""


class PartFailed(Exception):
    """A ranged part failed on every one of its attempts (``last``: why, the last time)."""

    def __init__(self, last: str):
        super().__init__(last)
        self.last = last


def copy_parts(
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
    Returns the byte count and sha256, like :func:`copy_whole`."""
    from concurrent.futures import ThreadPoolExecutor

    ranges = split_ranges(size, parts)
    fileno = getattr(sink, "fileno", None)
    if fileno is None:
        sink.allocate(size)  # type: ignore[attr-defined]
    counts = [[0] for _ in ranges]
    first = request_range(url, *ranges[0], size, policy)  # (alone: a server without ranges costs one request)

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
                got = (first if i == 0 and attempt == 0 else request_range(url, start, end, size, policy))(
                    counts[i], put
                )
                if got != end - start:
                    raise ConnectionError(f"{got} bytes for the range [{start}, {end}) of {size}")
                return
            except NoRanges:
                raise
            except Exception as e:  # noqa: BLE001 - classified: fatal ones raise, the rest are retried
                last = classify(e, url)
            if attempt == retries:
                raise PartFailed(last)
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


def classify(e: BaseException, url: str) -> str:
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
