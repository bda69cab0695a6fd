"""The local tier copied to a peer node (``ckpt.local.replicas=1``), with two nodes on this machine: two agents with
their own node names and local dirs, one run dir.  A node lost (both agents killed, its local dir cleared, the same
command again: a requeued job on a replacement node) restores its ranks from the copy its partner holds, exactly;
a corrupt copy falls back to the durable tier in one line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import cli, cli_cmd, popen_cmd
from test_nodes import descendants, free_port, signal_all

pytestmark = pytest.mark.slow  # (two agents and their ranks; each moment picked by what the run writes)

STEPS = 24
JOB = [
    "strategy=ddp",
    "strategy.cpu_threads=1",
    "strategy.timeout=60",
    "debug=tiny",
    f"trainer.max_steps={STEPS}",
    "trainer.batch_size=32",
    "ckpt=sync_dcp",
    "ckpt.interval_steps=6",
    "seed=21",
]


def agents(
    tmp_path, data_root, run_dir, extra: list[str], log: str, nnodes: str = "2", local: Path | None = None
) -> dict[str, subprocess.Popen]:
    """Node a's agent (it hosts the rendezvous: node b's starts once a's listens on its port), then node b's: their
    own names (PITSTOP_NODE_NAME), local dirs (``local``: node b's) and caches."""
    port = free_port()
    out = {}
    for name in ("a", "b"):
        args = [
            *JOB,
            *extra,
            "strategy.nproc_per_node=1",
            f"strategy.nnodes={nnodes}",
            f"strategy.rdzv_endpoint=127.0.0.1:{port}",
            f"run_dir={run_dir}",
            f"ckpt.local.dir={local if local and name == 'b' else tmp_path / ('shm_' + name)}",
            "ckpt.local.interval_steps=2",
            "ckpt.local.replicas=1",
            f"paths.cache_dir={tmp_path / ('cache_' + name)}",
        ]
        with open(tmp_path / f"{log}_{name}.log", "w") as f:
            env = dict(os.environ, PITSTOP_NODE_NAME=name)
            cmd = cli_cmd(args, data_root, tmp_path)
            out[name] = popen_cmd(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        if name == "a":
            wait_for(lambda: listening(port), 60, out)
    return out


def listening(port: int) -> bool:
    """Whether a socket of this machine listens on TCP ``port`` (the rendezvous store of node a's agent), as the
    kernel lists it: nothing connects to it."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        if any(int(r[1].rsplit(":", 1)[1], 16) == port and r[3] == "0A" for r in rows):  # (0A: LISTEN)
            return True
    return False


def wait_for(cond, timeout: float, procs: dict[str, subprocess.Popen] | None = None) -> None:
    """Until ``cond()`` (what the run writes) holds; fails at once when an agent of ``procs`` ended first.  Checked
    often: a tiny job's whole run is about a second, and the moment waited for must be caught before it ends."""
    deadline = time.monotonic() + timeout
    while not cond():
        ended = {n: p.returncode for n, p in (procs or {}).items() if p.poll() is not None}
        assert not ended, f"agent(s) ended ({ended}) before what the test waits for"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)  # (a check's interval, not a moment: each check reads what the run wrote)


def kill(procs: dict[str, subprocess.Popen]) -> None:
    for p in procs.values():
        signal_all([p.pid, *descendants(p.pid)], signal.SIGKILL)
        p.wait()


def finish(procs: dict[str, subprocess.Popen], tmp_path, log: str) -> None:
    try:
        codes = {n: p.wait(240) for n, p in procs.items()}
    finally:
        kill(procs)
    said = "".join((tmp_path / f"{log}_{n}.log").read_text(errors="replace")[-3000:] for n in procs)
    assert codes == {"a": 0, "b": 0}, said


def replicated(shm: Path, at_least: int) -> list[int]:
    """Steps of node ``shm``'s own local checkpoints whose copy its partner acknowledged (REPLICATED)."""
    return [int(p.parent.name[5:]) for p in shm.glob("*/step_*/REPLICATED") if int(p.parent.name[5:]) >= at_least]


@pytest.fixture(scope="module")
def references(data_root, tmp_path_factory):
    """The same job (2 ranks, one thread each) on one node, uninterrupted: its final parameters, per strategy."""
    done: dict[str, str] = {}

    def digest(strategy: str = "ddp") -> str:
        if strategy not in done:
            tmp = tmp_path_factory.mktemp("peer_ref")
            args = [*JOB, f"strategy={strategy}", "strategy.nproc_per_node=2", f"run_dir={tmp / 'run'}"]
            r = cli(args, data_root, tmp)
            assert r.returncode == 0, r.stderr[-3000:]
            done[strategy] = json.loads((tmp / "run" / "summary.json").read_text())["params_sha256"]
        return done[strategy]

    return digest


def lose_node_b(tmp_path, data_root, run_dir, after: int, extra: list[str]) -> int:
    """Run until a local save of a step past ``after`` (and newer than the durable tier's) is copied both ways (each
    node's leader marks its own REPLICATED after the agreement, in its own time: b's marker alone does not say a's is
    written), then lose the job and node b's local dir; the newest step b's copy holds. The job stops responding at
    the end of step ``after + 3`` (rank 1 sleeps; no hang detection), before the next durable save (``after`` + 4,
    a multiple of 6): that save's retention would otherwise remove the copies of its step and older ones if it came
    before the loss (on a loaded machine it did)."""
    assert (after + 4) % 6 == 0, "the stall must come before the next durable save (ckpt.interval_steps=6)"
    stall = ["fault=stall", f"fault.step={after + 3}", "fault.rank=1", "trainer.hang.enabled=false"]
    first = agents(tmp_path, data_root, run_dir, [*extra, *stall], "first")
    both = lambda: set(replicated(tmp_path / "shm_a", after)) & set(replicated(tmp_path / "shm_b", after))  # noqa: E731
    try:
        wait_for(both, 180, first)
    finally:
        kill(first)
    shutil.rmtree(tmp_path / "shm_b")  # (a replacement node: nothing of its own)
    return max(int(p.parent.name[5:]) for p in (tmp_path / "shm_a").glob("*/peer/1/step_*/COPIED"))


@pytest.mark.parametrize("backend,strategy", [("sync_dcp", "ddp"), ("async_dcp", "ddp"), ("async_dcp", "fsdp")])
def test_a_lost_node_restores_its_ranks_from_the_partners_copy_exactly(
    backend, strategy, data_root, tmp_path, references
):
    # (fsdp: each rank's files hold its own shards, so node b's are nowhere but in the copy)
    run_dir, job = tmp_path / "run", [f"ckpt={backend}", f"strategy={strategy}"]
    newest = lose_node_b(tmp_path, data_root, run_dir, 8, job)
    assert newest % 6, "the newest copied step is a durable one: nothing to show"
    again = agents(tmp_path, data_root, run_dir, job, "again")
    finish(again, tmp_path, "again")
    log = (run_dir / "train.log").read_text()
    m = re.search(r"\(step (\d+), peer tier\)", log)
    assert m and int(m.group(1)) in (newest, newest - 2), log[-3000:]  # (a newer save may not have been copied)
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["checkpoint"]["restored_from"] == "peer" and s["final_step"] == STEPS
    assert s["checkpoint"]["local_copies"] >= 1 and s["checkpoint"]["local_copies_off"] is None  # (copied again)
    assert s["params_sha256"] == references(strategy)


def test_a_corrupt_copy_falls_back_to_the_durable_tier_in_one_line(data_root, tmp_path, references):
    run_dir = tmp_path / "run"
    newest = lose_node_b(tmp_path, data_root, run_dir, 8, [])
    copy = next((tmp_path / "shm_a").glob(f"*/peer/1/step_{newest:08d}"))
    shard = next(copy.glob("__1_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    again = agents(tmp_path, data_root, run_dir, [], "again")
    finish(again, tmp_path, "again")
    log = (run_dir / "train.log").read_text()
    said = [line for line in log.splitlines() if "cannot be made whole" in line]
    assert len(said) == 1 and f"step {newest}" in said[0] and "durable tier" in said[0], log[-3000:]
    assert re.search(r"\(step \d+, durable tier\)", log), log[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["checkpoint"]["restored_from"] == "durable" and s["params_sha256"] == references()


@pytest.mark.serial  # (the job forms at 2 nodes only if b's agent joins within strategy.last_call_seconds)
def test_a_job_that_re_forms_without_the_lost_node_restores_its_files_from_the_copy_resharded(data_root, tmp_path):
    # Elastic (1 to 2 nodes): node b is lost (its agent and rank killed, its local dir cleared); node a's agent
    # re-forms the job at world size 1, which takes b's files from the copy a holds and reshards 2 ranks' state to 1.
    run_dir = tmp_path / "run"
    elastic = ["trainer.max_restarts=2", "strategy.last_call_seconds=8"]
    procs = agents(tmp_path, data_root, run_dir, elastic, "elastic", nnodes="1:2")
    try:
        wait_for(lambda: replicated(tmp_path / "shm_b", 8), 180, procs)
        signal_all([procs["b"].pid, *descendants(procs["b"].pid)], signal.SIGKILL)
        shutil.rmtree(tmp_path / "shm_b")
        assert procs["a"].wait(240) == 0, (tmp_path / "elastic_a.log").read_text()[-3000:]
    finally:
        kill(procs)
    log = (run_dir / "train.log").read_text()
    assert re.search(r"\(step \d+, peer tier\)", log) and "resuming on 1" in log, log[-3000:]
    assert "no other node to hold a copy" in log
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["checkpoint"]["restored_from"] == "peer" and s["final_step"] == STEPS and s["world_size"] == 1


def test_a_local_dir_too_small_for_two_copies_stops_both_nodes_before_training_in_one_line(data_root, tmp_path):
    small = tmp_path / "shm_b"  # node b's local dir: a real tmpfs of 8 KiB
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"a tmpfs cannot be mounted here: {mounted.stderr.decode(errors='replace').strip()[:200]}")
    try:
        procs = agents(tmp_path, data_root, tmp_path / "run", [], "small", local=small)
        codes = {n: p.wait(120) for n, p in procs.items()}
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
    for name in ("a", "b"):
        said = (tmp_path / f"small_{name}.log").read_text(errors="replace")
        last = [line for line in said.splitlines() if line.startswith("error: ")]
        assert codes[name] == 2 and last, said[-3000:]
        assert re.search(
            r"ckpt.local.replicas=1: the local dir \(ckpt.local.dir\) on node b has \d+ KiB for checkpoints, and a "
            r"node holds its own checkpoint and its partner's \(\d+ KiB\)", last[-1]), said[-3000:]  # fmt: skip
    log = (tmp_path / "run" / "train.log").read_text()
    assert "ckpt.local.replicas=1: the local dir" in log and not re.search(r"step \d+: \w+=", log)  # (no step)
