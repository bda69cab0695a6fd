"""Checkpoint cost per backend, side by side: how long the training loop is blocked per save.

    python bench/ckpt.py [--repeats 3] [--rss-saves 60]

Model: torchvision ResNet-50 + Adam (~25.6 M params -> ~307 MB of training state). For each backend and
two storage targets — local disk with fsync, and the same disk behind a 200 MB/s throttle (pitstop's
``ckpt.throttle_mbps``: every checkpoint file write is paced by a token bucket, a stand-in for a network
volume) — one save is started right after a training step and the loop's blocking time is measured the
way the runner accounts it (time inside ``maybe_save`` + waiting for staging before the next
``optimizer.step()``); then the bench waits until the save is durable (``total``). Backends alternate
within each repeat; medians are printed with the ratio to ``sync_save`` and the memory-copy lower bound
(one in-memory copy of the state's bytes). Then steps/s with a save every step vs no saves, and RSS over
many saves (host memory must stay flat).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import time

from common import compose, ensure_data, median

BACKENDS = ["sync_save", "sync_dcp", "async_dcp", "async_dcp_pinned"]
MODEL = ["model=resnet18", "model._target_=torchvision.models.resnet50", "~model.in_channels", "data.channels=3",
         "data.image_size=32", "data.mean=[0.5,0.5,0.5]", "data.std=[0.5,0.5,0.5]", "optim=adamw"]
BASE = ["logger=none", "trainer.progress_bar=false", "trainer.batch_size=8", "loader.num_workers=1",
        "trainer.eval_every_steps=100000", "trainer.eval_max_batches=1"]


def rss_mb(pid: int | None = None) -> float:
    with open(f"/proc/{pid or os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def tree_rss_mb() -> float:
    """RSS of this process plus its child processes (e.g. a process-based checkpoint writer)."""
    total = rss_mb()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                for child in f.read().split():
                    total += rss_mb(int(child))
        except OSError:
            pass
    return total


def make_runner(backend: str, run_dir: str, extra: list[str], steps: int = 100000):
    from pitstop.runner import Runner

    ckpt = [f"ckpt={backend}", "ckpt.interval_steps=1", "ckpt.keep_last_k=2"] if backend != "none" else ["ckpt=none"]
    cfg = compose([*BASE, *MODEL, *ckpt, f"trainer.max_steps={steps}", f"run_dir={run_dir}", *extra])
    r = Runner(cfg, run_dir)
    r.setup()
    r.restore()
    r.batches = iter(r.loader)
    step(r)  # initialises Adam's state, so the saved state is complete
    return r


def step(r) -> None:
    batch = r.data.on_device(r.strategy.to_device(next(r.batches)))
    r.train_step(batch)
    r.progress.step += 1


def state_bytes(r) -> int:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(r.model, r.optimizer)
    total = sum(t.numel() * t.element_size() for t in msd.values())
    for s in osd["state"].values():
        total += sum(t.numel() * t.element_size() for t in s.values() if hasattr(t, "numel"))
    return total


def memcpy_bound(r, repeats: int = 5) -> float:
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(r.model, r.optimizer)
    tensors = list(msd.values()) + [t for s in osd["state"].values() for t in s.values() if isinstance(t, torch.Tensor)]
    dst = [torch.empty_like(t) for t in tensors]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for d, t in zip(dst, tensors):
            d.copy_(t)
        times.append(time.perf_counter() - t0)
    return median(times)


def measure_save(r) -> tuple[float, float]:
    """(blocking seconds, seconds until durable) of one save, measured as the runner accounts it.

    The save starts after a step; the next training step runs (so background staging can overlap its
    forward/backward) and waits for staging before its optimizer step; both waits are blocking time.
    """
    before = r.ledger.seconds["checkpoint"]
    t0 = time.perf_counter()
    block = r.ckpt.maybe_save(r.target, r.step).blocked  # interval_steps=1: every call saves
    step(r)                                      # adds the staging wait to the ledger's checkpoint bucket
    block += r.ledger.seconds["checkpoint"] - before
    r.ckpt.wait()
    total = time.perf_counter() - t0
    r.ckpt._report_finished()
    return block, total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--throttle-mbps", type=float, default=200.0)
    ap.add_argument("--rss-saves", type=int, default=60)
    ap.add_argument("--steps", type=int, default=6, help="steps for the save-every-step throughput runs")
    ap.add_argument("--rss-only", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    ensure_data()
    if args.rss_only:
        return rss_over_saves(args.rss_only, args.rss_saves)
    tmp = tempfile.mkdtemp(prefix="pitstop-bench-ckpt-", dir=os.environ.get("BENCH_DIR"))
    targets = {"local disk + fsync": [], f"throttled {args.throttle_mbps:.0f} MB/s": [f"ckpt.throttle_mbps={args.throttle_mbps}"]}
    runners = {(t, b): make_runner(b, os.path.join(tmp, f"{i}-{b}"), extra)
               for i, (t, extra) in enumerate(targets.items()) for b in BACKENDS}
    any_r = next(iter(runners.values()))
    nbytes = state_bytes(any_r)
    bound = memcpy_bound(any_r)
    for r in runners.values():  # warm-up save: process checkpointer start-up, stager allocation
        measure_save(r)
    results = {k: [] for k in runners}
    for _ in range(args.repeats):
        for key, r in runners.items():
            results[key].append(measure_save(r))
    print(f"# ckpt: ResNet-50 + AdamW, {nbytes / 1e6:.0f} MB of model+optimizer state, {args.repeats} saves per cell "
          f"(after one warm-up save), backends alternating")
    print(f"memory-copy lower bound: {bound * 1e3:.1f} ms ({nbytes / bound / 1e9:.2f} GB/s, one copy of the state)")
    for target in targets:
        base = median([b for b, _ in results[(target, "sync_save")]])
        print(f"\n[{target}]")
        print(f"{'backend':<18}{'block/save':>12}{'vs sync_save':>14}{'vs memcpy':>11}{'durable after':>15}")
        for b in BACKENDS:
            block = median([x for x, _ in results[(target, b)]])
            total = median([y for _, y in results[(target, b)]])
            print(f"{b:<18}{block * 1e3:>10.1f}ms{block / base:>13.3f}x{block / bound:>10.2f}x{total:>14.2f}s")
    for r in runners.values():
        r.ckpt.close()
        r.close()
    del runners
    gc.collect()
    shutil.rmtree(tmp, ignore_errors=True)

    # ---- training throughput with a save every step -----------------------------------------------------
    print(f"\n# steps/s, {args.steps} steps with a save after every step vs no saves (local disk)")
    for b in ["none", *BACKENDS]:
        d = tempfile.mkdtemp(dir=tmp if os.path.isdir(tmp) else None)
        r = make_runner(b, d, [])
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(r)
            r.ckpt.maybe_save(r.target, r.step)
        r.ckpt.close()
        sps = args.steps / (time.perf_counter() - t0)
        if b == "none":
            none_sps = sps
        print(f"{b:<18}{sps:8.3f} steps/s  ({sps / none_sps:.2f}x of no saves)")
        r.close()
        shutil.rmtree(d, ignore_errors=True)

    # ---- host memory over many saves (each backend in a fresh process) --------------------------------
    print(f"\n# RSS (trainer process + checkpoint child processes) over {args.rss_saves} saves, ResNet-50 + AdamW")
    import subprocess
    import sys

    for b in ["async_dcp", "async_dcp_pinned", "sync_dcp", "sync_save"]:
        out = subprocess.run([sys.executable, __file__, "--rss-only", b, "--rss-saves", str(args.rss_saves)],
                             capture_output=True, text=True)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith(b)]
        print(lines[-1] if lines else f"{b}: failed: {out.stderr.strip().splitlines()[-1:]}")


def rss_over_saves(backend: str, saves: int) -> None:
    d = tempfile.mkdtemp(prefix="pitstop-bench-rss-", dir=os.environ.get("BENCH_DIR"))
    r = make_runner(backend, d, [])
    marks = {}
    for i in range(1, saves + 1):
        r.ckpt.maybe_save(r.target, r.step)
        step(r)
        if i in (1, 10, saves // 2, saves):
            r.ckpt.wait()
            gc.collect()
            marks[i] = tree_rss_mb()
    r.ckpt.close()
    growth = marks[saves] - marks[10]
    print(f"{backend:<18}" + "  ".join(f"save {k}: {v:6.0f} MB" for k, v in sorted(marks.items()))
          + f"   growth save 10->{saves}: {growth:+.0f} MB ({100 * growth / marks[10]:+.1f}%)", flush=True)
    r.close()
    shutil.rmtree(d, ignore_errors=True)

if __name__ == "__main__":
    main()
