"""The worker side of a loader: a stream reader reads its disjoint shards in order, decodes, batches, and hands
whole batches (or one failure) to the trainer; ``ShardSource`` is where shard bytes come from."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterator

import torch

from torch.utils.data import IterableDataset, get_worker_info

from pitstop.data.remote import ShardRef
from pitstop.data.shards import read_shard
from pitstop.errors import ConfigError, DataError
from pitstop.data.loader import plan
from pitstop.parts.seed import derive_seed

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("pitstop.data.loader")


class Failure:
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


INLINE_BYTES = 1 << 20  # a worker's batch tensors up to this size travel pickled, in the pipe (see Inline)


class Inline:
    """A small batch tensor on its way from a worker, as a numpy array pickled into the result pipe. torch sends a
    tensor through shared memory instead, with its file descriptor passed over a connection of its own: ~0.75 ms
    per tensor here, far more than copying a few KB (a batch of 64 8x8 digits is 4 KB), paid by the training
    process on every step. Large tensors keep torch's way (one copy in the worker, none in the trainer)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array


def to_transport(batch: object, limit: int = INLINE_BYTES) -> object:
    """``batch`` with each CPU tensor of at most ``limit`` bytes as an :class:`Inline` (lists, tuples, dicts)."""
    if isinstance(batch, torch.Tensor):
        plain = type(batch) is torch.Tensor and batch.layout == torch.strided and batch.device.type == "cpu"
        if plain and not (batch.requires_grad or batch.is_conj() or batch.is_neg()) and batch.nbytes <= limit:
            try:
                return Inline(batch.numpy())
            except (TypeError, RuntimeError):  # (a dtype numpy has not: bfloat16, float8, quantized)
                return batch
        return batch  # (subclasses, sparse and nested tensors, large ones: torch's shared memory)
    if type(batch) in (list, tuple):
        return type(batch)(to_transport(b, limit) for b in batch)
    if type(batch) is dict:
        return {k: to_transport(v, limit) for k, v in batch.items()}
    return batch


def from_transport(batch: object) -> Any:
    """The batch as the worker's collate made it: each :class:`Inline` a tensor again (no copy)."""
    if isinstance(batch, Inline):
        return torch.from_numpy(batch.array)
    if type(batch) in (list, tuple):
        return type(batch)(from_transport(b) for b in batch)
    if type(batch) is dict:
        return {k: from_transport(v) for k, v in batch.items()}
    return batch


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
        inline=False,
    ):
        self.refs, self.source, self.dataset = refs, source, dataset
        self.counts = [r.samples for r in refs]
        self.train, self.seed, self.epoch, self.batch_size = train, seed, epoch, batch_size
        self.drop_last, self.shuffle, self.partitions, self.streams = drop_last, shuffle, partitions, streams
        self.rank, self.world_size, self.starts, self.rotation = rank, world_size, starts, rotation
        self.base, self.window = base, window
        self.inline = inline  # small batch tensors through the pipe (not when the batches are pinned)

    def __iter__(self):
        info = get_worker_info()
        local_streams = [0] if info is None else [(info.id + self.rotation) % info.num_workers]
        if info is None and self.streams > 1:
            raise ConfigError("in-process reading supports one stream; set loader.num_workers to match")
        failed = False
        try:
            for s in local_streams:
                for item in self._stream(plan.stream_id(self.rank, s, self.streams, self.world_size, self.train)):
                    failed = isinstance(item, Failure)
                    yield item
        finally:  # after a failure the run goes down: let downloads in flight finish cleaning up first
            self.source.close(wait=failed)

    def _stream(self, g: int) -> Iterator[dict | Failure]:
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
                        yield Failure(str(e))
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
                    yield Failure(
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
        data = self.dataset.collate(items)
        return {
            "data": to_transport(data) if self.inline and get_worker_info() is not None else data,
            "stream": g,
            "end": pos,
            "keys": keys,
            "skipped": skipped,
            "io": self.source.take_stats(),
        }
