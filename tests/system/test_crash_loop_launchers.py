"""No crash loops: a deterministic bug (fault=bug: the same ValueError at step 6 of every attempt) with
trainer.max_restarts=10 stops after the second attempt, in one line, exit status 2, under pitstop's supervisor and
under torch's elastic agent (ddp, the bug on rank 1 only); a one-off crash is still restarted (test_strategy's
in-job restart, test_ckpt's kills)."""

from __future__ import annotations

import json

import pytest

from conftest import cli

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
    assert "the same failure happened twice at step 6 on rank 1" in last and "expected a batch of 64" in last
    rank1 = [f for f in failures(run_dir) if f["rank"] == 1]
    assert [f["attempt"] for f in rank1] == [0, 1]  # (the agent restarted once, then was stopped)
