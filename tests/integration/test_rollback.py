"""The in-process rollback (``Runner.rollback``), driven through a real Runner with real checkpoints: back to the
newest verified checkpoint at or before a step, the data in between skipped exactly once (also after a restart),
the steps thrown away booked in the ledger, the checkpoints of those steps removed; none to go back to: one line,
nothing deleted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import train
from pitstop.audit import audit
from pitstop.errors import NoRollbackPoint
from pitstop.train.runner import Runner

RUN = ["ckpt=sync_save", "ckpt.interval_steps=4", "data.record_sample_ids=true"]  # (debug=tiny: 12 steps of 16)


def _to_step_7_and_back(cfg) -> Runner:
    """Steps 1..7 (saved at 4, and at 7 as the last of this first stretch), then a rollback to at most step 6."""
    r = Runner(cfg, cfg.run_dir)
    r.setup()
    r.restore()
    r.total_steps = 7
    r.fit()
    assert sorted(os.listdir(Path(cfg.ckpt.dir))) == ["step_00000004", "step_00000007"]
    before = r.loader.state_dict()
    assert r.rollback(6, "a test's rollback", keep_data=True) == 4
    assert r.step == 4 and r.loader.state_dict() == before  # the checkpoint's model, the data position kept
    return r


def _samples(run_dir: str) -> tuple[int, int, int, int]:
    (epoch,) = audit(run_dir)
    return epoch.once, epoch.skipped, epoch.repeated, epoch.missing


def test_a_rollback_keeps_the_data_position_and_the_skip_outlives_a_restart(make_cfg, tmp_path):
    cfg = make_cfg(*RUN)
    r = _to_step_7_and_back(cfg)
    with r._resources:
        assert sorted(os.listdir(Path(cfg.ckpt.dir))) == ["step_00000004"]  # step 7's steps were thrown away
        state = json.loads((Path(cfg.run_dir) / "instability.json").read_text())
        assert list(state["skips"]) == ["4"] and state["rollbacks"] == 1
        r.total_steps = 12
        r.fit()
        s = r.finish()
    assert s["final_step"] == 12
    totals = json.loads((Path(cfg.run_dir) / "goodput.json").read_text())["totals"]
    assert totals["instability"] > 0  # steps 5..7 and the restore
    assert _samples(cfg.run_dir) == (12 * 16, 3 * 16, 0, 1438 - 15 * 16)  # steps 5..7's samples: skipped, never fed

    # The same, killed right after the rollback: the restart resumes from step 4 with the data position of the
    # rollback (instability.json), and ends with the same parameters, bitwise.
    again = make_cfg(*RUN, f"run_dir={tmp_path / 'again'}")
    _to_step_7_and_back(again).close()
    s2 = train(again)
    assert s2["resumed_from"] == 4 and s2["final_step"] == 12
    assert s2["params_sha256"] == s["params_sha256"]
    assert _samples(again.run_dir) == _samples(cfg.run_dir)


def test_no_verified_checkpoint_to_roll_back_to_stops_in_one_line_and_deletes_nothing(make_cfg):
    cfg = make_cfg(*RUN)
    r = Runner(cfg, cfg.run_dir)
    with r._resources:
        r.setup()
        r.restore()
        r.total_steps = 5
        r.fit()
        with pytest.raises(NoRollbackPoint) as e:
            r.rollback(3, "loss spike at step 4")
    message = str(e.value)
    assert "\n" not in message and "no verified checkpoint at or before step 3" in message, message
    assert "nothing deleted" in message
    assert sorted(os.listdir(Path(cfg.ckpt.dir))) == ["step_00000004", "step_00000005"]
