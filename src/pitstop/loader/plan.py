"""The epoch plan: which samples each stream reads, in which order — pure functions only.

Nothing here holds a live RNG: every order is derived from ``(seed, epoch, ...)``, so the plan of any
epoch can be recomputed after a restart and a saved position (a few integers) is enough to continue.

Vocabulary
- *partition*: a fixed logical slice of the shards of one epoch (``shard_order[p::P]``).  ``P`` is fixed
  for a data set/config and does not depend on how many processes read it.
- *stream*: what one reader (one DataLoader worker of one rank) reads, in order.  With ``G`` streams in
  all, stream ``g`` reads partitions ``p`` with ``p % G == g``, one after the other.
- *position*: how many samples of its stream a reader has handed to the trainer (consumed) this epoch.
"""

from __future__ import annotations

import numpy as np

from pitstop.seed import derive_seed


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(num_shards))
    return np.random.default_rng(derive_seed("shards", seed, epoch)).permutation(num_shards).tolist()


def sample_order(num_samples: int, seed: int, epoch: int, shard: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(num_samples))
    return np.random.default_rng(derive_seed("samples", seed, epoch, shard)).permutation(num_samples).tolist()


def num_batches(samples: int, batch_size: int, drop_last: bool) -> int:
    return samples // batch_size if drop_last else -(-samples // batch_size)


def round_robin(counts: list[int]) -> list[int]:
    """The order in which an in-order DataLoader hands out batches of workers with these counts."""
    seq: list[int] = []
    for i in range(max(counts, default=0)):
        seq.extend(w for w, n in enumerate(counts) if i < n)
    return seq


def stream_id(rank: int, worker: int, workers: int, world_size: int, train: bool) -> int:
    """The global stream of a rank's ``worker``.  Training: rank-major blocks (rank ``r`` owns streams
    ``r*workers .. r*workers+workers-1``; saved positions refer to these ids).  Evaluation: worker-major
    (stream ``worker*world_size + rank``), so partitions spread over the ranks before the workers of one
    rank: 2 val shards on 2 ranks x 2 workers give each rank one shard, not one rank both."""
    return rank * workers + worker if train else worker * world_size + rank


def stream_partitions(partitions: int, stream: int, streams: int) -> list[int]:
    return list(range(stream, partitions, streams))


def balanced_partitions(left: list[int], stream: int, streams: int, per_rank: int = 1) -> list[int]:
    """The rest of an epoch after an elastic resume (``left[p]``: samples of partition ``p`` not yet consumed):
    the partitions go, largest rest first, to the rank with the least so far, then within each rank to its
    reader with the least (ties: the lower one), so that the ranks -- which must take equal numbers of steps --
    end as nearly together as whole partitions allow (training streams are rank-major: ``per_rank`` each). A
    plain ``p % streams`` would hand consumed partitions to some ranks and untouched ones to others, and the
    batches of the busiest rank beyond the others' would be dropped."""
    ranks = max(1, streams // per_rank)
    rank_load, rank_parts = [0] * ranks, [[] for _ in range(ranks)]
    for p in sorted(range(len(left)), key=lambda p: (-left[p], p)):
        if left[p] > 0:
            r = min(range(ranks), key=lambda r: (rank_load[r], r))
            rank_load[r] += left[p]
            rank_parts[r].append(p)
    rank, mine = divmod(stream, per_rank)
    load, out = [0] * per_rank, []
    for p in rank_parts[rank]:  # (already largest first)
        w = min(range(per_rank), key=lambda w: (load[w], w))
        load[w] += left[p]
        if w == mine:
            out.append(p)
    return sorted(out)


def stream_items(num_shards: int, counts: list[int], partitions: int, stream: int, streams: int, seed: int,
                 epoch: int, shuffle: bool, base: dict[int, int], per_rank: int = 1) -> list[tuple[int, int, int]]:
    """What a stream reads this epoch, in order, as ``(partition, shard, first)``: ``first`` samples of that
    shard's order were consumed before this stream started (``base``: consumed samples per partition, after an
    elastic resume; then the partitions are spread by what is left of them, see :func:`balanced_partitions`)."""
    order = shard_order(num_shards, seed, epoch, shuffle)
    items = []
    if base:
        left = [sum(counts[shard] for shard in order[p::partitions]) - base.get(p, 0) for p in range(partitions)]
        mine = balanced_partitions(left, stream, streams, per_rank)
    else:
        mine = stream_partitions(partitions, stream, streams)
    for p in mine:
        skip = base.get(p, 0)
        for shard in order[p::partitions]:
            n = counts[shard]
            if skip >= n:
                skip -= n
                continue
            items.append((p, shard, skip))
            skip = 0
    return items


def partition_offsets(items: list[tuple[int, int, int]], counts: list[int], position: int,
                      base: dict[int, int]) -> dict[int, int]:
    """Consumed samples per partition after a stream reading ``items`` handed out ``position`` samples."""
    out = {p: base.get(p, 0) for p, _, _ in items}
    left = position
    for p, shard, first in items:
        take = min(counts[shard] - first, left)
        out[p] += take
        left -= take
    return out
