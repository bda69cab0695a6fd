"""strategy=ft's pure parts: how a step's samples are cut among the replica groups that take part in it, which
steps of replica groups' sample logs the audit counts, and the one-line refusals of strategy=ft's keys."""

from __future__ import annotations

import json
import random
import time

import pytest

from pitstop.audit import audit
from pitstop.data.loader.replica import ReplicaLoader
from pitstop.errors import ConfigError
from pitstop.goodput.ledger import Ledger
from pitstop.strategy.ft_keys import check_keys
from pitstop.strategy.groups import ReplicaGroups


@pytest.mark.parametrize("seed", range(6))
def test_every_sample_of_an_epoch_once_however_the_groups_of_each_step_change(seed):
    rng = random.Random(seed)
    total, batch = rng.choice([97, 1438, 64]), rng.choice([1, 7, 16])
    position, committed = 0, []
    while total - position >= 4:  # (fewer samples than groups are left only if groups joined just then)
        groups = rng.choice([1, 2, 3, 4])
        shares = [ReplicaLoader.share(position, total, batch, groups, r) for r in range(groups)]
        assert len({s[2] for s in shares}) == 1  # every group agrees how many samples the step takes
        assert all(1 <= end - start <= batch + 1 for start, end, _ in shares)
        if rng.random() < 0.2:  # a discarded step: nothing is consumed, the next step reads the same samples
            continue
        committed.extend(i for start, end, _ in shares for i in range(start, end))
        position += shares[0][2]
    assert committed == list(range(position)) and total - position < 4


def test_a_step_takes_batch_size_per_group_until_the_epoch_end_splits_the_rest_evenly():
    assert [ReplicaLoader.share(0, 100, 16, 2, r) for r in (0, 1)] == [(0, 16, 32), (16, 32, 32)]
    # 33 left for 2 groups of 16: one step of 17 + 16 instead of 16 + 16 and a last step of 1 for one group only
    assert [ReplicaLoader.share(67, 100, 16, 2, r) for r in (0, 1)] == [(67, 84, 33), (84, 100, 33)]
    assert [ReplicaLoader.share(97, 100, 16, 3, r) for r in (0, 1, 2)] == [(97, 98, 3), (98, 99, 3), (99, 100, 3)]


class _Shards:
    """What ReplicaLoader takes from the loader it wraps (its plan needs no data)."""

    dataset, batch_size, seed, shuffle = None, 4, 3, True
    refs, counts = [f"shard{i}" for i in range(5)], [7, 7, 7, 7, 3]


def test_the_fetches_left_of_the_epochs_follow_the_groups_that_take_part():
    # 31 samples per epoch, batch 4: with 2 groups a step takes 8 until fewer than 2 x 5 are left, then the rest
    # (31 = 8 + 8 + 8 + 7: 4 fetches); with 3 groups 12 + 12 + 7 (3); alone 4 x 7 + 3 (8). From a committed position
    # inside the second epoch, only what is left of it and of the epochs after counts
    loader = ReplicaLoader(_Shards(), lambda: (1, 0), replicas=2)
    assert [loader.fetches_left(2, groups) for groups in (1, 2, 3)] == [16, 8, 6]
    loader.committed = (1, 24)  # 7 samples of epoch 1 left
    assert [loader.fetches_left(2, groups) for groups in (1, 2, 3)] == [2, 1, 1]
    assert loader.fetches_left(1, 2) == 0  # (epoch 0 is over)
    # 9 samples left at 2 groups of batch 4: one fetch takes them all (at most batch + 1 each), where a
    # plan from the batch size alone would count 2
    loader.committed = (0, 22)
    assert loader.fetches_left(1, 2) == 1
    # the closed form against fetching step by step, for every position, group count and batch size up to 6
    for batch in range(1, 7):
        loader.batch_size = batch
        for slots in range(1, 8):
            for position in range(loader.num_samples + 1):
                cursor, fetches = (0, position), 0
                while True:
                    epoch, _, _, cursor, _ = loader._slice(cursor, slots, 0)
                    if epoch >= 1:
                        break
                    fetches += 1
                assert loader.fetches_in_epoch(position, slots) == fetches, (batch, slots, position)


