"""The epoch plan: which samples each stream reads, in which order — pure functions only.

Nothing here holds a live RNG: every order is derived from ``(seed, epoch, ...)``, so the plan of any
epoch can be recomputed after a restart and a saved position (a few integers) is enough to continue.

Vocabulary
- *partition*: a fixed logical slice of the shards of one epoch (``shard_order[p::P]``).  ``P`` is fixed
  for a data set/config and does not depend on how many processes read it.
- *stream*: what one reader (one DataLoader worker of one rank) reads, in order.  With ``G`` streams in
  all, stream ``g`` reads partitions ``p`` with ``p % G == g``, one after the other -- except for the rest
  of an epoch resumed at another world size, which is split sample by sample (:func:`split_rest`).
- *position*: how many samples of its stream a reader has handed to the trainer (consumed) this epoch.
"""

from __future__ import annotations

import numpy as np

from pitstop.parts.seed import derive_seed


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(num_shards))
    return np.random.default_rng(derive_seed("shards", seed, epoch)).permutation(num_shards).tolist()


def sample_order(num_samples: int, seed: int, epoch: int, shard: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(num_samples))
    return np.random.default_rng(derive_seed("samples", seed, epoch, shard)).permutation(num_samples).tolist()


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


Item = tuple[int, int, int, int, bool]
"""One run of a stream's reading: ``(partition, shard, first, end, cut)`` -- positions ``first:end`` of the shard's
sample order; ``cut``: the batch ends with this run (an elastic plan's batches), else batches are cut every
``batch_size`` samples."""

Consumed = dict[int, list[list[int]]]
"""Samples of each partition consumed before a segment: sorted, disjoint ``[start, end)`` intervals of the
partition's sample sequence (its shards in plan order, each in its sample order). A plain resume consumes a
prefix of each partition; one at another world size may leave holes (a partition split across ranks)."""


