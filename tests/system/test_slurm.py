"""hydra/launcher=slurm against a real SLURM 22.05 cluster on this machine (deploy/slurm/local-cluster.sh: munge,
slurmctld and two slurmd, nodes n1 and n2, one CPU each), brought up once for this module and taken down after it:
a sweep whose job is sent SLURM's preemption notice (``scancel --signal=USR2``, as submitit asks for) saves,
is requeued exactly once and resumes to the uninterrupted job's parameters while the sweep waits and writes its
report; the README's two-node command trains one rank per node to the one-command ddp(2) and fsdp(2) digest; the
plain sbatch script (deploy/slurm/train.sbatch) trains on two nodes, is requeued once after a notice, and, elastic
under --no-kill, loses a node (its slurmd and processes killed) and finishes on the other; with the local tier copied
to a partner node (ckpt.local.replicas=1), a node lost at a step (fault=lose_node) restores its ranks from the copy,
or, the copy corrupt, from the durable tier, to the uninterrupted run's parameters.

The cluster needs root and Debian's slurm-wlm and munge (.ci/run installs them where they are missing); without
them these tests skip, saying so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, cli, cli_cmd, popen_cmd, read_jsonl
from manual import assert_shows, page_output

pytestmark = pytest.mark.slow

CLUSTER = ROOT / "deploy" / "slurm" / "local-cluster.sh"
# what one job of the local cluster can have (slurm.yaml's defaults are a GPU node's: 16 CPUs, 8 GPUs, 256 GB)
SMALL = [
    "hydra/launcher=slurm",
    "hydra.launcher.partition=debug",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.gpus_per_node=0",
    "hydra.launcher.mem_gb=1",
    "hydra.launcher.timeout_min=10",
]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> dict:
    """The environment of a command that talks to the local cluster (SLURM_CONF; deploy/slurm first on PATH for
    its sacct stand-in)."""
    missing = [t for t in ("slurmctld", "slurmd", "sbatch", "munged") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"SLURM is not installed here ({', '.join(missing)} missing): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster runs its daemons as root")
    d = tmp_path_factory.mktemp("slurm")
    up = subprocess.run(["bash", str(CLUSTER), "up", str(d)], capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, up.stderr[-3000:]
    env = dict(os.environ, SLURM_CONF=str(d / "slurm.conf"))
    env["PATH"] = f"{CLUSTER.parent}{os.pathsep}{env['PATH']}"
    yield env
    subprocess.run(["bash", str(CLUSTER), "down", str(d)], capture_output=True, text=True, timeout=120)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def job_logs(sweep: Path, kind: str = "*") -> str:
    """The sweep's jobs' stdout and stderr as submitit kept them (``kind``: out, err or both)."""
    return "".join(p.read_text(errors="replace") for p in sorted((sweep / ".submitit").rglob(f"*_log.{kind}")))


def test_a_preempted_sweep_job_saves_is_requeued_once_and_resumes_exactly(slurm, data_root, tmp_path):
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        *SMALL,
        "ckpt=sync_save,async_dcp",
        "debug=tiny",
        "loader.num_workers=2",  # (the workers and their fork server get the notice too: they must ignore it)
        "trainer.max_steps=300",
        "trainer.eval_every_steps=150",
        "trainer.log_every_steps=20",
        f"hydra.sweep.dir={sweep}",
    ]
    p = popen_cmd(cli_cmd(args, data_root, tmp_path), env=slurm, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        metrics, deadline = sweep / "1" / "metrics.jsonl", time.monotonic() + 120
        while not (metrics.exists() and sum(1 for r in read_jsonl(metrics) if "loss" in r) >= 60):
            assert time.monotonic() < deadline and p.poll() is None, "the async_dcp job did not reach step 60"
            time.sleep(0.1)
        job = subprocess.run(
            ["squeue", "-h", "-o", "%i %j", "-t", "R"], capture_output=True, text=True, env=slurm, check=True
        ).stdout.split()[0::2]
        array = sorted(j for j in job if j.endswith("_1"))
        assert array, job
        subprocess.run(["scancel", "--signal=USR2", array[0]], env=slurm, check=True)  # as SLURM's notice comes
        out, _ = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out[-3000:]
    assert all((sweep / f"report.{x}").exists() for x in ("md", "csv", "png"))
    assert not list(sweep.rglob("failed.json"))  # no stale failure of the job's first run
    train_log = (sweep / "1" / "train.log").read_text()
    saved = [int(ln.rsplit("at step ", 1)[1].split(":")[0]) for ln in train_log.splitlines() if "preempted (" in ln]
    resumed = [int(ln.rsplit("resumed from step ", 1)[1]) for ln in train_log.splitlines() if "resumed from step" in ln]
    assert len(saved) == 1 and resumed == saved, train_log[-3000:]  # 0 steps lost
    logs = job_logs(sweep)
    assert job_logs(sweep, "err").count("Caught signal SIGUSR2") == 1 and "Traceback" not in logs, logs[-3000:]
    restarts = subprocess.run(
        ["scontrol", "show", "job", array[0].split("_")[0]], capture_output=True, text=True, env=slurm
    ).stdout
    assert restarts.count("Restarts=1") == 1 and restarts.count("Restarts=0") == 1, restarts  # requeued once
    done = [summary(sweep / k) for k in ("0", "1")]
    assert [s["final_step"] for s in done] == [300, 300]
    assert done[0]["params_sha256"] == done[1]["params_sha256"]  # the preempted job = the uninterrupted one


# The settings of the jobs compared with the one-command ddp(2) run: 120 steps, long enough to send a notice.
TWO_RANKS = [
    "strategy.cpu_threads=1",
    "debug=tiny",
    "trainer.max_steps=120",
    "trainer.eval_every_steps=60",
    "trainer.log_every_steps=20",
    "ckpt=sync_save",
]


@pytest.fixture(scope="module")
def ddp2(data_root, tmp_path_factory) -> str:
    """The one-command ddp(2) run's digest: two ranks on this machine, one thread each."""
    tmp = tmp_path_factory.mktemp("ddp2")
    p = cli(["strategy=ddp", "strategy.nproc_per_node=2", *TWO_RANKS, f"run_dir={tmp}/r"], data_root, tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    return summary(tmp / "r")["params_sha256"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_two_node_command_trains_one_rank_per_node_to_the_one_command_digest(
    slurm, data_root, tmp_path, ddp2, strategy
):
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        *SMALL,
        "hydra.launcher.nodes=2",
        f"strategy={strategy}",
        "strategy.nnodes=2",
        "strategy.nproc_per_node=1",
        "strategy.rdzv_endpoint=slurm",
        *TWO_RANKS,
        f"hydra.sweep.dir={sweep}",
    ]
    p = cli(args, data_root, tmp_path, env=slurm, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    s = summary(sweep / "0")
    assert s["world_size"] == 2 and s["final_step"] == 120
    assert s["params_sha256"] == ddp2
    assert "Traceback" not in job_logs(sweep)


def sbatch(env: dict, tmp_path: Path, options: list[str], overrides: list[str], data_root: Path) -> str:
    """Submit deploy/slurm/train.sbatch (``options`` for sbatch, ``overrides`` for recipe.train); the job id."""
    submit = subprocess.run(
        ["sbatch", "--parsable", *options, f"--chdir={ROOT}", f"--output={tmp_path}/slurm-%j.out",
         str(ROOT / "deploy" / "slurm" / "train.sbatch"), *overrides, f"paths.data_dir={data_root / 'data'}"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr
    return submit.stdout.strip().split(";")[0]


def job_state(slurm: dict, job: str) -> str:
    out = subprocess.run(
        ["squeue", "-h", "-t", "all", "-j", job, "-o", "%T"], capture_output=True, text=True, env=slurm
    )
    return out.stdout.strip()


def test_the_plain_sbatch_script_trains_on_two_nodes_and_a_notice_requeues_it_once(slurm, data_root, tmp_path, ddp2):
    # deploy/slurm/train.sbatch: srun starts one agent per node; `scancel --signal=USR1` (as --signal=USR1@90
    # sends it, to every process of the step) makes the ranks save and exit 75, and the script requeues the job.
    run_dir = tmp_path / "run"
    env = dict(slurm, PITSTOP_PYTHON=sys.executable, PITSTOP_RUN_DIR=str(run_dir))
    job = sbatch(env, tmp_path, [], ["strategy=ddp", "strategy.nproc_per_node=1", *TWO_RANKS], data_root)
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 120
    while not (metrics.exists() and sum(1 for r in read_jsonl(metrics) if "loss" in r) >= 40):  # 80 steps to go
        assert time.monotonic() < deadline, (tmp_path / f"slurm-{job}.out").read_text()[-3000:]
        time.sleep(0.1)
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm, check=True)

    def state() -> str:
        return job_state(slurm, job)

    deadline = time.monotonic() + 180
    while state() not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
        assert time.monotonic() < deadline, state()
        time.sleep(0.5)
    out = (tmp_path / f"slurm-{job}.out").read_text(errors="replace")
    assert state() == "COMPLETED" and "Traceback" not in out, out[-3000:]
    assert (
        "Restarts=1"
        in subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=slurm).stdout
    )
    assert out.count("requeueing job") == 1, out[-3000:]
    train_log = (run_dir / "train.log").read_text()
    saved = [int(ln.split(" at step ")[1].split(":")[0]) for ln in train_log.splitlines() if ": saved it" in ln]
    resumed = [int(ln.rsplit("resumed from step ", 1)[1]) for ln in train_log.splitlines() if "resumed from step" in ln]
    assert len(saved) == 1 and saved[0] >= 40 and resumed == saved, train_log[-3000:]  # saved on the notice: 0 lost
    ledger = json.loads((run_dir / "goodput.json").read_text())["attempts"]
    assert [a["status"] for a in ledger] == ["preempted", "finished"], ledger
    s = summary(run_dir)
    assert s["world_size"] == 2 and s["final_step"] == 120 and s["params_sha256"] == ddp2


def test_a_deterministic_bug_stops_both_nodes_of_an_sbatch_job_in_one_line_and_it_is_not_requeued(
    slurm, data_root, tmp_path
):
    # deploy/slurm/train.sbatch, ddp over n1 and n2, the bug on rank 1 (on n2) at step 6, strategy.max_restarts=10:
    # rank 1 fails the same way twice and stops n2's agent; rank 0 on n1 loses its peer, finds the verdict in the
    # shared run dir and stops n1's agent too. Both agents exit 2 with the loop's line, the script requeues only on
    # 75, and the job ends FAILED, Restarts=0. (Before, n1's agent waited strategy.timeout, 300 s, for a rendezvous
    # that n2 never joined, and ended with a line about the rendezvous.)
    run_dir = tmp_path / "run"
    env = dict(slurm, PITSTOP_PYTHON=sys.executable, PITSTOP_RUN_DIR=str(run_dir))
    overrides = ["strategy=ddp", "strategy.nproc_per_node=1", "strategy.cpu_threads=1", "debug=tiny",
                 "trainer.max_steps=10", "logger=none", "ckpt=sync_dcp", "ckpt.interval_steps=4", "fault=bug",
                 "fault.step=6", "fault.rank=1", "strategy.max_restarts=10"]  # fmt: skip
    job = sbatch(env, tmp_path, [], overrides, data_root)
    out, deadline = tmp_path / f"slurm-{job}.out", time.monotonic() + 120
    while job_state(slurm, job) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
        assert time.monotonic() < deadline, (out.read_text() if out.exists() else "no output")[-3000:]
        time.sleep(0.5)
    text = out.read_text(errors="replace")
    assert job_state(slurm, job) == "FAILED" and "pitstop: the nodes' agents exited with 2 2" in text, text[-3000:]
    assert text.count("error: the same failure happened twice at step 6 on rank 1, with no progress") == 2, text[-3000:]
    assert "requeueing" not in text
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=slurm).stdout
    assert "Restarts=0" in shown and "ExitCode=2:0" in shown, shown
    rank1 = [r["attempt"] for r in read_jsonl(run_dir / "failures.jsonl") if r["rank"] == 1]
    assert rank1 == [0, 1]  # (the agents restarted once, then were stopped)


def _wait_done(slurm: dict, job: str, out: Path, limit: float = 180) -> str:
    deadline = time.monotonic() + limit
    while (state := job_state(slurm, job)) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
        assert time.monotonic() < deadline, (out.read_text() if out.exists() else "no output")[-3000:]
        time.sleep(0.5)
    return state


def test_an_elastic_sbatch_job_with_a_bad_node_trains_on_the_other_exactly_as_one_node_does(slurm, data_root, tmp_path):
    # fault=bad_node on n2 (its checkpoint dir unwritable): n2's launcher finds it in its health check before the
    # rendezvous, excludes n2 (RUN_DIR/nodes.json) and exits 77 in one line; n1 forms the job alone
    # (strategy.nnodes=1:2, --no-kill) and ends bitwise as a one-node run of the same settings does, no attempt
    # failed, every sample once.
    from pitstop.audit import audit

    same = ["strategy=ddp", "strategy.nproc_per_node=1", "strategy.cpu_threads=1", "debug=tiny", "trainer.max_steps=20",
            "ckpt=sync_save", "ckpt.interval_steps=10", "logger=none", "data.record_sample_ids=true"]  # fmt: skip
    ref = cli([*same, f"run_dir={tmp_path / 'one'}"], data_root, tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run_dir = tmp_path / "run"
    env = dict(slurm, PITSTOP_PYTHON=sys.executable, PITSTOP_RUN_DIR=str(run_dir))
    bad = [
        "strategy.nnodes=1:2",
        "strategy.last_call_seconds=3",
        "fault=bad_node",
        "fault.node=n2",
        "fault.how=unwritable",
    ]
    job = sbatch(env, tmp_path, ["--no-kill"], [*same, *bad], data_root)
    out = tmp_path / f"slurm-{job}.out"
    assert _wait_done(slurm, job, out) == "COMPLETED", out.read_text()[-3000:]
    text = out.read_text(errors="replace")
    assert "pitstop: the nodes' agents exited with 0 77 (n1 n2)" in text, text[-3000:]
    assert (
        f"error: node n2 is not used: ckpt.dir {run_dir}/checkpoints is not writable (fault=bad_node: unwritable "
        "(injected)) (node n2 failed its health check 'dirs'); the job goes on without it (1 node(s) left, "
        "strategy.nnodes=1:2)"
    ) in text
    assert "requeueing" not in text
    assert json.loads((run_dir / "nodes.json").read_text())["nodes"]["n2"]["excluded"]["by"] == "health"
    s = summary(run_dir)
    assert s["world_size"] == 1 and s["final_step"] == 20 and s["goodput"]["failures"] == 0
    assert s["params_sha256"] == summary(tmp_path / "one")["params_sha256"]
    assert [(e.once, e.repeated) for e in audit(str(run_dir))] == [(320, 0)]  # (20 steps x 16 samples, once)


def test_an_sbatch_job_that_cannot_go_on_without_its_bad_node_is_requeued_without_it(slurm, data_root, tmp_path):
    # strategy.nnodes=2 (the script's: the allocation's count) and n2 unfit (its checkpoint dir unwritable): n2's
    # launcher excludes it and stops in one line (2 nodes needed, 1 left); n1's agent, whose rendezvous n2 never
    # joins, stops with the same line after strategy.timeout; the script requeues the job with n2 in its exclusion
    # list, where it waits for a second node this cluster does not have.
    run_dir = tmp_path / "run"
    env = dict(slurm, PITSTOP_PYTHON=sys.executable, PITSTOP_RUN_DIR=str(run_dir))
    overrides = ["strategy=ddp", "strategy.nproc_per_node=1", "strategy.timeout=10", "debug=tiny", "logger=none",
                 "ckpt=sync_save", "fault=bad_node", "fault.node=n2", "fault.how=unwritable"]  # fmt: skip
    job = sbatch(env, tmp_path, [], overrides, data_root)
    out = tmp_path / f"slurm-{job}.out"
    try:
        deadline = time.monotonic() + 120
        while "requeueing job" not in (text := out.read_text(errors="replace") if out.exists() else ""):
            assert time.monotonic() < deadline and job_state(slurm, job) in ("PENDING", "RUNNING"), text[-3000:]
            time.sleep(0.5)
        deadline = time.monotonic() + 60
        while "ExcNodeList=n2" not in (shown := scontrol_job(slurm, job)) or "JobState=PENDING" not in shown:
            assert time.monotonic() < deadline, shown
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job], env=slurm)
    line = (
        f"error: the job cannot go on: 1 node(s) excluded (n2: ckpt.dir {run_dir}/checkpoints is not writable "
        "(fault=bad_node: unwritable (injected)) (node n2 failed its health check 'dirs')) and strategy.nnodes=2 "
        "needs 2, 1 left; readmit a node (node_book.readmit) or lower the minimum"
    )
    text = out.read_text(errors="replace")
    assert text.count(line) == 2, text[-3000:]  # (n2's launcher, and n1's, whose rendezvous it never joined)
    assert "pitstop: the nodes' agents exited with 2 2 (n1 n2)" in text
    assert "pitstop: the job cannot go on without node(s) n2; requeueing job" in text
    assert "Restarts=1" in shown and not (run_dir / "goodput.json").exists()  # (no attempt ever started)


