"""trainer.instability's pure parts: the spike median, the escalation budgets, the run-dir state file's shape, a
checkpoint of non-finite state refused, a quarantined sample dropped from its batch, and the audit of skip and
rollback lines (sample logs written here as the product writes them)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pitstop.audit import audit
from pitstop.ckpt.finite import NonFiniteState, first_nonfinite, refuse_nonfinite
from pitstop.parts.batch import without
from pitstop.train.instability import Budget, SpikeMedian, said
from pitstop.train.rollback import RunDirState


def test_a_spike_is_a_loss_above_the_factor_times_the_median_once_the_window_is_full():
    m = SpikeMedian(factor=10.0, window=3)
    assert [m.spike(x) for x in (1.0, 50.0, 1.2)] == [None, None, None]  # (warm-up: nothing is a spike yet)
    assert m.spike(12.5) == 1.2  # median of 1.0, 50.0, 1.2
    assert m.spike(11.9) is None  # below 10 x 1.2, and it joins the window
    assert list(m.losses) == [50.0, 1.2, 11.9]  # (the spike did not join it)
    off = SpikeMedian(factor=None, window=2)
    assert [off.spike(x) for x in (1.0, 1.0, 1e9)] == [None, None, None]


def test_skips_within_the_window_escalate_to_a_rollback_then_a_stop():
    b = Budget("rollback", max_skips=2, window=10, max_rollbacks=1)
    assert [b.skipped(s) for s in (5, 9)] == ["skip", "skip"]
    assert b.skipped(20) == "skip"  # 5 and 9 are out of the window of step 20: one skip in it
    assert b.skipped(21) == "skip" and b.skipped(22) == "rollback" and b.began == 20
    b.rolled_back()
    assert [b.skipped(s) for s in (21, 21, 21)] == ["skip", "skip", "stop"]  # max_rollbacks=1 is used up
    assert Budget("skip", 1, 10, 5).skipped(3) == "skip"
    only_skip = Budget("skip", 0, 10, 5)
    assert only_skip.skipped(3) == "stop"  # on_instability=skip: stop where it would roll back
    assert Budget("stop", 9, 10, 5).skipped(1) == "stop"
    assert Budget("rollback", 0, 10, 3, rollbacks=3).skipped(1) == "stop"  # (rollbacks of earlier attempts count)


def test_the_stop_line_says_each_kind_of_unstable_step_once():
    assert said(["non-finite loss at step 5"] * 3 + ["loss spike at step 7"]) == (
        "non-finite loss at step 5 (3 times); loss spike at step 7"
    )


def test_the_run_dir_state_round_trips_and_a_damaged_one_is_kept_aside(tmp_path, caplog):
    s = RunDirState(str(tmp_path), is_main=True)
    assert (s.skips, s.quarantined, s.rollbacks) == ({}, [], 0)
    s.skips["4"] = {"world_size": 2, "loaders": [{"epoch": 0}, {"epoch": 0}], "from": 7}
    s.quarantined.append("0000410")
    s.rollbacks = 1
    s.write()
    again = RunDirState(str(tmp_path), is_main=True)
    assert (again.skips, again.quarantined, again.rollbacks) == (s.skips, ["0000410"], 1)
    (tmp_path / "instability.json").write_text(json.dumps({"skips": {"4": {"world_size": 0, "loaders": []}}}))
    with caplog.at_level("WARNING"):
        damaged = RunDirState(str(tmp_path), is_main=True)
    assert damaged.skips == {} and (tmp_path / "instability.json.corrupt").exists()
    assert "skips.4.world_size" in caplog.text and "instability.json.corrupt" in caplog.text


def test_a_checkpoint_of_non_finite_state_is_refused_naming_the_tensor():
    good = {"w": torch.ones(3), "step": torch.tensor(4)}
    assert first_nonfinite(good) is None
    refuse_nonfinite(good, {"state": {0: {"exp_avg": torch.zeros(3)}}})
    with pytest.raises(NonFiniteState, match=r"optimizer state holds a non-finite value \(state.0.exp_avg\)"):
        refuse_nonfinite(good, {"state": {0: {"exp_avg": torch.tensor([0.0, math.inf])}}})
    assert first_nonfinite({"layer": {"running_var": torch.tensor([1.0, math.nan])}}) == "layer.running_var"


def test_a_quarantined_sample_is_dropped_from_its_batch():
    x, y = torch.arange(8.0).reshape(4, 2), torch.tensor([0, 1, 2, 3])
    (x2, y2), keys = without((x, y), ["a", "b", "c", "d"], frozenset({"b", "d"}))
    assert keys == ["a", "c"] and y2.tolist() == [0, 2] and x2.tolist() == [[0.0, 1.0], [4.0, 5.0]]


def _logs(run_dir, lines_by_rank, metrics, quarantined=()):
    for rank, lines in lines_by_rank.items():
        (run_dir / f"samples.rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0, "epoch": e}) + "\n"
                                                  for s, e in metrics))  # fmt: skip
    if quarantined:
        (run_dir / "instability.json").write_text(json.dumps({"quarantined": list(quarantined)}))


def _head(attempt, resumed_from=0):
    return {"attempt": attempt, "resumed_from": resumed_from, "rank": 0, "world_size": 1, "epoch_samples": 8,
            "epochs": 1}  # fmt: skip


def test_the_audit_counts_skipped_and_quarantined_samples_apart_from_consumed_and_missing(tmp_path):
    # step 2's keys c, d were skipped (a non-finite loss); the step was taken again with e, f; h was quarantined
    lines = [_head(1.0), {"step": 1, "keys": ["a", "b"]}, {"step": 2, "keys": ["c", "d"]},
             {"skip": 2, "epoch": 0}, {"step": 2, "keys": ["e", "f"]}, {"step": 3, "keys": ["g"]}]  # fmt: skip
    _logs(tmp_path, {0: lines}, [(1, 0), (2, 0), (3, 0)], quarantined=["h"])
    (epoch,) = audit(str(tmp_path))
    assert (epoch.once, epoch.skipped, epoch.quarantined, epoch.repeated, epoch.missing) == (5, 2, 1, 0, 0)
    assert epoch.ok
    # the same keys skipped and then fed: repeated, a failure
    _logs(tmp_path, {0: [*lines, {"step": 4, "keys": ["c"]}]}, [(1, 0), (2, 0), (3, 0), (4, 0)], quarantined=["h"])
    (epoch,) = audit(str(tmp_path))
    assert epoch.repeated == 1 and epoch.examples == ["c"] and not epoch.ok


def test_the_audit_reads_a_rollback_keeping_the_data_and_a_restart_from_before_it(tmp_path):
    # steps 3, 4 rolled back to step 2 keeping the data position: e..h skipped; then 3, 4 again with i..l
    lines = [_head(1.0), {"step": 1, "keys": ["a", "b"]}, {"step": 2, "keys": ["c", "d"]},
             {"step": 3, "keys": ["e", "f"]}, {"step": 4, "keys": ["g", "h"]},
             {"rollback": 2, "from": 4, "keep_data": True, "epochs": {"3": 0, "4": 0}},
             {"step": 3, "keys": ["i", "j"]}]  # fmt: skip
    _logs(tmp_path, {0: lines}, [(1, 0), (2, 0), (3, 0)])
    (epoch,) = audit(str(tmp_path))
    assert (epoch.once, epoch.skipped, epoch.repeated, epoch.missing) == (6, 4, 0, 0)
    # killed; the restart resumed from step 1 (before the rollback's step): the skip no longer applies, the data
    # from step 2 on is taken again
    again = [_head(2.0, resumed_from=1), {"step": 2, "keys": ["c", "d"]}, {"step": 3, "keys": ["e", "f"]},
             {"step": 4, "keys": ["g", "h"]}]  # fmt: skip
    _logs(tmp_path, {0: lines + again}, [(1, 0), (2, 0), (3, 0), (4, 0)])
    (epoch,) = audit(str(tmp_path))
    assert (epoch.once, epoch.skipped, epoch.repeated, epoch.missing) == (8, 0, 0, 0)
    # a rollback that takes the data back: nothing skipped, the steps are redone
    redo = [_head(1.0), {"step": 1, "keys": ["a", "b"]}, {"step": 2, "keys": ["c", "d"]},
            {"rollback": 1, "from": 2, "keep_data": False, "epochs": {"2": 0}},
            {"step": 2, "keys": ["c", "d"]}]  # fmt: skip
    _logs(tmp_path, {0: redo}, [(1, 0), (2, 0)])
    (epoch,) = audit(str(tmp_path))
    assert (epoch.once, epoch.skipped, epoch.repeated) == (4, 0, 0)


def test_retention_keeps_the_checkpoint_a_rollback_may_go_back_to(tmp_path):
    from pitstop.ckpt import layout

    for step in (20, 40, 60, 80, 100):
        d = Path(layout.step_dir(str(tmp_path), step))
        d.mkdir()
        (d / layout.SAVE_MARKER).write_text("")
    layout.purge(str(tmp_path), keep_last_k=2, pinned=50)  # the trouble began at step 51
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000040", "step_00000080", "step_00000100"]
    layout.purge(str(tmp_path), keep_last_k=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000080", "step_00000100"]


def test_a_rollback_moves_the_work_since_its_checkpoint_to_its_bucket(tmp_path):
    import time

    from pitstop.goodput.ledger import GoodputLog, Ledger

    ledger = Ledger(time.time())
    g = GoodputLog(str(tmp_path), ledger)
    ledger.add("compute", 4.0)
    g.mark(4)  # a checkpoint of step 4 after 4 s of compute
    ledger.add("compute", 3.0)
    g.mark(7)
    ledger.add("compute", 2.0)  # steps 8, 9
    g.rolled_back(4, 9, "instability", "a test")
    assert ledger.seconds["compute"] == 4.0 and ledger.seconds["instability"] == 5.0
    doc = json.loads((tmp_path / "goodput.json").read_text())
    (attempt,) = doc["attempts"]
    assert list(attempt["marks"]) == ["4"] and attempt["rollbacks"][0]["seconds"] == 5.0
    assert doc["totals"]["productive"] == 4.0 and doc["totals"]["instability"] == 5.0


def test_the_audit_reads_a_skip_under_replica_groups(tmp_path):
    """strategy=ft writes each step's keys with its quorum and then its outcome; a skipped step has a skip line."""
    lines = [_head(1.0), {"step": 1, "quorum": 1, "keys": ["a", "b"]}, {"commit": 1, "ok": True, "quorum": 1},
             {"step": 2, "quorum": 1, "keys": ["c", "d"]}, {"skip": 2, "epoch": 0},
             {"step": 2, "quorum": 1, "keys": ["e", "f"]}, {"commit": 2, "ok": True, "quorum": 1}]  # fmt: skip
    _logs(tmp_path, {0: lines}, [(1, 0), (2, 0)])
    (epoch,) = audit(str(tmp_path))
    assert (epoch.once, epoch.skipped, epoch.repeated, epoch.missing) == (4, 2, 0, 2)
