"""Silent data corruption under ddp(2), real ranks (gloo on CPU), real DCP checkpoints: a flipped exponent bit in
rank 1's parameters is found at the next check, the rank named and recorded, the run rolled back to a checkpoint
from before it and trained on to the end, with the parameters of the uninterrupted run, bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import cli, final_losses, read_jsonl
from manual import assert_shows, page_output

pytestmark = pytest.mark.slow  # real ranks in subprocesses

K = 4  # trainer.sdc.interval
RUN = [
    "debug=tiny",
    "strategy=ddp",
    "trainer.max_steps=16",
    "trainer.eval_every_steps=null",
    "ckpt=sync_dcp",
    "ckpt.interval_steps=3",
    "ckpt.keep_last_k=1",  # (retention keeps the checkpoint a rollback needs: the newest at or before the last check)
    f"trainer.sdc.interval={K}",
]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def clean(data_root, tmp_path_factory):
    """The uninterrupted run, checked every K steps: it reports no corruption."""
    tmp = tmp_path_factory.mktemp("sdc_clean")
    p = cli([*RUN, f"run_dir={tmp / 'run'}"], data_root, tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    return tmp / "run"


def test_a_clean_run_compares_the_replicas_and_finds_nothing(clean):
    s = summary(clean)
    assert s["sdc"]["covered"] == "parameters and optimizer state of 2 replicas"
    assert s["sdc"]["checks"] == 16 // K and s["sdc"]["found"] == []  # (steps 4, 8, 12, 16: the last one too)
    assert not (clean / "suspects.json").exists()
    assert not [r for r in read_jsonl(clean / "metrics.jsonl") if r.get("event") == "sdc"]


def test_a_flipped_bit_on_rank_1_is_named_undone_and_the_run_ends_as_the_uninterrupted_one(data_root, tmp_path, clean):
    run_dir = tmp_path / "run"
    p = cli([*RUN, "fault=bitflip", "fault.step=5", "fault.rank=1", f"run_dir={run_dir}"], data_root, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    s = summary(run_dir)
    # Found at the first check after the flip (step 8, within K steps of step 5), rolled back to the newest
    # checkpoint at or before the last step that agreed (4): step 3's (6's may hold the corruption).
    (found,) = s["sdc"]["found"]
    assert found["step"] == 8 and found["rolled_back_to"] == 3 and 8 - 5 <= K
    assert found["ranks"] == [1] and found["tensors"][0].endswith("weight")  # (two ranks: named by the replay)
    log = (run_dir / "train.log").read_text()
    assert "silent data corruption at step 8" in log and "was on rank(s) [1]" in log
    assert_shows(page_output("run_dir=outputs/runs/sdc"), p.stdout + p.stderr, "a flipped bit (the page: 60 steps)")
    (suspect,) = json.loads((run_dir / "suspects.json").read_text())["suspects"]
    assert suspect["rank"] == 1 and suspect["step"] == 8 and suspect["host"]
    # Undone: the same parameters and the same losses as the uninterrupted run, bitwise; the flip happened once.
    assert s["params_sha256"] == summary(clean)["params_sha256"]
    assert final_losses(run_dir) == final_losses(clean)
    assert [json.loads(line)["key"] for line in (run_dir / "faults.jsonl").read_text().splitlines()] == ["bitflip@5"]
    # Booked: the checks, the rollback's restore and the steps 4..8 taken again, more than the checks alone.
    totals = json.loads((run_dir / "goodput.json").read_text())["totals"]
    assert totals["sdc"] > s["sdc"]["check_seconds"] > 0 and s["goodput"]["totals"]["sdc"] == totals["sdc"]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("event") == "sdc"] == [8]


def test_with_three_ranks_the_odd_one_out_is_named_at_once(data_root, tmp_path):
    run_dir = tmp_path / "run"
    three = ["strategy.nproc_per_node=3", "strategy.oversubscribe=true"]
    p = cli([*RUN, *three, "fault=bitflip", "fault.step=5", "fault.rank=2", f"run_dir={run_dir}"], data_root, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    (found,) = summary(run_dir)["sdc"]["found"]  # (after the rollback every check agreed)
    assert found["step"] == 8 and found["ranks"] == [2] and found["rolled_back_to"] == 3
    assert "rank(s) 2 differ from the other 2 replicas" in (run_dir / "train.log").read_text()
    (suspect,) = json.loads((run_dir / "suspects.json").read_text())["suspects"]
    assert suspect["rank"] == 2 and suspect["how"] == "the odd one out of 3 replicas" and suspect["world_size"] == 3
