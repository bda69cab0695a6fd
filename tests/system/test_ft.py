"""strategy=ft with real processes: a torchft Lighthouse and two replica groups, each a process under its own
supervisor. A group's SIGKILL leaves the other's process and attempt alone; the killed one restarts, heals from the
live peer without reading a checkpoint, and every sample is still read exactly once. A whole job killed resumes
bitwise from the durable checkpoint."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import cli, cli_cmd, final_losses, popen_cmd
from pitstop.audit import audit

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="needs torchft: pip install -e '.[ft]'"),
]

FT = ["strategy=ft", "debug=tiny", "data.record_sample_ids=true", "ckpt=sync_save"]


def group_summary(run: Path, k: int) -> dict:
    return json.loads((run / f"replica{k}" / "summary.json").read_text())


def attempts(run: Path, k: int) -> list[dict]:
    try:
        return json.loads((run / f"replica{k}" / "goodput.json").read_text())["attempts"]
    except (OSError, ValueError, KeyError):
        return []


def committed_step(run: Path, k: int) -> int:
    """The last step group ``k`` committed (its sample log is on disk step by step)."""
    try:
        lines = (run / f"replica{k}" / "samples.rank0.jsonl").read_text().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        r = json.loads(line) if line.startswith("{") and line.endswith("}") else {}
        if r.get("ok"):
            return int(r["commit"])
    return 0


@contextlib.contextmanager
def background_job(args: list[str], data_root, tmp_path):
    """The job started in the background (its output in ``tmp_path/job.log``), killed on the way out if still up."""
    log = open(tmp_path / "job.log", "w")
    p = popen_cmd(cli_cmd(args, data_root, tmp_path), stdout=log, stderr=subprocess.STDOUT)
    try:
        yield p
    finally:
        if p.poll() is None:
            p.kill()
        log.close()


def signal_once_both_trained(run: Path, p, k: int, sig: int, steps: int) -> None:
    """Send ``sig`` to group ``k``'s trainer once both groups committed ``steps`` steps (however late they started)."""
    wait_for(lambda: min(committed_step(run, 0), committed_step(run, 1)) >= steps, p=p)
    os.kill(attempts(run, k)[-1]["pid"], sig)


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def wait_for(what, timeout: float = 60.0, p=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if what():
            return
        if p is not None and p.poll() is not None:
            raise AssertionError(f"the job ended ({p.returncode}) while waiting")
        time.sleep(0.1)
    raise AssertionError("timed out waiting")


def test_a_peer_groups_kills_leave_the_healthy_group_alone_and_every_sample_is_read_once(data_root, tmp_path):
    run = tmp_path / "run"
    # (each group's loader decodes ahead in a worker process: loader.num_workers=1)
    args = [*FT, "trainer.max_steps=400", "trainer.eval_every_steps=200", "ckpt.interval_steps=40",
            "loader.num_workers=1", f"run_dir={run}"]  # fmt: skip
    rng, kills = random.Random(7), {0: 0, 1: 0}
    with background_job(args, data_root, tmp_path) as p:
        for _ in range(5):  # five SIGKILLs of a group drawn at random, each while both train
            base = min(committed_step(run, 0), committed_step(run, 1))
            wait_for(lambda: min(committed_step(run, 0), committed_step(run, 1)) >= base + 25, p=p)
            if max(committed_step(run, 0), committed_step(run, 1)) >= 330:  # too close to the end to kill
                break  # (a busy machine: the healthy group ran far ahead while its peer restarted)
            k = rng.choice([0, 1])
            healthy = attempts(run, 1 - k)
            victim = attempts(run, k)
            os.kill(victim[-1]["pid"], signal.SIGKILL)
            kills[k] += 1
            wait_for(lambda: len(attempts(run, k)) == len(victim) + 1, p=p)  # restarted (alone)
            at = committed_step(run, 1 - k)
            wait_for(lambda: committed_step(run, k) > at, p=p)  # healed and training again
            assert [a["pid"] for a in attempts(run, 1 - k)] == [a["pid"] for a in healthy]  # not restarted
        assert p.wait(timeout=240) == 0, (tmp_path / "job.log").read_text()[-3000:]
    assert sum(kills.values()) >= 3, kills
    for k in (0, 1):
        assert len(attempts(run, k)) == 1 + kills[k]  # only a killed group ever restarted
        text = (run / f"replica{k}" / "train.log").read_text()
        assert text.count("healed from a live peer") >= kills[k]  # every restart healed from the peer ...
        assert "restored " not in text  # ... and no attempt read a checkpoint
    s0, s1 = group_summary(run, 0), group_summary(run, 1)
    assert s0["final_step"] == s1["final_step"] == 400 and s0["params_sha256"] == s1["params_sha256"]
    discarded = s0["ft"]["discarded_steps"] + s1["ft"]["discarded_steps"]
    assert discarded <= 5  # at most the step in flight per failure (counted by the group that lived)
    epochs = audit(str(run))
    assert epochs and all(e.ok for e in epochs) and all(e.missing == 0 for e in epochs[:-1]), epochs
    job = json.loads((run / "summary.json").read_text())["ft_job"]
    assert job["attempts_per_group"] == {"0": 1 + kills[0], "1": 1 + kills[1]}
    for k in (0, 1):  # the job's account of each group, over all its attempts
        g = job["ft"]["groups"][str(k)]
        assert g["restarts"] == g["failures"] == kills[k] and g["heals"] >= kills[k], job["ft"]
    assert discarded <= job["ft"]["discarded_steps"] <= 5  # at most one per failure, over every attempt


@pytest.mark.parametrize("inner", ["ddp", "fsdp"])
def test_groups_of_two_ranks_a_killed_rank_restarts_only_its_own_group_which_heals_rank_by_rank(
    inner, data_root, tmp_path
):
    # strategy.nproc_per_node=2: each group is two ranks under DDP, or FSDP2 (HSDP), and its own elastic agent (4
    # processes on 2 cores); rank 1 of group 1 is SIGKILLed at step 30: its agent restarts both of its ranks, each
    # heals from the same rank of group 0 (under fsdp: its shard), whose processes never restart
    run = tmp_path / "run"
    # (strategy.min_replicas=2: both groups take the first step together, so group 1 reaches step 30 however late
    # its four processes start on a loaded machine; while it restarts, group 0 waits in its quorum, never restarting)
    args = [*FT, f"strategy.inner={inner}", "strategy.nproc_per_node=2", "strategy.oversubscribe=true",
            "strategy.min_replicas=2",
            "trainer.max_steps=300", "trainer.eval_every_steps=150", "ckpt.interval_steps=50", "fault=crash_at_step",
            "fault.replica=1", "fault.rank=1", "fault.step=30", f"run_dir={run}"]  # fmt: skip
    p = cli(args, data_root, tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    job = json.loads((run / "summary.json").read_text())["ft_job"]
    assert job["ranks_per_group"] == 2 and job["attempts_per_group"] == {"0": 1, "1": 2}, job
    assert [len(attempts(run, k)) for k in (0, 1)] == [1, 2]
    assert attempts(run, 1)[1]["ft"]["heals"], attempts(run, 1)  # the restarted group's rank 0 healed ...
    rank1 = (run / "replica1" / "rank1.log").read_text()  # ... and so did its rank 1, after the kill
    assert "healed from a live peer" in rank1.split("fault injection: SIGKILL (at step 30)")[1]
    for k in (0, 1):  # nobody read a checkpoint
        for name in ("train.log", "rank1.log"):
            assert "restored " not in (run / f"replica{k}" / name).read_text()
    s0, s1 = group_summary(run, 0), group_summary(run, 1)
    assert s0["final_step"] == s1["final_step"] == 300 and s0["params_sha256"] == s1["params_sha256"]
    epochs = audit(str(run))  # both ranks' sample logs of both groups: every sample once
    assert len(epochs) > 3 and all(e.ok for e in epochs) and all(e.missing == 0 for e in epochs[:-1]), epochs


def test_in_epochs_mode_a_killed_group_leaves_every_epoch_read_whole_and_the_groups_agree(data_root, tmp_path):
    # trainer.epochs=12: while a group is gone the other takes every step's whole share, so the epochs take more
    # steps; the run ends where the data position says the 12th epoch ends, and the LR schedule is re-planned after
    # the same committed steps in both groups (a healed group takes its peer's)
    run = tmp_path / "run"
    args = [*FT, "trainer.max_steps=null", "trainer.epochs=12", "trainer.eval_every_steps=null",
            "ckpt.interval_steps=100", f"run_dir={run}"]  # fmt: skip
    # group 1 SIGKILLed once both groups have trained together (however late either started), and gone for 20 of
    # group 0's steps: the warm fork server its next attempt comes from is stopped meanwhile (a warm restart is back
    # in ~0.1 s here, before the healthy group has left it out of a quorum; on a cluster a restart takes minutes)
    with background_job(args, data_root, tmp_path) as p:
        wait_for(lambda: min(committed_step(run, 0), committed_step(run, 1)) >= 10, p=p)
        trainer = attempts(run, 1)[-1]["pid"]
        server = parent(trainer)
        os.kill(server, signal.SIGSTOP)
        try:
            os.kill(trainer, signal.SIGKILL)
            alone = committed_step(run, 0) + 20
            wait_for(lambda: committed_step(run, 0) >= alone, p=p)
        finally:
            os.kill(server, signal.SIGCONT)
        assert p.wait(timeout=240) == 0, (tmp_path / "job.log").read_text()[-3000:]
    s0, s1 = group_summary(run, 0), group_summary(run, 1)
    assert s0["final_step"] == s1["final_step"] and s0["params_sha256"] == s1["params_sha256"]
    assert [len(attempts(run, k)) for k in (0, 1)] == [1, 2]
    epochs = audit(str(run))  # epochs mode: every one of the 12 must be whole
    assert len(epochs) == 12 and all(e.ok and e.missing == 0 and e.once == e.expected for e in epochs), epochs
    assert "12 epochs end at step" in (run / "replica0" / "train.log").read_text()


# min_replicas=2: every step has both groups (the steps' shares, and so the arithmetic, are the same in every run)
BOTH = [*FT, "strategy.min_replicas=2", "trainer.max_steps=60", "trainer.eval_every_steps=30", "ckpt.interval_steps=20"]


@pytest.fixture(scope="module")
def ft_reference(data_root, tmp_path_factory) -> Path:
    """An uninterrupted run of BOTH: the parameters and losses every interrupted one must reach exactly."""
    tmp = tmp_path_factory.mktemp("ft_ref")
    r = cli([*BOTH, f"run_dir={tmp / 'ref'}"], data_root, tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    assert group_summary(tmp / "ref", 0)["params_sha256"] == group_summary(tmp / "ref", 1)["params_sha256"]
    return tmp / "ref"


def launch_commits(run: Path, k: int) -> tuple[int, int]:
    """(attempts of group ``k`` in its sample log, the last step its newest attempt committed: 0 before its first)."""
    try:
        lines = (run / f"replica{k}" / "samples.rank0.jsonl").read_text().splitlines()
    except OSError:
        return 0, 0
    records = [json.loads(ln) for ln in lines if ln.startswith("{") and ln.endswith("}")]
    heads = [i for i, r in enumerate(records) if "attempt" in r]
    ok = [r["commit"] for r in records[heads[-1] :] if r.get("ok")] if heads else []
    return len(heads), (ok[-1] if ok else 0)


def test_a_whole_job_killed_at_several_moments_resumes_bitwise_every_step_with_both_groups(
    data_root, tmp_path, ft_reference
):
    # strategy.min_replicas=1 (the default): the Lighthouse forms a quorum of the groups that have started. The whole
    # job (launcher, Lighthouse, both groups, their fork server) is SIGKILLed three times, each time at a moment the
    # run wrote, and the same command runs again; every restart's first quorum waits for both groups, so neither ever
    # takes a step alone nor heals from the other, and the run ends with the parameters and losses of the
    # uninterrupted run whose every step had both groups. (Before, a group sometimes took the step after the restored
    # checkpoint alone and the other healed from it: exactly once, other parameters; 2 of 8 kills here.)
    run = tmp_path / "run"
    args = [*FT, "trainer.max_steps=60", "trainer.eval_every_steps=30", "ckpt.interval_steps=20", f"run_dir={run}"]

    def saved(step: int) -> bool:
        return (run / "checkpoints" / f"step_{step:08d}" / "COMMITTED").exists()

    moments = [  # (launch n: both groups' n-th attempt)
        lambda: saved(20) and min(launch_commits(run, k)[1] for k in (0, 1)) >= 23,  # between two saves
        lambda: all(launch_commits(run, k) >= (2, 21) for k in (0, 1)),  # the first step after a restore
        lambda: saved(40) and min(launch_commits(run, k)[1] for k in (0, 1)) >= 41,  # just after a save
    ]
    for n, moment in enumerate(moments, 1):
        p = popen_cmd(cli_cmd(args, data_root, tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                      start_new_session=True)  # fmt: skip
        try:
            wait_for(lambda: moment() and all(launch_commits(run, k)[0] == n for k in (0, 1)), p=p)
        finally:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    again = cli(args, data_root, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    for k in (0, 1):
        assert "healed from a live peer" not in (run / f"replica{k}" / "train.log").read_text()  # never alone
        resumed = [a["resumed_from"] for a in attempts(run, k)]
        assert resumed[0] is None and resumed[1:] in ([20, 20, 40], [20, 40, 40]), resumed  # (a fast save of 40)
        s = group_summary(run, k)
        assert s["params_sha256"] == group_summary(ft_reference, k)["params_sha256"]
        assert final_losses(run / f"replica{k}") == final_losses(ft_reference / f"replica{k}")
    assert all(e.ok for e in audit(str(run)))


def test_every_group_killed_at_once_restarts_in_the_job_from_the_durable_checkpoint_bitwise(
    data_root, tmp_path, ft_reference
):
    # Both groups SIGKILLed together (the launcher lives): no live peer to heal from, so both restarted attempts
    # restore the newest durable checkpoint, in the same job, and end at the uninterrupted run's parameters.
    run = tmp_path / "run"
    with background_job([*BOTH, f"run_dir={run}"], data_root, tmp_path) as p:
        wait_for(lambda: (run / "checkpoints" / "step_00000020").is_dir() and committed_step(run, 1) >= 25, p=p)
        for k in (0, 1):
            os.kill(attempts(run, k)[-1]["pid"], signal.SIGKILL)
        assert p.wait(timeout=180) == 0, (tmp_path / "job.log").read_text()[-3000:]
    for k in (0, 1):
        s = group_summary(run, k)
        assert len(attempts(run, k)) == 2 and s["resumed_from"] in (20, 40), s["resumed_from"]
        assert "healed from a live peer" not in (run / f"replica{k}" / "train.log").read_text()
        assert s["params_sha256"] == group_summary(ft_reference, k)["params_sha256"]
    assert all(e.ok for e in audit(str(run)))


def test_a_peer_killed_while_serving_a_heal_the_newcomer_restores_from_the_durable_checkpoint(data_root, tmp_path):
    # group 1 SIGKILLed once both trained 30 steps; group 0 is SIGKILLed in turn as it starts sending its state to
    # group 1 (fault=during_heal): the newcomer's transfer fails, the next quorum has no peer ahead of it, so it
    # restores the newest durable checkpoint; group 0 restarts and heals from it. Nothing lost, read once each.
    run = tmp_path / "run"
    heal = ["fault=during_heal", "fault.step=30", "fault.replica=0"]
    args = [*FT, *heal, "trainer.max_steps=200", "trainer.eval_every_steps=null", "ckpt.interval_steps=20",
            f"run_dir={run}"]  # fmt: skip
    with background_job(args, data_root, tmp_path) as p:
        signal_once_both_trained(run, p, 1, signal.SIGKILL, 30)
        assert p.wait(timeout=180) == 0, (tmp_path / "job.log").read_text()[-3000:]
    log0, log1 = ((run / f"replica{k}" / "train.log").read_text() for k in (0, 1))
    assert "fault injection: SIGKILL (while a peer heals from this group's state at step" in log0
    assert len(attempts(run, 0)) == len(attempts(run, 1)) == 2
    assert "the quorum or the heal failed; trying again" in log1 and "restored " in log1, log1[-3000:]
    # group 0's new attempt healed from group 1, or (back within ~0.1 s, in the same retry quorum as group 1, neither
    # ahead) restored the same durable checkpoint beside it
    after = log0.split("while a peer heals")[-1]
    assert "healed from a live peer" in after or "restored " in after, after[-3000:]
    s0, s1 = group_summary(run, 0), group_summary(run, 1)
    assert s0["final_step"] == s1["final_step"] == 200 and s0["params_sha256"] == s1["params_sha256"]
    assert all(e.ok for e in audit(str(run)))


@pytest.mark.parametrize("fault", ["crash_at_step", "preempt", "stall"])
def test_a_fault_as_a_group_applies_the_state_a_peer_sent(fault, data_root, tmp_path):
    # group 1 SIGKILLed once both trained 30 steps; its restart heals from group 0, and the fault fires as it applies
    # group 0's state (fault.phase=heal, the receiving side of a heal). SIGKILL: the half-applied state dies with the
    # process and the next attempt heals again. A notice: read at the step boundary after the heal, so the group
    # saves and leaves (75) and group 0 finishes alone. A stall: the group's own watchdog ends the stalled join and
    # the next attempt heals again. Group 0 never restarts; every sample is read once.
    run = tmp_path / "run"
    aimed = [f"fault={fault}", "fault.phase=heal", "fault.step=30", "fault.replica=1", "fault.rank=0",
             "trainer.hang.min_seconds=3"]  # fmt: skip
    args = [*FT, *aimed, "trainer.max_steps=200", "trainer.eval_every_steps=null", "ckpt.interval_steps=40",
            f"run_dir={run}"]  # fmt: skip
    with background_job(args, data_root, tmp_path) as p:
        signal_once_both_trained(run, p, 1, signal.SIGKILL, 30)
        assert p.wait(timeout=180) == 0, (tmp_path / "job.log").read_text()[-3000:]
    log1 = (run / "replica1" / "train.log").read_text()
    assert [a["status"] for a in attempts(run, 0)] == ["finished"]  # never restarted
    statuses = [a["status"] for a in attempts(run, 1)]
    if fault == "crash_at_step":
        assert "fault injection: SIGKILL (in a heal from a live peer at step 30 or later)" in log1, log1[-3000:]
        assert len(statuses) == 3 and statuses[-1] == "finished", statuses
        assert "healed from a live peer" in log1.split("fault injection: SIGKILL")[-1], log1[-3000:]
    elif fault == "preempt":
        assert "fault injection: preemption notice (SIGTERM) in a heal from a live peer" in log1, log1[-3000:]
        assert len(statuses) == 2 and statuses[-1] == "preempted", statuses
        left = attempts(run, 1)[-1]["step"]
        # (group 0 writes the durable checkpoints: group 1 leaves without a save of its own)
        assert f"preempted (SIGTERM) after step {left}; run the same command again" in log1, log1[-3000:]
    else:
        assert "stalls for 3600 s in a heal from a live peer" in log1, log1[-3000:]
        assert len(statuses) == 3 and statuses[-2:] == ["hung", "finished"], statuses
        # (within max(strategy.timeout, trainer.hang.min_seconds), not the 900 s of a restore's first read)
        assert "no progress in phase 'heal'" in log1, log1[-3000:]
        assert "healed from a live peer" in log1.split("hang:")[-1], log1[-3000:]
    s0 = group_summary(run, 0)
    assert s0["final_step"] == 200
    if fault != "preempt":
        assert group_summary(run, 1)["final_step"] == 200
        assert group_summary(run, 1)["params_sha256"] == s0["params_sha256"]
    epochs = audit(str(run))
    assert epochs and all(e.ok for e in epochs) and all(e.missing == 0 for e in epochs[:-1]), epochs


def test_a_stalled_group_is_ended_by_its_own_watchdog_and_the_healthy_group_never_restarts(data_root, tmp_path):
    # group 1 stops responding at step 40 (its torchft heartbeats go on): the healthy group waits in the "peers"
    # phase, whose limit torchft's own timeouts bound, so its watchdog leaves it alone; the stalled group's ends it
    run = tmp_path / "run"
    stall = ["fault=stall", "fault.step=40", "fault.rank=0", "fault.replica=1", "trainer.hang.min_seconds=3"]
    args = [*FT, *stall, "trainer.max_steps=120", "trainer.eval_every_steps=null", "ckpt.interval_steps=40",
            f"run_dir={run}"]  # fmt: skip
    r = cli(args, data_root, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [a["status"] for a in attempts(run, 0)] == ["finished"]  # never restarted
    assert [a["status"] for a in attempts(run, 1)] == ["hung", "finished"]
    assert "no progress in phase 'step'" in (run / "replica1" / "train.log").read_text()
    assert "healed from a live peer" in (run / "replica1" / "train.log").read_text().split("hang:")[-1]
    s0, s1 = group_summary(run, 0), group_summary(run, 1)
    assert s0["final_step"] == s1["final_step"] == 120 and s0["params_sha256"] == s1["params_sha256"]
    assert all(e.ok for e in audit(str(run)))


def test_with_gradient_accumulation_a_group_killed_mid_step_heals_and_every_sample_is_read_once(data_root, tmp_path):
    # trainer.grad_accum_steps=2: each micro-batch takes the next slice of the epoch's one order, and steps run into
    # the next epoch (64 samples a step, 1438 an epoch). Group 1 is SIGKILLed after the first micro-batch of step 30:
    # group 0's step fails in its all-reduce and is discarded (its micro-batches are read again), group 1 heals.
    # (min_replicas=2: step 30's quorum has both groups however the machine's load times their requests.)
    run = tmp_path / "run"
    crash = ["fault=crash_at_step", "fault.step=30", "fault.micro_batch=1", "fault.replica=1"]
    args = [*FT, "strategy.min_replicas=2", "trainer.grad_accum_steps=2", *crash, "trainer.max_steps=100",
            "trainer.eval_every_steps=null", "ckpt.interval_steps=40", f"run_dir={run}"]  # fmt: skip
    r = cli(args, data_root, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [a["status"] for a in attempts(run, 0)] == ["finished"]  # never restarted
    assert len(attempts(run, 1)) == 2 and attempts(run, 1)[-1]["status"] == "finished"
    assert "healed from a live peer" in (run / "replica1" / "train.log").read_text()
    s0, s1 = group_summary(run, 0), group_summary(run, 1)
    assert s0["final_step"] == s1["final_step"] == 100 and s0["params_sha256"] == s1["params_sha256"]
    assert s0["ft"]["discarded_steps"] >= 1  # step 30, whose all-reduce lost its peer
    epochs = audit(str(run))
    assert len(epochs) == 5 and all(e.ok for e in epochs) and all(e.missing == 0 for e in epochs[:-1]), epochs


def test_a_notice_to_one_group_lets_it_leave_and_the_other_finishes_the_job_alone(data_root, tmp_path):
    # The node of group 0 (the one that writes the durable checkpoints) is being preempted: its trainer gets the
    # notice, saves at the step it finishes and leaves with 75; its supervisor does not restart it (the node is
    # going), group 1 takes over the durable checkpoints and every step's whole batch, and finishes the job.
    run = tmp_path / "run"
    args = [*FT, "trainer.max_steps=120", "trainer.eval_every_steps=null", "ckpt.interval_steps=20",
            "trainer.preempt_grace_seconds=60", f"run_dir={run}"]  # fmt: skip
    with background_job(args, data_root, tmp_path) as p:
        signal_once_both_trained(run, p, 0, signal.SIGUSR1, steps=30)
        assert p.wait(timeout=180) == 0, (tmp_path / "job.log").read_text()[-3000:]
    left = attempts(run, 0)
    assert [a["status"] for a in left] == ["preempted"] and [a["status"] for a in attempts(run, 1)] == ["finished"]
    text = (run / "replica0" / "train.log").read_text()
    assert f"preempted (SIGUSR1) at step {left[0]['step']}: saved it" in text, text[-2000:]
    assert (run / "checkpoints" / "step_00000120").is_dir()  # group 1 wrote the durable checkpoints after it left
    assert group_summary(run, 1)["final_step"] == 120
    job = json.loads((run / "summary.json").read_text())["ft_job"]
    assert job["attempts_per_group"] == {"0": 1, "1": 1} and "preempted" in job["errors"]["0"]
    epochs = audit(str(run))
    assert epochs and all(e.ok for e in epochs) and all(e.missing == 0 for e in epochs[:-1]), epochs
    assert "Traceback" not in (tmp_path / "job.log").read_text()


def test_a_notice_to_one_group_when_every_group_is_needed_stops_the_whole_job_with_75(data_root, tmp_path):
    # strategy.min_replicas=2: without group 0, group 1 can form no quorum; it would wait for one, again and again.
    # The launcher hands it the notice once group 0 has left: after its quorum's timeout its step is discarded, it
    # stops at its last committed step, and the job leaves with 75.
    run = tmp_path / "run"
    args = [*FT, "strategy.min_replicas=2", "strategy.quorum_timeout=5", "trainer.max_steps=120",
            "trainer.eval_every_steps=null", "ckpt.interval_steps=20", "trainer.preempt_grace_seconds=60",
            f"run_dir={run}"]  # fmt: skip
    with open(tmp_path / "job.log", "w") as log:
        p = popen_cmd(cli_cmd(args, data_root, tmp_path), stdout=log, stderr=subprocess.STDOUT)
    try:
        signal_once_both_trained(run, p, 0, signal.SIGUSR1, steps=30)
        assert p.wait(timeout=120) == 75, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
    assert "replica group 0 ended, 1 left of min_replicas" in (tmp_path / "job.log").read_text()
    stops = [attempts(run, k) for k in (0, 1)]
    assert [a["status"] for a in stops[0]] == [a["status"] for a in stops[1]] == ["preempted"], stops


def test_a_notice_to_every_process_stops_the_job_with_75_and_the_same_command_resumes_it(data_root, tmp_path):
    # SLURM's notice reaches every process of the job step: the launcher, the Lighthouse, both groups. Both groups
    # stop after the same step (one saves it), the launcher waits for them and leaves with 75, nothing is lost.
    run = tmp_path / "run"
    # (quorum_timeout: a group whose notice came just after its step's all-reduce, while the other's came before,
    # waits that long for a quorum that cannot form, then stops at its last committed step)
    args = [*FT, "strategy.min_replicas=2", "strategy.quorum_timeout=10", "trainer.max_steps=80",
            "trainer.eval_every_steps=null", "ckpt.interval_steps=20", "trainer.preempt_grace_seconds=60",
            f"run_dir={run}"]  # fmt: skip
    with open(tmp_path / "job.err", "w") as log:  # (a file: a pipe nobody reads fills and blocks the job)
        p = popen_cmd(cli_cmd(args, data_root, tmp_path), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: min(committed_step(run, 0), committed_step(run, 1)) >= 30, p=p)
        os.killpg(p.pid, signal.SIGUSR1)
        p.wait(timeout=180)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    err = (tmp_path / "job.err").read_text()
    assert p.returncode == 75, err[-3000:]
    assert "preempted after a notice; run the same command again" in err, err[-3000:]
    # no attempt failed (the warm fork server outlived the notice: it reported each 75). (Where the notices fell
    # between the groups' steps, torchft logs the failed quorum or all-reduce of the group that went on, with its
    # traceback: that step is discarded.)
    assert "failed (" not in err and "attempt failed" not in err, err[-3000:]
    stops = {k: attempts(run, k)[-1] for k in (0, 1)}
    assert {a["status"] for a in stops.values()} == {"preempted"} and stops[0]["step"] == stops[1]["step"], stops
    step = stops[0]["step"]  # (each group's last committed step: one that went on had its next step discarded)
    assert (run / "checkpoints" / f"step_{step:08d}").is_dir()
    again = cli(args, data_root, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    for k in (0, 1):
        s = group_summary(run, k)
        assert s["final_step"] == 80 and s["resumed_from"] == step
    assert group_summary(run, 0)["params_sha256"] == group_summary(run, 1)["params_sha256"]
    assert all(e.ok for e in audit(str(run)))


def test_the_writer_group_killed_during_a_durable_save_the_job_goes_on_and_a_resume_skips_the_partial(
    data_root, tmp_path
):
    # fault=during_save aimed at group 0, the group that writes the durable checkpoints: SIGKILL while a save's
    # files are on disk without their commit marker. Group 1 goes on; group 0 restarts and heals from it; the durable
    # checkpoints go on being written. The partial one is never loaded: the same command again (the job is done)
    # restores the newest complete one, removes the partial, and reports the same parameters.
    run = tmp_path / "run"
    args = [*FT, "ckpt=async_dcp", "ckpt.throttle_mbps=5", "ckpt.interval_steps=20", "fault=during_save",
            "fault.step=20", "fault.replica=0", "trainer.max_steps=100", "trainer.eval_every_steps=null",
            f"run_dir={run}"]  # fmt: skip
    r = cli(args, data_root, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(attempts(run, 0)) == 2 and attempts(run, 0)[-1]["status"] == "finished"  # (the first was SIGKILLed)
    assert [a["status"] for a in attempts(run, 1)] == ["finished"]  # never restarted
    text = (run / "replica0" / "train.log").read_text()
    # (the first save from step 20 on that the fault's watcher sees half-written: step 20's, or a later one's on a
    # loaded machine)
    killed = re.search(r"fault injection: SIGKILL \(during the write of (step_(\d+))\)", text)
    assert killed and int(killed.group(2)) < 100 and "healed from a live peer" in text, text[-3000:]
    partial = run / "checkpoints" / killed.group(1)
    assert partial.is_dir() and not (partial / ".metadata").exists()
    assert (run / "checkpoints" / "step_00000100" / ".metadata").is_file()  # saves went on after the kill
    s0, s1 = group_summary(run, 0), group_summary(run, 1)
    assert s0["final_step"] == s1["final_step"] == 100 and s0["params_sha256"] == s1["params_sha256"]
    assert all(e.ok for e in audit(str(run)))
    again = cli(args, data_root, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not partial.exists() and "skipping partial checkpoint" in again.stderr + again.stdout
    s = group_summary(run, 0)
    assert s["resumed_from"] == 100 and s["params_sha256"] == s0["params_sha256"]


def live_env(pid: int, name: bytes) -> bytes:
    """The value of environment variable ``name`` in process ``pid`` as it is now, read from the process's memory
    (``NAME=VALUE`` as ``putenv`` stored it). /proc/PID/environ shows only the environment the process was exec'd
    with: an attempt forked from a copy of its launcher was never exec'd after the launcher set the variable."""
    import re

    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            span, perms, *rest = line.split()
            if not perms.startswith("rw") or (len(rest) > 3 and rest[3].startswith(("/", "[v"))):
                continue  # (the heap and anonymous memory only)
            start, end = (int(x, 16) for x in span.split("-"))
            with contextlib.suppress(OSError, ValueError, OverflowError):
                mem.seek(start)
                found = re.search(re.escape(name) + rb"=([0-9a-f]{64})\0", mem.read(end - start))
                if found:
                    return found.group(1)
    raise AssertionError(f"{name!r} is not in the memory of process {pid}")


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it (the processes of a job started as ``pid``)."""
    job, seen = {pid}, None
    while seen != job:
        seen = set(job)
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) not in job:
                with contextlib.suppress(OSError):
                    if parent(int(entry)) in job:
                        job.add(int(entry))
    return job


def listening(pids: set[int]) -> dict[int, list[tuple[str, int]]]:
    """The TCP sockets each process of ``pids`` listens on: (address, port), from /proc/net/tcp{,6} joined with the
    socket inodes of its open files."""
    import ipaddress

    listen: dict[str, tuple[str, int]] = {}  # inode -> (address, port)
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] != "0A":  # LISTEN
                    continue
                hexaddr, port = cols[1].split(":")
                raw = b"".join(bytes.fromhex(hexaddr[i : i + 8])[::-1] for i in range(0, len(hexaddr), 8))
                listen[cols[9]] = (str(ipaddress.ip_address(raw)), int(port, 16))
    out: dict[int, list[tuple[str, int]]] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # (gone meanwhile)
            continue
        links = []
        for fd in fds:
            with contextlib.suppress(OSError):  # (a file closed meanwhile: the process is still listed)
                links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        inodes = [link[len("socket:[") : -1] for link in links if link.startswith("socket:[")]
        out[pid] = [listen[i] for i in inodes if i in listen]
    return out


def test_a_job_on_one_machine_listens_on_loopback_alone_and_heals_over_the_secret_guarded_transport(
    data_root, tmp_path
):
    # Group 1 crashes at step 15, restarts and heals from group 0 over pitstop's heal transport (raw bytes, HMAC'd
    # with the job's secret, no pickle). While both train after the heal, every TCP socket that any process of the
    # job listens on (the Lighthouse in the launcher; each group's manager server, store, heal server, Gloo) is on
    # loopback. The job's secret, made by the launcher, is in no file of the run.
    import ipaddress

    run = tmp_path / "run"
    args = [*FT, "fault=crash_at_step", "fault.step=15", "fault.replica=1", "trainer.max_steps=400",
            "trainer.eval_every_steps=null", "ckpt.interval_steps=200", f"run_dir={run}"]  # fmt: skip
    with background_job(args, data_root, tmp_path) as p:
        wait_for(lambda: len(attempts(run, 1)) == 2 and committed_step(run, 1) > 16, p=p)
        trainers = {attempts(run, k)[-1]["pid"] for k in (0, 1)}
        sockets = listening(descendants(p.pid))
        alive = committed_step(run, 0) < 400 and committed_step(run, 1) < 400
        secret = live_env(attempts(run, 1)[-1]["pid"], b"PITSTOP_FT_SECRET")
        assert p.wait(timeout=240) == 0, (tmp_path / "job.log").read_text()[-3000:]
    assert alive and trainers <= set(sockets), (trainers, sockets)  # (sampled while both groups trained)
    assert len(sockets[p.pid]) >= 1 and all(len(sockets[t]) >= 3 for t in trainers), sockets
    wide = {pid: [(a, port) for a, port in s if not ipaddress.ip_address(a).is_loopback] for pid, s in sockets.items()}
    assert not any(wide.values()), f"listening beyond loopback (pid: address, port): {wide}"
    assert "healed from a live peer" in (run / "replica1" / "train.log").read_text()
    s0, s1 = group_summary(run, 0), group_summary(run, 1)
    assert s0["final_step"] == s1["final_step"] == 400 and s0["params_sha256"] == s1["params_sha256"]
    assert len(secret) == 64  # (the launcher's, 32 random bytes in hex) ... and written nowhere
    files = [f for f in run.rglob("*") if f.is_file()] + [tmp_path / "job.log"]
    assert files and not [str(f) for f in files if secret in f.read_bytes()]
