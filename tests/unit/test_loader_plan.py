"""The shard loader's pure parts: the plan of the rest of an epoch over a new world size (random cases), and a
missing data dir named with its ``recipe.prepare`` command (nothing is read).
"""

from __future__ import annotations


import pytest

from pitstop.errors import DataError
from pitstop.data.loader.plain import PlainLoader
from recipe.vision import ImageShards


def digits(data_root, root=None, **kw) -> ImageShards:
    return ImageShards(
        root=str(root or data_root / "data" / "digits"),
        name="digits",
        num_classes=10,
        channels=1,
        augment={"pad": 1},
        **kw,
    )


def test_missing_data_dir_names_path_and_command(tmp_path):
    ds = digits(None, root=tmp_path / "nowhere")
    with pytest.raises(DataError) as err:
        PlainLoader(ds, "train", batch_size=8, seed=0)
    msg = str(err.value)
    assert str(tmp_path / "nowhere") in msg and "python -m recipe.prepare data=digits" in msg and "\n" not in msg


def test_the_rest_of_an_epoch_is_split_over_the_ranks_sample_by_sample_in_equal_steps():
    # After a resume at another world size the rest of the epoch goes to the new ranks. DDP needs every rank to take
    # the same number of steps; by whole partitions the ranks' batch counts could differ, and the extra batches of
    # one would be dropped. Split at sample granularity (a partition may be shared by ranks, so what is consumed is
    # kept as intervals, holes and all), every rank gets the same number of batches and nothing is dropped.
    import random

    from pitstop.data.loader.plan import (
        consumed_after,
        count_batches,
        merge,
        rest_of_epoch,
        shard_order,
        split_rest,
        stream_items,
    )

    rng = random.Random(0)
    for case in range(300):
        counts = [rng.randint(1, 60) for _ in range(rng.randint(1, 9))]
        partitions = rng.randint(1, len(counts))
        order = shard_order(len(counts), 5, 1, True)
        sizes = [sum(counts[s] for s in order[p::partitions]) for p in range(partitions)]
        consumed = {}
        for p in range(partitions):  # random holes: what earlier ranks had read when the checkpoint was written
            cuts = sorted(rng.sample(range(sizes[p] + 1), k=min(4, sizes[p] + 1)))
            consumed[p] = merge([cuts[j : j + 2] for j in range(0, len(cuts) - 1, 2)])
        ranks, per_rank, batch = rng.randint(1, 4), rng.randint(1, 3), rng.choice([1, 3, 8, 32])
        rest = rest_of_epoch(order, counts, partitions, consumed)
        total = sum(e - f for _, _, f, e, _ in rest)
        assert total == sum(sizes) - sum(b - a for ivs in consumed.values() for a, b in ivs), case
        for drop_last in (False, True):
            streams = split_rest(rest, ranks, per_rank, batch, drop_last)
            steps = {
                sum(count_batches(streams[r * per_rank + w], batch, drop_last) for w in range(per_rank))
                for r in range(ranks)
            }
            assert len(steps) == 1, (case, steps)  # every rank the same number of steps
            read = [(shard, i) for st in streams for _, shard, f, e, _ in st for i in range(f, e)]
            assert len(read) == len(set(read)), case  # nothing twice
            dropped = total - len(read)
            if drop_last:  # (what does not fill a batch on every rank: a partial batch, as drop_last says)
                assert dropped < ranks * batch, case
            else:  # only when a step cannot give every rank a sample: fewer left than ranks, or batches of 1
                assert dropped == 0 or (dropped < ranks and (total < ranks or batch == 1)), case
            # read to the end, each stream adds what it read to what was consumed: the whole epoch, once
            done = consumed
            for st in streams:
                done = consumed_after(st, order, counts, partitions, sum(e - f for _, _, f, e, _ in st), done)
            if dropped == 0:
                assert done == {p: [[0, sizes[p]]] for p in range(partitions) if sizes[p]}, case
        got = stream_items(len(counts), counts, partitions, 0, ranks * per_rank, 5, 1, True, consumed, per_rank, batch)
        assert got == split_rest(rest, ranks, per_rank, batch, False)[0]  # (what a reader is handed: pure)


def test_a_reader_runs_as_many_downloads_at_once_as_keep_eight_connections_busy():
    # in ranged parts (one per 2 MB, <= 8) a shard's download already uses several connections: more shards at once
    # would split a capped link and deliver the one read next later; whole-shard downloads run up to the depth
    from pitstop.data.loader.cached import CachedSource
    from pitstop.data.remote import FetchPolicy, ShardRef

    def at_once(prefetch, parts, mb):
        source = CachedSource("/nonexistent", None, FetchPolicy(parts=parts), "size", prefetch)
        return source._at_once([ShardRef(f"http://store/{i}.tar", mb << 20, None, 10) for i in range(3)])

    assert at_once("auto", "auto", 8) == 2 and at_once("auto", "auto", 16) == 1  # 4 and 8 parts of 2 MB
    assert at_once("auto", 1, 8) == 8 and at_once(3, 1, 8) == 3  # one request per shard: up to the depth
    assert at_once("auto", "auto", 1) == 8  # (a 1 MB shard is one request)
