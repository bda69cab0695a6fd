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

The global batch is ``trainer.batch_size`` per rank, times the ranks of a group, times the groups of the step (the
gradients are averaged over them, the learning rate is unchanged).
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from typing import Any, Callable, Iterator


from pitstop.data.loader import plan
from pitstop.data.shards import read_shard
from pitstop.errors import DataError
from pitstop.train.seed import derive_seed

log = logging.getLogger("pitstop.data.loader")


class ReplicaLoader:
    """Wraps a training :class:`~pitstop.data.loader.base.ShardLoader` (its data set, shards, source of shard
    bytes, seed and batch size); ``participation()`` says (groups of this step, this group's place)."""

    kind = "replica"

    def __init__(
        self,
        loader: Any,
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
        self._shards: OrderedDict[int, list[dict]] = OrderedDict()
        self._source: Any = None

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

    # ---- reading ----------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        while True:
            yield self.next_batch()

    def next_batch(self) -> Any:
        # (the step's state moves on only once this micro-batch is read: a data stall recovered by the watchdog
        # interrupts the read, and the same call is made again)
        cursor, fetched, dropped = self._cursor, self._taken, self._dropped
        if fetched >= self.accum:  # the step before ended without a commit (discarded): read its samples again
            cursor, fetched, dropped = None, 0, 0
        groups, place = self.participation()
        groups, place = groups * self.ranks, place * self.ranks + self.rank  # (every rank of the step's groups)
        epoch, position = cursor or self.committed
        if self.num_samples - position < groups:  # the epoch's last few samples: fewer than groups
            dropped += self.num_samples - position
            epoch, position = epoch + 1, 0
        start, end, taken = self.share(position, self.num_samples, self.batch_size, groups, place)
        order = self.order(epoch)
        items, keys = [], []
        for shard, i in order[start:end]:
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
                self.stats["skipped_corrupt"] += 1
                continue
            keys.append(key)
        self._cursor, self._taken, self._dropped = (epoch, position + taken), fetched + 1, dropped
        self.batch_epoch = epoch
        if self.sample_log is not None:
            self.sample_log(keys)
        self.stats["samples"] += len(items)
        return self.dataset.collate(items)

    def commit(self) -> None:
        """The step in flight committed: its samples (every group's) are consumed."""
        if self._cursor is not None:  # (the epoch turns at the next fetch: this step's records say its own epoch)
            self.committed = self._cursor
        self.stats["dropped_at_epoch_end"] += self._dropped
        self._cursor, self._taken, self._dropped = None, 0, 0

    def _shard(self, shard: int) -> list[dict]:
        if shard not in self._shards:
            if self._source is None:
                self._source = self.inner.source()
            ref = self.refs[shard]
            data = self._source.read(ref)
            self.stats["bytes_from_source"] += len(data)
            self._shards[shard] = read_shard(data, ref.url)
            while len(self._shards) > 2:
                self._shards.popitem(last=False)
        self._shards.move_to_end(shard)
        return self._shards[shard]

    def close(self) -> None:
        if self._source is not None:
            self._source.close()
            self._source = None
