"""Hang detection (trainer.hang) in-process: a stalled step raises Hung within a few step-times, names the phase,
leaves its threads' stacks and a 'hung' attempt in the ledger; switched off, it is off.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import train
from pitstop.resilience.watchdog import Hung


def attempts(run_dir) -> list[dict]:
    return json.loads((Path(run_dir) / "goodput.json").read_text())["attempts"]


def test_a_stalled_step_in_process_raises_hung_names_the_phase_and_records_it(make_cfg, tmp_path):
    cfg = make_cfg(
        "trainer.max_steps=30",
        "fault=stall",
        "fault.step=5",
        "fault.rank=0",
        "trainer.hang.min_seconds=2",
        "ckpt=sync_save",
        "ckpt.interval_steps=2",
    )
    t0 = time.monotonic()
    with pytest.raises(Hung) as err:
        train(cfg)
    assert time.monotonic() - t0 < 30  # not the 3600 s of the stall
    msg = str(err.value)
    assert msg.startswith("hang: rank 0 made no progress in phase 'step'") and "\n" not in msg
    stacks = (Path(cfg.run_dir) / "hang.rank0.txt").read_text()
    assert "fault.py" in stacks and "fire" in stacks  # where it was stuck
    assert attempts(cfg.run_dir)[-1]["status"] == "hung"


def test_a_stalled_evaluation_raises_hung_naming_the_phase(make_cfg):
    """The fault x phase matrix, stall x evaluation (debug=tiny evaluates every 6 steps, 2 batches): the second
    evaluation stalls (the first one measured how long an evaluation takes)."""
    cfg = make_cfg("trainer.max_steps=18", "fault=stall", "fault.step=12", "fault.rank=0", "fault.phase=eval",
                   "trainer.hang.min_seconds=2", "ckpt=sync_save", "ckpt.interval_steps=3")  # fmt: skip
    with pytest.raises(Hung) as err:
        train(cfg)
    assert str(err.value).startswith("hang: rank 0 made no progress in phase 'eval'") and "\n" not in str(err.value)
    assert attempts(cfg.run_dir)[-1]["status"] == "hung" and attempts(cfg.run_dir)[-1]["step"] == 12


def test_hang_detection_off_is_off(make_cfg):
    cfg = make_cfg(
        "trainer.max_steps=4",
        "trainer.hang.enabled=false",
        "trainer.hang.min_seconds=0.001",
        "trainer.hang.first_seconds=0.001",
    )
    assert train(cfg)["final_step"] == 4
