"""``trainer.sdc`` in one process (the Runner in-process, real DCP checkpoints): with ``replay`` every sampled step is
taken twice and compared bitwise; a fault in one computation of a step is found, undone by a rollback, and the run
ends as the clean one. Without replicas and without ``replay`` nothing is compared, and a run says so. Bad input is
one line naming the key."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from conftest import final_losses, read_jsonl, refused, train
from recipe.vision import SmallCNN

RUN = ["trainer.max_steps=12", "trainer.eval_every_steps=null", "ckpt=sync_dcp", "ckpt.interval_steps=2"]


class FaultyOnce(SmallCNN):
    """The quick start's model, whose training forward number ``faulty`` (or each of a list of them) comes out wrong in
    one element: a fault of the core that computed it."""

    def __init__(self, faulty: Any = 0, **kw):
        super().__init__(**kw)
        self.faulty, self.forwards = {faulty} if isinstance(faulty, int) else {int(f) for f in faulty}, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.training:
            self.forwards += 1
            if self.forwards in self.faulty:
                out = out.clone()
                out[0, 0] = out[0, 0] * 2
        return out


def _faulty(forwards: int | str) -> list[str]:
    return [f"model._target_={__name__}.FaultyOnce", f"+model.faulty={forwards}"]


def test_a_replayed_step_that_computes_the_same_changes_nothing(make_cfg):
    plain = train(make_cfg(*RUN, "trainer.sdc.replay=false"))
    assert plain["sdc"]["checks"] == 0 and plain["sdc"]["covered"].startswith("nothing: one process")
    cfg = make_cfg(*RUN, "trainer.sdc.replay=true", "trainer.sdc.interval=3", "run_dir=${paths.output_dir}/r")
    s = train(cfg)
    assert s["sdc"]["checks"] == 4 and s["sdc"]["found"] == []  # (steps 3, 6, 9, 12)
    assert s["params_sha256"] == plain["params_sha256"]  # (the replay leaves the run as it was, bitwise)
    assert s["goodput"]["totals"]["sdc"] > 0 and not os.path.exists(os.path.join(cfg.run_dir, "suspects.json"))


def test_a_fault_in_one_computation_of_a_sampled_step_is_found_and_undone(make_cfg):
    clean_cfg = make_cfg(*RUN, *_faulty(0))
    clean = train(clean_cfg)
    # forwards: steps 1-3, step 3 again (its replay), steps 4-5, then step 6's first computation: the 7th
    cfg = make_cfg(
        *RUN, *_faulty(7), "trainer.sdc.replay=true", "trainer.sdc.interval=3", "run_dir=${paths.output_dir}/f"
    )
    s = train(cfg)
    (found,) = s["sdc"]["found"]
    # step 6's first computation was wrong: its replay differs; back to the checkpoint of step 4 (6 may hold it)
    assert found["step"] == 6 and found["ranks"] == [0] and found["rolled_back_to"] == 4
    assert s["params_sha256"] == clean["params_sha256"] and final_losses(cfg.run_dir) == final_losses(clean_cfg.run_dir)
    (suspect,) = json.loads(open(os.path.join(cfg.run_dir, "suspects.json")).read())["suspects"]
    assert suspect["rank"] == 0 and suspect["step"] == 6 and "two computations" in suspect["how"]
    assert [r["step"] for r in read_jsonl(os.path.join(cfg.run_dir, "metrics.jsonl")) if r.get("event") == "sdc"] == [6]
    assert s["goodput"]["totals"]["sdc"] > s["sdc"]["check_seconds"]  # (the rollback and steps 5, 6 again too)


def test_a_fault_that_comes_back_at_the_same_step_after_its_rollback_stops_the_run_in_one_line(make_cfg):
    from pitstop.errors import Unrecoverable

    # step 6's first computation is wrong (the 7th forward), and again after the rollback to step 4: steps 5 and 6
    # are the 9th and 10th forwards then (the 8th was step 6's replay)
    cfg = make_cfg(*RUN, *_faulty("[7,10]"), "trainer.sdc.replay=true", "trainer.sdc.interval=3")
    with pytest.raises(Unrecoverable) as e:
        train(cfg)
    assert str(e.value).startswith("silent data corruption at step 6 again after rolling back: rank(s) 0")
    assert "\n" not in str(e.value)
    suspects = json.loads(open(os.path.join(cfg.run_dir, "suspects.json")).read())["suspects"]
    assert [(s["rank"], s["step"]) for s in suspects] == [(0, 6), (0, 6)]


def test_a_bitflip_aimed_at_a_rank_that_does_not_exist_is_one_line(make_cfg):
    message = refused(make_cfg("fault=bitflip", "fault.step=3", "fault.rank=2"))
    assert message.startswith("fault.rank=2 but the job has 1 rank(s); use 0..0")
    message = refused(make_cfg("fault=bitflip", "fault.step=3", "fault.bit=8"))
    assert message.startswith("fault.bit=8 but ") and "use 0..7" in message
