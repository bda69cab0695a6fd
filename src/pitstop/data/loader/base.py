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
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader

from pitstop.data.dataset import ShardedDataset
from pitstop import fsurl
from pitstop.data.remote import FetchPolicy, ShardRef
from pitstop.errors import ConfigError, DataError
from pitstop.data.loader import evaluation, plan, server
from pitstop.parts.batch import without
from pitstop.parts.seed import derive_seed

from pitstop.data.loader.reader import Failure, ShardSource, StreamReader, from_transport
from pitstop.data.loader.sizes import memory_budget
from pitstop.data.loader.workers import worker_init

log = logging.getLogger("pitstop.data.loader")


class TrainBatches(ABC):
    """The training batches the loop holds: an endless iterator across epochs with an exact, saveable position.
    :class:`ShardLoader` (a rank's share of the shards, every ``loader`` option) implements it, and so does
    ``strategy=ft``'s ``ReplicaLoader`` (one global order cut among each step's replica groups)."""

    kind = "base"
    stats: dict[str, int]  # cumulative counters (samples, bytes from the source, ...)
    sample_log: Callable[[list[str]], None] | None  # each handed-out batch's sample keys (data.record_sample_ids)
    quarantined: frozenset[str] = frozenset()  # sample keys never handed out (trainer.instability.quarantine)
    last_keys: list[str] = []  # the sample keys of the batch handed out last

    @abstractmethod
    def __iter__(self) -> Iterator[Any]:
        """The training batches, endless (epoch after epoch)."""

    @abstractmethod
    def steps_per_epoch(self, epoch: int | None = None) -> int:
        """Batches an epoch hands out (this one, or ``epoch``)."""

    @abstractmethod
    def state_dict(self) -> dict:
        """The data position, for a checkpoint."""

    @abstractmethod
    def load_state_dict(self, state: dict, peers: list[dict] | None = None) -> None:
        """Restore a position (``peers``: every saved rank's, for a resume at another world size)."""

    @property
    @abstractmethod
    def epoch(self) -> int:
        """The epoch being read."""

    @property
    def batch_epoch(self) -> int:
        """The epoch of the batch handed out last (the sample log names it where a step takes several)."""
        return self.epoch

    def warm(self) -> None:
        """Start fetching what the current data position reads first, now (a loader with a cache does: the cached
        loader); by default nothing. Called as the loader is built on a fresh run and after a restore."""

    def close(self) -> None:
        """Release what the loader holds beyond its batch iterators (a worker pool of its own); by default nothing:
        the iterators' workers stop with the loop."""

    def commit(self) -> None:
        """The step of the batches handed out committed (a per-rank loader counts them as it hands them out;
        ``strategy=ft``'s loader advances its position only here)."""


