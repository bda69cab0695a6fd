"""A stateful, deterministic loader over sharded data (the common part of every ``loader`` option).

Each rank runs ``streams`` readers (DataLoader workers, or one in-process reader); each reader reads a
disjoint set of shards, decodes and batches in the worker, and hands whole batches to the trainer.
The trainer-side :class:`ShardLoader` counts only batches actually handed out, so its
``state_dict()`` — epoch, batches this epoch, each stream's sample position — is exact: prefetched
batches are never counted, and a resumed loader continues with bitwise-identical batches.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from pitstop.data.dataset import ShardedDataset
from pitstop import fsurl
from pitstop.data.remote import FetchPolicy, ShardRef
from pitstop.data.shards import read_shard
from pitstop.errors import ConfigError, DataError
from pitstop.data.loader import plan, server
from pitstop.train.seed import derive_seed

log = logging.getLogger("pitstop.data.loader")


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_size(value: Any, what: str = "loader.cache_limit", off: str = "null") -> int | None:
    """``null`` (no limit), a number of bytes, or a string like ``"20GB"`` / ``"512MiB"``."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "null", "none")):
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"{what}={value!r} is not a size; use bytes or e.g. 500MB, 20GB, 1.5TiB, or {off}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class _Failure:
    """Sent from a worker instead of raising, so the trainer gets the one-line message intact."""

    def __init__(self, message: str):
        self.message = message


class ShardSource:
    """How a reader gets a shard's bytes (picklable: it travels to the DataLoader workers).

    ``lookahead`` is told which shards this reader will open next, from the one it opens now, and ``later``
    those of its next epoch (hints: a cache may start fetching them, and keep what is read soonest);
    ``take_stats`` returns and resets this process's counters (sent along with each batch)."""

    def lookahead(self, refs: list[ShardRef], later: list[ShardRef] = ()) -> None:
        pass

    def read(self, ref: ShardRef) -> bytes:
        raise NotImplementedError

    def take_stats(self) -> dict[str, int]:
        return {}

    def close(self, wait: bool = False) -> None:
        """The reader is done; ``wait``: also for background work still running (after a failure)."""


