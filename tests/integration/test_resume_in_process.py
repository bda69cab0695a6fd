"""The mission, guarded in the fast tier: a resume is exact, and refuses what it must, without a subprocess.

The kill -9 versions of these live in the system tier (tests/system/test_ckpt.py); here the interruption is a
preemption notice the run sends itself (``fault=preempt``): the Runner saves that step and stops, and a new
Runner in the same run dir resumes. Each test fails on a planted bug of its kind: a resume that does not
restore the loader's position, the RNGs or the LR schedule (different parameters), one that accepts a changed
seed, a fallback that takes a corrupt checkpoint, retention that keeps the wrong ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import final_losses as losses, train
from pitstop.errors import FingerprintMismatch
from pitstop.resilience.preempt import Preempted

# 30 steps of 16 with 2 data workers: the notice at step 17 is mid-epoch (1438 training samples: ~90 steps an
# epoch), so the loader's position and each worker's stream matter; the LR schedule is mid-decay and dropout
# draws from the torch RNG.
RUN = ["trainer.max_steps=30", "loader.num_workers=2", "trainer.eval_every_steps=15"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_root):
    from conftest import compose_cfg

    tmp = tmp_path_factory.mktemp("ref")
    cfg = compose_cfg(
        [f"paths.data_dir={data_root / 'data'}", f"paths.output_dir={tmp / 'out'}", f"run_dir={tmp / 'run'}",
         "debug=tiny", *RUN, "ckpt=none"],
        tmp,
    )  # fmt: skip
    s = train(cfg)
    return s["params_sha256"], losses(cfg.run_dir)


@pytest.mark.parametrize("backend", ["sync_save", "async_dcp"])
def test_a_preempted_run_resumes_in_process_to_the_uninterrupted_parameters(backend, make_cfg, uninterrupted):
    cfg = make_cfg(*RUN, f"ckpt={backend}", "ckpt.interval_steps=10", "fault=preempt", "fault.step=17")
    with pytest.raises(Preempted):
        train(cfg)
    doc = json.loads((Path(cfg.run_dir) / "goodput.json").read_text())
    assert doc["attempts"][-1]["status"] == "preempted" and doc["attempts"][-1]["step"] == 17
    s = train(cfg)  # the same config again: resumes from the save of step 17
    assert s["resumed_from"] == 17 and s["final_step"] == 30
    ref_sha, ref_losses = uninterrupted
    assert s["params_sha256"] == ref_sha  # loader position, RNGs, LR schedule and optimizer all restored
    assert losses(cfg.run_dir) == ref_losses  # every step, those after the resume included


def test_a_changed_seed_is_refused_at_resume_and_leaves_the_checkpoints(make_cfg):
    cfg = make_cfg("ckpt=sync_save", "ckpt.interval_steps=6")
    train(cfg)
    saved = sorted(p.name for p in Path(cfg.ckpt.dir).iterdir())
    changed = make_cfg("ckpt=sync_save", "ckpt.interval_steps=6", "seed=1")  # the same run dir
    assert changed.run_dir == cfg.run_dir
    with pytest.raises(FingerprintMismatch) as e:
        train(changed)
    message = str(e.value)
    assert "\n" not in message and "seed" in message and "changed since it was saved" in message
    assert sorted(p.name for p in Path(cfg.ckpt.dir).iterdir()) == saved  # nothing lost


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(make_cfg):
    from pitstop.ckpt import layout

    cfg = make_cfg("ckpt=sync_dcp", "ckpt.interval_steps=4", "ckpt.keep_last_k=0")
    train(cfg)  # saves at 4, 8, 12
    newest = Path(layout.step_dir(cfg.ckpt.dir, 12))
    for f in newest.glob("*.distcp"):
        f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])  # truncated, the marker still there
    s = train(make_cfg("ckpt=sync_dcp", "ckpt.interval_steps=4", "ckpt.keep_last_k=0", "trainer.max_steps=14"))
    assert s["resumed_from"] == 8 and s["final_step"] == 14


def test_retention_keeps_the_newest_k_complete_checkpoints(make_cfg):
    from pitstop.ckpt import layout

    cfg = make_cfg("ckpt=sync_save", "ckpt.interval_steps=2", "ckpt.keep_last_k=2")
    train(cfg)  # saves at 2, 4, ..., 12
    left = sorted(layout.step_of(str(p)) for p in Path(cfg.ckpt.dir).iterdir() if layout.is_complete(str(p)))
    assert left == [10, 12]
