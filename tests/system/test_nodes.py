"""Several nodes, on one machine: real agents (``torchrun``, and pitstop's own launcher with ``strategy.nnodes``),
each with its own node-local cache and log, sharing one run dir; a node lost and a node that comes back.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PY, cli, cli_cmd, popen_cmd, read_jsonl

pytestmark = pytest.mark.slow  # every test here starts agents and ranks in subprocesses

# Shortened, but at the default loader (2 workers per rank) and evaluation settings.
JOB = [
    "trainer.max_steps=24",
    "trainer.batch_size=32",
    "trainer.eval_every_steps=12",
    "ckpt=async_dcp",
    "ckpt.interval_steps=10",
    "seed=21",
    "strategy.timeout=60",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summary(run_dir) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


class Agent:
    """One node's agent in its own process group (killing the group = losing the node), its output in a file."""

    def __init__(self, args: list[str], name: str, data_root, tmp_path, torchrun: list[str] | None = None):
        cmd = cli_cmd([*args, f"paths.cache_dir={tmp_path / ('cache_' + name)}"], data_root, tmp_path)
        env = dict(os.environ)
        if torchrun is not None:  # torchrun starts the rank; recipe.train runs as that rank (RANK set)
            cmd = [PY, "-m", "torch.distributed.run", *torchrun, "-m", "recipe.train", *cmd[3:]]
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # (README: needed with --nnodes=MIN:MAX)
        self.log = tmp_path / f"agent_{name}.log"
        with open(self.log, "w") as out:
            self.proc = popen_cmd(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"agent did not finish: {self.output()[-2000:]}") from None

    def kill(self) -> None:
        """The whole node at once: the agent and every process under it (torchrun starts its ranks in sessions
        of their own, so the process group alone would leave them running)."""
        signal_all([self.proc.pid, *descendants(self.proc.pid)], signal.SIGKILL)
        self.proc.wait()

    def output(self) -> str:
        return self.log.read_text()


def descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, of in parents.items() if of == parent]
        out += kids
        todo += kids
    return out


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def pending(pid: int, sig: signal.Signals) -> bool:
    """Whether ``sig`` waits, undelivered, at process ``pid`` (a stopped process keeps what it was sent)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
    except OSError:
        return False
    return any(m >> (sig - 1) & 1 for m in masks)


def two_nodes(args: list[str], data_root, tmp_path, torchrun: bool = False, second: list[str] | None = None):
    """Node 0's agent first (it hosts the rendezvous store), then node 1's; both exit codes and agents."""
    port = free_port()
    launch = (
        []
        if torchrun
        else ["strategy.nproc_per_node=1", "strategy.nnodes=2", f"strategy.rdzv_endpoint=127.0.0.1:{port}"]
    )
    flags = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    a = Agent([*launch, *args], "a", data_root, tmp_path, flags if torchrun else None)
    time.sleep(1.5)
    b = Agent([*launch, *(second or args)], "b", data_root, tmp_path, flags if torchrun else None)
    try:
        return (a.wait(), b.wait()), (a, b)
    finally:
        a.kill(), b.kill()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_torchrun_agents_train_bitwise_like_one_node_with_two_ranks(strategy, data_root, tmp_path):
    # Same world (2 ranks), seed and data as one node with 2 ranks => the same model. On CPU the threads per rank
    # are part of the arithmetic (a reduction split over another number of threads rounds differently): auto gives
    # each of two agents on this 2-core machine 2 threads (each thinks it has the node), one node's 2 ranks 1 each.
    # That was the whole difference (e63d… vs 5f9f… in the issue); pinned to the same count, the digests agree.
    same = [f"strategy={strategy}", *JOB, "strategy.cpu_threads=1"]
    ref = cli([*same, "strategy.nproc_per_node=2", f"run_dir={tmp_path / 'one'}"], data_root, tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    codes, agents = two_nodes([*same, f"run_dir={tmp_path / 'two'}"], data_root, tmp_path, torchrun=True)
    assert codes == (0, 0), agents[0].output()[-3000:] + agents[1].output()[-3000:]
    one, two = summary(tmp_path / "one"), summary(tmp_path / "two")
    assert two["world_size"] == 2 and two["final_step"] == 24
    assert two["params_sha256"] == one["params_sha256"]
    # only global rank 0 writes the run's files: one train.log (rank 1 has its own), one summary, one ledger
    assert "[rank1]" not in (tmp_path / "two" / "train.log").read_text() and (tmp_path / "two" / "rank1.log").is_file()


@pytest.mark.parametrize("launcher", ["pitstop", "torchrun"])
def test_a_lost_node_shrinks_the_job_and_a_new_node_grows_it_back(launcher, data_root, tmp_path):
    # Every node elastic between 1 and 2 nodes, restarts allowed: pitstop's launcher (strategy.nnodes=1:2) or
    # torchrun --nnodes=1:2. Node b's agent and ranks are killed mid-epoch (a lost node): node a's agent re-forms
    # the job at world size 1 and it resumes from the newest complete checkpoint. A new node c then joins: the
    # agents restart their ranks at once (membership changes cost no restart budget); the ranks take the restart
    # as a preemption notice, save, and the job resumes at world size 2 from that save.
    from pitstop.audit import audit

    run_dir, port = tmp_path / "run", free_port()
    args = [
        "strategy=ddp",
        "strategy.nproc_per_node=1",
        f"run_dir={run_dir}",
        "ckpt=async_dcp",
        "ckpt.interval_steps=5",
        "trainer.epochs=4",
        "trainer.batch_size=32",
        "seed=21",
        "logger=none",
        "data.record_sample_ids=true",
        "strategy.timeout=60",
        "strategy.cpu_threads=1",
        "trainer.hang.enabled=false",  # (node a's ranks are held below for as long as node c takes to join)
    ]
    torchrun = None
    if launcher == "pitstop":
        args += ["strategy.nnodes=1:2", f"strategy.rdzv_endpoint=127.0.0.1:{port}", "trainer.max_restarts=3"]
        args += ["strategy.last_call_seconds=15"]  # (b may start seconds after a on a busy machine: the job forms at 2)
    else:
        torchrun = [
            "--nnodes=1:2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--max-restarts=3",
            "--rdzv-conf=last_call_timeout=15,keep_alive_interval=1,keep_alive_max_attempt=5",
        ]

    def step() -> int:
        path = run_dir / "metrics.jsonl"
        return max((r.get("step", 0) for r in read_jsonl(path)), default=0) if path.exists() else 0

    def until(cond, what: str, limit: float = 120) -> None:
        t = time.time()
        while not cond():
            assert time.time() - t < limit, (
                f"timed out waiting for {what}: {(run_dir / 'train.log').read_text()[-3000:]}"
            )
            time.sleep(0.05)

    a = Agent(args, "a", data_root, tmp_path, torchrun)
    time.sleep(1.5)
    b = Agent(args, "b", data_root, tmp_path, torchrun)
    c = None
    try:
        until(lambda: step() >= 12, "step 12 at world size 2")
        b.kill()  # the lost node: its agent and its rank at once
        until(lambda: "rank 0/1 " in (run_dir / "train.log").read_text(), "the job at world size 1")
        shrunk = step()
        until(lambda: step() >= shrunk + 5, "progress at world size 1")
        # Hold node a's ranks (SIGSTOP: their agent runs on) until node c has joined and a's agent has asked them to
        # stop for the regrown job: without it the job at world size 1 can end before c is up (seconds, on a busy
        # machine), and c finds the rendezvous closed. The agent's SIGTERM waits at the stopped rank until SIGCONT.
        held = descendants(a.proc.pid)
        signal_all(held, signal.SIGSTOP)
        c = Agent(args, "c", data_root, tmp_path, torchrun)  # the replacement node
        try:
            until(lambda: any(pending(pid, signal.SIGTERM) for pid in held), "node c to join", limit=180)
        finally:
            signal_all(held, signal.SIGCONT)
        assert a.wait() == 0, a.output()[-3000:]
        assert c.wait() == 0, c.output()[-3000:]
    finally:
        for agent in (a, b, c):
            if agent is not None:
                agent.kill()
    headers = [r for p in sorted(run_dir.glob("samples.rank*.jsonl")) for r in read_jsonl(p) if "attempt" in r]
    worlds = [h["world_size"] for h in sorted((h for h in headers if h["rank"] == 0), key=lambda h: h["attempt"])]
    assert worlds == [2, 1, 2]  # lost a node, got one back
    s = summary(run_dir)
    assert s["world_size"] == 2 and s["goodput"]["restarts"] == 2
    assert s["goodput"]["totals"]["recovery_gap"] > 0
    # Work is lost when the node went after the newest checkpoint's step; when it went right at it (rank 0 had
    # reached a multiple of ckpt.interval_steps, saved, and lost its peer in the next step: ~1 time in 5 on a busy
    # machine), nothing was redone and none may be booked as lost.
    first, second = json.loads((run_dir / "goodput.json").read_text())["attempts"][:2]
    redone = first["step"] > (second.get("resumed_from") or 0)
    assert (s["goodput"]["totals"]["lost"] > 0) == redone, (first["step"], second.get("resumed_from"))
    log = (run_dir / "train.log").read_text()
    assert "resharding: checkpoint written by 2 rank(s), resuming on 1" in log
    assert "resharding: checkpoint written by 1 rank(s), resuming on 2" in log
    # Every sample of every epoch exactly once across all of it: where the world size changed mid-epoch, the rest of
    # the epoch was split over the new ranks sample by sample, in equal steps (tests/test_loader.py has the cases).
    for e in audit(str(run_dir)):
        assert e.repeated == 0 and e.missing == 0 and e.once == 1438, e
    assert s["metrics"]["val_accuracy"] > 0.8  # it converged like an uninterrupted run (~0.9 after 4 epochs)
    # Each resume re-planned the LR schedule over the steps left at its world size: after the last one (the job grew
    # back, fewer steps left than the schedule saved at world size 1 had planned) it still decays, step by step, to
    # its floor (optim=sgd: 0.05 x min_lr_ratio 0.01) at the last step, not to the floor early and flat from there.
    lr = {r["step"]: r["lr"] for r in read_jsonl(run_dir / "metrics.jsonl") if "lr" in r}
    after = [lr[k] for k in sorted(lr) if k > max(h["resumed_from"] for h in headers)]
    assert all(x > y for x, y in zip(after, after[1:])), after
    assert math.isclose(after[-1], 0.05 * 0.01) and sorted(lr)[-1] == s["final_step"]

    # The same sequence of world sizes, replayed without agents: 2 ranks stopped (a preemption notice) right after the
    # step the shrunken job resumed from, 1 rank from there to the step the grown job resumed from, 2 ranks to the
    # end. Where the elastic run's ranks happened to be when the node was lost or came back does not matter: only
    # the checkpoints resumed from do, so the final parameters are the same, bit for bit.
    (r1, r2) = sorted({h["resumed_from"] for h in headers} - {0})
    replay = [
        a
        for a in args
        if not a.startswith(("run_dir=", "strategy.nnodes=", "strategy.rdzv_endpoint=", "trainer.max_restarts="))
    ] + [f"run_dir={tmp_path / 'replay'}"]
    for world, stop, code in ((2, r1, 75), (1, r2, 75), (2, None, 0)):
        fault = ["fault=preempt", f"fault.step={stop}"] if stop else []
        p = cli([*replay, f"strategy.nproc_per_node={world}", *fault], data_root, tmp_path)
        assert p.returncode == code, p.stderr[-3000:]
    assert summary(tmp_path / "replay")["params_sha256"] == s["params_sha256"]


def test_each_node_downloads_each_shard_once(data_root, tmp_path):
    from pitstop.testing.slowstore import SlowStore

    with SlowStore(str(data_root / "data"), latency_ms=5) as store:
        codes, agents = two_nodes(
            ["strategy=ddp", *JOB, "loader=cached", f"data.root={store.url}/digits", f"run_dir={tmp_path / 'run'}"],
            data_root,
            tmp_path,
        )
        assert codes == (0, 0), agents[0].output()[-3000:] + agents[1].output()[-3000:]
        requests = {p: v["requests"] for p, v in store.stats()["paths"].items() if p.endswith(".tar")}
    # 10 shards (8 train, 2 val), two nodes with a cache dir each, 2 loader workers per rank: at most one download
    # per shard per node (never ranks x workers), and each download is in exactly one node's cache
    assert len(requests) == 10 and set(requests.values()) <= {1, 2}, requests
    cached = [len(list((tmp_path / f"cache_{n}").rglob("*.tar"))) for n in "ab"]
    assert min(cached) > 0 and sum(cached) == sum(requests.values()), (cached, requests)


@pytest.mark.parametrize("case", ["seed", "run_dir", "cache_dir"])
def test_nodes_that_disagree_are_refused_in_one_line(case, data_root, tmp_path):
    args = ["strategy=ddp", *JOB, "logger=none", f"run_dir={tmp_path / 'run'}"]
    second = list(args)
    if case == "seed":
        second[second.index("seed=21")] = "seed=22"
    elif case == "run_dir":  # same name (the job id), another directory: not the shared one
        second[-1] = f"run_dir={tmp_path / 'elsewhere' / 'run'}"
    else:  # both nodes' cache dirs on one (shared) directory
        args = second = [*args, "loader=cached", f"loader.cache_dir={tmp_path / 'shared_cache'}"]
    started = time.time()
    codes, agents = two_nodes(args, data_root, tmp_path, second=second)
    assert codes == (2, 2) and time.time() - started < 60
    want = {
        "seed": "different configs: seed=21 on rank 0 (node 0",
        "run_dir": "is not shared between the nodes",
        "cache_dir": "loader.cache_dir is shared by nodes",
    }[case]
    for agent in agents:
        last = [ln for ln in agent.output().splitlines() if ln.startswith("error: ")][-1]
        assert want in last, agent.output()[-3000:]
    if case == "seed":
        assert "seed=22 on rank 1 (node 1" in last


def test_a_node_that_cannot_reach_the_rendezvous_fails_within_the_timeout(data_root, tmp_path):
    started = time.time()
    p = cli(
        [
            "strategy=ddp",
            "strategy.nproc_per_node=1",
            "strategy.nnodes=2",
            "strategy.rdzv_endpoint=192.0.2.1:29500",
            "strategy.timeout=5",
            "logger=none",
            f"run_dir={tmp_path / 'run'}",
        ],
        data_root,
        tmp_path,
        timeout=120,
    )
    took = time.time() - started
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and last.startswith(
        "error: this node could not join the job's rendezvous at 192.0.2.1:29500"
    )
    assert took < 60, took


def test_several_nodes_need_a_rendezvous_endpoint(make_cfg):
    from pitstop.errors import ConfigError
    from pitstop.launch.launcher import run
    from pitstop.launch.plan import plan

    assert plan(make_cfg("strategy=ddp", "strategy.nnodes=1:4"), {}).nodes == (1, 4)
    for bad in ("0", "3:2", "x"):
        with pytest.raises(ConfigError, match="strategy.nnodes must be N or MIN:MAX"):
            plan(make_cfg("strategy=ddp", f"strategy.nnodes={bad}"), {})
    cfg = make_cfg("strategy=ddp", "strategy.nnodes=2", "strategy.nproc_per_node=1")
    with pytest.raises(ConfigError, match="needs strategy.rdzv_endpoint=HOST:PORT"):
        run(cfg, cfg.run_dir)