class StreamReader(IterableDataset):
    """Worker side: reads the streams of one rank from given positions and yields batches."""

    def __init__(
        self,
        *,
        refs,
        source,
        dataset,
        train,
        seed,
        epoch,
        batch_size,
        drop_last,
        shuffle,
        partitions,
        streams,
        rank,
        world_size,
        starts,
        rotation,
        base,
        window=1,
    ):
        self.refs, self.source, self.dataset = refs, source, dataset
        self.counts = [r.samples for r in refs]
        self.train, self.seed, self.epoch, self.batch_size = train, seed, epoch, batch_size
        self.drop_last, self.shuffle, self.partitions, self.streams = drop_last, shuffle, partitions, streams
        self.rank, self.world_size, self.starts, self.rotation = rank, world_size, starts, rotation
        self.base, self.window = base, window

    def __iter__(self):
        info = get_worker_info()
        local_streams = [0] if info is None else [(info.id + self.rotation) % info.num_workers]
        if info is None and self.streams > 1:
            raise ConfigError("in-process reading supports one stream; set loader.num_workers to match")
        failed = False
        try:
            for s in local_streams:
                for item in self._stream(plan.stream_id(self.rank, s, self.streams, self.world_size, self.train)):
                    failed = isinstance(item, _Failure)
                    yield item
        finally:  # after a failure the run goes down: let downloads in flight finish cleaning up first
            self.source.close(wait=failed)

    def _stream(self, g: int) -> Iterator[dict | _Failure]:
        total_streams = self.streams * self.world_size
        plan_items = plan.stream_items(
            len(self.refs),
            self.counts,
            self.partitions,
            g,
            total_streams,
            self.seed,
            self.epoch,
            self.shuffle,
            self.base,
            self.streams,
            self.batch_size,
            self.drop_last,
        )
        reads = plan.read_order(plan_items, self.window, self.seed, self.epoch, g)
        pos = self.starts.get(g, 0)
        last = {i: t for t, (i, _) in enumerate(reads)}  # where each run's last sample is read
        opens: list[int] = list(dict.fromkeys(i for i, _ in reads[pos:]))  # runs by first read from here on
        later = []  # what this stream reads next epoch (a plain epoch: same stream ids), for a cache's eviction
        if self.train:
            later = [
                self.refs[s]
                for _, s, *_ in plan.stream_items(
                    len(self.refs),
                    self.counts,
                    self.partitions,
                    g,
                    total_streams,
                    self.seed,
                    self.epoch + 1,
                    self.shuffle,
                    {},
                    self.streams,
                    self.batch_size,
                    self.drop_last,
                )
            ]
        loaded: dict[int, tuple[list, list[int]]] = {}  # run -> (its shard's samples, the shard's sample order)
        items, keys, skipped, opened = [], [], 0, 0
        for t in range(pos, len(reads)):
            i, o = reads[t]
            _, shard, first, _, cut = plan_items[i]
            ref = self.refs[shard]
            if i not in loaded:
                self.source.lookahead([self.refs[plan_items[j][1]] for j in opens[opened:]], later)
                opened += 1
                n = ref.samples
                try:
                    raw = self.source.read(ref)
                    samples = read_shard(raw, ref.url)
                    if len(samples) != n:
                        raise DataError(
                            f"shard {ref.url} has {len(samples)} samples but the index says {n}; re-run recipe.prepare"
                        )
                except DataError as e:
                    if not self.dataset.skip_corrupt:
                        yield _Failure(str(e))
                        return
                    samples = [None] * n
                loaded[i] = samples, plan.sample_order(n, self.seed, self.epoch, shard, self.shuffle)
            samples, order = loaded[i]
            index = order[first + o]
            pos = t + 1
            sample = samples[index]
            try:
                if sample is None:
                    raise DataError(f"unreadable shard {ref.url}")
                seed = derive_seed(self.seed, self.epoch, sample["__key__"])
                items.append(self.dataset.decode(sample, train=self.train, seed=seed))
                keys.append(sample["__key__"])
            except Exception as e:  # noqa: BLE001 - any decode failure names shard and key
                if not self.dataset.skip_corrupt:
                    key = sample["__key__"] if sample else f"#{index}"
                    yield _Failure(
                        f"corrupt sample {key!r} in shard {ref.url}: {e} "
                        f"(set data.skip_corrupt=true to skip and count such samples)"
                    )
                    return
                skipped += 1
            if len(items) == self.batch_size:
                yield self._batch(g, pos, items, keys, skipped)
                items, keys, skipped = [], [], 0
            if last[i] == t:  # this run is done: its shard's samples go
                del loaded[i]
                if cut and items:  # (an elastic plan's batch ends here)
                    if not self.drop_last:
                        yield self._batch(g, pos, items, keys, skipped)
                    items, keys, skipped = [], [], 0
        if items and not self.drop_last:
            yield self._batch(g, pos, items, keys, skipped)
        self.source.lookahead([], later)  # (done with this epoch: its next reads are next epoch's)

    def _batch(self, g, pos, items, keys, skipped) -> dict:
        return {
            "data": default_collate(items),
            "stream": g,
            "end": pos,
            "keys": keys,
            "skipped": skipped,
            "io": self.source.take_stats(),
        }


