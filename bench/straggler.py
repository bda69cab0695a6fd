"""What the slow-rank detector (``trainer.straggler``) costs a step, how soon it names a slow rank, whether a clean run
names anyone, and how much of a slowdown's cost the ledger's ``straggler`` bucket holds.

    python bench/straggler.py [--steps 300] [--repeats 3] [--clean-steps 2000] [--slow-steps 400]

The quick start's model and data (SmallCNN on digits, batch 64 per rank, SGD) under ``strategy=ddp``, 2 ranks on
this machine's CPU (gloo), ``ckpt=none``, every step a full batch.

- **cost**: runs of ``--steps`` steps with the detector off and on (the default window), in turn, ``--repeats``
  times, the same steps and data in each: the step's median time of each (``throughput.step_seconds_p50``), and
  the detector's own measured time per step (its all-gathers and decisions, ``exchange_seconds``, over the steps).
  Then, in this process, what the detector's hooks (one per parameter, after its gradient is accumulated) add to a
  backward (a world of one rank, gloo): the time spent inside a timed copy of them, and one forward + backward with
  and without them, interleaved. Cost per step = (exchange + hooks) / the step off.
- **latency**: ``fault=slow_rank fault.rank=1 fault.factor=1.5 fault.from_step=40``: the step at which rank 1 is named,
  minus 40 (steps; two windows is the least it can be, by design).
- **false flags**: one clean run of ``--clean-steps`` steps: ranks named (must be 0), and the highest ratio of a
  rank's work to the median of the other's in any window (how close a clean run comes to ``trainer.straggler.factor``).
- **booked vs cost**: runs of ``--slow-steps`` steps with and without ``fault=slow_rank`` (from step 40), in turn,
  ``--repeats`` times: the loop's wall clock (the run's ``compute`` + ``straggler`` + ``data_wait`` + ``logging`` +
  ``sdc``) slowed minus clean (what the slowdown cost), against the slowed run's ``straggler`` bucket, and against
  what the fault slept (``faults.jsonl``). Target: the bucket holds at least half the cost. On a machine shared with
  other jobs the wall clocks of two runs differ by seconds either way; the cost is also given from the step medians
  (slowed over clean, times the steps slowed), which such bursts do not move.

What it leaves out: GPUs (there the marks are CUDA events; not run here: no GPU), more than two ranks (the median of the
others is then a real median), a slowdown that comes and goes within a window (a window's sum smooths it), and
``strategy=fsdp`` and ``ft`` (not covered by the detector).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from common import DDP_LOOP, ROOT, compose, ensure_data, median, save_result, train

# What bench/results/straggler.json's figures are, and the code they measure (read by the docs' results page,
# bench/figures.py, without running this script).
FIGURES = {
    "model": ("", "the job measured", None),
    "window": ("", "steps per window (trainer.straggler.window): ranks are compared once a window", None),
    "factor": ("x", "a rank is named slow past this ratio to the others' median (trainer.straggler.factor)", None),
    "cost.steps": ("", "steps per run", None),
    "cost.repeats": ("", "runs with the detector off and on, in turn", None),
    "cost.step_ms_off": ("ms", "a step with the detector off (median)", None),
    "cost.step_ms_on": ("ms", "a step with the detector on (median)", None),
    "cost.on_over_off": ("x", "on over off, end to end (noise included)", None),
    "cost.exchange_ms_per_step": ("ms", "the detector's all-gathers and decisions, per step", None),
    "cost.hook_ms_per_backward": ("ms", "the time inside its gradient hooks, per backward", None),
    "cost.hooks_per_backward": ("", "hook calls per backward", None),
    "cost.ddp_fwd_bwd_ms": ("ms", "one forward + backward without the hooks (one rank)", None),
    "cost.hooked_fwd_bwd_ms": ("ms", "the same with the hooks", None),
    "cost.cost_per_step": ("%", "(exchange + hooks) over the step with the detector off", "< 0.01"),
    "latency.from_step": ("", "fault=slow_rank slows rank 1 (1.5x) from this step", None),
    "latency.named_at_step": ("", "the step at which rank 1 was named", None),
    "latency.since": ("", "the step the detector says the slowness began", None),
    "latency.steps": ("", "steps from the slowdown to the naming (two windows is the least, by design)", None),
    "latency.ratio": ("x", "rank 1's work over the others' median in the window that named it", None),
    "clean_run.steps": ("", "steps of the clean run", None),
    "clean_run.windows": ("", "windows it checked", None),
    "clean_run.false_flags": ("", "ranks it named (a clean run must name none)", "== 0"),
    "clean_run.max_ratio": ("x", "the highest ratio of a rank's work to the others' median in any window", None),
    "clean_run.seconds": ("s", "its wall clock", None),
    "booked_vs_cost.steps": ("", "steps per run, slowed and clean", None),
    "booked_vs_cost.slowdown_cost_s": ("s", "the loop's wall clock slowed minus clean, per repeat", None),
    "booked_vs_cost.bucket_s": ("s", "the slowed run's straggler bucket, per repeat", None),
    "booked_vs_cost.slept_s": ("s", "what the fault slept, per repeat", None),
    "booked_vs_cost.slowdown_cost_by_step_median_s": (
        "s",
        "the slowdown's cost from the step medians, per repeat",
        None,
    ),
    "booked_vs_cost.bucket_over_cost": ("x", "the bucket over the slowdown's cost (medians)", ">= 0.5"),
    "booked_vs_cost.bucket_over_cost_by_step_median": ("x", "the same, cost from the step medians", None),
    "booked_vs_cost.bucket_over_slept": ("x", "the bucket over what the fault slept (medians)", None),
}
MEASURES = [
    "src/pitstop/train/straggler.py",
    "src/pitstop/train/straggler_groups.py",
    "src/pitstop/strategy/ddp.py",
    "src/pitstop/resilience/slow_faults.py",
]

BASE = DDP_LOOP
LOOP = ("compute", "straggler", "data_wait", "logging", "sdc")  # the loop's own buckets
FROM = 40
SLOW = ["fault=slow_rank", "fault.rank=1", "fault.factor=1.5", f"fault.from_step={FROM}"]


def run(steps: int, extra: list[str], run_dir: str) -> dict:
    args = [*BASE, f"trainer.max_steps={steps}", f"trainer.eval_every_steps={steps}", f"run_dir={run_dir}", *extra]
    s = train(args, run_dir, timeout=3600)
    with open(os.path.join(run_dir, "goodput.json")) as f:
        totals = json.load(f)["totals"]
    named = []
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            named = [r for r in map(json.loads, f) if r.get("event") == "straggler" and "since" in r]
    except FileNotFoundError:
        pass
    slept = 0.0
    if os.path.exists(os.path.join(run_dir, "faults.jsonl")):
        with open(os.path.join(run_dir, "faults.jsonl")) as f:
            slept = sum(r.get("seconds", 0.0) for r in map(json.loads, f) if r.get("key") == "slow_rank:slept")
    return {
        "step": s["throughput"]["step_seconds_p50"],
        "loop": sum(s["wall_clock"].get(k, 0.0) for k in LOOP),
        "straggler": s["straggler"],
        "bucket": totals.get("straggler", 0.0),
        "named": named,
        "slept": slept,
        "steps": s["final_step"],
    }


def hook_cost(repeats: int = 400) -> dict:
    """One forward + backward of the quick start's model in DDP (one rank, gloo): with DDP alone and with the
    detector's hooks (``DDP.watch_gradients``: one per parameter, after its gradient is accumulated), interleaved (the
    medians, ms: end to end, noise included); and the time spent inside a timed copy of those hooks (ms per backward:
    what they add, their calls' own cost left out)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from pitstop.config.build import build
    from pitstop.strategy.ddp import DDP, loopback_store

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=loopback_store(0, 1, timedelta(seconds=60)), rank=0, world_size=1)
    cfg = compose([])
    models = [torch.nn.parallel.DistributedDataParallel(build(cfg.model)) for _ in range(3)]
    stamps: list[float] = []
    DDP.__new__(DDP).watch_gradients(models[1], lambda: stamps.append(time.perf_counter()))
    inside: list[float] = []

    def timed(_: object) -> None:  # (what watch_gradients registers, timed)
        t = time.perf_counter()
        stamps.append(t)
        inside.append(time.perf_counter() - t)

    for p in models[2].parameters():
        p.register_post_accumulate_grad_hook(timed)
    x, y = torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))
    try:
        models[0](x)
    except RuntimeError:  # (another model's input: 3 channels)
        x = torch.randn(64, 3, 8, 8)
    times: dict[str, list[float]] = {"ddp": [], "hooked": [], "timed": []}
    for i in range(repeats + 20):
        for name, model in zip(times, models):
            t = time.perf_counter()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if i >= 20:  # (warm)
                times[name].append(time.perf_counter() - t)
    dist.destroy_process_group()
    backwards = repeats + 20
    return {
        "ddp_ms": median(times["ddp"]) * 1e3,
        "hooked_ms": median(times["hooked"]) * 1e3,
        "inside_hook_ms": sum(inside) / backwards * 1e3,
        "hooks": len(inside) / backwards,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clean-steps", type=int, default=2000)
    ap.add_argument("--slow-steps", type=int, default=400)
    opt = ap.parse_args()
    os.chdir(ROOT)
    ensure_data()
    window = int(compose([]).trainer.straggler.window)
    factor = float(compose([]).trainer.straggler.factor)
    cost = {"off": ["trainer.straggler.enabled=false"], "on": []}
    got: dict[str, list[dict]] = {k: [] for k in cost}
    pairs: list[tuple[dict, dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        n = 0
        for _ in range(opt.repeats):
            for label, extra in cost.items():  # (in turn: a slow minute of a shared machine hits both)
                n += 1
                got[label].append(run(opt.steps, extra, os.path.join(tmp, f"c{n}")))
        latency_run = run(FROM + 4 * window, SLOW, os.path.join(tmp, "latency"))
        t = time.perf_counter()
        clean = run(opt.clean_steps, [], os.path.join(tmp, "clean"))
        clean_wall = time.perf_counter() - t
        for _ in range(opt.repeats):
            n += 1
            base = run(opt.slow_steps, [], os.path.join(tmp, f"b{n}"))
            slowed = run(opt.slow_steps, SLOW, os.path.join(tmp, f"s{n}"))
            pairs.append((base, slowed))
    hook = hook_cost()
    step_off = median([r["step"] for r in got["off"]])
    step_on = median([r["step"] for r in got["on"]])
    exchange = median([r["straggler"]["exchange_seconds"] / r["steps"] for r in got["on"]])
    hook_ms = hook["inside_hook_ms"]
    named = latency_run["named"]
    costs = [s["loop"] - b["loop"] for b, s in pairs]
    # (the same from the step medians, which a burst of another process's load does not move: the slowed steps' median
    # over the clean's, times the steps slowed)
    by_median = [(s["step"] - b["step"]) * (opt.slow_steps - FROM + 1) for b, s in pairs]
    buckets = [s["bucket"] for _, s in pairs]
    slept = [s["slept"] for _, s in pairs]
    figures = {
        "model": "SmallCNN (quick start), digits, batch 64 per rank, SGD; strategy=ddp, 2 ranks, gloo on CPU",
        "window": window,
        "factor": factor,
        "cost": {
            "steps": opt.steps,
            "repeats": opt.repeats,
            "step_ms_off": round(step_off * 1e3, 3),
            "step_ms_on": round(step_on * 1e3, 3),
            "on_over_off": round(step_on / step_off, 4),
            "exchange_ms_per_step": round(exchange * 1e3, 4),
            "hook_ms_per_backward": round(hook_ms, 4),
            "hooks_per_backward": hook["hooks"],
            "ddp_fwd_bwd_ms": round(hook["ddp_ms"], 3),
            "hooked_fwd_bwd_ms": round(hook["hooked_ms"], 3),
            "cost_per_step": round((exchange + hook_ms / 1e3) / step_off, 5),
        },
        "latency": {
            "from_step": FROM,
            "named_at_step": named[0]["step"] if named else None,
            "since": named[0]["since"] if named else None,
            "steps": (named[0]["step"] - FROM) if named else None,
            "ratio": named[0]["ratio"] if named else None,
        },
        "clean_run": {
            "steps": clean["steps"],
            "windows": clean["straggler"]["checked"],
            "false_flags": len(clean["straggler"]["flags"]),
            "max_ratio": clean["straggler"]["max_ratio"],
            "seconds": round(clean_wall, 1),
        },
        "booked_vs_cost": {
            "steps": opt.slow_steps,
            "slowdown_cost_s": [round(c, 3) for c in costs],
            "bucket_s": [round(b, 3) for b in buckets],
            "slept_s": [round(s, 3) for s in slept],
            "slowdown_cost_by_step_median_s": [round(c, 3) for c in by_median],
            "bucket_over_cost": round(median(buckets) / median(costs), 3) if median(costs) > 0 else None,
            "bucket_over_cost_by_step_median": (
                round(median(buckets) / median(by_median), 3) if median(by_median) > 0 else None
            ),
            "bucket_over_slept": round(median(buckets) / max(median(slept), 1e-9), 3),
        },
    }
    c = figures["cost"]
    print(f"step, detector off / on (median)     {c['step_ms_off']:8.3f} / {c['step_ms_on']:.3f} ms  "
          f"(on/off {c['on_over_off']:.4f}: end to end, noise included)")  # fmt: skip
    print(f"exchange per step (every {window})        {c['exchange_ms_per_step']:8.4f} ms")
    own, hooked = c["ddp_fwd_bwd_ms"], c["hooked_fwd_bwd_ms"]
    print(f"inside the hooks per backward        {c['hook_ms_per_backward']:8.4f} ms  (forward + "
          f"backward, one rank: {own:.3f} ms DDP's own, {hooked:.3f} ms hooked)")  # fmt: skip
    print(f"cost per step                        {c['cost_per_step'] * 100:8.3f} %   (target < 1%)")
    lat = figures["latency"]
    print(f"rank 1 at 1.5x from step {FROM}: named at step {lat['named_at_step']} (since {lat['since']}, "
          f"{lat['ratio']}x): {lat['steps']} steps after the slowdown (two windows: {2 * window})")  # fmt: skip
    cl = figures["clean_run"]
    print(f"clean run: {cl['steps']} steps, {cl['windows']} windows, {cl['false_flags']} rank(s) named, highest "
          f"ratio {cl['max_ratio']} (factor {factor}) ({cl['seconds']} s)")  # fmt: skip
    b = figures["booked_vs_cost"]
    print(f"slowdown's cost (loop wall, slowed - clean) {b['slowdown_cost_s']} s; bucket {b['bucket_s']} s; "
          f"slept {b['slept_s']} s")  # fmt: skip
    print(f"  the same from the step medians: {b['slowdown_cost_by_step_median_s']} s")
    print(f"bucket / cost {b['bucket_over_cost']} (by the step medians: {b['bucket_over_cost_by_step_median']}; "
          f"target >= 0.5); bucket / slept {b['bucket_over_slept']}")  # fmt: skip
    print(f"-> {save_result('straggler', figures)}")


if __name__ == "__main__":
    main()