def test_an_elastic_sbatch_job_excludes_its_slow_node_and_re_forms_without_it(slurm, data_root, tmp_path):
    # trainer.straggler.action=exclude with fault=slow_rank on rank 1: once rank 1 has been named slow for longer than
    # exclude_after_seconds, the job saves, rank 1's node is excluded (RUN_DIR/nodes.json, by straggler), its rank
    # exits 77 and stops its agent, the other exits 78. Which node rank 1 is on is the rendezvous's choice. n2: n1's
    # agent re-forms the job alone (strategy.nnodes=1:2, --no-kill) from that save, using no restart of
    # strategy.max_restarts=0, and it finishes at world size 1. n1 (whose agent hosts the rendezvous: the job cannot
    # go on without it): the script requeues the job with n1 in its exclusion list (this cluster has no other node for
    # it: it waits). Either way every sample read so far was read once.
    from pitstop.audit import audit

    run_dir = tmp_path / "run"
    env = dict(slurm, PITSTOP_PYTHON=sys.executable, PITSTOP_RUN_DIR=str(run_dir))
    overrides = ["strategy=ddp", "strategy.nproc_per_node=1", "strategy.nnodes=1:2", "strategy.last_call_seconds=5",
                 "strategy.max_restarts=0", "strategy.cpu_threads=1", "debug=tiny", "trainer.max_steps=60",
                 "trainer.eval_every_steps=null", "ckpt=sync_dcp", "ckpt.interval_steps=100", "logger=none",
                 "data.record_sample_ids=true", "trainer.straggler.window=10", "trainer.straggler.action=exclude",
                 "trainer.straggler.exclude_after_seconds=0.01", "fault=slow_rank", "fault.rank=1",
                 "fault.factor=3"]  # fmt: skip
    job = sbatch(env, tmp_path, ["--no-kill"], overrides, data_root)
    out = tmp_path / f"slurm-{job}.out"
    try:
        deadline = time.monotonic() + 180
        while (state := job_state(slurm, job)) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and not (
            state == "PENDING" and "requeueing job" in (out.read_text(errors="replace") if out.exists() else "")
        ):
            assert time.monotonic() < deadline, (out.read_text() if out.exists() else "no output")[-3000:]
            time.sleep(0.5)
        shown = scontrol_job(slurm, job)
    finally:
        subprocess.run(["scancel", job], env=slurm)
    text = out.read_text(errors="replace")
    book = json.loads((run_dir / "nodes.json").read_text())["nodes"]
    (slow,) = book
    assert book[slow]["excluded"]["by"] == "straggler", book
    attempts = json.loads((run_dir / "goodput.json").read_text())["attempts"]
    left = attempts[0]["step"]  # (the save it left at)
    assert attempts[0]["status"] == "reformed" and 0 < left < 60, attempts
    if slow == "n2":
        assert state == "COMPLETED" and "pitstop: the nodes' agents exited with 0 77 (n1 n2)" in text, text[-3000:]
        assert [a["status"] for a in attempts] == ["reformed", "finished"] and attempts[1]["resumed_from"] == left
        assert summary(run_dir)["world_size"] == 1 and summary(run_dir)["final_step"] == 60
        read = 16 * 2 * left + 16 * (60 - left)
    else:
        assert "pitstop: the job cannot go on without node(s) n1; requeueing job" in text, text[-3000:]
        assert "ExcNodeList=n1" in shown and "Restarts=1" in shown, shown
        read = 16 * 2 * left
    assert [(e.once, e.repeated) for e in audit(str(run_dir))] == [(read, 0)]