class ShardLoader(ABC):
    """Trainer side: an endless iterator of batches across epochs with an exact, saveable position.

    The contract of a ``loader`` option: ``iter(loader)`` (training batches, endless), ``iterate_once``
    (an evaluation pass in lockstep across ranks), ``steps_per_epoch``, ``state_dict``/``load_state_dict``
    (the data position), ``stats`` (cumulative counters); a subclass says where shard bytes come from
    (:meth:`source`)."""

    kind = "base"

    def __init__(
        self,
        dataset: ShardedDataset,
        split: str,
        batch_size: int,
        seed: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        train: bool = True,
        num_workers: int = 2,
        partitions: int | None = None,
        shuffle: bool = True,
        drop_last: bool = False,
        pin_memory: bool = False,
        prefetch_factor: int = 4,
        timeout: float = 0,
        retries: int = 3,
        backoff: float = 0.5,
        read_timeout: float = 60.0,
        allow_pipe: bool = False,
        eval_in_memory: Any = "256MB",
        shuffle_shards_window: int = 1,
        storage_options: Any = None,
        **_: Any,
    ):
        if int(batch_size) <= 0:
            raise ConfigError(f"batch size must be a positive integer, got {batch_size}")
        self.dataset, self.split, self.batch_size, self.seed = dataset, split, int(batch_size), int(seed)
        self.rank, self.world_size, self.train = rank, world_size, train
        self.num_workers, self.pin_memory, self.prefetch_factor = int(num_workers), pin_memory, prefetch_factor
        self.shuffle, self.drop_last, self.timeout = shuffle and train, drop_last, timeout
        self.streams = max(1, self.num_workers)
        if int(shuffle_shards_window) < 1:
            raise ConfigError(
                f"loader.shuffle_shards_window={shuffle_shards_window} must be >= 1 (1: one shard at a "
                f"time; K: each reader mixes the samples of K shards)"
            )
        self.window = int(shuffle_shards_window) if train and shuffle else 1
        self.eval_in_memory = _memory_budget(eval_in_memory)
        options = fsurl.storage_options(storage_options, "loader.storage_options")
        if options and dataset.storage_options != options:  # before the index is read: it may be remote too
            dataset.storage_options = options
            dataset.__dict__.pop("index", None)
        self._kept: tuple[int, list[tuple[Any, bool]]] | None = None  # (passes' length, the pass) kept in memory
        shards = dataset.index.shards(split)
        self.refs = [ShardRef(dataset.index.resolve(s), s.bytes, s.sha256, s.samples) for s in shards]
        self.urls = [r.url for r in self.refs]
        self.counts = [s.samples for s in shards]
        self.policy = FetchPolicy(
            retries=int(retries),
            backoff=float(backoff),
            timeout=float(read_timeout),
            allow_pipe=bool(allow_pipe),
            storage_options=options,
        )
        if not allow_pipe and any(u.startswith("pipe:") for u in self.urls):
            raise ConfigError(
                f"the shard index of {dataset.root} uses shell-command URLs (pipe:), which run "
                f"commands; set loader.allow_pipe=true only if you trust it"
            )
        self.partitions = int(partitions or len(shards))
        if self.num_workers:  # (the runner started it before its threads; else a fresh interpreter)
            server.start({__name__, type(self).__module__, type(dataset).__module__})
        if train and self.streams * world_size > self.partitions:  # (evaluation tolerates idle readers)
            if self.partitions < world_size:
                raise ConfigError(
                    f"{split} split has {self.partitions} partition(s) but {world_size} ranks: every rank needs at "
                    f"least one; write more shards (recipe.prepare data.prepare.samples_per_shard=...) "
                    f"or use fewer ranks"
                )
            # A worker without a partition would only idle: use as many as there are partitions per rank.
            fewer = self.partitions // world_size
            log.warning(
                "%s split has %d partition(s) for %d rank(s): %d loader worker(s) per rank instead of "
                "loader.num_workers=%d (write more shards to use them all)",
                split,
                self.partitions,
                world_size,
                fewer,
                self.num_workers,
            )
            self.num_workers = self.streams = fewer
        self.epoch, self.batches, self.positions = 0, 0, {}
        self.base: plan.Consumed = {}  # what was consumed of each partition before this segment (elastic resume)
        self._plans: dict[tuple, list[plan.Item]] = {}
        self.stats = {"samples": 0, "skipped_corrupt": 0, "bytes_from_source": 0, "fetch_retries": 0}
        self.sample_log: Callable[[list[str]], None] | None = None

    # ---- the plan (pure) -------------------------------------------------------------------------
    def _gid(self, rank: int, worker: int) -> int:
        return plan.stream_id(rank, worker, self.streams, self.world_size, self.train)

    def _items(self, epoch: int, g: int) -> list[plan.Item]:
        base = self.base if epoch == self.epoch else {}
        key = (epoch, g, repr(sorted(base.items())))  # (pure: asked for every step, computed once)
        if key not in self._plans:
            if len(self._plans) > 64:
                self._plans.clear()
            self._plans[key] = plan.stream_items(
                len(self.urls),
                self.counts,
                self.partitions,
                g,
                self.streams * self.world_size,
                self.seed,
                epoch,
                self.shuffle,
                base,
                self.streams,
                self.batch_size,
                self.drop_last,
            )
        return self._plans[key]

    def _stream_batches(self, epoch: int, g: int) -> int:
        return plan.count_batches(self._items(epoch, g), self.batch_size, self.drop_last)

    def steps_per_epoch(self, epoch: int | None = None) -> int:
        """Batches each rank hands out per epoch: the same on every rank (the smallest rank's count)."""
        e = self.epoch if epoch is None else epoch
        return min(
            sum(self._stream_batches(e, self._gid(r, s)) for s in range(self.streams)) for r in range(self.world_size)
        )

    # ---- position ---------------------------------------------------------------------------------
    def layout(self) -> dict:
        out = {
            "world_size": self.world_size,
            "streams": self.streams,
            "partitions": self.partitions,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }
        if self.window > 1:  # (absent at 1: checkpoints from before the option resume bitwise)
            out["window"] = self.window
        return out

    def _reads(self, g: int) -> list[tuple[int, int]] | None:
        """Stream ``g``'s read order when it mixes shards; None when it reads run after run."""
        if self.window == 1:
            return None
        return plan.read_order(self._items(self.epoch, g), self.window, self.seed, self.epoch, g)

    def state_dict(self) -> dict:
        ended = self.batches >= self.steps_per_epoch()
        offsets: plan.Consumed = {}
        if not ended:  # what is consumed of each partition, with this rank's reading (for a resume on other ranks)
            order = plan.shard_order(len(self.urls), self.seed, self.epoch, self.shuffle)
            offsets = self.base
            for s in range(self.streams):
                g = self._gid(self.rank, s)
                offsets = plan.consumed_after(
                    self._items(self.epoch, g),
                    order,
                    self.counts,
                    self.partitions,
                    self.positions.get(g, 0),
                    offsets,
                    self._reads(g),
                )
        return {
            "epoch": self.epoch,
            "batches": self.batches,
            "ended": ended,
            "positions": {str(k): v for k, v in self.positions.items()},
            "base": {str(k): v for k, v in self.base.items()},
            "offsets": {str(k): v for k, v in offsets.items()},
            "layout": self.layout(),
        }

    def load_state_dict(self, state: dict, peers: list[dict] | None = None) -> None:
        """Restore the position. Same layout: continue bitwise. Another number of ranks or workers (same
        partitions, batch size, seed): ``peers`` (every saved rank's state) give the consumed samples of each
        partition, and the remaining ones are spread over the new readers — nothing repeated, nothing lost."""
        saved = state["layout"]
        if saved == self.layout():
            self.epoch, self.batches = int(state["epoch"]), int(state["batches"])
            self.positions = {int(k): int(v) for k, v in state["positions"].items()}
            self.base = plan.as_consumed(state.get("base", {}))
            return
        elastic = ("world_size", "streams", "window")  # (what is consumed is known sample by sample)
        fixed = {k: (saved.get(k), v) for k, v in self.layout().items() if k not in elastic and saved.get(k) != v}
        if fixed or not peers or len(peers) != saved.get("world_size"):
            changed = fixed or {k: (saved.get(k), v) for k, v in self.layout().items() if saved.get(k) != v}
            raise ConfigError(
                f"cannot resume the data position: loader layout changed {changed} (saved, now); "
                f"only the number of ranks and loader.num_workers may change across a resume"
            )
        self.epoch, self.batches, self.positions = int(state["epoch"]), 0, {}
        if state.get("ended"):
            self.base = {}
            self.epoch += 1
            return
        merged: dict[int, list[list[int]]] = {}
        for peer in peers:  # (every rank carries what was consumed before; the union adds what each read since)
            for p, ivs in plan.as_consumed(peer["offsets"]).items():
                merged.setdefault(p, []).extend(ivs)
        self.base = {p: plan.merge(ivs) for p, ivs in merged.items()}

    # ---- reading ----------------------------------------------------------------------------------
    @abstractmethod
    def source(self) -> ShardSource:
        """Where this loader's readers get shard bytes (a fresh, picklable object per epoch)."""

    def _reader(self, epoch: int) -> Iterator[dict | _Failure]:
        """Readers for ``epoch``: from the saved position if it is the current epoch, else from its start."""
        current = epoch == self.epoch
        done = self.batches if current else 0
        counts = [self._stream_batches(epoch, self._gid(self.rank, s)) for s in range(self.streams)]
        seq = plan.round_robin(counts)
        rotation = seq[done] if done < len(seq) else 0
        # Workers hand out batches round-robin starting at worker 0; rotate stream ids so that the
        # stream whose turn it was when we stopped comes first.  Streams already exhausted yield nothing.
        reader = StreamReader(
            refs=self.refs,
            source=self.source(),
            dataset=self.dataset,
            train=self.train,
            seed=self.seed,
            epoch=epoch,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            shuffle=self.shuffle,
            partitions=self.partitions,
            streams=self.streams,
            rank=self.rank,
            world_size=self.world_size,
            starts=dict(self.positions) if current else {},
            rotation=rotation,
            base=dict(self.base) if current else {},
            window=self.window,
        )
        if self.num_workers == 0:
            return iter(reader)
        # A generator of its own: starting workers must not draw from the global torch RNG (which the
        # checkpoint restores), or a resumed run would see different dropout masks than an uninterrupted one.
        generator = torch.Generator().manual_seed(derive_seed("loader", self.seed, epoch, self.rank, self.train))
        return iter(
            DataLoader(
                reader,
                batch_size=None,
                num_workers=self.num_workers,
                pin_memory=self.pin_memory,
                prefetch_factor=self.prefetch_factor,
                timeout=self.timeout,
                generator=generator,
                multiprocessing_context=server.context(),
                worker_init_fn=functools.partial(_worker_init, parent=server.parent(), trainer=os.getpid()),
            )
        )

    def __iter__(self) -> Iterator[Any]:
        ahead = None  # the next epoch's workers, started while this epoch's last prefetched batches drain
        lead = self.num_workers * self.prefetch_factor if self.num_workers else 0
        while True:
            if self.batches >= self.steps_per_epoch():
                self.epoch, self.batches, self.positions, self.base = self.epoch + 1, 0, {}, {}
            it, ahead = (ahead if ahead is not None else self._reader(self.epoch)), None
            limit = self.steps_per_epoch()
            for item in it:
                if isinstance(item, _Failure):
                    raise DataError(item.message)
                self.batches += 1
                self.positions[item["stream"]] = item["end"]
                self.stats["samples"] += len(item["keys"])
                self.stats["skipped_corrupt"] += item["skipped"]
                for k, v in item["io"].items():
                    self.stats[k] = self.stats.get(k, 0) + v
                if self.sample_log is not None:
                    self.sample_log(item["keys"])
                yield item["data"]
                if self.batches >= limit:
                    break
                if ahead is None and lead and limit - self.batches <= lead:  # no gap at the epoch boundary
                    ahead = self._reader(self.epoch + 1)
            del it
            if self.batches < limit:  # every reader ran dry early (samples skipped as corrupt)
                self.batches = limit

    def eval_batches(self) -> list[int]:
        """Batches of one evaluation pass, per rank (pure: every rank computes the same list)."""
        return [
            sum(self._stream_batches(0, self._gid(r, s)) for s in range(self.streams)) for r in range(self.world_size)
        ]

    def iterate_once(
        self, max_batches: int | None = None, share: Callable[[Any, int], Any] | None = None
    ) -> Iterator[tuple[Any, bool]]:
        """One pass over this rank's share (evaluation): no shuffling, no position kept.

        Yields ``(batch, counted)``, and every rank yields the same number of batches: a forward is a
        collective under DDP (buffer broadcast) and FSDP (parameter all-gather), so a rank that stopped
        early while a peer still runs forwards would deadlock the job.  A rank that ran out keeps stepping
        with a one-sample *padding* batch (``counted=False``: run it, do not score it).  A rank with no
        evaluation data at all gets its padding sample from a rank that has some, through
        ``share(obj, src)`` (a broadcast every rank calls, before any forward, only when such a rank exists).
        """
        counts = self.eval_batches()
        steps = max(counts, default=0)
        if max_batches is not None:
            steps = min(steps, int(max_batches))
        if self._kept is not None and self._kept[0] == steps:
            yield from self._kept[1]  # the same batches as the first pass, without starting a worker
            return
        mine = min(counts[self.rank], steps)
        it = self._reader(0) if mine else iter(())
        first = self._checked(next(it)) if mine else None
        shared = bool(steps and min(counts) == 0 and self.world_size > 1)
        if shared:
            if share is None:
                raise ValueError("a rank has no evaluation data: iterate_once needs share= to stay in lockstep")
            src = counts.index(max(counts))
            pad = share(first_sample(first) if self.rank == src else None, src)
        else:
            pad = first_sample(first) if first is not None else None
        # Kept in memory for later passes if it fits loader.eval_in_memory (each rank decides alone: a kept
        # pass runs no collective, so it is never kept when its padding came from a peer by a broadcast).
        keep: list[tuple[Any, bool]] | None = [] if self.eval_in_memory and not shared else None
        size = 0
        for i in range(mine):
            pair = (first if i == 0 else self._checked(next(it))), True
            first = None
            if keep is not None:
                size += nbytes(pair[0])
                if size <= self.eval_in_memory:
                    keep.append(pair)
                else:
                    keep = None
            yield pair
        del it  # stop this pass's workers now, not when the generator is collected
        for _ in range(steps - mine):
            if keep is not None:
                keep.append((pad, False))
            yield pad, False
        if keep is not None:
            self._kept = (steps, keep)
            log.info(
                "%s split: this rank's %d evaluation batches (%s bytes) are kept in memory for later passes "
                "(loader.eval_in_memory=%s bytes)",
                self.split,
                len(keep),
                f"{size:,}",
                f"{self.eval_in_memory:,}",
            )

    @staticmethod
    def _checked(item: dict | _Failure) -> Any:
        if isinstance(item, _Failure):
            raise DataError(item.message)
        return item["data"]


