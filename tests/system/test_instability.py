"""trainer.instability under the launchers, as a user runs it: a NaN on one rank of ddp(2) is skipped on every rank
with no restart and the quick start still reaches its accuracy floor; a diverging run (optim.lr=1e6) stops in one
line, exit status 2, with restarts left unused; a rollback's skip is honoured after a kill -9 and a restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PY, cli, cli_cmd, popen_cmd, read_jsonl, run_cmd, tiny_cfg, train
from manual import assert_shows, page_output

pytestmark = pytest.mark.slow

QUICK_START_FLOOR = 0.97  # (README: the quick start reaches at least 97% validation accuracy)


def _audit(run_dir: Path) -> str:
    p = run_cmd([PY, "-m", "pitstop.audit", str(run_dir)])
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_a_nan_on_one_rank_of_ddp_is_skipped_on_every_rank_and_the_quick_start_reaches_its_floor(data_root, tmp_path):
    run_dir = tmp_path / "run"
    args = ["logger=none", "strategy=ddp", "strategy.max_restarts=2", "fault=nonfinite", "fault.step=100",
            "fault.rank=1", "data.record_sample_ids=true", f"run_dir={run_dir}"]  # fmt: skip
    p = cli(args, data_root, tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["metrics"]["val_accuracy"] >= QUICK_START_FLOOR, summary["metrics"]
    assert summary["instability"] == {"skipped_steps": 1, "rollbacks": 0, "quarantined": []}
    assert summary["goodput"]["restarts"] == 0 and summary["goodput"]["totals"]["instability"] > 0
    for rank in (0, 1):  # the step is skipped on both ranks, the NaN was on rank 1's loss only
        skips = [r for r in read_jsonl(run_dir / f"samples.rank{rank}.jsonl") if "skip" in r]
        assert [r["skip"] for r in skips] == [100], rank
    out = _audit(run_dir)
    assert "every sample exactly once" in out and " skipped " in out.splitlines()[0]
    # (the manual shows this run: its command is the page's, but for logger=none, restarts and the paths)
    assert_shows(page_output("fault=nonfinite fault.step=100"), p.stdout + p.stderr, "a NaN once, ddp(2)")
    assert_shows(page_output("pitstop.audit outputs/runs/nan"), out, "the audit of a run with a skipped step")


def test_a_diverging_run_stops_in_one_line_with_exit_status_2_and_no_restart(data_root, tmp_path):
    run_dir = tmp_path / "run"
    args = ["debug=tiny", "optim.lr=1e6", "ckpt=sync_dcp", "ckpt.interval_steps=2", "trainer.max_restarts=3",
            f"run_dir={run_dir}"]  # fmt: skip
    p = cli(args, data_root, tmp_path)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2, p.stderr[-3000:]
    assert last.startswith("error: training is unstable: non-finite loss, gradient norm or buffer at step 4"), last
    assert "after 2 rollback(s) (max_rollbacks=2)" in last
    assert_shows(page_output("optim.lr=1e6"), p.stdout + p.stderr, "a run that diverges")
    assert len(json.loads((run_dir / "goodput.json").read_text())["attempts"]) == 1  # (3 restarts left unused)
    assert run_cmd([PY, "-m", "pitstop.ckpt.verify", str(run_dir)]).returncode == 0
    assert not (run_dir / "summary.json").exists()


def test_the_data_a_rollback_skipped_stays_skipped_after_a_kill_and_a_restart(data_root, tmp_path):
    """Step 4 saved by a first run; the second (to step 60, no save before its last) meets a poisoned sample at step
    6, rolls back to step 4 at once keeping its data position, and is killed (-9) when metrics.jsonl says so. The
    restart resumes from step 4 with that position (RUN_DIR/instability.json), and ends with the parameters of the
    same run not killed, bitwise."""
    peek = train(tiny_cfg(data_root, tmp_path / "peek", "trainer.max_steps=6", "data.record_sample_ids=true"))
    assert peek["final_step"] == 6
    key = read_jsonl(tmp_path / "peek" / "run" / "samples.rank0.jsonl")[6]["keys"][0]  # a sample of step 6
    first = ["debug=tiny", "ckpt=sync_save", "trainer.max_steps=4", "data.record_sample_ids=true"]
    second = ["debug=tiny", "ckpt=sync_save", "trainer.max_steps=60", "ckpt.interval_steps=1000",
              "data.record_sample_ids=true", "fault=poison", f"fault.sample={key}", "trainer.instability.max_skips=0",
              "trainer.instability.quarantine=false"]  # fmt: skip
    dirs = {}
    for name in ("whole", "killed"):
        tmp = tmp_path / name
        dirs[name] = tmp / "run"
        assert train(tiny_cfg(data_root, tmp, *first[1:]))["final_step"] == 4
    ref = train(tiny_cfg(data_root, tmp_path / "whole", *second[1:]))
    assert ref["instability"]["rollbacks"] == 1 and ref["final_step"] == 60

    run_dir = dirs["killed"]
    cmd = cli_cmd([*second, f"run_dir={run_dir}"], data_root, tmp_path / "killed")
    proc = popen_cmd(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 120
    while not (metrics.exists() and '"event":"rollback"' in metrics.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its rollback"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000004"]  # (killed before a save)
    assert list(json.loads((run_dir / "instability.json").read_text())["skips"]) == ["4"]
    p = cli([*second, f"run_dir={run_dir}"], data_root, tmp_path / "killed")
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["resumed_from"] == 4 and s["final_step"] == 60
    assert s["params_sha256"] == ref["params_sha256"]
    assert _audit(run_dir).splitlines()[1:] == _audit(dirs["whole"]).splitlines()[1:]
