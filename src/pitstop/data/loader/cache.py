"""A machine-local shard cache shared by every rank and DataLoader worker on the machine.

Layout of ``cache_dir``::

    <sha256[:16]>-<shard name>        complete, verified shards (content-addressed: a changed shard is a new file)
    <...>.part.<pid>.<thread>         a download in progress (never read; removed on failure or when stale)
    .locks/<name>.lock                one lock per shard: exactly one process downloads it
                                      (a part file is created at full size and flock-ed by its download)
    .cache.lock                       serialises space accounting and eviction
    .future/<pid>-<thread>.json       each live reader's next reads, in order (what eviction looks at)

Guarantees:

- **One download per shard per machine**: a miss takes the shard's file lock, re-checks, downloads to a
  private temp file, verifies size and sha256 against the index, fsyncs and renames it into place.
  Readers only ever open complete files; a crash or kill leaves at most a temp file, which is removed the
  next time anyone takes that shard's lock (or by eviction: nobody holds its lock). The part file is
  reserved at full size under ``.cache.lock``, so concurrent downloads never overshoot ``limit``.
- **Within ``limit`` bytes, the shard needed furthest in the future goes first, never one in use**
  (``policy="future"``, Belady's MIN): the read order is a pure function of seed and epoch, so every reader
  publishes its next reads -- the rest of this epoch and all of the next -- in ``.future/`` (distances in
  samples, comparable across readers that step together); eviction removes first the shards no live reader
  will read in that horizon (least recently used first), then those whose next read is furthest. With a
  cache of half the data set, LRU re-downloads most of every epoch (the shuffled order reads next what it
  evicted); MIN re-downloads about half, the least possible. ``policy="lru"``: least recently used first
  (reads touch the mtime). A shard is in use while some process holds a shared ``flock`` on it (from the
  moment a prefetch finishes until the reader has read it); eviction only removes files on which it can
  take an exclusive lock without waiting. If everything is in use, the shard is served without being kept
  (counted as ``cache_bypass``) rather than blocking or failing.
- **A full disk** (ENOSPC) evicts what it can and retries once, then fails with the cache dir named.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import math
import os
import shutil
import threading
from typing import BinaryIO

from filelock import FileLock

from pitstop.data.remote import Counters, FetchPolicy, ShardRef, fetch, fetch_counted
from pitstop.data.sources import SinkError
from pitstop.errors import DataError

PART = ".part."
FUTURE = ".future"
POLICIES = ("future", "lru")


def _margin(path: str) -> int:
    """Free space to leave on the cache's disk: 64 MiB, or 5% of a small disk."""
    return min(64 << 20, shutil.disk_usage(path).total // 20)


class ShardCache:
    def __init__(
        self, cache_dir: str, limit: int | None, policy: FetchPolicy, verify: str = "sha256", eviction: str = "future"
    ):
        self.dir, self.limit, self.policy, self.verify = os.path.abspath(cache_dir), limit, policy, verify
        self.eviction = eviction
        self.counters = Counters(
            "cache_hits", "cache_misses", "bytes_from_source", "cache_evictions", "cache_bypass", "fetch_retries"
        )
        try:
            os.makedirs(os.path.join(self.dir, ".locks"), exist_ok=True)
            os.makedirs(os.path.join(self.dir, FUTURE), exist_ok=True)
        except OSError as e:
            raise DataError(
                f"cannot create loader.cache_dir {self.dir}: {e.strerror}; point it at a writable local disk"
            ) from e

    # ---- bookkeeping --------------------------------------------------------------------------------
    def take_stats(self) -> dict[str, int]:
        return self.counters.take()

    def path(self, ref: ShardRef) -> str:
        tag = ref.sha256[:16] if ref.sha256 else hashlib.sha256(ref.url.encode()).hexdigest()[:16]
        name = ref.url.rstrip("/").rsplit("/", 1)[-1].replace(" ", "_")[-80:] or "shard"
        return os.path.join(self.dir, f"{tag}-{name}")

    # ---- what readers will read ---------------------------------------------------------------------
    def _future_file(self) -> str:
        return os.path.join(self.dir, FUTURE, f"{os.getpid()}-{threading.get_ident()}.json")

    def publish(self, refs: list[ShardRef]) -> None:
        """This reader's next reads, in order, from the one it is reading now (for ``eviction="future"``)."""
        if self.eviction != "future":
            return
        ahead, at = {}, 0
        for ref in refs:
            ahead.setdefault(os.path.basename(self.path(ref)), at)
            at += max(int(ref.samples or 1), 1)
        path = self._future_file()
        tmp = f"{path}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(ahead, f, separators=(",", ":"))
            os.replace(tmp, path)
        except OSError:  # a hint only: without it, eviction is least recently used
            pass

    def _next_reads(self) -> dict[str, int]:
        """Shard file -> samples until its next read by any live reader on this machine."""
        out: dict[str, int] = {}
        folder = os.path.join(self.dir, FUTURE)
        for name in os.listdir(folder):
            if not name.endswith(".json"):
                continue
            path = os.path.join(folder, name)
            try:
                os.kill(int(name.split("-", 1)[0]), 0)
            except ProcessLookupError:  # a reader that died: its reads will not happen
                self._discard(path)
                continue
            except (ValueError, PermissionError):
                pass
            try:
                with open(path) as f:
                    ahead = json.load(f)
            except (OSError, ValueError):
                continue
            for shard, at in ahead.items():
                out[shard] = min(out.get(shard, at), at)
        return out

    # ---- the public operation ---------------------------------------------------------------------
    def acquire(self, ref: ShardRef) -> BinaryIO | bytes:
        """The shard, in the cache and locked against eviction: an open file (shared lock held; the caller
        reads and closes it), or — when no room can be made — the bytes themselves, not kept."""
        f = self._open_complete(ref)
        if f is not None:
            self.counters.add("cache_hits")
            return f
        final = self.path(ref)
        with FileLock(os.path.join(self.dir, ".locks", os.path.basename(final) + ".lock")):
            f = self._open_complete(ref)  # another process finished it while we waited
            if f is not None:
                self.counters.add("cache_hits")
                return f
            self.counters.add("cache_misses")
            self._remove_stale_parts(final)
            part = self._reserve(ref, final)
            if part is None:  # no room: everything is in use (or the disk is full of other things)
                self.counters.add("cache_bypass")
                return fetch_counted(ref, self.policy, self.counters, verify_sha=self.verify == "sha256")
            return self._download(ref, part, final)

    @staticmethod
    def read(handle: BinaryIO | bytes) -> bytes:
        if isinstance(handle, bytes):
            return handle
        try:
            return handle.read()
        finally:
            handle.close()

    # ---- internals ----------------------------------------------------------------------------------
    def _open_complete(self, ref: ShardRef) -> BinaryIO | None:
        path = self.path(ref)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            return None
        fcntl.flock(f.fileno(), fcntl.LOCK_SH)  # waits only for an evictor that is deleting it right now
        st = os.fstat(f.fileno())
        if st.st_nlink == 0:  # evicted while we opened it
            f.close()
            return None
        if ref.bytes and st.st_size != ref.bytes:  # damaged on disk (not by us: we rename verified files only)
            f.close()
            self._discard(path)
            return None
        try:
            os.utime(path)  # LRU: most recently used
        except OSError:
            pass
        return f

    def _discard(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def _remove_stale_parts(self, final: str) -> None:
        # Only the holder of this shard's lock writes its part files, and we hold it now: any left are stale.
        prefix = os.path.basename(final) + PART
        for name in os.listdir(self.dir):
            if name.startswith(prefix):
                self._discard(os.path.join(self.dir, name))

    def _reserve(self, ref: ShardRef, final: str) -> BinaryIO | None:
        """Make room and claim it: a part file of the shard's size, exclusively locked by this download
        (so concurrent downloads count against ``cache_limit`` and eviction can tell live parts from stale)."""
        with FileLock(os.path.join(self.dir, ".cache.lock")):
            if not self._room_locked(ref.bytes):
                return None
            tmp = f"{final}{PART}{os.getpid()}.{threading.get_ident()}"
            part = open(tmp, "w+b")
            fcntl.flock(part.fileno(), fcntl.LOCK_EX)
            if ref.bytes:
                try:
                    os.posix_fallocate(part.fileno(), 0, ref.bytes)
                except OSError:
                    part.truncate(ref.bytes)  # no fallocate here: at least the limit accounting sees it
            return part

    def _download(self, ref: ShardRef, part: BinaryIO, final: str) -> BinaryIO:
        """Fill ``part``, verify, publish it under ``final`` and return it open, shared-locked (in use)."""

        def sink() -> BinaryIO:  # every attempt starts over
            part.seek(0)
            return part

        try:
            for attempt in (0, 1):
                try:
                    transferred = fetch(
                        ref,
                        sink,
                        self.policy,
                        verify_sha=self.verify == "sha256",
                        on_retry=lambda _: self.counters.add("fetch_retries"),
                    )
                    break
                except SinkError as e:
                    full = e.error.errno in (errno.ENOSPC, errno.EDQUOT)
                    if not full:
                        raise DataError(
                            f"cannot write shard {os.path.basename(final)} to loader.cache_dir "
                            f"{self.dir}: {e.error.strerror}"
                        ) from e
                    if attempt == 1 or self._evict(need=ref.bytes) == 0:
                        raise DataError(
                            f"loader.cache_dir {self.dir} is full (no space left on the device) and "
                            f"nothing can be evicted; free space there or set loader.cache_limit below "
                            f"the free space"
                        ) from e
            self.counters.add("bytes_from_source", transferred)
            part.truncate(part.tell())
            part.flush()
            os.fsync(part.fileno())
            os.replace(part.name, final)  # still exclusively locked: nobody evicts it before we read it
            fcntl.flock(part.fileno(), fcntl.LOCK_SH)
            part.seek(0)
            return part
        except BaseException:
            part.close()
            self._discard(part.name)  # the cache never keeps a partial file
            raise

    def _entries(self) -> list[tuple[float, int, str]]:
        out = []
        for name in os.listdir(self.dir):
            if name.startswith("."):
                continue
            path = os.path.join(self.dir, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            out.append((st.st_mtime, st.st_size, path))
        return out

    def _room_locked(self, need: int) -> bool:
        """(``.cache.lock`` held) Evict least-recently-used idle shards until ``need`` more bytes fit under
        ``limit`` and on the disk; False if they cannot."""

        def excess() -> int:
            over_disk = need + _margin(self.dir) - shutil.disk_usage(self.dir).free
            over_limit = 0 if self.limit is None else sum(s for _, s, _ in self._entries()) + need - self.limit
            return max(over_disk, over_limit)

        if excess() > 0:
            self._evict_locked(excess())
        return excess() <= 0

    def _evict(self, need: int) -> int:
        with FileLock(os.path.join(self.dir, ".cache.lock")):
            return self._evict_locked(max(need, need + _margin(self.dir) - shutil.disk_usage(self.dir).free))

    def _evict_locked(self, excess: int) -> int:
        entries = sorted(self._entries())  # least recently used first
        if self.eviction == "future":  # not read again in the known horizon first, then the furthest next read
            ahead = self._next_reads()
            entries.sort(key=lambda e: -ahead.get(os.path.basename(e[2]), math.inf))
        freed = 0
        for _, size, path in entries:
            if freed >= excess:
                break
            try:
                f = open(path, "rb")
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue  # in use (a reader), or a download in progress
            # (a part file nobody locks was left by a killed process: removing it is right too)
            try:
                self._discard(path)
                freed += size
                if PART not in os.path.basename(path):
                    self.counters.add("cache_evictions")
            finally:
                f.close()
        return freed
