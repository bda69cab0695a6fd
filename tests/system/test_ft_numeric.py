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
        p = cli([*FT, "trainer.max_steps=12", "fault=nonfinite", "fault.step=5", *aimed, f"run_dir={run}"], data_root,
                tmp_path / name)  # fmt: skip
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