# A lost node's ranks restore from the copy its partner holds (ckpt.local.replicas=1): the guide's command
# (docs/guides/checkpoints.md, "A copy on a partner node"), each node's local dir its own (one machine here).
PEER = [
    "ckpt=async_dcp",
    "ckpt.interval_steps=50",
    "ckpt.local.interval_steps=5",
    "ckpt.local.replicas=1",
    "trainer.max_restarts=1",
    "fault.node=n2",
    "fault.step=72",
]


@pytest.mark.parametrize("fault", ["lose_node", "corrupt_peer_copy", "lose_node_and_partner"])
def test_a_node_lost_at_a_step_restores_its_ranks_from_the_partners_copy_to_the_uninterrupted_parameters(
    slurm, data_root, tmp_path, ddp2, fault
):
    # fault=lose_node on n2 at the end of step 72 (or of the first step after it at which n1 acknowledged a copy of
    # n2's files: a loaded machine may not have copied one by then): n2's rank clears n2's local dir (its own
    # checkpoints and the copies it holds for n1) and is killed; both agents restart their ranks
    # (trainer.max_restarts=1). n2 comes back empty: its rank's files of the newest replicated step (the one the kill's
    # line names, or a newer one acknowledged just before the kill) come from the copy n1 holds, verified, and the
    # run ends with the uninterrupted ddp(2) run's parameters. corrupt_peer_copy: as
    # the job restarts, n1 flips a byte in each data file of the copies it holds for n2: the restore says so in one
    # line and takes the durable tier's step 50, to the same parameters. lose_node_and_partner: n1 is lost too (its
    # local dir cleared, its rank killed): the durable tier's step 50.
    sweep = tmp_path / "sweep"
    local = f"ckpt.local.dir={tmp_path}/shm_${{oc.env:SLURMD_NODENAME}}"
    args = ["-m", *SMALL, "hydra.launcher.nodes=2", "strategy=ddp", "strategy.nnodes=2", "strategy.nproc_per_node=1",
            "strategy.rdzv_endpoint=slurm", *TWO_RANKS, *PEER, f"fault={fault}", local,
            f"hydra.sweep.dir={sweep}"]  # fmt: skip
    p = cli(args, data_root, tmp_path, env=slurm, timeout=400)
    out = p.stdout + p.stderr + job_logs(sweep)
    assert p.returncode == 0, out[-3000:]
    log = (sweep / "0" / "train.log").read_text()
    s = summary(sweep / "0")
    assert s["world_size"] == 2 and s["final_step"] == 120 and s["goodput"]["restarts"] == 1
    assert s["params_sha256"] == ddp2
    ranks = "".join(p.read_text() for p in sorted((sweep / "0").glob("rank*.log")))  # (ranks but 0: rank*.log)
    # (with a copy to lose: at the end of step 72, or of the first step after it at which n1 holds a copy of n2's)
    kill = r"fault injection: SIGKILL \(node n2 lost at step (\d+)(; its partner holds its copy of step (\d+))?\)"
    lost = re.search(kill, log + ranks)
    assert lost and int(lost[1]) >= 72, (log + ranks)[-3000:]
    assert (lost[2] is None) == (fault == "lose_node_and_partner"), lost[0]  # (both lost: at step 72, no copy waited)
    booked = json.loads((sweep / "0" / "goodput.json").read_text())["restore_by_tier"]  # (the ledger, by tier)
    assert list(booked) == [s["checkpoint"]["restored_from"]] and booked[s["checkpoint"]["restored_from"]]["count"] == 1
    if fault == "lose_node":
        restored = re.search(r"\(step (\d+), peer tier\)", log)
        assert restored and int(restored[1]) >= int(lost[3]), log[-3000:]  # (a newer copy may land before the kill)
        assert s["checkpoint"]["restored_from"] == "peer"
        assert_shows(page_output("fault=lose_node"), out + log + ranks, "a lost node (checkpoints guide)")
    elif fault == "lose_node_and_partner":  # (n1, n2's partner, lost too: no copy is left)
        assert "fault injection: SIGKILL (node n1, the partner of lost node n2, lost too at step 72)" in log + ranks
        assert "(step 50, durable tier)" in log and s["checkpoint"]["restored_from"] == "durable", log[-3000:]
    else:
        corrupted = r"fault injection: node n1 corrupted [1-9]\d* file\(s\) of the \d+ cop(y|ies) it holds for lost n"
        assert re.search(corrupted, log + ranks), (log + ranks)[-3000:]
        said = [ln for ln in log.splitlines() if "cannot be made whole" in ln]
        assert len(said) == 1 and "durable tier" in said[0], log[-3000:]
        assert "(step 50, durable tier)" in log and s["checkpoint"]["restored_from"] == "durable"
    assert "Traceback" not in log + ranks  # (the elastic agent reports the killed rank's exit with one, as it must)


