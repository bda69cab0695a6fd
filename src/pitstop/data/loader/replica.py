"""The training batches of a replica group (``strategy=ft``): one global order per epoch, cut step by step
among the groups that take part in the step, so that every sample of an epoch is read exactly once however
groups come and go.

The epoch's order is one sequence of all its samples: the shards in their seeded order, each shard's samples
in their seeded order (the same pure functions as every loader, :mod:`pitstop.data.loader.plan`). The data
position is two integers, ``(epoch, position)``, the same in every group (it is part of the state a newcomer
heals from, and of the durable checkpoint). A step with ``P`` groups takes the next ``P x batch_size`` samples;
the group at place ``r`` of the quorum reads the ``r``-th slice (a group of ``R`` ranks: its rank ``i`` reads the
``(r x R + i)``-th of ``P x R`` slices, ``trainer.batch_size`` per rank); with ``trainer.grad_accum_steps=K`` each
of the step's ``K`` micro-batches takes the next such slice (a step may run into the next epoch). A committed step moves
the position on (:meth:`ReplicaLoader.commit`); a discarded one does not, so its samples are read again by the next
step (the loader sees a step end without a commit at the next step's first fetch). The epoch's last fetch splits
the rest evenly over its groups (at most ``batch_size + 1`` each); only if groups joined just then and the rest is
fewer samples than groups is it dropped (counted: ``dropped_at_epoch_end``).

With ``loader.num_workers=W`` a pool of ``W`` worker processes (forks of the data workers' fork server) decodes
the next ``W`` slices ahead, planned as if the step's groups stay and it commits (the usual case); a slice that
turns out otherwise (a group came or went, a step was discarded) is read again, in the pool's order, from where
the data position says. What a sample decodes to depends on its key, epoch and seed only, never on who read it.

The global batch is ``trainer.batch_size`` per rank, times the ranks of a group, times the groups of the step (the
gradients are averaged over them, the learning rate is unchanged).
"""

from __future__ import annotations

import logging
import math
import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Iterator


from pitstop.data.loader import plan
from pitstop.data.shards import read_shard
from pitstop.errors import DataError
from pitstop.parts.seed import derive_seed
from pitstop.data.loader.base import ShardLoader, TrainBatches

if TYPE_CHECKING:
    from concurrent.futures import ProcessPoolExecutor

    from pitstop.data.dataset import ShardedDataset
    from pitstop.data.loader.reader import ShardSource
    from pitstop.data.remote import ShardRef

log = logging.getLogger("pitstop.data.loader")


