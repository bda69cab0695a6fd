"""Reading shards from where they live: a local path, ``http(s)://``, or any fsspec URL (``s3://``, ``gs://``...).

:func:`fetch` reads one shard (through :mod:`pitstop.data.sources`) with a per-request timeout, retries with
exponential backoff, and checks what arrived against the index (byte size, and sha256 when asked), so a truncated
or corrupted response is retried and then reported — naming the URL — instead of being decoded.  HTTP goes
through the standard library (``urllib``); other schemes through fsspec, whose backend the user installs
(``pip install s3fs``).  ``pipe:`` URLs (a shell command whose stdout is the shard, a webdataset convention) run
a command from the data index, so they are refused unless explicitly allowed.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import BinaryIO, Callable

from pitstop.data import sources
from pitstop.errors import DataError
from pitstop.fsurl import is_url

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
        if urllib.parse.urlsplit(ref.url).netloc in sources.NO_RANGES:
            return 1
        want = min(MAX_PARTS, ref.bytes // PART_BYTES) if self.parts == "auto" else int(self.parts)
        return max(1, min(want, ref.bytes // (64 << 10)))  # (never parts under 64 KB)


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
                    n, digest = sources.copy_parts(ref.url, sink, policy, ref.bytes, parts, progress, retries, on_retry)
                except sources.NoRanges:  # the source does not serve ranges: one request per download from now on
                    parts, sink = 1, sink_factory()
                    sources.NO_RANGES.add(urllib.parse.urlsplit(ref.url).netloc)
                except sources.PartFailed as e:  # (its own retries are spent)
                    last = e.last
                    break
            if n < 0:
                n, digest = sources.copy_whole(ref.url, sink, policy, progress)
            if ref.bytes and n != ref.bytes:
                last = f"truncated or changed shard: it ends at byte offset {n}, the index says {ref.bytes} bytes"
            elif verify_sha and ref.sha256 and digest != ref.sha256:
                last = f"sha256 {digest[:12]}... does not match the index ({ref.sha256[:12]}...)"
            else:
                return transferred + progress[0]
        except Exception as e:  # noqa: BLE001 - classified: fatal ones raise, the rest are retried
            last = sources.classify(e, ref.url)
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