def nbytes(batch: Any) -> int:
    """The bytes of a batch's tensors."""
    if isinstance(batch, torch.Tensor):
        return batch.element_size() * batch.nelement()
    if isinstance(batch, (list, tuple)):
        return sum(nbytes(b) for b in batch)
    if isinstance(batch, dict):
        return sum(nbytes(b) for b in batch.values())
    return 0


def _memory_budget(value: Any) -> int:
    """``loader.eval_in_memory``: a size (bytes, "256MB"), or 0 / false for none."""
    if value is False or value == 0 or str(value).strip().lower() in ("0", "false", "off"):
        return 0
    size = parse_size(value, "loader.eval_in_memory", off="0")
    if size is None:
        raise ConfigError(
            "loader.eval_in_memory=null: give a size such as 256MB, or 0 to read the evaluation "
            "data at every evaluation"
        )
    return size


def first_sample(batch: Any) -> Any:
    """A one-sample batch of the same structure (copied: it must not pin the whole batch's memory)."""
    if isinstance(batch, torch.Tensor):
        return batch[:1].clone()
    if isinstance(batch, (list, tuple)):
        return type(batch)(first_sample(b) for b in batch)
    if isinstance(batch, dict):
        return {k: first_sample(v) for k, v in batch.items()}
    return batch