class ShardLoader(TrainBatches):
    """The contract of a ``loader`` option, trainer side: batches across epochs, endless, with an exact position
    (``iter``, ``iterate_once`` for an evaluation pass in lockstep across ranks, ``steps_per_epoch``, ``state_dict``,
    ``load_state_dict``, ``stats``). It owns the order and the position; a ``loader`` option of your own subclasses it
    and implements only :meth:`source` (as ``PlainLoader`` and ``CachedLoader`` do), taking its own keys in
    ``__init__`` and passing the others on. What :meth:`source` returns is pickled to the reader processes and hands
    back a shard's exact bytes or raises: a failed read is retried (``loader.retries``, for a URL), then fails the run
    with a :class:`~pitstop.errors.DataError` naming the shard. The same data, seed and ranks give the same batches,
    whatever the source."""

    kind = "base"
    epoch: int = 0  # (an attribute here: the readers advance it)

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
        download_parts: int | str = "auto",
        allow_pipe: bool = False,
        eval_in_memory: int | str | bool = "256MB",
        shuffle_shards_window: int = 1,
        storage_options: Mapping[str, Any] | None = None,
    ):
        """Builds only: each key's range is checked by its schema (``pitstop.config.schema.Loader``) before this; what
        is checked here needs the shard index (``pipe:`` URLs, enough partitions for the ranks)."""
        options = fsurl.storage_options(storage_options, "loader.storage_options")
        self.dataset, self.split, self.batch_size, self.seed = dataset.reaching(options), split, batch_size, seed
        self.rank, self.world_size, self.train = rank, world_size, train
        self.pin_memory, self.prefetch_factor, self.timeout = pin_memory, prefetch_factor, timeout
        self.shuffle, self.drop_last = shuffle and train, drop_last
        self.window = shuffle_shards_window if train and shuffle else 1
        self.eval_in_memory = memory_budget(eval_in_memory)
        self._kept: tuple[int, list[tuple[Any, bool]]] | None = None  # (passes' length, the pass) kept in memory
        self.refs = _shard_refs(self.dataset, split, allow_pipe)
        self.urls = [r.url for r in self.refs]
        self.counts = [r.samples for r in self.refs]
        self.policy = FetchPolicy(
            retries=retries,
            backoff=backoff,
            timeout=read_timeout,
            allow_pipe=allow_pipe,
            storage_options=options,
            parts=download_parts if download_parts == "auto" else _parts(download_parts),
        )
        self.partitions = int(partitions or len(self.refs))
        self.num_workers = _workers_per_rank(num_workers, self.partitions, world_size, split, train)
        self.streams = max(1, self.num_workers)
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

    def worker_modules(self) -> set[str]:
        """What a data worker runs: imported in the workers' fork server before it serves them."""
        return {__name__, type(self).__module__, type(self.dataset).__module__}

    def side_stats(self) -> dict[str, int]:
        """Counters of work done outside the readers (a subclass's), taken once: added to ``stats``."""
        return {}

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
        """The data position (JSON): epoch, batches handed out, each reader's place, what each partition gave."""
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
        """Where the readers get shard bytes: a fresh, picklable :class:`ShardSource` per epoch (``read(ref)``)."""

    def _reader(self, epoch: int, resume: bool = True) -> Iterator[dict | Failure]:
        """Readers for ``epoch``: from the saved position if it is the current epoch (and ``resume``), else from its
        start (``resume=False``: the next epoch's, made in a thread while this one's position still changes)."""
        current = resume and epoch == self.epoch
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
            inline=not self.pin_memory,  # (pinned batches: torch's shared memory, the pin thread pins them)
        )
        if self.num_workers == 0:
            return iter(reader)
        # A generator of its own: starting workers must not draw from the global torch RNG (which the
        # checkpoint restores), or a resumed run would see different dropout masks than an uninterrupted one.
        generator = torch.Generator().manual_seed(derive_seed("loader", self.seed, epoch, self.rank, self.train))
        mp_context, parent = server.workers(self.worker_modules())
        return iter(
            DataLoader(
                reader,
                batch_size=None,
                num_workers=self.num_workers,
                pin_memory=self.pin_memory,
                prefetch_factor=self.prefetch_factor,
                timeout=self.timeout,
                generator=generator,
                multiprocessing_context=mp_context,
                worker_init_fn=functools.partial(worker_init, parent=parent, trainer=os.getpid()),
            )
        )

    def __iter__(self) -> Iterator[Any]:
        # The next epoch's workers are started while this epoch's last prefetched batches drain, from a thread: a
        # worker's start waits for the fork server's answer (~20 ms each), which the training loop would wait for.
        starter = ThreadPoolExecutor(1, thread_name_prefix="pitstop-next-epoch") if self.num_workers else None
        try:
            yield from self._epochs(starter)
        finally:
            if starter is not None:  # (not waiting: a start stuck on a fork server must not hold up a stall's exit;
                starter.shutdown(wait=False, cancel_futures=True)  # the iterator it makes is dropped, workers stop)

    def _epochs(self, starter: ThreadPoolExecutor | None) -> Iterator[Any]:
        ahead: Future | None = None  # the next epoch's readers, being started
        lead = self.num_workers * self.prefetch_factor if self.num_workers else 0
        while True:
            if self.batches >= self.steps_per_epoch():
                self.epoch, self.batches, self.positions, self.base = self.epoch + 1, 0, {}, {}
            it, ahead = (ahead.result() if ahead is not None else self._reader(self.epoch)), None
            limit, failure = self.steps_per_epoch(), None
            for item in it:
                if isinstance(item, Failure):
                    failure = item
                    break
                self.batches += 1
                self.positions[item["stream"]] = item["end"]
                self.stats["samples"] += len(item["keys"])
                self.stats["skipped_corrupt"] += item["skipped"]
                for counts in (item["io"], self.side_stats()):
                    for k, v in counts.items():
                        self.stats[k] = self.stats.get(k, 0) + v
                data, self.last_keys = from_transport(item["data"]), item["keys"]
                if self.quarantined and not self.quarantined.isdisjoint(self.last_keys):
                    data, self.last_keys = without(data, self.last_keys, self.quarantined)
                if self.sample_log is not None:
                    self.sample_log(self.last_keys)
                yield data
                if self.batches >= limit:
                    break
                if ahead is None and lead and limit - self.batches <= lead:  # no gap at the epoch boundary
                    ahead = starter.submit(self._next_reader, self.epoch + 1, _current_device(self.pin_memory))
            if failure is None and starter is not None:  # the ended epoch's workers stop in the starter thread: joining
                held, it = [it], None  # their processes took ~30 ms of the loop's time at each epoch boundary
                starter.submit(held.clear)  # (the last reference: dropped there, whichever thread runs first)
            del it
            if failure is not None:  # (raised once the readers are released: their workers stop now, not when
                del ahead  # the traceback that holds this frame is collected, which takes 5 s per worker)
                raise DataError(failure.message)
            if self.batches < limit:  # every reader ran dry early (samples skipped as corrupt)
                self.batches = limit

    def _next_reader(self, epoch: int, device: int | None) -> Iterator[dict | Failure]:
        """(In the starter thread) the next epoch's reader, made on the trainer's device: a pinning DataLoader pins
        for the current device of the thread that makes it, and a thread's starts at 0 (another rank's GPU)."""
        if device is not None:
            torch.accelerator.set_device_index(device)
        return self._reader(epoch, resume=False)

    def eval_batches(self) -> list[int]:
        """Batches of one evaluation pass, per rank (pure: every rank computes the same list)."""
        return [
            sum(self._stream_batches(0, self._gid(r, s)) for s in range(self.streams)) for r in range(self.world_size)
        ]

    def iterate_once(
        self, max_batches: int | None = None, share: Callable[[Any, int], Any] | None = None
    ) -> Iterator[tuple[Any, bool]]:
        """One pass over this rank's share (evaluation), every rank yielding as many ``(batch, counted)`` pairs
        (``evaluation.one_pass``)."""
        return evaluation.one_pass(self, max_batches, share)