def test_the_epoch_order_is_every_sample_once_a_pure_function_of_seed_and_epoch():
    loader = ReplicaLoader(_Shards(), lambda: (1, 0), replicas=2)
    orders = [loader.order(e) for e in (0, 1, 0)]
    assert sorted(orders[0]) == sorted((s, i) for s, n in enumerate(_Shards.counts) for i in range(n))
    assert orders[0] == orders[2] != orders[1]
    assert loader.steps_per_epoch() == 4  # 31 samples, 2 groups x 4
    loader.committed = (1, 12)  # (epoch, position)
    other = ReplicaLoader(_Shards(), lambda: (1, 0), replicas=2)
    other.load_state_dict(loader.state_dict())
    assert (other.epoch, other.position) == (1, 12)
    with pytest.raises(Exception, match="another strategy than strategy=ft"):
        other.load_state_dict({"epoch": 0, "batches": 3})  # a per-rank loader's position


def _write(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")


def _head(attempt, resumed=0, healed=False, samples=8, t=None):
    h = {"attempt": attempt, "resumed_from": resumed, "rank": 0, "world_size": 1, "epoch_samples": samples}
    h["epochs"] = None
    if t is not None:  # (when the attempt restored; older logs have no clock here: their start counts)
        h["t"] = t
    return {**h, "healed": True} if healed else h


def _step(step, quorum, keys, ok=True, t=0.0, decided=True):
    out = [{"step": step, "quorum": quorum, "keys": keys}]
    return out + ([{"commit": step, "ok": ok, "quorum": quorum, "t": t}] if decided else [])


def _metrics(run_dir, steps):
    for k in (0, 1):
        _write(run_dir / f"replica{k}" / "metrics.jsonl", [{"step": s, "epoch": 0, "loss": 1.0} for s in steps])


def test_the_audit_of_replica_groups_counts_committed_steps_and_a_dead_groups_last_step_if_a_peer_committed_it(
    tmp_path,
):
    run = tmp_path / "run"
    # group 0 lives throughout; group 1 dies twice: once after its step 2's all-reduce (group 0 committed step 2
    # in the same quorum: its keys count), once before (group 0 discarded that step: they do not)
    _write(run / "replica0" / "samples.rank0.jsonl", [
        _head(10.0, samples=10),
        *_step(1, 1, ["a", "b"], t=11), *_step(2, 1, ["c", "d"], t=12),
        *_step(3, 2, ["e"], ok=False, t=13),  # group 1 died during step 3: discarded, read again next step
        *_step(3, 3, ["e", "f"], t=14), *_step(4, 4, ["g"], t=15),
    ])  # fmt: skip
    _write(run / "replica1" / "samples.rank0.jsonl", [
        _head(10.1, samples=10), *_step(1, 1, ["x"], t=11),
        *_step(2, 1, ["y"], decided=False),  # killed: its peer committed step 2 (in quorum 1)
        _head(12.5, resumed=2, healed=True, samples=10),
        *_step(3, 2, ["z"], decided=False),  # killed: its peer discarded step 3 (in quorum 2)
        _head(13.5, resumed=3, healed=True, samples=10), *_step(4, 4, ["h"], t=15),
    ])  # fmt: skip
    _metrics(run, [1, 2, 3, 4])
    [epoch] = audit(str(run))
    # 10 keys once: y counts (its step was committed by the peer), e once (its discarded read not), z not at all
    assert (epoch.once, epoch.repeated, epoch.missing, epoch.expected) == (10, 0, 0, 10), epoch


def test_the_audit_counts_every_micro_batch_of_a_step_and_the_epoch_each_names(tmp_path):
    # trainer.grad_accum_steps=2 under strategy=ft: a step writes one line per micro-batch, each naming its epoch (a
    # step may run into the next one); group 1, killed after step 2's all-reduce, has both lines counted because its
    # peer committed that step in the same quorum; metrics.jsonl says epoch 1 for step 2, the lines say better
    def micro(step, quorum, parts, ok=True, decided=True):
        lines = [{"step": step, "micro": m, "epoch": e, "quorum": quorum, "keys": k} for m, (e, k) in enumerate(parts)]
        return lines + ([{"commit": step, "ok": ok, "quorum": quorum, "t": 11.0}] if decided else [])

    run = tmp_path / "run"
    _write(run / "replica0" / "samples.rank0.jsonl", [
        _head(10.0, samples=6), *micro(1, 1, [(0, ["a"]), (0, ["b"])]), *micro(2, 1, [(0, ["c"]), (1, ["a"])]),
    ])  # fmt: skip
    _write(run / "replica1" / "samples.rank0.jsonl", [
        _head(10.1, samples=6), *micro(1, 1, [(0, ["d"]), (0, ["e"])]),
        *micro(2, 1, [(0, ["f"]), (1, ["b"])], decided=False),  # killed after the all-reduce: the peer committed
    ])  # fmt: skip
    for k in (0, 1):
        _write(run / f"replica{k}" / "metrics.jsonl", [{"step": s, "epoch": s - 1, "loss": 1.0} for s in (1, 2)])
    first, second = audit(str(run))
    assert (first.epoch, first.once, first.repeated, first.missing) == (0, 6, 0, 0), first
    assert (second.epoch, second.once, second.repeated) == (1, 2, 0) and second.partial, second


def test_the_audit_of_replica_groups_rolls_back_only_what_a_whole_job_restart_redid(tmp_path):
    run = tmp_path / "run"
    # both groups start together (neither rolls the other back), are killed after step 3; the job's next run
    # restores both from the step-2 checkpoint and redoes step 3 with other samples' order: counted once
    _write(run / "replica0" / "samples.rank0.jsonl", [
        _head(10.0), *_step(1, 1, ["a", "b"], t=11), *_step(2, 2, ["c", "d"], t=12), *_step(3, 3, ["e", "f"], t=13),
        _head(20.0, resumed=2), *_step(3, 1, ["e", "g"], t=21),
    ])  # fmt: skip
    _write(run / "replica1" / "samples.rank0.jsonl", [
        _head(10.05), *_step(1, 1, ["h"], t=11), *_step(2, 2, [], t=12),
        _head(20.05, resumed=2), *_step(3, 1, ["f"], t=21),
    ])  # fmt: skip
    _metrics(run, [1, 2, 3])
    [epoch] = audit(str(run))
    assert (epoch.once, epoch.repeated, epoch.missing) == (8, 0, 0), epoch


def test_the_audit_of_replica_groups_rolls_back_a_dead_peers_steps_when_a_newcomer_restores_after_it(tmp_path):
    run = tmp_path / "run"
    # group 1 is killed after step 1 and restarts (t=12); its heal from group 0 fails as group 0 dies (after its
    # step 3, t=14), so it restores the step-1 checkpoint (t=15) and redoes steps 2 and 3 with group 0's samples
    # (alone: the whole batch). Group 0's steps 2 and 3 died with it; group 0 comes back healed from group 1.
    _write(run / "replica0" / "samples.rank0.jsonl", [
        _head(10.0, samples=10), *_step(1, 1, ["a", "b"], t=11), *_step(2, 2, ["c", "d", "e"], t=13),
        *_step(3, 2, ["f", "g", "h"], t=14),
        _head(16.0, resumed=4, healed=True, samples=10, t=16.1),
    ])  # fmt: skip
    _write(run / "replica1" / "samples.rank0.jsonl", [
        _head(10.1, samples=10), *_step(1, 1, ["x"], t=11),
        _head(12.0, resumed=1, samples=10, t=15.0), *_step(2, 3, ["c", "d", "e"], t=15.2),
        *_step(3, 3, ["f", "g", "h"], t=15.3), *_step(4, 3, ["y"], t=15.4),
    ])  # fmt: skip
    _metrics(run, [1, 2, 3, 4])
    [epoch] = audit(str(run))
    # (by the newcomer's start, before group 0 died, group 0's steps 2 and 3 would count too: 6 repeated)
    assert (epoch.once, epoch.repeated, epoch.missing) == (10, 0, 0), epoch


@pytest.mark.parametrize(
    "keys, message",
    [
        (dict(min_replicas=3), "strategy.min_replicas=3 must be between 1 and strategy.replicas=2"),
        (dict(replica_id=2), "strategy.replica_id=2 must be null or 0 .. strategy.replicas-1=1"),
        (dict(inner="fsdp"), "strategy.inner=fsdp shards inside a replica group, which needs strategy.nproc_per_node"),
        (dict(inner="tp"), "strategy.inner='tp' is not a strategy inside a replica group: use ddp or fsdp"),
    ],
)
def test_strategy_ft_keys_are_refused_in_one_line_naming_the_key(keys, message):
    values = dict(replicas=2, replica_id=None, min_replicas=1, inner="ddp", nproc_per_node=1) | keys
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        check_keys(**values)


class _Group(ReplicaGroups):
    """What build_fault reads of strategy=ft's replica groups (group K of 2)."""

    replicas = 2

    def __init__(self, replica_id):
        self.replica_id = replica_id


# rank 1 of 2: a random fault, aimed at rank 0, arms no timer in this process
_RANK1 = type("Strategy", (), {"rank": 1, "world_size": 2})()


def _fault(tmp_path, groups, *overrides):
    from contextlib import ExitStack

    from conftest import compose_cfg
    from pitstop.train.assembly import build_fault

    cfg = compose_cfg(["strategy=ft", "strategy.max_restarts=3", *overrides], tmp_path)
    with ExitStack() as hold:
        fault = build_fault(cfg, str(tmp_path), _RANK1, groups, 100, Ledger(time.time()), None, hold)
        return type(fault).__name__, getattr(fault, "mtbf", None), getattr(fault, "seed", None)


def test_a_fault_is_aimed_at_one_replica_group_or_at_each_at_the_jobs_rate(tmp_path):
    crash = ["fault=crash_at_step", "fault.step=5", "fault.replica=1"]
    assert _fault(tmp_path, _Group(0), *crash)[0] == "NoFault"
    assert _fault(tmp_path, _Group(1), *crash)[0] == "CrashAtStep"
    any_ = ["fault=random", "fault.mtbf_seconds=8", "fault.seed=3", "fault.replica=any"]
    (_, mtbf0, seed0), (_, mtbf1, seed1) = (_fault(tmp_path, _Group(k), *any_) for k in (0, 1))
    assert mtbf0 == mtbf1 == 16.0 and seed0 != seed1  # two groups at 16 s each: the job's 8 s, independent draws
    with pytest.raises(ConfigError, match=r"fault.replica=2 must be null, any or 0 .. strategy.replicas-1"):
        _fault(tmp_path, _Group(0), "fault=crash_at_step", "fault.step=5", "fault.replica=2")
    with pytest.raises(ConfigError, match=r"fault.replica=1 aims a fault at a replica group: it needs strategy=ft"):
        _fault(tmp_path, ReplicaGroups(), *crash)


def test_more_processes_than_cores_for_the_groups_started_here_is_refused_unless_oversubscribed(tmp_path):
    import os

    from conftest import compose_cfg
    from pitstop.launch.plan import plan
    from pitstop.launch.replicas import check_room

    cores = os.cpu_count() or 1
    many = [f"strategy.replicas={cores}", "strategy.nproc_per_node=2", "strategy.device=cpu"]
    with pytest.raises(ConfigError, match=rf"strategy.replicas x strategy.nproc_per_node={2 * cores} but this machine"):
        check_room(plan(compose_cfg(["strategy=ft", *many], tmp_path), {}))
    check_room(plan(compose_cfg(["strategy=ft", *many, "strategy.oversubscribe=true"], tmp_path), {}))
    # one group of a job started on several machines (strategy.replica_id): its own ranks are checked by its agent
    one = ["strategy=ft", *many, "strategy.replica_id=0", "strategy.lighthouse=h:1"]
    check_room(plan(compose_cfg(one, tmp_path), {}))


def test_a_healed_group_re_plans_the_lr_schedule_exactly_as_its_peer_whatever_its_own_count():
    # the decision to re-plan reads the schedule's own plan (a heal copies it), not the process's total: a group
    # healed mid-run with a stale count of its own re-plans at the same steps as its peer, to the same numbers
    import torch

    from pitstop.parts.lr import warmup_cosine
    from pitstop.train.steps import steps_with_groups

    class Left:
        def __init__(self):
            self.left = 0

        def fetches_left(self, epochs, groups):
            return self.left // groups

    def scheduler():
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        return warmup_cosine(opt, total_steps=100, warmup_steps=2)

    a, b, data = scheduler(), scheduler(), Left()
    data.left = 200
    total_a = steps_with_groups(10, data, 3, 1, a, 100, groups=1)  # A alone: re-planned to 210
    b.load_state_dict(a.state_dict())  # B heals from A: the schedule, not A's count
    totals = {"a": total_a, "b": 110}  # (B's own count is stale: by chance what the next step computes)
    for step, groups in ((11, 2), (12, 2), (13, 1), (14, 2)):
        data.left = 200 - 2 * (step - 10)
        totals = {k: steps_with_groups(step, data, 3, 1, s, totals[k], groups) for k, s in (("a", a), ("b", b))}
        assert totals["a"] == totals["b"]
        assert a.lr_lambdas[0].__dict__ == b.lr_lambdas[0].__dict__, step
