"""Goodput with real processes: the ledger across real kills and restarts, the fault modes, the supervisor,
ckpt.interval=auto, recipe.goodput's figures and scale projection, preemption notices (a real SIGTERM) and the
sweep report of a real -m run with a failing job.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest

from conftest import PY, cli, read_jsonl, run_cmd
from pitstop.goodput.ledger import JOB_BUCKETS

RUN = [
    "debug=tiny",
    "trainer.max_steps=40",
    "trainer.batch_size=32",
    "loader.num_workers=1",
    "trainer.eval_every_steps=20",
]


def load(run_dir) -> tuple[dict, dict]:
    return (
        json.loads((Path(run_dir) / "summary.json").read_text()),
        json.loads((Path(run_dir) / "goodput.json").read_text()),
    )


def check_account(doc: dict) -> None:
    t = doc["totals"]
    assert math.isclose(sum(t[b] for b in JOB_BUCKETS), t["total"], abs_tol=0.01)
    assert all(t[b] >= 0 for b in JOB_BUCKETS)
    assert math.isclose(doc["goodput"], t["productive"] / t["total"], abs_tol=1e-3)
    # The ledger adds up to the wall clock within 1%: each attempt's own span (its program start to its last
    # record) and, between automatic restarts, the gap; overlapping buckets (a second counted twice) would exceed it
    a = doc["attempts"]
    span = sum(x["end"] - x["start"] for x in a if x.get("end"))
    span += sum(max(0.0, x["start"] - p["end"]) for p, x in zip(a, a[1:]) if x.get("auto_restart") and p.get("end"))
    assert abs(t["total"] - span) <= 0.01 * span + 0.01 * len(a), (t["total"], span)


@pytest.fixture(scope="module")
def reference(data_root, tmp_path_factory):
    """An uninterrupted run: the final parameters every interrupted run must reach exactly."""
    tmp = tmp_path_factory.mktemp("ref")
    p = cli([*RUN, f"run_dir={tmp / 'run'}", "ckpt=none", "trainer.max_steps=120"], data_root, tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    p = cli([*RUN, f"run_dir={tmp / 'run40'}", "ckpt=none"], data_root, tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    return {120: load(tmp / "run")[0]["params_sha256"], 40: load(tmp / "run40")[0]["params_sha256"]}


@pytest.mark.slow
def test_recipe_goodput_prints_the_published_figures():
    def run(*args):
        return run_cmd([PY, "-m", "recipe.goodput", *args], 60)

    p = run("--failures-per-day", "8.6", "--interval", "2h", "30min")
    assert p.returncode == 0, p.stderr
    assert "64.2%" in p.stdout and "91.0%" in p.stdout and "save cost C and restart cost R" in p.stdout
    p = run("--mtbf", "3h", "--save-cost", "60", "--interval", "10min")
    assert p.returncode == 0 and "Young–Daly sqrt(2*C*MTBF) = 19.0 min" in p.stdout, p.stdout
    p = run("--mtbf", "soon")
    assert p.returncode == 2 and "'soon' is not a duration" in p.stderr


@pytest.mark.slow
def test_scale_projection_takes_c_and_r_from_a_real_run(data_root, tmp_path):
    # A real run that saved and restarted once gives C, W and R; projected to N nodes, each failing every 30 days.
    run_dir = tmp_path / "run"
    p = cli(
        [
            *RUN,
            f"run_dir={run_dir}",
            "ckpt=sync_save",
            "ckpt.interval_steps=10",
            "fault=crash_at_step",
            "fault.step=15",
            "trainer.max_restarts=1",
        ],
        data_root,
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    summary, ledger = load(run_dir)
    plot = tmp_path / "scale.png"
    p = run_cmd(
        [
            PY,
            "-m",
            "recipe.goodput",
            "--nodes",
            "1",
            "64",
            "4096",
            "--from",
            str(run_dir),
            "--node-mtbf",
            "30d",
            "--replace-cost",
            "5min",
            "--replace-share",
            "0.5",
            "--plot",
            str(plot),
        ],
        120,
    )
    assert p.returncode == 0, p.stderr
    from pitstop.goodput.model import at_scale, fmt_duration

    c, w, r = (
        summary["checkpoint"]["block_seconds_mean"],
        summary["checkpoint"]["total_seconds_mean"],
        ledger["restart_seconds"],
    )
    assert f"C={fmt_duration(c)} W={fmt_duration(w)} R={fmt_duration(r)} (process restart) from {run_dir}" in p.stdout
    rows = [ln.split() for ln in p.stdout.splitlines() if ln.strip() and ln.split()[0] in ("1", "64", "4096")]
    assert [row[0] for row in rows] == ["1", "64", "4096"]
    goodput = [float(row[-2].rstrip("%")) for row in rows]
    assert goodput[0] >= goodput[1] > goodput[2]  # more nodes: failures more often
    big = at_scale(4096, 30 * 86400, c, r, w, 300, 0.5)
    assert big["failures_per_day"] == pytest.approx(4096 / 30) and big["restart"] == pytest.approx(r + 150)
    assert f"{big['goodput'] * 100:.1f}%" == rows[2][-2] and plot.stat().st_size > 10_000
    # Young-Daly per N: sqrt(2 C MTBF/N)
    assert big["young_daly"] == pytest.approx(math.sqrt(2 * c * 30 * 86400 / 4096))
    no_restart = tmp_path / "clean"
    assert cli([*RUN, f"run_dir={no_restart}", "ckpt=sync_save"], data_root, tmp_path).returncode == 0
    p = run_cmd([PY, "-m", "recipe.goodput", "--nodes", "--from", str(no_restart)], 60)
    assert p.returncode == 1 and "never restarted, so R is unknown" in p.stderr.strip().splitlines()[-1]


# ---- real kills -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_supervisor_restarts_a_killed_single_process_job_and_the_ledger_spans_both(data_root, tmp_path, reference):
    run_dir = tmp_path / "run"
    p = cli(
        [
            *RUN,
            f"run_dir={run_dir}",
            "ckpt=sync_save",
            "ckpt.interval_steps=10",
            "fault=crash_at_step",
            "fault.step=25",
            "trainer.max_restarts=2",
            "logger=mlflow",
            f"logger.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        ],
        data_root,
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    s, doc = load(run_dir)
    assert s["params_sha256"] == reference[40] and s["resumed_from"] == 20
    a1, a2 = doc["attempts"]
    assert (a1["status"], a1["step"] >= 20, a1["auto_restart"]) == ("running", True, False)  # killed: never closed
    assert (a2["status"], a2["resumed_from"], a2["auto_restart"]) == ("finished", 20, True)
    assert doc["restarts"] == 1 and doc["failures"] == 1 and s["goodput"]["restarts"] == 1
    assert [a["start_method"] for a in doc["attempts"]] == ["forkserver"] * 2  # warm: forks of a pre-imported server
    assert all(a["buckets"]["program_start"] > 0 for a in doc["attempts"])
    assert all(a["buckets"]["init"] > 0 for a in doc["attempts"]) and a2["buckets"]["restore"] > 0  # a2 restored
    assert math.isclose(
        doc["restart_seconds"],
        doc["totals"]["recovery_gap"]
        + sum(  # (each figure rounded)
            a2["buckets"][k] for k in ("program_start", "health", "init", "restore")
        ),
        abs_tol=0.003,
    )
    check_account(doc)
    assert "attempt 1 failed (killed by signal 9); restarting" in (run_dir / "train.log").read_text()
    assert "goodput" in p.stderr and "lost" in p.stderr  # the table at the end


@pytest.mark.slow
def test_a_manual_rerun_after_a_kill_is_one_job_in_the_ledger(data_root, tmp_path, reference):
    run_dir = tmp_path / "run"
    common = [
        *RUN,
        f"run_dir={run_dir}",
        "ckpt=sync_save",  # (durable before step 31 starts: an async save of step 30 may still be in flight at 33)
        "ckpt.interval_steps=10",
        "fault=crash_at_step",
        "fault.step=33",
    ]
    assert cli(common, data_root, tmp_path).returncode != 0
    p = cli(common, data_root, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    s, doc = load(run_dir)
    assert s["params_sha256"] == reference[40]
    assert [a["resumed_from"] for a in doc["attempts"]] == [None, 30] and not doc["attempts"][1]["auto_restart"]
    check_account(doc)
    # its time line, from the run dir alone: the killed attempt, the rerun from step 30, the steps and saves
    from pitstop.goodput.timeline import read
    from recipe.goodput import main

    main(["--timeline", str(run_dir)])
    assert (run_dir / "timeline.png").stat().st_size > 0
    line = read(str(run_dir))
    assert [(a.status, a.resumed_from) for a in line.attempts] == [("running", None), ("finished", 30)]
    assert line.attempts[0].end <= line.attempts[1].start and {s for _, s in line.saves} >= {10, 20, 30, 40}
    assert max(s for _, s in line.steps) == 40 and 33 in {s for _, s in line.steps}  # (step 33 ran, then was redone)


@pytest.mark.slow
def test_random_failures_are_seeded_and_the_job_finishes_exactly(data_root, tmp_path, reference):
    # fault.mtbf_steps: the failures are drawn in steps, so they fall in the run however fast the machine is. Seed 137
    # with a mean of 60 steps draws 35 steps for the first attempt (killed at the end of step 35: it resumes from the
    # save of 30) and 173 for the second (past the end: it finishes). (Drawn in seconds, a seed tuned to one machine's
    # speed let a faster one end the job before its first failure.)
    run_dir = tmp_path / "run"
    p = cli(
        [
            *RUN,
            "trainer.max_steps=120",
            f"run_dir={run_dir}",
            "ckpt=sync_save",
            "ckpt.interval_steps=10",
            "fault=random",
            "fault.mtbf_steps=60",
            "fault.seed=137",
            "trainer.max_restarts=3",
        ],
        data_root,
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    s, doc = load(run_dir)
    assert s["params_sha256"] == reference[120]
    assert [r["key"] for r in read_jsonl(run_dir / "faults.jsonl")] == ["random#0"]
    log = (run_dir / "train.log").read_text()
    assert "attempt 1 fails after 35 steps (mtbf 60 steps)" in log and "attempt 2 fails after 173 steps" in log
    assert "SIGKILL (random failure 1, at step 35: this attempt's step 35)" in log
    assert doc["restarts"] == 1 and [a.get("resumed_from") for a in doc["attempts"]] == [None, 30], doc["attempts"]
    check_account(doc)


@pytest.mark.slow
def test_an_attempt_killed_during_init_is_an_attempt_of_the_job(data_root, tmp_path, reference):
    # Seed 8694 draws 0.007 s for the first attempt (killed as soon as the fault is armed at the end of init:
    # in init or restore, before the first step) and 123 s for the second.
    run_dir = tmp_path / "run"
    p = cli(
        [
            *RUN,
            f"run_dir={run_dir}",
            "ckpt=sync_save",
            "ckpt.interval_steps=10",
            "fault=random",
            "fault.mtbf_seconds=30",
            "fault.seed=8694",
            "trainer.max_restarts=1",
        ],
        data_root,
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    s, doc = load(run_dir)
    assert s["params_sha256"] == reference[40]
    first = doc["attempts"][0]
    assert doc["restarts"] == 1 and first["status"] == "running" and first["step"] == 0
    assert first["buckets"]["init"] > 0 and first["buckets"]["compute"] == 0
    check_account(doc)


@pytest.mark.slow
def test_kill_during_a_background_checkpoint_write_resumes_exactly(data_root, tmp_path, reference):
    run_dir = tmp_path / "run"
    p = cli(
        [
            *RUN,
            f"run_dir={run_dir}",
            "ckpt=async_dcp",
            "ckpt.interval_steps=10",
            "ckpt.throttle_mbps=1",
            "fault=during_save",
            "fault.step=20",
            "trainer.max_restarts=1",
        ],
        data_root,
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    s, doc = load(run_dir)
    assert s["params_sha256"] == reference[40]
    assert [r["key"] for r in read_jsonl(run_dir / "faults.jsonl")] == ["during_save"]
    log = (run_dir / "train.log").read_text()
    assert "SIGKILL (during the write of step_00000020)" in log
    assert s["resumed_from"] == 10  # the interrupted step-20 save never counted
    check_account(doc)


@pytest.mark.slow
def test_auto_interval_measures_the_save_cost_and_logs_each_change(data_root, tmp_path):
    run_dir = tmp_path / "run"
    p = cli(
        [
            *RUN,
            "trainer.max_steps=60",
            f"run_dir={run_dir}",
            "ckpt=sync_save",
            "ckpt.interval=auto",
            "ckpt.mtbf_seconds=2",
            "ckpt.keep_last_k=0",
        ],
        data_root,
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    log = (run_dir / "train.log").read_text()
    assert "ckpt.interval=auto: save every" in log and "MTBF 2.00 s: ckpt.mtbf_seconds" in log
    steps = sorted(int(d.name[5:]) for d in (run_dir / "checkpoints").glob("step_*"))
    assert steps[0] == 1 and steps[-1] == 60 and len(steps) >= 4  # first after step 1, then every ~0.1-0.3 s
    changes = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "ckpt_interval_seconds" in r]
    assert changes and all(0 < r["ckpt_interval_seconds"] < 2 for r in changes)


# ---- the sweep report ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_sweep_report_after_a_real_multirun_with_a_failed_job(data_root, tmp_path):
    sweep = tmp_path / "sweep"
    p = cli(
        [
            "-m",
            "debug=tiny",
            "ckpt=sync_save,async_dcp",
            "optim.lr=0.05,1e30",
            f"hydra.sweep.dir={sweep}",
            "logger=mlflow",
            f"logger.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        ],
        data_root,
        tmp_path,
        timeout=400,
    )
    assert p.returncode != 0  # a job failed, so the sweep did
    md = (sweep / "report.md").read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| ckpt=")]
    assert len(rows) == 4, md
    failed = [r for r in rows if "FAILED" in r]
    assert len(failed) == 2 and all("optim.lr=1e" in r and "non-finite loss" in r for r in failed)
    ok = [r for r in rows if "| ok |" in r]
    assert len(ok) == 2 and all("%" in r for r in ok)
    lines = (sweep / "report.csv").read_text().splitlines()
    assert len(lines) == 5 and lines[0].startswith("job,configuration,status")
    assert (sweep / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["pitstop"], filter_string=f"tags.sweep = '{sweep.name}'")
    assert len(runs) == 4 and set(runs["tags.sweep_job"]) == {"0", "1", "2", "3"}
    # each run named by what its job set (where its files went left out)
    names = {
        f"digits-cnn-sgd debug=tiny ckpt={c} optim.lr={lr} logger=mlflow"
        for c in ("sync_save", "async_dcp")
        for lr in ("0.05", "1e+30")
    }  # fmt: skip (Hydra writes 1e30 so)
    assert set(runs["tags.mlflow.runName"]) == names, set(runs["tags.mlflow.runName"])


# ---- preemption notices (a real SIGTERM) --------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["single", "ddp", "ddp-rank1-restarts"])
def test_a_preemption_notice_saves_exits_75_and_the_same_command_loses_no_step(
    strategy, data_root, tmp_path, reference
):
    run_dir = tmp_path / "run"
    args = [
        *RUN,
        f"run_dir={run_dir}",
        f"strategy={strategy.split('-')[0]}",
        "ckpt=async_dcp",
        "ckpt.interval_steps=10",
        "fault=preempt",
        "fault.step=13",
    ]
    if strategy == "ddp-rank1-restarts":
        # A notice to one rank, with restarts to spare: the job stops for a requeue (the rank hands the notice
        # to the launching process, whose agent gives it to every rank); it is not restarted in place.
        args += ["fault.rank=1", "fault.signal=SIGUSR1", "trainer.max_restarts=3"]  # (SLURM's --signal=USR1@90)
    first = cli(args, data_root, tmp_path)
    assert first.returncode == 75, first.stderr[-3000:]  # EX_TEMPFAIL: requeue, not failure
    # (rank 0 of the rank-1 case may agree before the agent's signal reaches it: "a peer's notice")
    assert re.search(
        r"preempted \((SIGTERM|SIGUSR1|a peer's notice)\) at step 13: saved it", (run_dir / "train.log").read_text()
    )
    assert (run_dir / "checkpoints" / "step_00000013" / ".metadata").is_file()
    second = cli(args, data_root, tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    s, doc = load(run_dir)
    assert s["resumed_from"] == 13 and [a["status"] for a in doc["attempts"]] == ["preempted", "finished"]
    assert doc["totals"]["lost"] == 0.0  # no step computed twice
    if strategy == "single":
        assert s["params_sha256"] == reference[40]  # the same model as an uninterrupted run
    check_account(doc)


@pytest.mark.slow
def test_a_notice_to_the_launching_process_of_a_ddp_job_stops_every_rank_after_its_save(data_root, tmp_path):
    # Kubernetes' SIGTERM reaches the launching process (torch's elastic agent runs in it) as well as the ranks;
    # the agent must not kill the ranks in the middle of their save: it hands the notice on and waits for them.
    import os
    import signal as sig
    import time

    from conftest import cli_cmd, popen_cmd

    run_dir = tmp_path / "run"
    args = [
        *RUN,
        f"run_dir={run_dir}",
        "strategy=ddp",
        "ckpt=async_dcp",
        "ckpt.interval_steps=10",
        "trainer.max_steps=400",
        "trainer.max_restarts=2",
    ]
    p = popen_cmd(cli_cmd(args, data_root, tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and p.poll() is None:
        steps = (
            [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] if (run_dir / "metrics.jsonl").exists() else []
        )
        if any(s >= 15 for s in steps):
            break
        time.sleep(0.2)
    os.kill(p.pid, sig.SIGTERM)  # the launching process only (the ranks get it from the agent)
    out, err = p.communicate(timeout=180)
    assert p.returncode == 75, err[-3000:]
    log = (run_dir / "train.log").read_text()
    assert "preemption notice (SIGTERM): every rank saves and stops" in log
    stopped = json.loads((run_dir / "goodput.json").read_text())["attempts"][-1]
    assert stopped["status"] == "preempted" and re.search(
        rf"preempted \(SIGTERM\) at step {stopped['step']}: (saved it|the save of this step is already under way)", log
    )
    second = cli(args, data_root, tmp_path)  # the same command
    assert second.returncode == 0, second.stderr[-3000:]
    s, doc = load(run_dir)
    assert s["resumed_from"] == stopped["step"] and doc["totals"]["lost"] == 0.0
    check_account(doc)


@pytest.mark.slow
def test_a_notice_to_every_process_of_the_step_leaves_the_checkpoint_process_to_write_the_save(
    data_root, tmp_path, reference
):
    # SLURM's notice (scancel --signal, --signal=USR1@90) reaches every process of the job step: with
    # ckpt=async_dcp_pinned that includes DCP's checkpoint process, which the notice ended in the middle of the save
    # it asked for (ConnectionResetError, the step lost). It is started with the notices blocked: the save at the
    # notice's step is written and durable, the job leaves with 75 and the same command ends at the reference.
    import os
    import signal
    import time

    from conftest import cli_cmd, popen_cmd

    run_dir = tmp_path / "run"
    args = [*RUN, f"run_dir={run_dir}", "ckpt=async_dcp_pinned", "ckpt.interval_steps=10", "trainer.max_steps=120"]
    p = popen_cmd(cli_cmd(args, data_root, tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                  start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:  # past the first save: the checkpoint process runs
        path = run_dir / "metrics.jsonl"
        if any(r.get("step", 0) >= 15 for r in (read_jsonl(path) if path.exists() else [])):
            break
        time.sleep(0.1)
    os.killpg(p.pid, signal.SIGUSR1)  # every process of the "step": trainer, workers, tracker, checkpoint process
    _, err = p.communicate(timeout=120)
    assert p.returncode == 75, err[-3000:]
    log = (run_dir / "train.log").read_text()
    stopped = json.loads((run_dir / "goodput.json").read_text())["attempts"][-1]
    assert stopped["status"] == "preempted" and f"preempted (SIGUSR1) at step {stopped['step']}: saved it" in log
    assert (run_dir / "checkpoints" / f"step_{stopped['step']:08d}" / ".metadata").is_file()
    assert "failed" not in log and "died" not in log and "Traceback" not in err, log[-3000:]
    second = cli(args, data_root, tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    s, doc = load(run_dir)
    assert s["resumed_from"] == stopped["step"] and doc["totals"]["lost"] == 0.0
    assert s["params_sha256"] == reference[120]


@pytest.mark.slow
def test_sigterm_to_the_supervisor_is_a_notice_for_its_attempt(data_root, tmp_path, reference):
    # The scheduler signals the job's main process (the supervisor): it hands the notice to its attempt, which
    # saves; both leave with 75, and the same command resumes from the saved step.
    import signal
    import subprocess
    import time

    from conftest import cli_cmd, popen_cmd

    run_dir = tmp_path / "run"
    args = [*RUN, f"run_dir={run_dir}", "ckpt=sync_save", "ckpt.interval_steps=1000", "trainer.max_restarts=2"]
    args += ["trainer.max_steps=120"]  # (the notice comes at step 5 or later: 40 steps could end before it lands)
    proc = popen_cmd(cli_cmd(args, data_root, tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait until it trains (a step past 5 is in the ledger)
        try:
            if json.loads((run_dir / "goodput.json").read_text())["attempts"][-1]["step"] >= 5:
                break
        except (OSError, ValueError, KeyError, IndexError):
            pass
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    doc = json.loads((run_dir / "goodput.json").read_text())
    stopped = doc["attempts"][-1]["step"]
    assert doc["attempts"][-1]["status"] == "preempted" and (run_dir / "checkpoints" / f"step_{stopped:08d}").is_dir()
    p = cli(args, data_root, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    s, doc = load(run_dir)
    assert s["resumed_from"] == stopped and s["params_sha256"] == reference[120] and doc["totals"]["lost"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("to", ["every process", "the supervisor alone"])
def test_a_notice_to_the_supervisor_and_its_attempt_stops_the_job_with_75_and_no_restart(
    to, data_root, tmp_path, reference
):
    # trainer.max_restarts: pitstop's supervisor runs the attempt. SLURM's notice reaches both, and the warm fork
    # server between them: the supervisor (which SIGUSR1 would kill) waits for the attempt's save and starts no new
    # attempt, the fork server (which SIGUSR1 killed: the attempt's 75 then read as exit status 255, a "failure"
    # restarted in place) outlives it. The same command ends at the uninterrupted run's parameters. A notice to the
    # supervisor alone (a batch script's `--signal=B:USR1@N`) is handed on to its attempt.
    import os
    import signal
    import time

    from conftest import cli_cmd, popen_cmd

    run_dir = tmp_path / "run"
    args = [*RUN, f"run_dir={run_dir}", "ckpt=sync_save", "ckpt.interval_steps=10", "trainer.max_restarts=2"]
    args += ["trainer.max_steps=120"]  # (the notice comes at step 15 or later: 40 steps could end before it lands)
    with open(tmp_path / "job.log", "w") as out:
        p = popen_cmd(cli_cmd(args, data_root, tmp_path), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:
        path = run_dir / "metrics.jsonl"
        if any(r.get("step", 0) >= 15 for r in (read_jsonl(path) if path.exists() else [])):
            break
        time.sleep(0.1)
    if to == "every process":
        os.killpg(p.pid, signal.SIGUSR1)
    else:
        os.kill(p.pid, signal.SIGUSR1)
    assert p.wait(timeout=120) == 75, (tmp_path / "job.log").read_text()[-3000:]
    text = (tmp_path / "job.log").read_text()
    assert "failed (" not in text and "Traceback" not in text, text[-3000:]
    stopped = json.loads((run_dir / "goodput.json").read_text())["attempts"]
    assert [a["status"] for a in stopped] == ["preempted"]
    assert f"preempted (SIGUSR1) at step {stopped[0]['step']}: saved it" in (run_dir / "train.log").read_text()
    if to != "every process":
        return  # (the resume is the same as below)
    second = cli(args, data_root, tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    s, doc = load(run_dir)
    assert s["resumed_from"] == stopped[0]["step"] and s["params_sha256"] == reference[120]
    assert doc["totals"]["lost"] == 0.0