def _shard_refs(dataset: ShardedDataset, split: str, allow_pipe: bool) -> list[ShardRef]:
    """The split's shards as the readers fetch them; shell-command URLs only where they are allowed."""
    refs = [ShardRef(dataset.index.resolve(s), s.bytes, s.sha256, s.samples) for s in dataset.index.shards(split)]
    if not allow_pipe and any(r.url.startswith("pipe:") for r in refs):
        raise ConfigError(
            f"the shard index of {dataset.root} uses shell-command URLs (pipe:), which run "
            f"commands; set loader.allow_pipe=true only if you trust it"
        )
    return refs


def _workers_per_rank(num_workers: int, partitions: int, world_size: int, split: str, train: bool) -> int:
    """Reader streams per rank: ``loader.num_workers`` (at least one stream: 0 workers read in the trainer), fewer
    where the training split has too few partitions for them all (a worker without a partition would only idle)."""
    streams = max(1, num_workers)
    if not train or streams * world_size <= partitions:  # (evaluation tolerates idle readers)
        return num_workers
    if partitions < world_size:
        raise ConfigError(
            f"{split} split has {partitions} partition(s) but {world_size} ranks: every rank needs at least one; "
            f"write more shards (recipe.prepare data.prepare.samples_per_shard=...) or use fewer ranks"
        )
    fewer = partitions // world_size
    log.warning(
        "%s split has %d partition(s) for %d rank(s): %d loader worker(s) per rank instead of loader.num_workers=%d "
        "(write more shards to use them all)",
        split,
        partitions,
        world_size,
        fewer,
        num_workers,
    )
    return fewer


def _parts(value: int | str) -> int:
    """``loader.download_parts`` as a number of ranged requests (>= 1), or a one-line error."""
    if isinstance(value, bool) or not str(value).isdigit() or int(value) < 1:
        raise ConfigError(
            f"loader.download_parts={value!r}: use auto (one ranged request per 2 MB of a shard, at most 8 at "
            f"once) or a number >= 1 (1: one request per shard)"
        )
    return int(value)


def _current_device(pinned: bool) -> int | None:
    """The accelerator device this thread uses, where batches are pinned for one (else None)."""
    return torch.accelerator.current_device_index() if pinned and torch.accelerator.is_available() else None
