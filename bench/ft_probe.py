"""What torchft itself costs a healthy replica group when a peer group dies (issue 25, before ``strategy=ft``).

    .venv/bin/pip install -e '.[ft]'   # torchft==0.2.0 beside the pinned torch (not in the default install)
    python bench/ft_probe.py [--kills 5] [--heartbeat-ms 250 1000] [--timeout 2] [--step-ms 20]

Two replica groups of one rank each (a process each, its own TCPStore and ``torchft.Manager``, a
``ProcessGroupGloo`` across groups) train a small model for real against one Lighthouse started here. Every few
seconds group 1 is SIGKILLed and started again: it heals from group 0 over torchft's checkpoint transport. For each
Lighthouse heartbeat timeout the table shows, side by side in one run:
- group 0's pause per failure (its longest step around the kill, minus a normal step) and its discarded steps;
- group 1's heal: from its imports done to its first committed step (Manager, quorum, state from group 0), and
  whether it then held group 0's parameters at that step;
- whether group 0 ever restarted (its pid is the same from start to end).
The figures say which knob bounds the pause (the heartbeat timeout, not the collective timeout: a dead peer's
sockets close at once) and so what ``strategy=ft`` should derive from the measured step time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time


def replica(args: argparse.Namespace) -> None:
    """One replica group of one rank: train until told to stop, one JSON line per step on stdout."""
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    t_imported = time.time()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=args.timeout)

    def load(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load,
        state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
        min_replica_size=1,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=10),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"group{args.replica}",
        heartbeat_interval=timedelta(milliseconds=max(20, args.heartbeat_ms // 5)),
        init_sync=False,
    )
    g = torch.Generator().manual_seed(1)
    while True:
        t0 = time.perf_counter()
        manager.start_quorum()
        x = torch.randn(32, 64, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        time.sleep(args.step_ms / 1000)  # the rest of a step's compute
        for p in model.parameters():
            manager.allreduce(p.grad).wait()
        committed = manager.should_commit()
        if committed:
            opt.step()
        digest = float(sum(p.double().sum() for p in model.parameters()))
        now = time.time()
        rec = {"t": now, "took": time.perf_counter() - t0, "step": manager.current_step(), "committed": committed,
               "participants": manager.num_participants(), "since_imports": now - t_imported, "pid": os.getpid(),
               "digest": digest}  # fmt: skip
        print(json.dumps(rec), flush=True)


def run_one(heartbeat_ms: int, kills: int, timeout: float, step_ms: int) -> dict:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=20, heartbeat_timeout_ms=heartbeat_ms
    )
    tmp = tempfile.mkdtemp(prefix="ft-probe-")
    base = [sys.executable, __file__, "--lighthouse", lighthouse.address(), "--timeout", str(timeout),
            "--step-ms", str(step_ms), "--heartbeat-ms", str(heartbeat_ms)]  # fmt: skip

    def start(k: int, n: int):
        out = open(os.path.join(tmp, f"group{k}.{n}.jsonl"), "w")
        err = open(os.path.join(tmp, f"group{k}.{n}.err"), "w")
        return subprocess.Popen([*base, "--replica", str(k)], stdout=out, stderr=err), out.name

    def records(path: str) -> list[dict]:
        with open(path) as f:
            return [json.loads(line) for line in f if line.startswith("{")]

    g0, g0_path = start(0, 0)
    g1, g1_path = start(1, 0)
    kill_times, heals, healed_equal = [], [], []
    try:
        time.sleep(8)  # both up, training together
        for n in range(1, kills + 1):
            kill_times.append(time.time())
            g1.send_signal(signal.SIGKILL)
            g1.wait()
            time.sleep(0.5)
            g1, g1_path = start(1, n)
            deadline = time.time() + 60
            while time.time() < deadline:
                recs = [r for r in records(g1_path) if r["committed"]]
                if recs:
                    first = recs[0]
                    heals.append(first["since_imports"])  # Manager, quorum, heal, first commit
                    peer = [r for r in records(g0_path) if r["step"] == first["step"]]
                    healed_equal.append(bool(peer) and peer[-1]["digest"] == first["digest"])
                    break
                time.sleep(0.1)
            time.sleep(3)
    finally:
        for p in (g0, g1):
            p.kill()
            p.wait()
        lighthouse.shutdown()
    steps = records(g0_path)
    normal = statistics.median(r["took"] for r in steps)
    pauses, discarded = [], 0
    for t in kill_times:
        around = [r for r in steps if t - 0.2 <= r["t"] - r["took"] and r["t"] <= t + 15]
        if around:
            pauses.append(max(r["took"] for r in around[:20]) - normal)
    discarded = sum(1 for r in steps if not r["committed"])
    return {
        "heartbeat_ms": heartbeat_ms,
        "step_s": normal,
        "pause_median_s": statistics.median(pauses) if pauses else None,
        "pause_max_s": max(pauses) if pauses else None,
        "discarded": discarded,
        "kills": len(kill_times),
        "healed_equal": f"{sum(healed_equal)}/{len(healed_equal)}",
        "group0_pids": len({r["pid"] for r in steps}),
        "heal_s": statistics.median(heals) if heals else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replica", type=int)
    ap.add_argument("--lighthouse")
    ap.add_argument("--timeout", type=float, default=2.0, help="the Manager's and Gloo's timeout (s)")
    ap.add_argument("--step-ms", type=int, default=20)
    ap.add_argument("--heartbeat-ms", type=int, nargs="+", default=[250, 1000])
    ap.add_argument("--kills", type=int, default=5)
    args = ap.parse_args()
    if args.replica is not None:
        args.heartbeat_ms = args.heartbeat_ms[0]
        return replica(args)
    rows = [run_one(hb, args.kills, args.timeout, args.step_ms) for hb in args.heartbeat_ms]
    print(f"torchft: 2 replica groups x 1 rank (gloo, CPU), step {args.step_ms} ms + compute, "
          f"timeout {args.timeout} s, {args.kills} SIGKILLs of group 1")  # fmt: skip
    head = ["heartbeat_ms", "step_s", "pause_median_s", "pause_max_s", "discarded", "kills", "healed_equal",
            "group0_pids", "heal_s"]  # fmt: skip
    print(" | ".join(head))
    for r in rows:
        print(" | ".join(f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in head))


if __name__ == "__main__":
    main()
