"""Goodput settings in-process: inconsistent fault and interval settings are refused before training, and a
launcher's own notice handler runs after the save (submitit's requeue).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import refused, train


# ---- bad input -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["fault=random", "fault.mtbf_seconds=-5", "trainer.max_restarts=3"], "fault.mtbf_seconds must be a positive"),
        (["fault=random", "fault.mtbf_seconds=30"], "set trainer.max_restarts"),
        (["fault=random", "fault.mtbf_steps=0", "trainer.max_restarts=3"], "fault.mtbf_steps must be a positive"),
        (
            ["fault=random", "trainer.max_restarts=3"],
            "fault=random needs one of fault.mtbf_seconds (wall clock) and "
            "fault.mtbf_steps (steps), got None and None: set one of them",
        ),
        (
            ["fault=random", "fault.mtbf_seconds=9", "fault.mtbf_steps=9", "trainer.max_restarts=3"],
            "got 9.0 and 9.0: set one of them",
        ),
        (["fault=during_save", "ckpt=none"], "fault=during_save needs checkpoints"),
        (["fault=during_heal", "ckpt=sync_save"], "fault=during_heal kills a replica group as a peer heals from it"),
        (["fault=crash_at_step", "fault.step=500"], "fault.step=500 is not a step of this run (1..12)"),
        (["fault=crash_at_step", "fault.step=3", "fault.rank=2"], "fault.rank=2 but the job has 1 rank(s)"),
        (["fault=stall", "fault.step=3"], "fault.rank=1 but the job has 1 rank(s)"),
        (["trainer.hang.min_seconds=0"], "trainer.hang.min_seconds must be a positive number, got 0"),
        (["ckpt=sync_save", "ckpt.interval=sometimes"], "ckpt.interval='sometimes': use auto"),
    ],
)
def test_inconsistent_fault_and_interval_settings_fail_before_training(make_cfg, overrides, expected):
    assert expected in refused(make_cfg(*overrides))


def test_a_launchers_own_handler_runs_after_the_save_submitit_requeue(make_cfg):
    # Under hydra/launcher=slurm, submitit has a SIGUSR2 handler that requeues the job and exits. pitstop's
    # notice handler takes the signal first, saves, and then hands it on: the requeue comes after a durable save.
    import signal

    from pitstop.ckpt import layout

    cfg = make_cfg(
        "trainer.max_steps=12",
        "ckpt=sync_save",
        "ckpt.interval_steps=100",
        "fault=preempt",
        "fault.step=5",
        "fault.signal=SIGUSR2",
    )
    seen = []

    def submitit_like(signum, frame):  # what submitit's checkpoint_and_try_requeue does, in short
        seen.append((signal.Signals(signum).name, layout.is_complete(layout.step_dir(cfg.ckpt.dir, 5))))
        raise SystemExit(-1)

    previous = signal.signal(signal.SIGUSR2, submitit_like)
    try:
        with pytest.raises(SystemExit):
            train(cfg)
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert seen == [("SIGUSR2", True)]  # called once, after the save of step 5 was committed
    doc = json.loads((Path(cfg.run_dir) / "goodput.json").read_text())
    assert doc["attempts"][-1]["status"] == "preempted" and doc["attempts"][-1]["step"] == 5
    s = train(cfg)  # the requeued job
    assert s["resumed_from"] == 5 and s["final_step"] == 12
