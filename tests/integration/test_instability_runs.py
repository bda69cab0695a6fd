"""trainer.instability through a real Runner: a transient non-finite loss (fault=nonfinite) is skipped and the run
goes on; a sample that is non-finite every time it is seen (fault=poison) is found and quarantined, the audit clean;
a diverging run (optim.lr=1e6) stops in one line after its budgets, with no checkpoint of a NaN written; bad fault
keys are one line before anything runs. The kill -9 and launcher versions are in tests/system/test_instability.py."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from conftest import read_jsonl, refused, train
from manual import assert_shows, page_output
from pitstop.audit import audit, main as audit_main
from pitstop.ckpt.verify import main as verify_main
from pitstop.train.instability import InstabilityStop

RUN = ["ckpt=sync_save", "ckpt.interval_steps=4", "data.record_sample_ids=true"]  # (debug=tiny: 12 steps of 16)


def _steps(run_dir) -> list[dict]:
    return [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "loss" in r]


def _instability_seconds(run_dir) -> float:
    return json.loads((Path(run_dir) / "goodput.json").read_text())["totals"]["instability"]


def _no_checkpoint_holds_a_nan(run_dir) -> None:
    ckpts = sorted((Path(run_dir) / "checkpoints").glob("step_*"))
    assert verify_main([str(Path(run_dir) / "checkpoints")]) == 0
    for c in ckpts:
        state = torch.load(c / "state.pt", weights_only=True)
        tensors = [t for part in ("model", "optim") for t in _tensors(state[part])]
        assert tensors and all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point()), c


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def test_a_non_finite_loss_is_skipped_on_its_step_and_the_run_goes_on(make_cfg, tmp_path):
    clean = train(make_cfg(*RUN, f"run_dir={tmp_path / 'clean'}"))
    cfg = make_cfg(*RUN, "fault=nonfinite", "fault.step=5")
    s = train(cfg)
    assert s["final_step"] == 12 and s["instability"] == {"skipped_steps": 1, "rollbacks": 0, "quarantined": []}
    assert s["goodput"]["restarts"] == 0 and _instability_seconds(cfg.run_dir) > 0
    steps = _steps(cfg.run_dir)
    assert [r["step"] for r in steps] == list(range(1, 13)) and all(math.isfinite(r["loss"]) for r in steps)
    # the update of the skipped step was not applied: the LR schedule did not move (every step's LR is the clean
    # run's), the parameters stayed finite, and the batch after it is step 5's
    assert [r["lr"] for r in steps] == [r["lr"] for r in _steps(tmp_path / "clean")]
    events = [r for r in read_jsonl(Path(cfg.run_dir) / "metrics.jsonl") if r.get("event") == "skip"]
    assert [(e["step"], e["value"]) for e in events] == [(5, "nan")]
    (epoch,) = audit(cfg.run_dir)
    assert (epoch.once, epoch.skipped, epoch.repeated) == (12 * 16, 16, 0)  # the skipped batch: never consumed
    assert s["params_sha256"] != clean["params_sha256"]  # (it took one batch more: not the clean run)
    _no_checkpoint_holds_a_nan(cfg.run_dir)


def test_a_skipped_last_step_ends_the_epochs_one_step_early_and_that_step_is_saved(make_cfg):
    """The epoch's last (partial) batch is the one skipped: the run ends one step early, its last step saved."""
    cfg = make_cfg(*RUN, "trainer.max_steps=null", "trainer.epochs=1", "trainer.batch_size=64",
                   "ckpt.interval_steps=100", "fault=nonfinite", "fault.step=23")  # fmt: skip
    s = train(cfg)
    assert s["final_step"] == s["total_steps"] == 22 and s["instability"]["skipped_steps"] == 1
    assert sorted(p.name for p in (Path(cfg.run_dir) / "checkpoints").iterdir()) == ["step_00000022"]
    (epoch,) = audit(cfg.run_dir)
    assert (epoch.once, epoch.skipped, epoch.repeated, epoch.missing) == (22 * 64, 1438 - 22 * 64, 0, 0)


