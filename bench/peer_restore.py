"""A lost node's recovery from its partner's copy of the local tier against from the durable tier, and what the copy
adds to each local save (``ckpt.local.replicas=1``, issue 50).

    python bench/peer_restore.py [--steps 400] [--lose-at 305] [--local-every 10] [--durable-every 200] \
        [--throttle-mbps 20] [--repeat 3]

One job, two "nodes" on this machine (pitstop's launcher twice, ``strategy.nnodes=2``, one rank each, each node its
own ``PITSTOP_NODE_NAME`` and its own local dir), ddp on the quick start's CNN, async DCP saves: the durable tier
(``ckpt.dir``) every ``--durable-every`` steps, written and read through ``ckpt.throttle_mbps`` (a network volume's
speed), the local tier every ``--local-every`` steps. ``fault=lose_node`` loses node n2 at the end of step ``--lose-at``
(its rank killed, its local dir cleared); the launchers restart both ranks (``trainer.max_restarts=1``). Run side by
side, alternating, ``--repeat`` times each (the median run of each is reported: a recovery of ~2 s moves by ~0.5 s
with what else the machine does), equal work (the same steps, seed, data and loss):

- ``peer``: ``ckpt.local.replicas=1``: n2's ranks restore from the copy n1 holds;
- ``durable``: ``ckpt.local.replicas=0``: n2 comes back empty, so the job restores from the durable tier.

Recovery = from the loss (the time ``faults.jsonl`` records, just before the kill) to the first productive step
(the end of step ``--lose-at`` + 1 in the restarted attempt: the first step no attempt had done), from rank 0's
``metrics.jsonl``. Its parts, from the ledger: the restart (recovery gap, program start, init), the restore, and the
steps done again (``lost``). Save cost, per local save, from the runs' summaries: the loop's blocking time and the
save's start -> complete (with the copy verified by its holder, when replicated). Every run ends with the same
parameters as a run without a loss (params_sha256): the figures are of runs that recovered exactly.
Target: recovery from the peer >= 5x faster than from the durable tier; the loop's blocking time per local save
unchanged within noise (<= 1.25x).

Each "node" gets its share of the machine's cores (``strategy.cpu_threads=1``): a rank of a one-rank node would
otherwise take every core, and two ranks with two OpenMP threads each on two cores spin against each other for
their first steps (~0.4 s of the first step of every attempt, measured; a real node's cores are its own).

What it leaves out: both "nodes" share one machine's memory, disk and cores, and the copy crosses loopback, not a
network; a small CNN (under 1 MB of state), so the durable tier's slow reads cost little here (at 20 MB/s, ~0.1 s
for the restore's check and load) and its extra cost is the older step and the steps done again; the restart itself
(processes, rendezvous, process groups: about a second here, minutes at scale, where a replacement node must also
join) is paid by both and is a large part of either recovery here (``recipe.goodput --peer`` adds the restart and
replacement at the job's scale to what each tier adds to it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from common import ROOT, ensure_data, save_result

FIGURES = {
    "steps": ("", "steps of the job", None),
    "lose_at": ("", "the step at whose end node n2 is lost (fault=lose_node)", None),
    "local_every": ("", "local tier: a save every this many steps", None),
    "durable_every": ("", "durable tier: a save every this many steps", None),
    "throttle_mbps": ("MB/s", "the durable tier's bandwidth, reads and writes (ckpt.throttle_mbps)", None),
    "recovery.peer": ("s", "a lost node, replicated local tier: from the loss to the first productive step", None),
    "recovery.durable": ("s", "the same without the copy: restored from the durable tier", None),
    "recovery.speedup": ("x", "recovery from the durable tier over recovery from the peer (medians)", ">= 5"),
    "recoveries.*": ("s", "every run's recovery (--repeat runs of each, alternating)", None),
    "restored_step.*": ("", "the step the job resumed from", None),
    "parts.*.*": (
        "s",
        "the recovery's parts (the ledger's buckets of the attempt after the loss): restart (recovery gap, program "
        "start, init), restore; redone: the work done again (the ledger's lost)",
        None,
    ),
    "local_save.block": ("s", "the loop's blocking time per local save, without the copy", None),
    "local_save.lag": ("s", "a local save's start to complete, without the copy", None),
    "replicated_save.block": ("s", "the same with the copy on the partner node", None),
    "replicated_save.lag": (
        "s",
        "the same with the copy: a save's start to its copy's end (what interval=auto uses)",
        None,
    ),
    "durable_save.block": ("s", "the loop's blocking time per durable save", None),
    "durable_save.lag": ("s", "a durable save's start to committed, through the throttle", None),
    "block_ratio": ("x", "blocking time per local save, with the copy over without (noise: ~10%)", "<= 1.25"),
    "same_params": ("", "every recovered run ends with the parameters of the run without a loss", "== true"),
}
MEASURES = ["src/pitstop/ckpt", "src/pitstop/resilience/node_loss.py", "src/pitstop/launch", "src/pitstop/train"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(a: argparse.Namespace) -> list[str]:
    return [
        "strategy=ddp",
        "strategy.nproc_per_node=1",
        "strategy.nnodes=2",
        "strategy.cpu_threads=1",  # (each "node" its own core, as a node has its own: see the module's docstring)
        "strategy.timeout=60",
        "logger=none",
        "trainer.progress_bar=false",
        f"trainer.max_steps={a.steps}",
        "trainer.batch_size=64",
        "trainer.eval_every_steps=null",
        "loader.num_workers=1",
        "ckpt=async_dcp",
        f"ckpt.interval_steps={a.durable_every}",
        f"ckpt.throttle_mbps={a.throttle_mbps}",
        f"ckpt.local.interval_steps={a.local_every}",
        "seed=7",
    ]


def two_nodes(args: list[str], tmp: str, name: str, timeout: float) -> list[int]:
    """Node n1's launcher, then n2's, each in its own session with its own node name and local dir; their codes."""
    port, procs = free_port(), []
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    for node in ("n1", "n2"):
        local = os.path.join(tmp, f"{name}_shm_{node}")
        cmd = [sys.executable, "-m", "recipe.train", *args, f"strategy.rdzv_endpoint=127.0.0.1:{port}"]
        cmd += [f"ckpt.local.dir={local}", f"paths.cache_dir={os.path.join(tmp, f'{name}_cache_{node}')}"]
        out = open(os.path.join(tmp, f"{name}_{node}.log"), "w")
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                env={**env, "PITSTOP_NODE_NAME": node},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        )
        time.sleep(1.0)  # (n1 hosts the rendezvous store)
    deadline = time.time() + timeout
    try:
        return [p.wait(max(1.0, deadline - time.time())) for p in procs]
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{name}: the job did not finish in {timeout:.0f} s (logs in {tmp})") from None
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)


def recovery(run_dir: str, lose_at: int) -> dict:
    """From the loss to the first productive step, its parts, and the step resumed from."""
    with open(os.path.join(run_dir, "faults.jsonl")) as f:
        lost = min(json.loads(ln)["time"] for ln in f if ln.strip() and json.loads(ln)["key"].startswith("lose_node"))
    first = None
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("step") == lose_at + 1 and "time" in r and "loss" in r and r["time"] > lost:
                first = r["time"]
                break
    if first is None:
        raise SystemExit(f"{run_dir}: no step {lose_at + 1} after the loss in metrics.jsonl")
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "goodput.json")) as f:
        ledger = json.load(f)
    again = ledger["attempts"][-1]["buckets"]  # (the attempt after the loss)
    gap = ledger["totals"].get("recovery_gap", 0.0)  # (between the attempts: the run's only restart)
    return {
        "seconds": first - lost,
        "resumed_from": summary.get("resumed_from"),
        "tier": summary["checkpoint"].get("restored_from"),
        "booked": sorted(ledger.get("restore_by_tier", {})),  # (the ledger's: the restore booked by its tier)
        "parts": {
            "restart": gap + sum(again.get(k, 0.0) for k in ("program_start", "health", "init")),
            "restore": again.get("restore", 0.0),
            "redone": ledger["totals"].get("lost", 0.0),
        },
        "checkpoint": summary["checkpoint"],
        "params": summary["params_sha256"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--lose-at", type=int, default=305)
    p.add_argument("--local-every", type=int, default=10)
    p.add_argument("--durable-every", type=int, default=200)
    p.add_argument("--throttle-mbps", type=float, default=20.0)
    p.add_argument("--repeat", type=int, default=3, help="pairs of runs with a loss; the median of each is reported")
    p.add_argument("--timeout", type=float, default=900.0)
    a = p.parse_args()
    ensure_data()
    tmp = tempfile.mkdtemp(prefix="pitstop-bench-peer-")
    base = job(a)
    runs: dict[str, list[dict]] = {"peer": [], "durable": []}
    done = False
    try:
        plain = os.path.join(tmp, "plain")
        codes = two_nodes([*base, f"run_dir={plain}", "ckpt.local.replicas=0"], tmp, "plain", a.timeout)
        if codes != [0, 0]:
            raise SystemExit(f"the run without a loss failed: {codes} (logs in {tmp})")
        with open(os.path.join(plain, "summary.json")) as f:
            reference = json.load(f)["params_sha256"]
        for i in range(a.repeat):  # (alternating, so that a slow spell of the machine falls on both)
            for name, replicas in (("peer", 1), ("durable", 0)):
                run_dir = os.path.join(tmp, f"{name}{i}")
                # (at --lose-at in both runs, whatever is copied: the recovery's clock stops at the step after it)
                lose = ["fault=lose_node", "fault.node=n2", f"fault.step={a.lose_at}", "fault.wait_for_copy=false"]
                lose.append("trainer.max_restarts=1")
                args = [*base, f"run_dir={run_dir}", f"ckpt.local.replicas={replicas}", *lose]
                codes = two_nodes(args, tmp, f"{name}{i}", a.timeout)
                if codes != [0, 0]:
                    raise SystemExit(f"{name}: the job did not recover: exit codes {codes} (logs in {tmp})")
                got = recovery(run_dir, a.lose_at)
                if got["tier"] != name or got["booked"] != [name]:
                    raise SystemExit(
                        f"{name}: the job restored from the {got['tier']} tier, its ledger booked {got['booked']} "
                        f"(logs in {tmp})"
                    )
                runs[name].append(got)
        done = True
    finally:
        if done:
            shutil.rmtree(tmp, ignore_errors=True)
    every = {k: [round(r["seconds"], 2) for r in v] for k, v in runs.items()}
    median = {k: sorted(v, key=lambda r: r["seconds"])[len(v) // 2] for k, v in runs.items()}  # (the median run)
    same = all(r["params"] == reference for v in runs.values() for r in v)
    peer, far = median["peer"], median["durable"]
    ck_peer, ck_far = peer["checkpoint"], far["checkpoint"]
    block, block_rep = ck_far["local_block_seconds_mean"], ck_peer["local_block_seconds_mean"]
    figures = {
        "steps": a.steps,
        "lose_at": a.lose_at,
        "local_every": a.local_every,
        "durable_every": a.durable_every,
        "throttle_mbps": a.throttle_mbps,
        "recovery": {
            "peer": round(peer["seconds"], 3),
            "durable": round(far["seconds"], 3),
            "speedup": round(far["seconds"] / max(peer["seconds"], 1e-9), 2),
        },
        "recoveries": every,
        "restored_step": {"peer": peer["resumed_from"], "durable": far["resumed_from"]},
        "parts": {k: {n: round(v, 3) for n, v in r["parts"].items()} for k, r in median.items()},
        "local_save": {"block": block, "lag": ck_far["local_total_seconds_mean"]},
        "replicated_save": {"block": block_rep, "lag": ck_peer["local_replicated_seconds_mean"]},
        "durable_save": {"block": ck_far["block_seconds_mean"], "lag": ck_far["total_seconds_mean"]},
        "block_ratio": round(block_rep / max(block, 1e-9), 2),
        "same_params": same,
    }
    print(f"{'node n2 lost at step ' + str(a.lose_at):28} {'resumed from':>12} {'recovery s':>10} "
          f"{'restart s':>9} {'restore s':>9} {'redone s':>8}")  # fmt: skip
    for name, r in median.items():
        parts = r["parts"]
        print(
            f"{'from the ' + name + (' copy' if name == 'peer' else ' tier'):28} {r['resumed_from']!s:>12} "
            f"{r['seconds']:>10.2f} {parts['restart']:>9.2f} {parts['restore']:>9.2f} {parts['redone']:>8.2f}"
        )
    print(f"(the median of {a.repeat} runs each; all: peer {every['peer']} s, durable {every['durable']} s)")
    print(f"recovery from the durable tier / from the peer: {figures['recovery']['speedup']:.2f}x (target >= 5x)")
    print(
        f"a local save blocks the loop {block * 1000:.1f} ms without the copy, {block_rep * 1000:.1f} ms with it "
        f"({figures['block_ratio']:.2f}x, target <= 1.25x); complete after "
        f"{figures['local_save']['lag']:.3f} s without, {figures['replicated_save']['lag']:.3f} s with the copy"
    )
    print(f"every recovered run ends with the parameters of the run without a loss: {figures['same_params']}")
    save_result("peer_restore", figures)


if __name__ == "__main__":
    main()
