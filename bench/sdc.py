"""What the silent-data-corruption check (``trainer.sdc``) costs a step, side by side in one run.

    python bench/sdc.py [--steps 300] [--repeats 3] [--clean-steps 2000]

The quick start's model and data (SmallCNN on digits, batch 64 per rank, SGD) under ``strategy=ddp``, 2 ranks on
this machine's CPU (gloo), ``ckpt=none``, every step a full batch. Three rows, run in turn (off, default, every step;
then again, ``--repeats`` times), the same steps and data in each:

- ``off``: ``trainer.sdc.enabled=false``;
- ``default``: the default interval (``trainer.sdc.interval``);
- ``every step``: ``trainer.sdc.interval=1``: what one check costs, measured ``--steps`` times a run.

Figures: the step's median time (``off``); one check's time as the run's ledger measures it (``check``: the
digests and the all-gather, waiting for the slower rank included, which the next step's gradient all-reduce would
otherwise have waited) and this rank's digest alone (``digest``); the check's cost per step at the default interval
(``check / interval / step``: the target is <= 1%); and the loop's wall time (the runs' ``compute`` + ``data_wait`` +
``sdc`` + ``logging``) of ``default`` and ``every step`` over ``off`` (end to end: on a machine shared with other
jobs these move by tens of percent from run to run, far more than the check's share; read the per-check figure).
Then one clean run of ``--clean-steps`` steps with the check at every step: it must report no corruption.
And a larger model in this process, one intra-op thread (a rank's share of this machine): torchvision's ResNet-50 with
AdamW's state (~25 M parameters, ~75 M floats digested), one step (batch 16, 32x32 images) against one digest.

What it leaves out: GPUs (the digest is one reduction per tensor on the device, the all-gather NCCL's; not
measured here), the all-gather of more ranks (its vector grows by one int64 per tensor per rank).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from common import DDP_LOOP, compose, ensure_data, median, save_result, train

# What bench/results/sdc.json's figures are, and the code they measure (read by the docs' results page,
# bench/figures.py, without running this script).
FIGURES = {
    "model": ("", "the job measured", None),
    "steps": ("", "steps per run", None),
    "repeats": ("", "runs of each row (off, default, every step), in turn", None),
    "interval": ("", "the default trainer.sdc.interval (steps between checks)", None),
    "step_ms": ("ms", "a step with the check off (median)", None),
    "check_ms": (
        "ms",
        "one check: the digests and the all-gather, waiting for the slower rank included (median)",
        None,
    ),
    "digest_ms": ("ms", "this rank's digest alone (median)", None),
    "cost_per_step_at_default": (
        "%",
        "the check's cost per step at the default interval (check / interval / step)",
        "<= 0.01",
    ),
    "cost_per_step_every_step": ("%", "the check's cost per step at trainer.sdc.interval=1", None),
    "loop_default_over_off": (
        "x",
        "the loop's wall time, default interval over off (noisy: read the per-check figures)",
        None,
    ),
    "loop_every_step_over_off": ("x", "the loop's wall time, every step over off (noisy)", None),
    "resnet50_adamw.floats": ("", "floats digested (ResNet-50 with AdamW's state)", None),
    "resnet50_adamw.step_ms": ("ms", "one ResNet-50 step (batch 16, 32x32, one thread)", None),
    "resnet50_adamw.digest_ms": ("ms", "one digest of its model and optimizer state", None),
    "resnet50_adamw.cost_per_step_at_default": ("%", "the digest's cost per step at the default interval", "<= 0.01"),
    "clean_run.steps": ("", "steps of the clean run, checked every step", None),
    "clean_run.checks": ("", "checks it made", None),
    "clean_run.corruptions_found": ("", "corruptions it reported (a clean run must report none)", "== 0"),
    "clean_run.seconds": ("s", "its wall clock", None),
}
MEASURES = ["src/pitstop/train/sdc.py", "src/pitstop/parts/digest.py"]

BASE = DDP_LOOP
LOOP = ("compute", "data_wait", "sdc", "logging")  # the loop's own buckets (not start-up, not the final evaluation)


def default_interval() -> int:
    return int(compose([]).trainer.sdc.interval)


def run(steps: int, extra: list[str], run_dir: str) -> dict:
    args = [*BASE, f"trainer.max_steps={steps}", f"trainer.eval_every_steps={steps}", f"run_dir={run_dir}", *extra]
    s = train(args, run_dir, timeout=1800)
    sdc, wall = s["sdc"], s["wall_clock"]
    return {
        "step": s["throughput"]["step_seconds_p50"],
        "loop": sum(wall.get(k, 0.0) for k in LOOP),
        "checks": sdc["checks"],
        "check": sdc["check_seconds"] / max(sdc["checks"], 1),
        "digest": sdc["digest_seconds"] / max(sdc["checks"], 1),
        "found": sdc["found"],
        "steps": s["final_step"],
    }


def large_model(repeats: int = 5) -> dict:
    """ResNet-50 + AdamW in this process: one training step's time against one digest of its replica state."""
    import torch
    import torchvision

    from pitstop.parts.digest import replica_digest, replica_state

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torchvision.models.resnet50(num_classes=10)
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def digest() -> None:
        replica_digest([t for _, t in replica_state(model, opt)])

    step()  # (the optimizer's state exists from here)
    times: dict[str, list[float]] = {"step": [], "digest": []}
    for _ in range(repeats):  # (in turn)
        for name, fn in (("step", step), ("digest", digest)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    floats = sum(t.numel() for _, t in replica_state(model, opt))
    return {"floats": floats, "step_ms": median(times["step"]) * 1e3, "digest_ms": median(times["digest"]) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clean-steps", type=int, default=2000)
    opt = ap.parse_args()
    ensure_data()
    interval = default_interval()
    rows = {
        "off": ["trainer.sdc.enabled=false"],
        f"default (every {interval})": [],
        "every step": ["trainer.sdc.interval=1"],
    }
    got: dict[str, list[dict]] = {k: [] for k in rows}
    with tempfile.TemporaryDirectory() as tmp:
        n = 0
        for _ in range(opt.repeats):
            for label, extra in rows.items():  # (in turn: a slow minute of a shared machine hits every row)
                n += 1
                got[label].append(run(opt.steps, extra, os.path.join(tmp, f"r{n}")))
        t = time.perf_counter()
        clean = run(opt.clean_steps, ["trainer.sdc.interval=1"], os.path.join(tmp, "clean"))
        clean_wall = time.perf_counter() - t
    big = large_model()
    off, default, each = (got[k] for k in rows)
    step = median([r["step"] for r in off])
    check = median([r["check"] for r in each])
    digest = median([r["digest"] for r in each])
    loop_off = median([r["loop"] for r in off])
    figures = {
        "model": "SmallCNN (quick start), digits, batch 64 per rank, SGD; strategy=ddp, 2 ranks, gloo on CPU",
        "steps": opt.steps,
        "repeats": opt.repeats,
        "interval": interval,
        "step_ms": round(step * 1e3, 3),
        "check_ms": round(check * 1e3, 3),
        "digest_ms": round(digest * 1e3, 4),
        "cost_per_step_at_default": round(check / interval / step, 5),
        "cost_per_step_every_step": round(check / step, 5),
        "loop_default_over_off": round(median([r["loop"] for r in default]) / loop_off, 4),
        "loop_every_step_over_off": round(median([r["loop"] for r in each]) / loop_off, 4),
        "resnet50_adamw": {
            "floats": big["floats"],
            "step_ms": round(big["step_ms"], 1),
            "digest_ms": round(big["digest_ms"], 2),
            "cost_per_step_at_default": round(big["digest_ms"] / interval / big["step_ms"], 6),
        },
        "clean_run": {
            "steps": clean["steps"],
            "checks": clean["checks"],
            "corruptions_found": len(clean["found"]),
            "seconds": round(clean_wall, 1),
        },
    }
    print(f"step (check off, median)        {figures['step_ms']:8.3f} ms")
    print(f"one check (digests + all-gather) {figures['check_ms']:8.3f} ms   (this rank's digest alone: "
          f"{figures['digest_ms']:.4f} ms)")  # fmt: skip
    at_default = figures["cost_per_step_at_default"] * 100
    print(f"cost per step, every {interval:<3} steps   {at_default:8.3f} %   (target <= 1%)")
    print(f"cost per step, every step        {figures['cost_per_step_every_step'] * 100:8.3f} %")
    print(f"loop time default / off          {figures['loop_default_over_off']:8.4f}")
    print(f"loop time every step / off       {figures['loop_every_step_over_off']:8.4f}")
    b = figures["resnet50_adamw"]
    share = b["cost_per_step_at_default"] * 100
    print(f"ResNet-50 + AdamW ({b['floats'] / 1e6:.0f} M floats): step {b['step_ms']:.1f} ms, digest "
          f"{b['digest_ms']:.2f} ms: {share:.3f} % per step every {interval} steps")  # fmt: skip
    c = figures["clean_run"]
    print(f"clean run: {c['steps']} steps, {c['checks']} checks, {c['corruptions_found']} corruption(s) found "
          f"({c['seconds']} s)")  # fmt: skip
    print(f"-> {save_result('sdc', figures)}")


if __name__ == "__main__":
    main()
