"""Numbers that go wrong in one replica group of strategy=ft, real processes (a torchft Lighthouse, a supervisor per
group, gloo): a NaN in one group's loss is skipped by every group at the same step; a flipped bit in one group's
parameters is found by the groups' digests at the next check, the odd group named, the job rolled back and ended
with the parameters of the uninterrupted job, bitwise."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from conftest import PY, cli, read_jsonl, run_cmd

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="needs torchft: pip install -e '.[ft]'"),
]

FT = ["strategy=ft", "debug=tiny", "data.record_sample_ids=true", "trainer.eval_every_steps=null"]


def group_summary(run: Path, k: int) -> dict:
    return json.loads((run / f"replica{k}" / "summary.json").read_text())


def test_a_nan_in_one_group_is_skipped_by_every_group_at_the_same_step(data_root, tmp_path):
    """The loss of step 5 is NaN in group 1 only: the groups' all-reduce makes its gradients NaN in group 0 too, so
    both skip step 5 (no restart, the audit clean), and the job ends as the one whose loss of step 5 is NaN in every
    group: the same step skipped, the same data skipped, the same parameters, bitwise."""
    runs = {}
    for name, aimed in (("one", ["fault.replica=1"]), ("every", [])):
        run = tmp_path / name / "run"
        args = [*FT, "strategy.min_replicas=2", "trainer.max_steps=12", "fault=nonfinite", "fault.step=5", *aimed]
        p = cli([*args, f"run_dir={run}"], data_root, tmp_path / name)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[name] = run
    run = runs["one"]
    digests = set()
    for k in (0, 1):
        s = group_summary(run, k)
        assert s["final_step"] == 12 and s["goodput"]["restarts"] == 0, k
        assert s["instability"] == {"skipped_steps": 1, "rollbacks": 0, "quarantined": []}, k
        assert [r["skip"] for r in read_jsonl(run / f"replica{k}" / "samples.rank0.jsonl") if "skip" in r] == [5]
        digests.add(s["params_sha256"])
        digests.add(group_summary(runs["every"], k)["params_sha256"])
    assert len(digests) == 1, digests  # (both groups of both jobs)
    assert "the loss of step 5 is NaN" in (run / "replica1" / "train.log").read_text()
    assert "the loss of step 5 is NaN" not in (run / "replica0" / "train.log").read_text()  # (group 0's loss: finite)
    audit = run_cmd([PY, "-m", "pitstop.audit", str(run)])
    assert audit.returncode == 0 and "every sample exactly once" in audit.stdout, audit.stdout + audit.stderr


K = 4  # trainer.sdc.interval
SDC = [*FT, "strategy.replicas=3", "strategy.min_replicas=3", "strategy.oversubscribe=true",
       "trainer.max_steps=16", "ckpt=sync_save", "ckpt.interval_steps=3",
       "ckpt.keep_last_k=1", f"trainer.sdc.interval={K}"]  # fmt: skip


def test_a_flipped_bit_in_one_of_three_groups_is_named_undone_and_the_job_ends_as_the_uninterrupted_one(
    data_root, tmp_path
):
    """After step 5 an exponent bit of group 2's first parameter flips (fault.replica=2). The groups compare their
    digests at the quorum every K committed steps: step 8 differs, group 2 is the odd one out of three, and every
    group rolls back to the job's newest checkpoint at or before step 4 (the last check that agreed: step 3's, not
    6's, which may hold the flip) and takes steps 4..8 again; the job ends with the uninterrupted job's parameters."""
    runs = {}
    for name, fault in (("clean", []), ("flip", ["fault=bitflip", "fault.step=5", "fault.replica=2"])):
        run = tmp_path / name / "run"
        p = cli([*SDC, *fault, f"run_dir={run}"], data_root, tmp_path / name)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[name] = run
    clean, run = runs["clean"], runs["flip"]
    for k in range(3):
        s = group_summary(clean, k)
        assert s["sdc"]["covered"] == "parameters and optimizer state of 3 replica groups"
        assert s["sdc"]["checks"] == 16 // K and s["sdc"]["found"] == [], k  # (steps 4, 8, 12, 16)
        assert not (clean / f"replica{k}" / "suspects.json").exists()
    reference = group_summary(clean, 0)["params_sha256"]
    for k in range(3):
        s = group_summary(run, k)
        (found,) = s["sdc"]["found"]
        assert found["step"] == 8 and 8 - 5 <= K and found["replicas"] == [2] and found["rolled_back_to"] == 3, k
        assert found["tensors"][0].endswith("weight")
        (suspect,) = json.loads((run / f"replica{k}" / "suspects.json").read_text())["suspects"]
        assert suspect["replica"] == 2 and suspect["step"] == 8 and suspect["host"], k
        assert suspect["how"] == "the odd one out of 3 replica groups"
        assert s["final_step"] == 16 and s["goodput"]["restarts"] == 0 and s["goodput"]["totals"]["sdc"] > 0
        assert [r["step"] for r in read_jsonl(run / f"replica{k}" / "metrics.jsonl") if r.get("event") == "sdc"] == [8]
        assert s["params_sha256"] == group_summary(clean, k)["params_sha256"] == reference, k  # undone, bitwise
    text = (run / "replica0" / "train.log").read_text()
    assert "silent data corruption at step 8: replica group(s) 2 differ from the other 2 replica groups" in text
    assert [json.loads(x)["key"] for x in (run / "replica2" / "faults.jsonl").read_text().splitlines()] == ["bitflip@5"]
    assert not (run / "replica0" / "faults.jsonl").exists()  # (aimed at group 2 alone)
    assert "removed checkpoint" in text and "step_00000006: its steps were rolled back to step 3" in text
