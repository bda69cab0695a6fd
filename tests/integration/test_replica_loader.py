"""strategy=ft's training batches on the real digits shards, replica groups played in-process: every sample of
every epoch once while groups leave, come back healed from a peer's state, and steps are discarded."""

from __future__ import annotations

import collections
import random

import pytest
import torch

from pitstop.data.loader.plain import PlainLoader
from pitstop.data.loader.replica import ReplicaLoader
from recipe.vision import ImageShards


def group_loader(
    data_root, place: list[int], accum: int = 1, ranks: int = 1, rank: int = 0, workers: int = 0
) -> ReplicaLoader:
    ds = ImageShards(root=str(data_root / "data" / "digits"), name="digits", num_classes=10, channels=1,
                     augment={"pad": 1})  # fmt: skip
    inner = PlainLoader(ds, "train", batch_size=32 // ranks, seed=11, num_workers=workers)
    return ReplicaLoader(inner, lambda: (place[0], place[1]), replicas=3, accum=accum, ranks=ranks, rank=rank)


@pytest.mark.parametrize("accum, ranks", [(1, 1), (3, 1), (2, 2)])
def test_groups_that_leave_and_come_back_read_every_sample_of_every_epoch_once(data_root, accum, ranks):
    # accum: micro-batches per step (trainer.grad_accum_steps), each the next slice; a step may run into the next
    # epoch, and a discarded one (no commit) is read again from where the last committed step ended. ranks: a
    # group's ranks (strategy.nproc_per_node), each reading its own part of the group's share
    rng = random.Random(4)
    places = {k: [3, k] for k in range(3)}
    loaders = {(k, r): group_loader(data_root, places[k], accum, ranks, r) for k in range(3) for r in range(ranks)}
    alive = {0, 1, 2}
    seen: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    shapes = set()
    while loaders[min(alive), 0].epoch < 2:
        if rng.random() < 0.15 and len(alive) > 1:  # a group dies
            alive.discard(rng.choice(sorted(alive)))
        elif rng.random() < 0.3 and len(alive) < 3:  # a group comes back: each rank healed from a live peer's
            k = rng.choice(sorted({0, 1, 2} - alive))
            for r in range(ranks):
                loaders[k, r] = group_loader(data_root, places[k], accum, ranks, r)
                loaders[k, r].load_state_dict(loaders[min(alive), r].state_dict())
            alive.add(k)
        members = sorted(alive)
        for place, k in enumerate(members):
            places[k][:] = [len(members), place]
        procs = [(k, r) for k in members for r in range(ranks)]
        keys: dict[tuple[int, int], list[tuple[int, list[str]]]] = {p: [] for p in procs}
        for _ in range(accum):
            for p in procs:
                got: list[str] = []
                loaders[p].sample_log = got.extend
                x, y = loaders[p].next_batch()
                assert len(x) == len(y) == len(got)
                shapes.add(tuple(x.shape[1:]))
                keys[p].append((loaders[p].batch_epoch, got))
            assert len({loaders[p].batch_epoch for p in procs}) == 1
        if rng.random() < 0.1:  # a peer failed during the all-reduce: the step is discarded everywhere
            continue
        for p in procs:
            loaders[p].commit()
            for epoch, got in keys[p]:
                seen[epoch].update(got)
    total = loaders[0, 0].num_samples
    for epoch in (0, 1):
        assert len(seen[epoch]) == total and set(seen[epoch].values()) == {1}, epoch
    assert len(shapes) == 1  # (one image size throughout)


def test_a_sample_decodes_as_the_per_rank_loaders_decode_it(data_root):
    # the same key, epoch and seed give the same augmented tensor as the other loaders (derive_seed)
    loader = group_loader(data_root, [1, 0])
    got: list[str] = []
    loader.sample_log = got.extend
    x, _ = loader.next_batch()
    plain = PlainLoader(loader.dataset, "train", batch_size=1438, seed=11, num_workers=0)
    keys: list[list[str]] = []
    plain.sample_log = keys.append
    batch = next(iter(plain))
    where = {k: i for i, k in enumerate(keys[0])}
    assert torch.equal(x[0], batch[0][where[got[0]]])


def test_a_micro_batch_read_interrupted_by_a_stall_is_read_again_whole(data_root):
    # the watchdog ends a stalled fetch by raising in the main thread (DataStall), and the loop asks again: the step
    # in flight must not have moved on, in its first micro-batch or in its last
    from pitstop.resilience.watchdog import DataStall

    for interrupted in (1, 2):
        loader = group_loader(data_root, [1, 0], accum=2)
        reader = loader.local_reader()
        shard, calls = reader._shard, [0]

        def stalling(index, _shard=shard, _at=interrupted):
            calls[0] += 1
            if calls[0] == (_at - 1) * 32 + 5:  # (a sample's shard read, 32 a micro-batch: the interrupted one's 5th)
                raise DataStall("no batch within the limit")
            return _shard(index)

        reader._shard = stalling
        got: list[list[str]] = []
        loader.sample_log = got.append
        for _ in range(2):
            try:
                loader.next_batch()
            except DataStall:
                loader.next_batch()  # (as Batches.next does after a recovered stall)
        loader.commit()
        clean = group_loader(data_root, [1, 0], accum=2)
        expected: list[list[str]] = []
        clean.sample_log = expected.append
        clean.next_batch(), clean.next_batch()
        assert got == expected and loader.position == 64, interrupted  # the same two slices, each once


def test_loader_workers_decode_ahead_exactly_what_the_trainer_would_read_as_groups_come_and_go(data_root):
    # loader.num_workers=2: the pool decodes the next slices as if the quorum stays and the step commits; a change of
    # the quorum, a discarded step and a heal (a new position) make the planned slices wrong, and the batches must
    # still be the ones read in the trainer, bit for bit
    import concurrent.futures

    place = [2, 0]
    plain, ahead = group_loader(data_root, place, accum=2), group_loader(data_root, place, accum=2, workers=2)
    got: dict[str, list] = {"plain": [], "ahead": []}
    plain.sample_log, ahead.sample_log = got["plain"].append, got["ahead"].append
    try:
        for step in range(40):
            place[:] = [3, 1] if 10 <= step < 20 else [2, 0]  # a group joined before it for ten steps
            if step == 30:  # a heal: both take a peer's position
                state = {**plain.state_dict(), "position": plain.position + 96}
                plain.load_state_dict(state), ahead.load_state_dict(state)
            for _ in range(2):
                x0, y0 = plain.next_batch()
                x1, y1 = ahead.next_batch()
                assert torch.equal(x0, x1) and torch.equal(y0, y1), step
            if step % 7 != 3:  # every seventh step discarded (no commit): its slices are read again
                plain.commit(), ahead.commit()
        assert got["plain"] == got["ahead"] and plain.committed == ahead.committed
        assert ahead.workers == 2 and ahead._pool is not None  # (read in the pool, not in the trainer)
        bytes_read = "bytes_from_source"  # (each worker reads the shards it needs: more bytes than one reader)
        assert {**plain.stats, bytes_read: 0} == {**ahead.stats, bytes_read: 0}
        assert ahead.stats[bytes_read] >= plain.stats[bytes_read] > 0
        futures = list(ahead._ahead.values())
        assert futures and all(isinstance(f, concurrent.futures.Future) for f in futures)
    finally:
        ahead.close()
    assert ahead._pool is None and not ahead._ahead


def test_a_killed_loader_worker_leaves_the_trainer_reading_the_same_batches_itself(data_root):
    # a worker SIGKILLed (the OOM killer, say): the pool is broken; the loader says so once and reads in the trainer
    import os
    import signal
    import time

    place = [1, 0]
    plain, ahead = group_loader(data_root, place), group_loader(data_root, place, workers=2)
    try:
        for step in range(20):
            if step == 8:
                for p in list(ahead._pool._processes.values()):
                    os.kill(p.pid, signal.SIGKILL)
                time.sleep(0.5)  # (the pool's manager thread sees it)
            x0, y0 = plain.next_batch()
            x1, y1 = ahead.next_batch()
            assert torch.equal(x0, x1) and torch.equal(y0, y1), step
            plain.commit(), ahead.commit()
        assert ahead.workers == 0 and ahead._pool is None  # reading in the trainer from then on
    finally:
        ahead.close()
