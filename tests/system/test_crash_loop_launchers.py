"""No crash loops: a deterministic bug (fault=bug: the same ValueError at step 6 of every attempt) with
trainer.max_restarts=10 stops after the second attempt, in one line, exit status 2, under pitstop's supervisor,
under torch's elastic agent (ddp, the bug on rank 1 only) and under replica groups (strategy=ft: in every group; or
in one group's heals, which stops the whole job); a one-off crash is still restarted (test_strategy's in-job restart,
test_ckpt's kills, test_ft's group kills and crash_at_step)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import time

import pytest

from conftest import cli, cli_cmd, popen_cmd
from manual import assert_shows, page_output

pytestmark = pytest.mark.slow

RUN = ["debug=tiny", "trainer.max_steps=10", "logger=none", "ckpt=sync_dcp", "ckpt.interval_steps=4"]


def failures(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "failures.jsonl").read_text().splitlines()]


def test_a_deterministic_bug_stops_after_two_attempts_under_the_supervisor(data_root, tmp_path):
    run_dir = tmp_path / "run"
    args = [*RUN, "trainer.max_restarts=10", "fault=bug", "fault.step=6", f"run_dir={run_dir}"]
    p = cli(args, data_root, tmp_path)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2, p.stderr[-3000:]
    assert "the same failure happened twice at step 6 on rank 0" in last and "expected a batch of 64" in last
    assert f"{run_dir}/train.log" in last
    assert_shows(page_output("fault=bug fault.step=6"), p.stdout + p.stderr, "a crash loop (wrong-without-crashing)")
    attempts = json.loads((run_dir / "goodput.json").read_text())["attempts"]
    assert len(attempts) == 2 and [f["attempt"] for f in failures(run_dir)] == [0, 1]
    assert not (run_dir / "summary.json").exists()


def test_a_deterministic_bug_on_one_rank_stops_the_elastic_agent_after_two_attempts(data_root, tmp_path):
    run_dir = tmp_path / "run"
    args = [*RUN, "strategy=ddp", "strategy.max_restarts=10", "fault=bug", "fault.step=6", "fault.rank=1",
            f"run_dir={run_dir}"]  # fmt: skip
    p = cli(args, data_root, tmp_path, timeout=400)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2, p.stderr[-3000:]
    said = "the same failure happened twice at step 6 on rank 1" in last and "expected a batch of 64" in last
    assert said, p.stderr[-6000:]
    rank1 = [f for f in failures(run_dir) if f["rank"] == 1]
    assert [f["attempt"] for f in rank1] == [0, 1]  # (the agent restarted once, then was stopped)


# ---- replica groups (strategy=ft: a Lighthouse and one supervisor per group) ---------------------------------------
FT = ["strategy=ft", "debug=tiny", "logger=none", "ckpt=sync_save", "strategy.max_restarts=10"]
needs_torchft = pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="needs torchft")


def group_attempts(run_dir, k: int) -> list[dict]:
    try:
        return json.loads((run_dir / f"replica{k}" / "goodput.json").read_text())["attempts"]
    except (OSError, ValueError, KeyError):
        return []


def committed(run_dir, k: int) -> int:
    """The last step group ``k`` committed (its sample log is on disk step by step)."""
    try:
        lines = (run_dir / f"replica{k}" / "samples.rank0.jsonl").read_text().splitlines()
    except OSError:
        return 0
    done = [json.loads(ln)["commit"] for ln in lines if ln.startswith('{"commit"') and '"ok":true' in ln]
    return done[-1] if done else 0


@needs_torchft
def test_a_deterministic_bug_in_every_replica_group_stops_the_job_after_two_attempts(data_root, tmp_path):
    # the same code and data in both groups: both fail at step 6, restart together from the save of 4 (the first
    # quorum waits for both) and fail there again: the job stops in one line naming the group
    run_dir = tmp_path / "run"
    args = [*FT, "trainer.max_steps=10", "ckpt.interval_steps=4", "fault=bug", "fault.step=6", f"run_dir={run_dir}"]
    p = cli(args, data_root, tmp_path)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2, p.stderr[-3000:]
    assert last.startswith("error: replica group ") and "the same failure happened twice at step 6 on rank 0" in last
    assert "expected a batch of 64" in last and "/train.log)" in last, last
    for k in (0, 1):
        assert 1 <= len(group_attempts(run_dir, k)) <= 2  # (a group whose peer looped first may leave on its notice)
    assert sorted(len(group_attempts(run_dir, k)) for k in (0, 1))[-1] == 2


@needs_torchft
def test_a_replica_group_in_a_crash_loop_stops_the_whole_job_and_the_healthy_group_saves_and_leaves(
    data_root, tmp_path
):
    # Group 1 cannot take a peer's state (fault=bug fault.phase=heal): SIGKILLed once both groups trained, it restarts,
    # heals from group 0 and fails, twice the same way at the same point. With strategy.min_replicas=1 group 0 could
    # train on alone for ever (before: it did, to the last step, exit 0); the job stops in one line instead, exit 2,
    # group 0 saving at the step it is at and leaving.
    run_dir = tmp_path / "run"
    args = [*FT, "trainer.max_steps=2000", "trainer.eval_every_steps=null", "ckpt.interval_steps=500", "fault=bug",
            "fault.phase=heal", "fault.step=10", "fault.replica=1", "data.record_sample_ids=true",
            f"run_dir={run_dir}"]  # fmt: skip
    with open(tmp_path / "job.log", "w") as out:
        p = popen_cmd(cli_cmd(args, data_root, tmp_path), stdout=subprocess.DEVNULL, stderr=out)
    try:
        while min(committed(run_dir, 0), committed(run_dir, 1)) < 10:  # (both trained: group 1 then heals at >= 10)
            assert p.poll() is None, (tmp_path / "job.log").read_text()[-3000:]
            time.sleep(0.05)
        os.kill(group_attempts(run_dir, 1)[-1]["pid"], signal.SIGKILL)
        assert p.wait(timeout=120) == 2, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
    last = (tmp_path / "job.log").read_text().strip().splitlines()[-1]
    assert last.startswith("error: replica group 1: the same failure happened twice at step 0 on rank 0"), last
    assert "(attempts 2 and 3): HealFailed: replica group 1 cannot load the state a peer sent" in last, last
    assert [a["status"] for a in group_attempts(run_dir, 1)] == ["running", "failed", "failed"]  # killed, then looped
    healthy = group_attempts(run_dir, 0)
    assert [a["status"] for a in healthy] == ["preempted"] and healthy[0]["step"] < 2000, healthy