def scontrol_job(slurm: dict, job: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=slurm).stdout


def _lose_node(slurm: dict, job: str, node: str) -> list[int]:
    """Kill one node of the local cluster as a node failure would: its slurmd, and every process of ``job`` on it
    (the tasks, their children and their slurmstepd), all stopped first so none of them reacts."""
    cluster = Path(slurm["SLURM_CONF"]).parent
    victims = {int((cluster / "run" / f"slurmd-{node}.pid").read_text())}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if f"SLURM_JOB_ID={job}".encode() in env and f"SLURMD_NODENAME={node}".encode() in env:
            victims |= {int(pid), parent}  # (its parent: the step's slurmstepd, or a process of the task)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in victims:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    return sorted(victims)


def _at_two(run_dir: Path) -> bool:
    """Whether rank 0's newest attempt on disk ran at world size 2. Its sample log reaches the disk when a save
    starts (what a resume would not redo), its header with it: this attempt has then saved at least once."""
    path = run_dir / "samples.rank0.jsonl"
    text = path.read_text() if path.exists() else ""
    heads = [json.loads(ln) for ln in text[: text.rfind("\n") + 1].splitlines() if ln.startswith('{"attempt"')]
    return bool(heads) and heads[-1]["world_size"] == 2


def test_an_elastic_sbatch_job_that_loses_a_node_goes_on_with_the_other_and_reads_every_sample_once(
    slurm, data_root, tmp_path
):
    # `sbatch --no-kill deploy/slurm/train.sbatch strategy.nnodes=1:2`: one job step per node, so SLURM ends only the
    # lost node's step; node 0's agent (it hosts the rendezvous: the node strategy.rdzv_endpoint=slurm names)
    # re-forms the job at world size 1 from the newest complete checkpoint and finishes it. Last in this module: n2
    # comes back.
    from pitstop.audit import audit

    run_dir = tmp_path / "run"
    env = dict(slurm, PITSTOP_PYTHON=sys.executable, PITSTOP_RUN_DIR=str(run_dir))
    overrides = [
        "strategy=ddp",
        "strategy.nproc_per_node=1",
        "strategy.nnodes=1:2",  # (after the script's strategy.nnodes=$SLURM_JOB_NUM_NODES: this one counts)
        "strategy.last_call_seconds=15",  # (n2's agent may start seconds after n1's when the machine is busy)
        "trainer.max_restarts=3",
        "strategy.cpu_threads=1",
        "ckpt=async_dcp",
        "ckpt.interval_steps=5",
        "trainer.epochs=2",
        "trainer.batch_size=32",
        "trainer.log_every_steps=5",
        "logger=none",
        "data.record_sample_ids=true",
    ]
    job = sbatch(env, tmp_path, ["--no-kill"], overrides, data_root)
    out = tmp_path / f"slurm-{job}.out"
    try:
        # A save started at world size 2 (step 5 of ~48; a kill before it would leave no trace of that attempt in
        # the sample logs: its steps are redone). An agent later than strategy.last_call_seconds finds the job formed
        # without it, at world size 1, and is let in by a restart if the job is still going: [1, 2, 1].
        deadline = time.monotonic() + 120
        while not _at_two(run_dir):
            said = out.read_text() if out.exists() else "no output"
            assert time.monotonic() < deadline and "agents exited" not in said, said[-3000:]
            time.sleep(0.1)
        assert len(_lose_node(slurm, job, "n2")) >= 4  # slurmd, slurmstepd, the agent, its rank (and helpers)

        def state() -> str:
            return job_state(slurm, job)

        deadline = time.monotonic() + 180
        while state() not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PENDING"):
            assert time.monotonic() < deadline, state()
            time.sleep(0.5)
        assert state() == "COMPLETED", out.read_text()[-3000:]
    finally:
        subprocess.run(["scancel", job], env=slurm)
        up = subprocess.run(["bash", str(CLUSTER), "up", str(Path(slurm["SLURM_CONF"]).parent)], capture_output=True)
        assert up.returncode == 0, up.stderr[-2000:]  # (n2's slurmd back for whatever runs next)
    headers = [r for p in sorted(run_dir.glob("samples.rank*.jsonl")) for r in read_jsonl(p) if "attempt" in r]
    worlds = [h["world_size"] for h in sorted((h for h in headers if h["rank"] == 0), key=lambda h: h["attempt"])]
    assert worlds in ([2, 1], [1, 2, 1]), worlds  # lost a node, went on without it
    s = summary(run_dir)
    assert s["world_size"] == 1 and s["goodput"]["restarts"] == len(worlds) - 1
    assert (
        "Restarts=0"
        in subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=slurm).stdout
    )
    for e in audit(str(run_dir)):
        assert e.repeated == 0 and e.missing == 0 and e.once == 1438, e


