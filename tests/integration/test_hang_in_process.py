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


# ---- the fault x phase matrix: a stall in each checkpoint phase, and in a restore --------------------------------
# (a stall that no fault option aims at is injected by holding the function that does that phase's work: the host
# copy, the write, the commit marker; the stall is bounded so that the run's clean-up can end)


def stall_once(monkeypatch, owner, name: str, when, seconds: float = 8.0) -> list:
    """Make ``owner.name`` sleep ``seconds`` the first time ``when(*args)`` holds; returns the calls' record."""
    real = getattr(owner, name)
    stalled: list = []

    def held(*args, **kw):
        if not stalled and when(*args, **kw):
            stalled.append(time.monotonic())
            time.sleep(seconds)
        return real(*args, **kw)

    monkeypatch.setattr(owner, name, held)
    return stalled


def hung_in(cfg, phase: str) -> str:
    t0 = time.monotonic()
    with pytest.raises(Hung) as err:
        train(cfg)
    msg = str(err.value)
    assert msg.startswith(f"hang: rank 0 made no progress in phase '{phase}'") and "\n" not in msg, msg
    assert time.monotonic() - t0 < 60 and attempts(cfg.run_dir)[-1]["status"] == "hung"
    return msg


def test_a_stalled_host_copy_is_a_hang_of_the_step_that_waits_for_it(make_cfg, monkeypatch):
    from pitstop.ckpt.staging import HostStager

    cfg = make_cfg("trainer.max_steps=30", "ckpt=async_dcp", "ckpt.interval_steps=8", "trainer.hang.min_seconds=2")
    hang_file = Path(cfg.run_dir) / "hang.rank0.txt"
    real, stalled = HostStager._stage, []

    def held(*args, **kw):  # (the copy's thread: held until the hang is declared, so the run's clean-up ends at once)
        if not stalled:
            stalled.append(time.monotonic())
            deadline = time.monotonic() + 30
            while not hang_file.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return real(*args, **kw)

    monkeypatch.setattr(HostStager, "_stage", held)
    hung_in(cfg, "step")  # (the loop waits for the copy before the optimizer step: inside the step)
    assert stalled


def test_a_stalled_write_and_a_stalled_commit_are_hangs_of_the_checkpoint_phase(make_cfg, monkeypatch):
    from pitstop.ckpt import formats, integrity

    base = ["trainer.max_steps=30", "ckpt=sync_save", "ckpt.interval_steps=4", "trainer.hang.min_seconds=2"]
    saves: list = []

    def third_save_begins(summed, data) -> bool:  # (the first two saves measured how long a save takes)
        if summed.running.nbytes == 0:
            saves.append(summed)
            return len(saves) == 3
        return False

    writes = stall_once(monkeypatch, formats.Summed, "write", third_save_begins)
    hung_in(make_cfg(*base), "checkpoint")
    assert writes
    monkeypatch.undo()
    at_12 = lambda path, name, data, **kw: name == "COMMITTED" and path.endswith("step_00000012")  # noqa: E731
    commits = stall_once(monkeypatch, integrity, "write_durable", at_12)
    hung_in(make_cfg(*base), "checkpoint")
    assert commits


def test_a_stalled_restore_is_a_hang_of_the_restore(make_cfg):
    cfg = make_cfg("trainer.max_steps=12", "ckpt=sync_save", "ckpt.interval_steps=4")
    train(cfg)
    again = make_cfg("trainer.max_steps=16", "ckpt=sync_save", "ckpt.interval_steps=4", "fault=stall",
                     "fault.step=4", "fault.rank=0", "fault.phase=restore", "fault.seconds=8",
                     "trainer.hang.first_seconds=4", "trainer.hang.min_seconds=2")  # fmt: skip
    hung_in(again, "restore")  # (a restore runs once per attempt: its limit is trainer.hang.first_seconds)