def merge(intervals: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def shard_starts(order: list[int], counts: list[int], partitions: int) -> dict[int, tuple[int, int]]:
    """shard -> (its partition, where its samples start in the partition's sequence)."""
    out = {}
    for p in range(partitions):
        at = 0
        for shard in order[p::partitions]:
            out[shard] = (p, at)
            at += counts[shard]
    return out


def rest_of_epoch(order: list[int], counts: list[int], partitions: int, consumed: Consumed) -> list[Item]:
    """What no rank has consumed yet, in partition order, as runs (``cut`` unset)."""
    out: list[Item] = []
    for p in range(partitions):
        done, at = consumed.get(p, []), 0
        for shard in order[p::partitions]:
            n, lo = counts[shard], 0
            for a, b in done + [[at + counts[shard], at + counts[shard]]]:
                a, b = max(a - at, 0), min(b - at, n)
                if a > lo:
                    out.append((p, shard, lo, min(a, n), False))
                lo = max(lo, b)
                if lo >= n:
                    break
            at += n
    return out


def split_rest(rest: list[Item], ranks: int, per_rank: int, batch_size: int, drop_last: bool) -> list[list[Item]]:
    """The rest of an epoch after a resume at another world size, for every stream (rank-major, ``per_rank``
    each): the ranks must take equal numbers of steps, so every rank gets the same number of batches ``K``
    (the fewest that hold the rest), of nearly equal sample totals, each batch whole ``batch_size`` samples
    except the last few of a rank; a rank's batch ``i`` goes to its reader ``i % per_rank`` (the order an
    in-order DataLoader hands them out in), each batch cut where it ends. Partitions are split at sample
    granularity, so nothing is dropped -- unless fewer samples than ranks are left (or, with ``drop_last``,
    what does not fill a batch on every rank)."""
    total = sum(e - f for _, _, f, e, _ in rest)
    if drop_last:
        k = total // (ranks * batch_size)
        totals = [k * batch_size] * ranks
    else:
        k = min(-(-total // (ranks * batch_size)), total // ranks)
        even, extra = divmod(total, ranks)
        totals = [min(even + (r < extra), k * batch_size) for r in range(ranks)]
    streams: list[list[Item]] = [[] for _ in range(ranks * per_rank)]
    runs, i, used = list(rest), 0, 0  # (a cursor: run i, of which ``used`` samples are taken)
    for r in range(ranks):
        left = totals[r]
        for b in range(k):
            size = min(batch_size, left - (k - b - 1))  # (whole batches first, at least one sample for the rest)
            left -= size
            out = streams[r * per_rank + b % per_rank]
            while size:
                p, shard, first, end, _ = runs[i]
                take = min(size, end - first - used)
                out.append((p, shard, first + used, first + used + take, take == size))
                size -= take
                used += take
                if first + used == end:
                    i, used = i + 1, 0
    return streams


def stream_items(
    num_shards: int,
    counts: list[int],
    partitions: int,
    stream: int,
    streams: int,
    seed: int,
    epoch: int,
    shuffle: bool,
    consumed: Consumed,
    per_rank: int = 1,
    batch_size: int = 1,
    drop_last: bool = False,
) -> list[Item]:
    """What a stream reads this epoch, in order. Without ``consumed``: the partitions ``p % streams == stream``,
    whole. After a resume at another world size (``consumed``: what the saved ranks had read of each
    partition): its share of the rest, see :func:`split_rest`."""
    order = shard_order(num_shards, seed, epoch, shuffle)
    if consumed:
        return split_rest(
            rest_of_epoch(order, counts, partitions, consumed),
            max(1, streams // per_rank),
            per_rank,
            batch_size,
            drop_last,
        )[stream]
    return [
        (p, shard, 0, counts[shard], False)
        for p in stream_partitions(partitions, stream, streams)
        for shard in order[p::partitions]
    ]


def read_order(items: list[Item], window: int, seed: int, epoch: int, stream: int) -> list[tuple[int, int]]:
    """The order a stream hands out its samples, as ``(item index, offset in the item's run)``: run after run,
    or with a mixing window ``K > 1`` (``loader.shuffle_shards_window``) its runs taken ``K`` at a time, each
    group's samples in a seeded permutation, so that a batch mixes ``K`` shards (shards written one class at a
    time would otherwise make batches of one class). An elastic rest (``cut`` runs) is read run after run."""
    if window <= 1 or any(item[4] for item in items):
        return [(i, o) for i, item in enumerate(items) for o in range(item[3] - item[2])]
    out: list[tuple[int, int]] = []
    for start in range(0, len(items), window):
        group = [
            (i, o) for i in range(start, min(start + window, len(items))) for o in range(items[i][3] - items[i][2])
        ]
        perm = np.random.default_rng(derive_seed("mix", seed, epoch, stream, start)).permutation(len(group))
        out.extend(group[j] for j in perm.tolist())
    return out


def count_batches(items: list[Item], batch_size: int, drop_last: bool) -> int:
    """The batches a stream reading ``items`` yields (as :class:`~pitstop.data.loader.reader.StreamReader`
    cuts them)."""
    n = acc = 0
    for _, _, first, end, cut in items:
        acc += end - first
        n, acc = n + acc // batch_size, acc % batch_size
        if cut and acc:
            n, acc = n + (not drop_last), 0
    return n + (1 if acc and not drop_last else 0)


def consumed_after(
    items: list[Item],
    order: list[int],
    counts: list[int],
    partitions: int,
    position: int,
    consumed: Consumed,
    reads: list[tuple[int, int]] | None = None,
) -> Consumed:
    """``consumed`` plus what a stream reading ``items`` (in the order ``reads``, see :func:`read_order`; default
    run after run) has handed out at ``position`` samples."""
    starts = shard_starts(order, counts, partitions)
    out = {p: [list(iv) for iv in ivs] for p, ivs in consumed.items()}
    if reads is None:
        left = position
        for p, shard, first, end, _ in items:
            take = min(end - first, left)
            if take <= 0:
                break
            at = starts[shard][1] + first
            out.setdefault(p, []).append([at, at + take])
            left -= take
    else:
        for i, o in reads[:position]:
            p, shard, first, _, _ = items[i]
            at = starts[shard][1] + first + o
            out.setdefault(p, []).append([at, at + 1])
    return {p: merge(ivs) for p, ivs in out.items()}


def as_consumed(raw: dict) -> Consumed:
    """A saved ``base``/``offsets`` map: intervals, or (checkpoints from before them) a consumed prefix."""
    return {
        int(p): merge([[0, int(v)]] if isinstance(v, (int, float)) else [list(iv) for iv in v]) for p, v in raw.items()
    }
