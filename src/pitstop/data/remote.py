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
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import BinaryIO, Callable

from pitstop.errors import DataError
from pitstop.fsurl import is_url

CHUNK = 1 << 20


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
    for attempt in range(retries + 1):
        sink = sink_factory()
        progress = [0]  # bytes received in this attempt, also when it fails half-way
        try:
            n, digest = _copy(ref.url, sink, policy, progress)
            if ref.bytes and n != ref.bytes:
                last = f"truncated or changed shard: it ends at byte offset {n}, the index says {ref.bytes} bytes"
            elif verify_sha and ref.sha256 and digest != ref.sha256:
                last = f"sha256 {digest[:12]}... does not match the index ({ref.sha256[:12]}...)"
            else:
                return transferred + progress[0]
        except (DataError, SinkError):
            raise
        except FileNotFoundError as e:
            raise DataError(f"shard not found: {ref.url} — re-run recipe.prepare for this data dir") from e
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code} {e.reason}"
            e.close()
            if e.code in (403, 404, 410):
                raise DataError(f"cannot read shard {ref.url}: {last} — check data.root") from e
        except (OSError, ValueError, http.client.HTTPException) as e:  # URLError, timeouts, resets, short reads
            last = f"{type(e).__name__}: {getattr(e, 'reason', None) or e}"
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
    """A growable in-memory sink."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, b: bytes) -> int:
        self.parts.append(b)
        return len(b)

    def getvalue(self) -> bytes:
        return b"".join(self.parts)


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
