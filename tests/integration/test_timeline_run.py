"""A real run's time line (pitstop.goodput.timeline), read from the files the run wrote: two attempts in one run dir
(the second resumes from the first's checkpoint), with evaluations, saves and a skipped step. What the picture
plots is checked, not its pixels: every stretch lies inside its attempt, in time order, none over another; each
step's data wait sits right before its compute, where it happened (as many as the steps that waited, spread over
the run); evaluations and saves follow their step; and the stretches add up to the ledger's own buckets."""

from __future__ import annotations

import json

import pytest

from conftest import train

pytestmark = pytest.mark.slow  # (two tiny runs in-process)
MS = 0.002  # (``time`` in metrics.jsonl is written rounded to the millisecond)


def test_a_real_runs_time_line_puts_each_stretch_where_it_happened(make_cfg):
    from pitstop.goodput.timeline import read
    from pitstop.goodput.timeline_draw import _legend

    common = ["ckpt=sync_save", "ckpt.interval_steps=4", "trainer.eval_every_steps=6"]
    first = make_cfg(*common, "trainer.max_steps=8", "fault=nonfinite", "fault.step=3")
    train(first)
    train(make_cfg(*common, "trainer.max_steps=16", f"run_dir={first.run_dir}"))  # (resumes from step 8)

    line = read(first.run_dir)
    records = [json.loads(r) for r in open(f"{first.run_dir}/metrics.jsonl")]
    steps = [r for r in records if "loss" in r]
    with open(f"{first.run_dir}/goodput.json") as f:
        ledger = json.load(f)["attempts"]
    assert [(a.status, a.resumed_from, a.last_step) for a in line.attempts] == [("finished", None, 8),
                                                                               ("finished", 8, 16)]  # fmt: skip
    for a in line.attempts:
        own = [s for s in line.spans if s.attempt == a.number and s.what != "recovery_gap"]
        assert all(a.start - MS <= s.start and s.end <= a.end + MS for s in own)  # inside its attempt
        for before, after in zip(own, own[1:]):  # in time order, none over another
            assert after.start >= before.end - MS, (before, after)
    waits = [s for s in line.spans if s.what == "data_wait"]
    computes = [s for s in line.spans if s.what == "compute"]
    assert len(computes) == len(steps) and len(waits) == sum(r["fetch_seconds"] > 0 for r in steps)
    assert len(waits) > 10 and waits[0].start < computes[5].start < waits[-1].start  # spread over the run
    assert all(any(abs(w.end - c.start) < 1e-6 for c in computes) for w in waits)  # each right before its compute
    # the stretches drawn add up to the ledger's buckets (the same measured seconds, placed)
    for bucket in ("data_wait", "compute"):
        drawn = sum(s.end - s.start for s in line.spans if s.what == bucket)
        assert drawn == pytest.approx(sum(a["buckets"][bucket] for a in ledger), abs=0.01), bucket
    evals = [s for s in line.spans if s.what == "eval"]
    assert len(evals) == len(line.evals) >= 2  # (steps 6, 8 and 12, 16: each after its step's line)
    assert all(e.end > e.start and any(abs(e.start - c.end) < 1e-6 for c in computes) for e in evals)
    assert [s.what for s in line.spans].count("instability") == 1 == len(line.skips)
    saves = [s for s in line.spans if s.what == "checkpoint"]
    assert len(saves) == len(line.saves) and all(s.end > s.start for s in saves)
    shown = {h.get_label() for h in _legend([line], {})}
    assert {"compute", "evaluation", "checkpoint (blocking)", "step skipped (instability)"} <= shown
    assert not shown & {"quorum", "discarded", "sdc", "straggler"}  # (only what the picture shows)