class ReplicaLoader(TrainBatches):
    """Wraps a training :class:`~pitstop.data.loader.base.ShardLoader` (its data set, shards, source of shard
    bytes, seed and batch size); ``participation()`` says (groups of this step, this group's place)."""

    kind = "replica"
    batch_epoch: int = 0  # (an attribute here: the epoch of the micro-batch fetched last)

    def __init__(
        self,
        loader: ShardLoader,
        participation: Callable[[], tuple[int, int]],
        replicas: int,
        accum: int = 1,
        ranks: int = 1,
        rank: int = 0,
    ):
        """``accum``: micro-batches (fetches) per step, ``trainer.grad_accum_steps``; ``ranks``: the ranks of a group
        (``strategy.nproc_per_node``), ``rank`` this process's among them."""
        self.inner, self.participation, self.replicas, self.accum = loader, participation, int(replicas), int(accum)
        self.ranks, self.rank = int(ranks), int(rank)
        self.dataset, self.batch_size, self.seed, self.shuffle = (
            loader.dataset,
            loader.batch_size,
            loader.seed,
            loader.shuffle,
        )
        self.refs, self.counts = loader.refs, loader.counts
        self.num_samples = sum(self.counts)
        self.committed = (0, 0)  # (epoch, position) after the last committed step: the state
        self._cursor: tuple[int, int] | None = None  # where the step in flight reads next (None: between steps)
        self._taken, self._dropped = 0, 0  # the step in flight's fetches, and samples it dropped at an epoch end
        self.batch_epoch = 0  # the epoch of the micro-batch fetched last (a step may run into the next epoch)
        self.stats = {"samples": 0, "skipped_corrupt": 0, "dropped_at_epoch_end": 0, "bytes_from_source": 0}
        self.sample_log: Callable[[list[str]], None] | None = None
        self._orders: dict[int, list[tuple[int, int]]] = {}
        self._slices: SliceReader | None = None  # (in this process: no workers, or a broken pool)
        self.workers = int(getattr(loader, "num_workers", 0) or 0)
        self._pool: ProcessPoolExecutor | None = None
        self._ahead: dict[tuple[int, int, int], Any] = {}  # (epoch, start, end) -> a future of its slice

    # ---- the plan (pure) ------------------------------------------------------------------------------
    def order(self, epoch: int) -> list[tuple[int, int]]:
        """The epoch's samples, in reading order: (shard, index in the shard)."""
        if epoch not in self._orders:
            self._orders = {
                epoch: [
                    (shard, i)
                    for shard in plan.shard_order(len(self.refs), self.seed, epoch, self.shuffle)
                    for i in plan.sample_order(self.counts[shard], self.seed, epoch, shard, self.shuffle)
                ]
            }
        return self._orders[epoch]

    @staticmethod
    def share(position: int, total: int, batch: int, groups: int, place: int) -> tuple[int, int, int]:
        """``[start, end)`` of the epoch's order that the group at ``place`` of ``groups`` reads at ``position``,
        and how many samples the step takes in all."""
        rest = total - position
        if rest >= groups * (batch + 1):  # (else the next step could not give every group a sample)
            return position + place * batch, position + (place + 1) * batch, groups * batch
        base, extra = divmod(rest, groups)  # the epoch's last step: the rest split evenly (<= batch + 1 each)
        start = position + place * base + min(place, extra)
        return start, start + base + (1 if place < extra else 0), rest

    def fetches_left(self, epochs: int, groups: int) -> int:
        """Fetches (micro-batches) left until the committed position reaches the end of epoch ``epochs - 1``, if
        ``groups`` groups take part in every step from here on (pure: the same in every group)."""
        epoch, position = self.committed
        if epoch >= epochs:
            return 0
        slots = groups * self.ranks
        return self.fetches_in_epoch(position, slots) + (epochs - epoch - 1) * self.fetches_in_epoch(0, slots)

    def fetches_in_epoch(self, position: int, slots: int) -> int:
        """Fetches that read the rest of an epoch from ``position`` with ``slots`` readers in every step (the rules of
        :meth:`share` and :meth:`next_batch`, in closed form): full steps while at least ``slots x (batch + 1)``
        samples are left, then one that splits the rest, unless fewer than ``slots`` are left (dropped)."""
        rest, full, b = self.num_samples - position, slots * self.batch_size, self.batch_size
        if rest < slots:
            return 0
        steps = max(0, -(-(rest - slots * (b + 1) + 1) // full))  # (ceil)
        last = rest - steps * full
        return steps + (1 if last >= slots else 0)

    def steps_per_epoch(self, epoch: int | None = None) -> int:
        """With every group taking part (the schedule's plan; missing groups make an epoch longer)."""
        return max(1, math.ceil(self.num_samples / (self.batch_size * self.replicas * self.ranks)))

    @property
    def epoch(self) -> int:
        """The epoch of the last committed step (the data position's)."""
        return self.committed[0]

    @property
    def position(self) -> int:
        """Samples of the epoch consumed by committed steps."""
        return self.committed[1]

    @property
    def batches(self) -> int:
        """Batches of the current epoch so far, counted as if every group took part."""
        return self.position // (self.batch_size * self.replicas * self.ranks)

    # ---- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        epoch, position = self.committed
        return {"kind": self.kind, "epoch": epoch, "position": position, "stats": dict(self.stats)}

    def load_state_dict(self, state: dict, peers: list[dict] | None = None) -> None:
        if state.get("kind") != self.kind:
            raise DataError(
                "this checkpoint's data position was saved by another strategy than strategy=ft (a per-rank "
                "position): resume it with the strategy it was trained with"
            )
        self.committed = (int(state["epoch"]), int(state["position"]))
        self._cursor, self._taken, self._dropped = None, 0, 0
        self.stats.update(state.get("stats", {}))
        self._forget_ahead()

    # ---- reading ----------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        while True:
            yield self.next_batch()

    def _slice(self, cursor: tuple[int, int], groups: int, place: int) -> tuple[int, int, int, tuple[int, int], int]:
        """Where a fetch at ``cursor`` reads (pure): ``(epoch, start, end, cursor after it, samples dropped)``."""
        epoch, position = cursor
        dropped = 0
        if self.num_samples - position < groups:  # the epoch's last few samples: fewer than groups
            dropped = self.num_samples - position
            epoch, position = epoch + 1, 0
        start, end, taken = self.share(position, self.num_samples, self.batch_size, groups, place)
        return epoch, start, end, (epoch, position + taken), dropped

    def next_batch(self) -> Any:
        # (the step's state moves on only once this micro-batch is read: a data stall recovered by the watchdog
        # interrupts the read, and the same call is made again)
        cursor, fetched, dropped = self._cursor, self._taken, self._dropped
        if fetched >= self.accum:  # the step before ended without a commit (discarded): read its samples again
            cursor, fetched, dropped = None, 0, 0
        groups, place = self.participation()
        groups, place = groups * self.ranks, place * self.ranks + self.rank  # (every rank of the step's groups)
        epoch, start, end, after, more = self._slice(cursor or self.committed, groups, place)
        batch, keys, skipped, read = self._read(epoch, start, end)
        if self.workers:  # the next slices, as if this step's groups stay and it commits
            self._plan_ahead(after, groups, place)
        self._cursor, self._taken, self._dropped = after, fetched + 1, dropped + more
        self.batch_epoch = epoch
        self.stats["skipped_corrupt"] += skipped
        self.stats["bytes_from_source"] += read
        if self.sample_log is not None:
            self.sample_log(keys)
        self.stats["samples"] += len(keys)
        return batch

    def _read(self, epoch: int, start: int, end: int) -> tuple[Any, list[str], int, int]:
        """A slice: from the pool if it was planned (its decode is under way or done), else read here (a slice
        planned otherwise would wait behind the pool's stale work)."""
        from concurrent.futures.process import BrokenProcessPool

        future = self._ahead.get((epoch, start, end))
        if future is not None:
            try:
                got = future.result()
            except BrokenProcessPool as e:  # a worker died (killed, out of memory): read here from now on
                self._give_up_pool(f"strategy=ft's loader workers failed ({e}): reading in the trainer from here on")
            except BaseException:  # a stall the watchdog interrupted, or any error: a fresh pool next time
                self._stop_pool(patience=0.0)
                raise
            else:
                del self._ahead[epoch, start, end]
                return got
        return self.local_reader().read(epoch, pairs=self.order(epoch)[start:end])

    def local_reader(self) -> SliceReader:
        """The reader in this process (no workers, or a pool that broke)."""
        if self._slices is None:
            self._slices = SliceReader(self.dataset, self.refs, self.inner.source(), self.seed)
        return self._slices

    def _pool_or_none(self) -> ProcessPoolExecutor | None:
        if self._pool is None and self.workers:
            from concurrent.futures import ProcessPoolExecutor

            from pitstop.data.loader import server

            mp_context, parent = server.workers({__name__, type(self.dataset).__module__})
            self._pool = ProcessPoolExecutor(
                self.workers,
                mp_context=mp_context,
                initializer=_start_worker,
                initargs=(parent, os.getpid(), self.dataset, self.refs, self.inner.source(), self.seed),
            )
        return self._pool

    def _plan_ahead(self, cursor: tuple[int, int], groups: int, place: int) -> None:
        from concurrent.futures.process import BrokenProcessPool

        wanted = []
        for _ in range(self.workers):
            epoch, start, end, cursor, _ = self._slice(cursor, groups, place)
            wanted.append((epoch, start, end))
        for key in set(self._ahead) - set(wanted):  # planned for another quorum or position: not needed now
            self._ahead.pop(key).cancel()
        try:
            for key in wanted:
                if key not in self._ahead and self._pool_or_none() is not None:
                    self._ahead[key] = self._pool.submit(_read_in_worker, key[0], self.order(key[0])[key[1] : key[2]])
        except (BrokenProcessPool, RuntimeError) as e:  # (a worker died since: the pool takes no more work)
            self._give_up_pool(f"strategy=ft's loader workers failed ({e}): reading in the trainer from here on")

    def _give_up_pool(self, why: str) -> None:
        log.warning("%s", why)
        self._stop_pool(patience=0.0)
        self.workers = 0

    def _forget_ahead(self) -> None:
        for future in self._ahead.values():
            future.cancel()
        self._ahead.clear()

    def _stop_pool(self, patience: float = 10.0) -> None:
        """End the pool's workers (a later fetch starts a fresh pool): told to stop once the work in flight is done,
        within ``patience`` seconds, else terminated (a stuck worker; a stall). Told and waited for, not left to stop
        on their own: a process that exits right after could close the pool's call queue before the manager thread
        put the stop sentinels in, and then wait for its workers forever."""
        import threading

        self._forget_ahead()
        pool, self._pool = self._pool, None
        if pool is None:
            return
        processes = list(getattr(pool, "_processes", {}).values())
        if patience > 0:
            stopping = threading.Thread(
                target=pool.shutdown, kwargs={"wait": True, "cancel_futures": True}, daemon=True
            )
            stopping.start()
            stopping.join(patience)
            if not stopping.is_alive():
                return
        else:
            pool.shutdown(wait=False, cancel_futures=True)
        for p in processes:  # (the manager thread then fails what is left: the pool is broken)
            p.terminate()
        for p in processes:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)

    def commit(self) -> None:
        """The step in flight committed: its samples (every group's) are consumed."""
        if self._cursor is not None:  # (the epoch turns at the next fetch: this step's records say its own epoch)
            self.committed = self._cursor
        self.stats["dropped_at_epoch_end"] += self._dropped
        self._cursor, self._taken, self._dropped = None, 0, 0

    def warm(self) -> None:
        """Nothing to fetch ahead: the pool reads the next slices as the first step asks (the ShardLoader contract)."""

    def close(self) -> None:
        self._stop_pool(patience=10.0)
        if self._slices is not None:
            self._slices.close()
            self._slices = None


class SliceReader:
    """Reads and decodes a slice of an epoch's order (``(shard, index)`` pairs) into a batch: in the trainer, or in
    a loader worker. Keeps the last two shards it read."""

    def __init__(self, dataset: ShardedDataset, refs: list[ShardRef], source: ShardSource, seed: int):
        self.dataset, self.refs, self.source, self.seed = dataset, refs, source, seed
        self._shards: OrderedDict[int, list[dict]] = OrderedDict()
        self._read = 0

    def read(self, epoch: int, pairs: list[tuple[int, int]]) -> tuple[Any, list[str], int, int]:
        """``(batch, keys, corrupt samples skipped, bytes read from the source)``."""
        self._read = 0
        items, keys, skipped = [], [], 0
        for shard, i in pairs:
            sample = self._shard(shard)[i]
            key = sample["__key__"]
            try:
                items.append(self.dataset.decode(sample, train=True, seed=derive_seed(self.seed, epoch, key)))
            except Exception as e:  # noqa: BLE001 - any decode failure names shard and key
                if not self.dataset.skip_corrupt:
                    raise DataError(
                        f"corrupt sample {key!r} in shard {self.refs[shard].url}: {e} "
                        f"(set data.skip_corrupt=true to skip and count such samples)"
                    ) from None
                skipped += 1
                continue
            keys.append(key)
        return self.dataset.collate(items), keys, skipped, self._read

    def _shard(self, shard: int) -> list[dict]:
        if shard not in self._shards:
            ref = self.refs[shard]
            data = self.source.read(ref)
            self._read += len(data)
            self._shards[shard] = read_shard(data, ref.url)
            while len(self._shards) > 2:
                self._shards.popitem(last=False)
        self._shards.move_to_end(shard)
        return self._shards[shard]

    def close(self) -> None:
        self.source.close()


_worker: SliceReader | None = None  # a loader worker's reader


def _start_worker(
    parent: int, trainer: int, dataset: ShardedDataset, refs: list[ShardRef], source: ShardSource, seed: int
) -> None:
    """A loader worker of strategy=ft: ends with its trainer, ignores the scheduler's notices."""
    global _worker
    from pitstop.data.loader.workers import worker_init

    worker_init(0, parent, trainer)
    import torch

    torch.set_num_threads(1)  # (as torch's DataLoader does in its workers: the trainer has the cores)
    _worker = SliceReader(dataset, refs, source, seed)


def _read_in_worker(epoch: int, pairs: list[tuple[int, int]]) -> tuple[Any, list[str], int, int]:
    assert _worker is not None
    return _worker.read(epoch, pairs)
