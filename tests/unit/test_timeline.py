"""A run's time line (pitstop.goodput.timeline): read from the run dir alone, also for a killed attempt, and drawn."""

from __future__ import annotations

import json
import os

import pytest

from pitstop.goodput.ledger import GoodputLog, Ledger
from pitstop.goodput.timeline import draw, lines, read


def _attempt(run_dir, t0, steps, status=None, resumed_from=None):
    """One attempt as the runner records it: its ledger's goodput.json record and its metrics.jsonl lines."""
    ledger = Ledger(t0)
    log = GoodputLog(str(run_dir), ledger, heartbeat=0.0)
    log.resumed(resumed_from)
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        for step in steps:
            f.write(json.dumps({"step": step, "loss": 1.0 / step, "time": t0 + step}) + "\n")
            if step % 5 == 0:
                f.write(json.dumps({"step": step, "ckpt_block_seconds": 0.01, "time": t0 + step + 0.5}) + "\n")
            if step % 10 == 0:
                f.write(json.dumps({"step": step, "val_accuracy": 0.5, "time": t0 + step + 0.7}) + "\n")
        f.write('{"step": 99, "loss"')  # (a line cut by a kill)
        f.write("\n")
    log.write(steps[-1], status=status or "running")
    return log


def test_a_killed_attempt_and_its_restart_are_read_from_the_run_dir(tmp_path):
    _attempt(tmp_path, 1000.0, [1, 2, 3, 4, 5, 6, 7])  # killed after step 7: no end status on record
    _attempt(tmp_path, 1000.0, [6, 7, 8, 9, 10], status="finished", resumed_from=5)
    line = read(str(tmp_path))
    assert [a.status for a in line.attempts] == ["running", "finished"]
    assert line.attempts[1].resumed_from == 5 and line.attempts[0].start == 0.0
    assert [s for _, s in line.steps] == [1, 2, 3, 4, 5, 6, 7, 6, 7, 8, 9, 10]  # (the cut line is skipped)
    assert [s for _, s in line.saves] == [5, 10] and [s for _, s in line.evals] == [10]
    assert all(b != "total" for a in line.attempts for b in a.buckets)  # (a bucket of its own, not a sum)
    path = draw(str(tmp_path))
    assert path == str(tmp_path / "timeline.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_job_of_replica_groups_draws_a_line_per_group(tmp_path):
    for k in (1, 0):
        (tmp_path / f"replica{k}").mkdir()
        _attempt(tmp_path / f"replica{k}", 1000.0, [1, 2, 3], status="finished")
    assert [line.name for line in lines(str(tmp_path))] == ["replica0", "replica1"]
    assert os.path.getsize(draw(str(tmp_path), str(tmp_path / "job.png"))) > 0


def test_a_dir_that_is_no_run_is_refused_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no goodput.json"):
        lines(str(tmp_path))


def test_a_skipped_step_and_a_rollback_are_marked(tmp_path):
    _attempt(tmp_path, 1000.0, [1, 2, 3, 4])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"event": "skip", "step": 5, "value": "nan", "why": "x", "time": 1005.2}) + "\n")
        f.write(json.dumps({"event": "rollback", "step": 2, "from": 4, "bucket": "instability", "time": 1005.5}) + "\n")
    line = read(str(tmp_path))
    assert [(round(t, 3), s) for t, s in line.skips] == [(5.2, 5)] and line.rollbacks == [(5.5, 2)]
    assert [s for _, s in line.steps] == [1, 2, 3, 4]  # (neither is a step taken)
    assert draw(str(tmp_path)).endswith("timeline.png")