def test_a_poisoned_sample_is_quarantined_and_every_other_sample_is_taken_once_per_epoch(
    make_cfg, tmp_path, caplog, capsys
):
    first = make_cfg(*RUN, "trainer.max_steps=1", "trainer.batch_size=64", f"run_dir={tmp_path / 'peek'}")
    train(first)
    key = read_jsonl(Path(first.run_dir) / "samples.rank0.jsonl")[1]["keys"][7]  # a sample of the first batch
    cfg = make_cfg(*RUN, "trainer.max_steps=null", "trainer.epochs=2", "trainer.batch_size=64",
                   "trainer.eval_every_steps=null", "fault=poison", f"fault.sample={key}")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="pitstop"):
        s = train(cfg)
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert_shows(page_output("fault=poison"), said, "a bad record (wrong-without-crashing)")
    assert s["instability"] == {"skipped_steps": 1, "rollbacks": 0, "quarantined": [key]}
    assert s["goodput"]["restarts"] == 0 and s["epoch"] == 1 and _instability_seconds(cfg.run_dir) > 0
    assert json.loads((Path(cfg.run_dir) / "instability.json").read_text())["quarantined"] == [key]
    e0, e1 = audit(cfg.run_dir)
    assert (e0.once, e0.skipped, e0.quarantined, e0.repeated, e0.missing) == (1438 - 64, 64, 0, 0, 0)
    assert (e1.once, e1.skipped, e1.quarantined, e1.repeated, e1.missing) == (1437, 0, 1, 0, 0)
    fed = [k for r in read_jsonl(Path(cfg.run_dir) / "samples.rank0.jsonl") if "keys" in r for k in r["keys"]]
    assert fed.count(key) == 1  # seen once, in the batch whose step was skipped; never fed again
    capsys.readouterr()
    assert audit_main([str(cfg.run_dir)]) == 0
    assert_shows(page_output("pitstop.audit outputs/runs/poison"), capsys.readouterr().out, "the audit of a quarantine")
    _no_checkpoint_holds_a_nan(cfg.run_dir)


def test_a_diverging_run_stops_in_one_line_after_its_budgets_and_no_checkpoint_holds_a_nan(make_cfg):
    cfg = make_cfg(*RUN, "optim.lr=1e6", "ckpt.interval_steps=2")
    with pytest.raises(InstabilityStop) as e:
        train(cfg)
    line = str(e.value)
    # (step 3's update leaves BatchNorm's statistics non-finite in step 4's forward: step 4 is never applied)
    assert "\n" not in line and line.startswith(
        "training is unstable: non-finite loss, gradient norm or buffer at step 4"
    )
    assert "after 2 rollback(s) (max_rollbacks=2)" in line and "the last step's samples (this rank): " in line
    state = json.loads((Path(cfg.run_dir) / "instability.json").read_text())
    assert state["rollbacks"] == 2 and list(state["skips"]) == ["2"] and state["quarantined"] == []
    assert sorted(p.name for p in (Path(cfg.run_dir) / "checkpoints").iterdir()) == ["step_00000002"]
    _no_checkpoint_holds_a_nan(cfg.run_dir)
    (epoch,) = audit(cfg.run_dir)
    assert epoch.repeated == 0 and epoch.once == 3 * 16  # steps 1..3 of the last try; every other batch skipped


@pytest.mark.parametrize(
    "overrides, said",
    [
        (["fault=poison", "fault.sample=no-such-sample"], "fault.sample='no-such-sample' is no sample of the"),
        (["fault=nonfinite", "fault.step=5", "fault.rank=3"], "fault.rank=3 but the job has 1 rank(s)"),
        (["fault=nonfinite", "fault.step=99"], "fault.step=99 is not a step of this run (1..12)"),
        (["trainer.instability.spike_window=1"], "trainer.instability.spike_window must be an integer >= 2"),
        (["trainer.instability.on_instability=retry"], "trainer.instability.on_instability must be 'rollback' or"),
    ],
)
def test_bad_instability_and_fault_keys_are_one_line_before_anything_runs(make_cfg, overrides, said):
    cfg = make_cfg(*RUN, *overrides)
    assert said in refused(cfg)
    assert not (Path(cfg.run_dir) / "metrics.jsonl").exists() or not _steps(cfg.run_dir)