def _worker_init(worker_id: int, parent: int, trainer: int) -> None:
    """A worker is not the trainer: it must not keep signal handlers of the trainer's (a preemption notice
    caught and ignored by a worker keeps it alive after its loader is gone), it ends when the ``trainer``
    process does, and on SIGUSR2 it writes its threads' stacks to stderr (the hang watchdog asks for them).

    Ending with the trainer: torch's own check compares the worker's parent pid with the one it saw at its
    start, but that parent is the fork server (``parent``), which outlives a killed trainer while it has
    children; a worker of a trainer killed by SIGKILL or the OOM killer would wait for work forever and hold
    the job's stdout and stderr open (a supervisor's or CI's pipe never ends). So a thread watches the trainer
    (a pidfd on Linux) and exits the worker when it is gone, also if it was gone before the worker started;
    and the kernel kills the worker if its parent dies (PR_SET_PDEATHSIG)."""
    import faulthandler

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGURG):  # preemption notices, the watchdog's wake-up
        signal.signal(sig, signal.SIG_DFL)
    _write_where(trainer)
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    _die_with_parent()
    if os.getppid() != parent:
        os._exit(1)
    _exit_with(trainer)


def _write_where(pid: int) -> None:
    """This worker's stdout and stderr go where process ``pid``'s go now (as a fork of it would), not where
    the fork server's went when it started (a log file or a test's capture since replaced)."""
    for fd in (1, 2):
        try:
            target = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:  # not Linux, or not reopenable (a socket): keep the fork server's
            continue
        os.dup2(target, fd)
        os.close(target)


def _exit_with(pid: int) -> None:
    """Exit this process (at once, status 1) when process ``pid`` ends; now if it already has."""
    import select
    import threading
    import time

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # no pidfds here: ask once a second
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])  # readable once the process has ended
        else:
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                except PermissionError:
                    pass
                time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="pitstop-exit-with-trainer", daemon=True).start()


def _die_with_parent() -> None:
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
