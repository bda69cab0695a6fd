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
SDC = [*FT, "strategy.oversubscribe=true", "trainer.max_steps=16", "ckpt=sync_save", "ckpt.interval_steps=3",
       "ckpt.keep_last_k=1", f"trainer.sdc.interval={K}"]  # fmt: skip


TWO = ("its parameters at this step were far from the replay's", "was on replica group(s) [1] (named by the replay")
THREE = ("the odd one out of 3 replica groups", "replica group(s) 2 differ from the other 2 replica groups")


@pytest.mark.parametrize("groups,how,said", [(3, *THREE), (2, *TWO)], ids=["three_groups", "two_groups"])
def test_a_flipped_bit_in_one_group_is_named_undone_and_the_job_ends_as_the_uninterrupted_one(
    groups, how, said, data_root, tmp_path
):
    """After step 5 an exponent bit of the last group's first parameter flips (fault.replica). The groups compare
    their digests in the quorum every K committed steps: step 8 differs; of three groups the odd one is named at once,
    of two the replay of steps 4..8 names it. Every group rolls back to the job's newest checkpoint at or before step
    4 (the last check that agreed: step 3's, not 6's, which may hold the flip) and takes steps 4..8 again; the job ends
    with the uninterrupted job's parameters, bitwise (every step has every group: strategy.min_replicas)."""
    victim, runs = groups - 1, {}
    job = [*SDC, f"strategy.replicas={groups}", f"strategy.min_replicas={groups}"]
    for name, fault in (("clean", []), ("flip", ["fault=bitflip", "fault.step=5", f"fault.replica={victim}"])):
        run = tmp_path / name / "run"
        p = cli([*job, *fault, f"run_dir={run}"], data_root, tmp_path / name)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[name] = run
    clean, run = runs["clean"], runs["flip"]
    reference = group_summary(clean, 0)["params_sha256"]
    for k in range(groups):
        s = group_summary(clean, k)
        assert s["sdc"]["covered"] == f"parameters and optimizer state of {groups} replica groups"
        assert s["sdc"]["checks"] == 16 // K and s["sdc"]["found"] == [], k  # (steps 4, 8, 12, 16)
        assert not (clean / f"replica{k}" / "suspects.json").exists()
        s = group_summary(run, k)
        (found,) = s["sdc"]["found"]
        assert found["step"] == 8 and 8 - 5 <= K and found["replicas"] == [victim] and found["rolled_back_to"] == 3
        assert found["tensors"][0].endswith("weight")
        (suspect,) = json.loads((run / f"replica{k}" / "suspects.json").read_text())["suspects"]
        assert suspect["replica"] == victim and suspect["step"] == 8 and suspect["host"], k
        assert suspect["how"].startswith(how)
        assert s["final_step"] == 16 and s["goodput"]["restarts"] == 0 and s["goodput"]["totals"]["sdc"] > 0
        assert [r["step"] for r in read_jsonl(run / f"replica{k}" / "metrics.jsonl") if r.get("event") == "sdc"] == [8]
        assert s["params_sha256"] == group_summary(clean, k)["params_sha256"] == reference, k  # undone, bitwise
    text = (run / "replica0" / "train.log").read_text()
    assert "silent data corruption at step 8" in text and said in text
    assert "step_00000006: its steps were rolled back to step 3" in text  # (removed by the group that writes them)
    faults = (run / f"replica{victim}" / "faults.jsonl").read_text().splitlines()
    assert [json.loads(x)["key"] for x in faults] == ["bitflip@5"]
    assert not (run / "replica0" / "faults.jsonl").exists()  # (aimed at one group alone)
    audit = run_cmd([PY, "-m", "pitstop.audit", str(run)])
    assert audit.returncode == 0 and "every sample exactly once" in audit.stdout, audit.stdout + audit.stderr
