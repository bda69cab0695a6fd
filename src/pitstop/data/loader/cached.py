"""``loader=cached``: shards are copied once to a fast local cache dir and read from there afterwards.

Each reader (DataLoader worker, or the training process with ``num_workers=0``) keeps its next shards
downloading in background threads while it decodes the current one, so epoch 1 overlaps network transfer
with compute, and later epochs read local files only. How many: ``prefetch_shards`` (a number), or ``auto``:
as many as a download takes shards' worth of reading, from what it measures (the seconds a download takes,
the seconds between the reader's shards), plus one; 2 until it has measured, at most ``MAX_DEPTH``.
The cache itself (one download per machine, within ``cache_limit`` the shard read furthest in the future
evicted first, integrity checks) is
:class:`pitstop.data.loader.cache.ShardCache`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pitstop.data.remote import FetchPolicy, ShardRef
from pitstop.errors import ConfigError
from pitstop.data.loader import plan, server
from pitstop.data.loader.base import ShardLoader, ShardSource
from pitstop.data.loader.sizes import parse_size
from pitstop.data.loader.cache import ShardCache

MAX_DEPTH = 8
MAX_CONNECTIONS = 8  # a reader's downloads at once x their ranged parts, at most (see CachedSource._at_once)
log = logging.getLogger("pitstop.data.loader")


class CachedSource(ShardSource):
    def __init__(
        self,
        cache_dir: str,
        limit: int | None,
        policy: FetchPolicy,
        verify: str,
        prefetch: int | str,
        eviction: str = "future",
    ):
        self.cache_dir, self.limit, self.policy, self.verify, self.prefetch = cache_dir, limit, policy, verify, prefetch
        self.eviction = eviction
        self._cache: ShardCache | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future] = {}
        self._pid = -1
        self._download_s: float | None = None  # (auto) a download's seconds, and a shard's reading seconds
        self._shard_s: float | None = None
        self._last_shard: float | None = None

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_cache", "_pool", "_pending")} | {
            "_cache": None,
            "_pool": None,
            "_pending": {},
            "_pid": -1,
        }

    @property
    def depth(self) -> int:
        """Shards to keep downloading ahead of the one being read."""
        if self.prefetch != "auto":
            return int(self.prefetch)
        if not self._download_s or not self._shard_s:
            return 2
        return max(1, min(MAX_DEPTH, math.ceil(self._download_s / self._shard_s) + 1))

    def _acquire(self, ref: ShardRef):
        t0 = time.perf_counter()
        handle = self.cache.acquire(ref)
        took = time.perf_counter() - t0
        if took > 0.005:  # (a download, or a wait for another process's: a hit takes microseconds)
            self._download_s = took if self._download_s is None else 0.7 * self._download_s + 0.3 * took
        return handle

    @property
    def cache(self) -> ShardCache:
        if self._cache is None or self._pid != os.getpid():  # built in the process that reads (after fork)
            self._cache = ShardCache(self.cache_dir, self.limit, self.policy, self.verify, self.eviction)
            self._pool, self._pending, self._pid = None, {}, os.getpid()
        return self._cache

    def lookahead(self, refs: list[ShardRef], later: list[ShardRef] = ()) -> None:
        cache = self.cache
        cache.publish([*refs, *later])
        now = time.perf_counter()
        if refs and self._last_shard is not None:  # the reader moved on to its next shard
            took = now - self._last_shard
            self._shard_s = took if self._shard_s is None else 0.7 * self._shard_s + 0.3 * took
        self._last_shard = now if refs else None
        depth = self.depth
        if self.prefetch == "auto" and self.limit and refs:  # (shards held ahead are in use: leave room to evict)
            depth = min(depth, max(1, self.limit // (8 * max(max(r.bytes for r in refs[: depth + 1]), 1))))
        if depth <= 0 or len(refs) < 2:  # (refs[0] is read right now, by the caller)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._at_once(refs), thread_name_prefix="pitstop-prefetch")
        for ref in refs[1 : depth + 1]:  # refs[0] is read right now, by the caller
            if ref.url not in self._pending:
                self._pending[ref.url] = self._pool.submit(self._acquire, ref)

    def _at_once(self, refs: list[ShardRef]) -> int:
        """Downloads this reader runs at the same time; the others wait their turn in read order. A download in
        ranged parts already uses several connections: more shards at once would only split a capped link among
        them and deliver the one read next later (and the longer downloads would make ``auto`` go deeper still)."""
        parts = self.policy.parts_for(max(refs, key=lambda r: r.bytes))
        most = MAX_DEPTH if self.prefetch == "auto" else max(1, int(self.prefetch))
        return max(1, min(most, MAX_CONNECTIONS // parts))

    def read(self, ref: ShardRef) -> bytes:
        fut = self._pending.pop(ref.url, None)
        handle = fut.result() if fut is not None else self._acquire(ref)
        return ShardCache.read(handle)

    def take_stats(self) -> dict[str, int]:
        return self.cache.take_stats()

    def close(self, wait: bool = False) -> None:
        for fut in self._pending.values():  # release shards prefetched for a stream that ended early,
            if not fut.cancel():  # without waiting for downloads still running (unless asked)
                fut.add_done_callback(_release)
                if wait:
                    concurrent.futures.wait([fut])
        self._pending = {}
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _into_cache(cache: ShardCache, refs: list[ShardRef]) -> None:
    for ref in refs:
        try:
            handle = cache.acquire(ref)
        except Exception as e:  # noqa: BLE001 - the reader fetches it again, with retries, and reports a failure
            log.debug("shard %s not fetched ahead: %s", ref.url, e)
            return
        if not isinstance(handle, bytes):
            handle.close()


def _release(fut: Future) -> None:
    try:
        handle = fut.result()
    except BaseException:  # noqa: BLE001 - a failed lookahead of an unused shard is not an error
        return
    if not isinstance(handle, bytes):
        handle.close()


class CachedLoader(ShardLoader):
    kind = "cached"

    def __init__(
        self,
        *args: Any,
        cache_dir: str,
        cache_limit: int | str | None = None,
        prefetch_shards: int | str = "auto",
        verify: str = "sha256",
        cache_policy: str = "future",
        **kw: Any,
    ):
        super().__init__(*args, **kw)
        self.cache_policy = cache_policy
        if prefetch_shards != "auto" and not (str(prefetch_shards).isdigit()):
            raise ConfigError(
                f"loader.prefetch_shards={prefetch_shards!r}: use auto (as deep as downloads need) or a "
                f"number of shards >= 0"
            )
        self.cache_dir, self.cache_limit = str(cache_dir), parse_size(cache_limit)
        self.prefetch_shards = prefetch_shards if prefetch_shards == "auto" else int(prefetch_shards)
        self.verify = verify
        largest = max(r.bytes for r in self.refs)
        if self.cache_limit is not None and self.cache_limit < largest:
            raise ConfigError(
                f"loader.cache_limit={cache_limit} is smaller than the largest shard ({largest:,} bytes "
                f"in {self.dataset.root}); raise it or write smaller shards"
            )
        self.stats.update({"cache_hits": 0, "cache_misses": 0, "cache_evictions": 0, "cache_bypass": 0})
        ShardCache(self.cache_dir, self.cache_limit, self.policy, verify, cache_policy)  # fail now if unusable
        self._warmed: set[str] = set()  # (warm(): the shards it asked for, its cache and its downloads running)
        self._warm_depth: float = math.inf  # (warm(): the shards per stream its first call chose, at most)
        self._warm_cache: ShardCache | None = None
        self._warm_threads: list[threading.Thread] = []

    def lead_refs(self, n: int) -> list[list[ShardRef]]:
        """Per reader stream of this rank, the first ``n`` shards it reads from the current position, in order."""
        out = []
        for s in range(self.streams):
            g = self._gid(self.rank, s)
            items = self._items(self.epoch, g)
            reads = plan.read_order(items, self.window, self.seed, self.epoch, g) if items else []
            lead: dict[str, ShardRef] = {}
            for i, _ in reads[self.positions.get(g, 0) :]:
                ref = self.refs[items[i][1]]
                if ref.url not in lead:
                    lead[ref.url] = ref
                    if len(lead) == n:
                        break
            out.append(list(lead.values()))
        return out

    def warm(self) -> None:
        """Start downloading, now, what each of this rank's readers reads first from the current position: its
        first shard and the ones its prefetch would ask for as it starts (``prefetch_shards``; 2 for auto), one
        stream's in read order (the first shards first). The readers start later and find them in the cache, or
        being downloaded (they wait for that download; there is never a second). A cold epoch's first shards have
        nothing to overlap them otherwise, and a capped link would idle through the set-up. The runner calls it
        as the loader is built on a fresh run (it then overlaps the model's build, dynamo's import and the
        set-up), and after a restore on a resumed one (the position is known only then). Under a
        ``cache_limit`` too small to keep them beside the readers' own prefetch, only the first shards, or none.
        A failed download here is left to the reader to retry and report."""
        if self.num_workers:  # the workers' fork server first: forked while no download thread exists yet
            server.workers(self.worker_modules())
        ahead = 2 if self.prefetch_shards == "auto" else int(self.prefetch_shards)
        for n in [d for d in (1 + ahead, 1) if d <= self._warm_depth]:  # (never deeper than a call before chose)
            leads = self.lead_refs(n)
            size = sum({r.url: r.bytes for refs in leads for r in refs}.values())
            if self.cache_limit is None or self.cache_limit >= 8 * size:
                break
        else:
            self._warm_depth = 0
            return
        self._warm_depth = n
        leads = [[r for r in refs if r.url not in self._warmed] for refs in leads]  # (not asked for before)
        if not any(leads):
            return
        if self._warm_cache is None:
            self._warm_cache = ShardCache(self.cache_dir, self.cache_limit, self.policy, self.verify, self.cache_policy)
        self._warmed.update(r.url for refs in leads for r in refs)
        for refs in filter(None, leads):  # (daemons: a job that ends meanwhile does not wait for them; the cache
            # drops a part file. A shard in two streams' leads is downloaded by the first to get its lock; the other
            # waits for it and finds it there, each stream keeping its own read order.)
            thread = threading.Thread(target=_into_cache, args=(self._warm_cache, refs), name="pitstop-first-shards")
            thread.daemon = True
            thread.start()
            self._warm_threads.append(thread)

    def side_stats(self) -> dict[str, int]:
        """The counters of warm()'s downloads so far (in cache_misses, bytes_from_source; a reader that then finds
        one of its first shards there counts a cache hit too, and so does warm() where a reader got there first)."""
        if self._warm_cache is None:
            return {}
        self._warm_threads = [t for t in self._warm_threads if t.is_alive()]
        out = self._warm_cache.take_stats()
        if not self._warm_threads:
            self._warm_cache = None
        return out

    def source(self) -> ShardSource:
        return CachedSource(
            self.cache_dir, self.cache_limit, self.policy, self.verify, self.prefetch_shards, self.cache_policy
        )