def test_an_elastic_sbatch_job_that_loses_a_node_restores_its_ranks_from_the_partners_copy(slurm, data_root, tmp_path):
    # ckpt.local.replicas=1 on the real cluster: each node's local dir (named by its SLURMD_NODENAME) holds its own
    # files and a verified copy of the other's. n2 is lost (its slurmd and processes killed) and its local dir cleared;
    # n1's agent re-forms the job at world size 1, which takes n2's files from the copy n1 holds (the durable tier
    # has nothing that new) and reshards them. Last in this module with the other lost-node test: n2 comes back.
    import re

    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    env = dict(slurm, PITSTOP_PYTHON=sys.executable, PITSTOP_RUN_DIR=str(run_dir))
    overrides = [
        "strategy=ddp",
        "strategy.nproc_per_node=1",
        "strategy.nnodes=1:2",
        "strategy.last_call_seconds=15",
        "trainer.max_restarts=3",
        "strategy.cpu_threads=1",
        "debug=tiny",
        "trainer.max_steps=200",
        "trainer.batch_size=32",
        "logger=none",
        "ckpt=sync_dcp",
        "ckpt.interval_steps=100",
        f"ckpt.local.dir={shm}_${{oc.env:SLURMD_NODENAME}}",
        "ckpt.local.interval_steps=2",
        "ckpt.local.replicas=1",
    ]
    job = sbatch(env, tmp_path, ["--no-kill"], overrides, data_root)
    out = tmp_path / f"slurm-{job}.out"
    n2 = Path(f"{shm}_n2")
    try:
        deadline = time.monotonic() + 120
        while not any(int(p.parent.name[5:]) >= 8 for p in n2.glob("*/step_*/REPLICATED")):  # (copied: acknowledged)
            said = out.read_text() if out.exists() else "no output"
            assert time.monotonic() < deadline and "agents exited" not in said, said[-3000:]
            time.sleep(0.05)
        assert len(_lose_node(slurm, job, "n2")) >= 4
        shutil.rmtree(n2)  # (a replacement node would come back with nothing of its own)
        deadline = time.monotonic() + 180
        while job_state(slurm, job) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PENDING"):
            assert time.monotonic() < deadline, job_state(slurm, job)
            time.sleep(0.5)
        assert job_state(slurm, job) == "COMPLETED", out.read_text()[-3000:]
    finally:
        subprocess.run(["scancel", job], env=slurm)
        up = subprocess.run(["bash", str(CLUSTER), "up", str(Path(slurm["SLURM_CONF"]).parent)], capture_output=True)
        assert up.returncode == 0, up.stderr[-2000:]
    log = (run_dir / "train.log").read_text()
    m = re.search(r"\(step (\d+), peer tier\)", log)
    assert m and 8 <= int(m.group(1)) < 100 and "resuming on 1" in log, log[-3000:]
    s = summary(run_dir)
    assert s["checkpoint"]["restored_from"] == "peer" and s["world_size"] == 1 and s["final_step"] == 200
