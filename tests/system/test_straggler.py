"""Slow ranks under ddp(2), real ranks (gloo on CPU): ``fault=slow_rank`` makes rank 1's work twice as long from a
step; ``trainer.straggler`` names it within two windows and books the job's wait for it in the ledger, and the same
run without the fault names no one. With ``action=exclude``, two ranks started as SLURM or torchrun would start them
(``RANK`` set, one "node" each): the slow node is recorded as excluded once the step is saved, and its rank exits
``EXCLUDED_EXIT``, the other ``REFORM_EXIT``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from conftest import cli, cli_cmd, popen_cmd, read_jsonl
from manual import assert_shows, page_output
from pitstop.ckpt.layout import is_complete

# real ranks in subprocesses; serial: what they assert is one rank's work against another's, which a neighbour test's
# ranks on the same 2 cores disturb far more than any slowdown a real cluster would not notice (run alone, after the
# parallel part; a CPU hog beside them is still survived: the fault's slowdown is larger than its noise)
pytestmark = [pytest.mark.slow, pytest.mark.serial]

W = 20  # trainer.straggler.window
FROM = 21  # fault.from_step
RUN = [
    "debug=tiny",
    "strategy=ddp",
    "trainer.max_steps=80",
    "trainer.eval_every_steps=null",
    f"trainer.straggler.window={W}",
]
# (twice, not the 1.5: at 1.5 the measured ratio was 1.41-1.78 on this shared machine, near the factor 1.3, and
# once the run after the parallel part named no one; bench/straggler.py measures 1.5 on a quiet machine)
SLOW = ["fault=slow_rank", "fault.rank=1", "fault.factor=2", f"fault.from_step={FROM}"]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def injected(run_dir: Path) -> float:
    lines = [json.loads(x) for x in (run_dir / "faults.jsonl").read_text().splitlines()]
    return sum(r["seconds"] for r in lines if r["key"] == "slow_rank:slept")


def test_a_rank_at_half_speed_is_named_within_two_windows_and_its_wait_booked(data_root, tmp_path):
    run_dir = tmp_path / "run"
    p = cli([*RUN, *SLOW, f"run_dir={run_dir}"], data_root, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    s = summary(run_dir)["straggler"]
    assert s["covered"].startswith("the work of 2 ranks")
    (flag,) = s["flags"]  # (named once: rank 0 never; noise below the factor does not end rank 1's flag)
    assert flag["rank"] == 1 and flag["since"] == FROM and flag["ratio"] > 1.3 and flag["until"] is None
    named = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("event") == "straggler"]
    assert [(r["rank"], r["since"]) for r in named] == [(1, FROM)]
    assert named[0]["step"] <= FROM - 1 + 2 * W  # (within two windows of the slowdown)
    log = (run_dir / "train.log").read_text()
    assert log.count("straggler: rank 1 (node ") == 1 and f"since step {FROM}" in log
    assert_shows(page_output("fault=slow_rank"), p.stdout + p.stderr, "a slow rank (slow-ranks-and-bad-nodes)")
    # Booked: at least half of what rank 1 slept (the others waited that long in the all-reduce), out of compute.
    slept = injected(run_dir)
    totals = json.loads((run_dir / "goodput.json").read_text())["totals"]
    assert slept > 0 and totals["straggler"] >= slept / 2, (totals["straggler"], slept)
    assert totals["straggler"] == pytest.approx(s["seconds"], abs=2e-3)


def test_the_same_run_without_the_fault_names_no_one(data_root, tmp_path):
    run_dir = tmp_path / "run"
    p = cli([*RUN, f"run_dir={run_dir}"], data_root, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    s = summary(run_dir)["straggler"]
    assert s["checked"] == 80 // W and s["flags"] == [] and s["seconds"] == 0
    assert "straggler: rank" not in (run_dir / "train.log").read_text()


def test_exclude_saves_records_the_slow_node_and_its_rank_leaves_as_excluded(data_root, tmp_path):
    run_dir = tmp_path / "run"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [
        "debug=tiny", "strategy=ddp", "strategy.nnodes=2", "strategy.nproc_per_node=1", "strategy.cpu_threads=1",
        "trainer.max_steps=60", "trainer.eval_every_steps=null", "ckpt=sync_dcp", "ckpt.interval_steps=100",
        "trainer.straggler.window=10", "trainer.straggler.action=exclude",
        "trainer.straggler.exclude_after_seconds=0.01", "fault=slow_rank", "fault.rank=1", "fault.factor=3",
        f"run_dir={run_dir}",
    ]  # fmt: skip
    procs = []
    for rank in (0, 1):  # (as SLURM or torchrun starts a rank: RANK set; each its own node)
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PITSTOP_NODE_NAME=f"node-{rank}")
        out = open(tmp_path / f"rank{rank}.out", "w")
        procs.append(popen_cmd(cli_cmd(args, data_root, tmp_path), stdout=out, stderr=subprocess.STDOUT, env=env))
    codes = [p.wait(240) for p in procs]
    assert codes == [78, 77], [(tmp_path / f"rank{r}.out").read_text()[-2000:] for r in (0, 1)]  # REFORM, EXCLUDED
    excluded = json.loads((run_dir / "nodes.json").read_text())["nodes"]
    assert list(excluded) == ["node-1"] and excluded["node-1"]["excluded"]["by"] == "straggler"
    attempt = json.loads((run_dir / "goodput.json").read_text())["attempts"][-1]
    step = attempt["step"]
    assert attempt["status"] == "reformed" and 0 < step < 60 and step % 10 == 0  # (at a window's end)
    # The step it left at is saved and complete (durable before any rank left).
    assert is_complete(str(run_dir / "checkpoints" / f"step_{step:08d}"))
    assert sorted(os.listdir(run_dir / "checkpoints")) == [f"step_{step:08d}"]
    log = (run_dir / "train.log").read_text()
    assert log.count("straggler: node node-1 excluded from the job") == 1
