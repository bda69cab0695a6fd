"""What the instability guard (``trainer.instability``) costs a step, side by side in one run.

    python bench/instability.py [--steps 400] [--ddp-steps 200] [--repeats 3] [--block 10]

The quick start's model and data (SmallCNN with BatchNorm on digits, batch 64 per rank, SGD), ``ckpt=none``, every
step a full batch, in two setups:

- ``single``: ``strategy=single``, one process (the guard: this rank's loss and gradient norm, and a copy of the
  BatchNorm buffers before each step, to put them back on a skipped step);
- ``ddp``: ``strategy=ddp``, 2 ranks on this machine's CPU (gloo): the same, plus one all-reduce of two numbers (a
  flag and the loss) every step.

Each setup with ``trainer.instability.enabled=false`` (``off``) and ``=true`` (``on``, the default), a fresh process
each, the same steps, data and seed; ``--repeats`` times, the order of off and on alternating from one repeat to
the next (a slow minute of a shared machine hits both). Figures: the median over repeats of each run's median step
time (``throughput.step_seconds_p50``), on / off (the guard's cost per step, as a ratio) and on - off in ms; each
run's wall time of the loop (``compute`` + ``data_wait`` + ``logging`` + ``sdc`` of its ledger), on / off; and
whether on and off ended with the same parameters (``params_sha256``: the guard changes no step it finds stable).
Then ``single`` again in this process (``single_interleaved``): a Runner with the guard and one without, ``--block``
steps each in turn, every step (batch and ``Runner.train_step``) timed alone, medians over ``--steps`` steps each:
load that comes and goes between processes lands on both. No step is skipped here (``skipped_steps`` is 0 in every
run): what a skipped step costs (a forward per sample to find a poisoned one, a rollback) is not measured.

What it leaves out: GPUs (there the guard's ``.item()`` of the loss and norm is a device-to-host sync each step,
which a CPU run does not pay; the all-reduce is NCCL's), more than 2 ranks, larger models (the gradient norm is one
pass over the gradients, the buffer copy one over BatchNorm's statistics), ``spike_factor`` (off by default: a
median of the last ``spike_window`` losses), fp16's loss scale (then the scaler's check owns the gradients).
On a machine shared with other jobs the step times move by several percent from run to run: read the ratio
against that spread (each run's figures are in the result file).
"""

from __future__ import annotations

import argparse
import os
import tempfile

from common import train, ensure_data, median, save_result

# What bench/results/instability.json's figures are, and the code they measure (read by the docs' results page,
# bench/figures.py, without running this script). single: one process; ddp: 2 ranks (gloo); single_interleaved: two
# Runners in this process, blocks of steps in turn.
FIGURES = {
    "model": ("", "the job measured", None),
    "repeats": ("", "runs with the guard off and on, the order alternating", None),
    "*.steps": ("", "steps per run", None),
    "*.block": ("", "steps per block, the two Runners in turn", None),
    "*.step_off_ms": ("ms", "a step with trainer.instability.enabled=false (median of the runs' medians)", None),
    "*.step_on_ms": ("ms", "a step with the guard on, the default (median of the runs' medians)", None),
    "*.cost_ratio": ("x", "on over off: the guard's cost per step", None),
    "*.cost_ms": ("ms", "on minus off, per step", None),
    "*.loop_on_over_off": ("x", "the loop's wall time, on over off (noisy on a shared machine)", None),
    "*.same_params": ("", "on and off ended with the same parameters (the guard changes no stable step)", "== true"),
    "*.runs_step_off_ms": ("ms", "each run's median step, off", None),
    "*.runs_step_on_ms": ("ms", "each run's median step, on", None),
}
MEASURES = ["src/pitstop/train/instability.py", "src/pitstop/train/step.py"]

BASE = [
    "logger=none",
    "ckpt=none",
    "trainer.progress_bar=false",
    "trainer.eval_max_batches=1",
    "loader.drop_last=true",
]
SETUPS = {"single": ["strategy=single"], "ddp": ["strategy=ddp"]}
ROWS = {"off": ["trainer.instability.enabled=false"], "on": ["trainer.instability.enabled=true"]}
LOOP = ("compute", "data_wait", "sdc", "logging")  # the loop's own buckets (not start-up, not the final evaluation)


def run(steps: int, extra: list[str], run_dir: str) -> dict:
    args = [*BASE, f"trainer.max_steps={steps}", f"trainer.eval_every_steps={steps}", f"run_dir={run_dir}", *extra]
    s = train(args, run_dir, timeout=900)
    wall = s["wall_clock"]
    return {
        "step": s["throughput"]["step_seconds_p50"],
        "loop": sum(wall.get(k, 0.0) for k in LOOP),
        "steps": s["final_step"],
        "skipped": s["instability"]["skipped_steps"],
        "params": s["params_sha256"],
    }


def interleaved(steps: int, block: int, tmp: str) -> dict:
    """``single`` once more, in this process: a Runner with the guard and one without, on the same config, seed and
    data, taking ``block`` steps in turn (off first, then on first, ...), each step (its batch and
    ``Runner.train_step``) timed alone: a busy second of a shared machine lands on both within a block."""
    import time

    from common import compose

    from pitstop.train.runner import Runner
    from pitstop.train.state import Batches

    runners = {}
    for row, extra in ROWS.items():
        run_dir = os.path.join(tmp, f"interleaved-{row}")
        cfg = compose([*BASE, *SETUPS["single"], *extra, f"trainer.max_steps={steps + 1}", f"run_dir={run_dir}"])
        r = Runner(cfg, run_dir)
        r.setup()
        r.restore()
        r.batches = Batches(r.loader, r.watchdog)
        r.train_step(r.batches)  # (the first step, not timed)
        r.progress.step += 1
        runners[row] = r
    times: dict[str, list[float]] = {row: [] for row in ROWS}
    try:
        for i in range(steps // block):
            for row in ROWS if i % 2 == 0 else reversed(ROWS):
                r = runners[row]
                for _ in range(block):
                    t = time.perf_counter()
                    r.train_step(r.batches)
                    times[row].append(time.perf_counter() - t)
                    r.progress.step += 1
        assert runners["on"].stepper.guard is not None and runners["off"].stepper.guard is None
    finally:
        for r in runners.values():
            r.close()
    off, on = median(times["off"]), median(times["on"])
    return {
        "steps": len(times["on"]),
        "block": block,
        "step_off_ms": round(off * 1e3, 3),
        "step_on_ms": round(on * 1e3, 3),
        "cost_ratio": round(on / off, 4),
        "cost_ms": round((on - off) * 1e3, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400, help="steps per single-process run")
    ap.add_argument("--ddp-steps", type=int, default=200, help="steps per ddp run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block", type=int, default=10, help="steps in turn in the interleaved single-process row")
    opt = ap.parse_args()
    ensure_data()
    steps = {"single": opt.steps, "ddp": opt.ddp_steps}
    got: dict[tuple[str, str], list[dict]] = {(s, r): [] for s in SETUPS for r in ROWS}
    with tempfile.TemporaryDirectory(prefix="pitstop-bench-") as tmp:
        n = 0
        for rep in range(opt.repeats):
            for setup, extra in SETUPS.items():
                for row in ROWS if rep % 2 == 0 else reversed(ROWS):  # (off, on; then on, off; ...)
                    n += 1
                    r = run(steps[setup], [*extra, *ROWS[row]], os.path.join(tmp, f"r{n}"))
                    got[(setup, row)].append(r)
                    print(f"  {setup:<7}{row:<4} step {r['step'] * 1e3:7.2f} ms  loop {r['loop']:6.2f} s", flush=True)
        inter = interleaved(opt.steps, opt.block, tmp)
    figures: dict = {
        "model": "SmallCNN (quick start), digits, batch 64 per rank, SGD, ckpt=none; ddp: 2 ranks, gloo on CPU",
        "repeats": opt.repeats,
    }
    print(f"\n{'setup':<22}{'steps':>6}{'off':>11}{'on':>11}{'on/off':>9}{'on-off':>10}{'loop on/off':>13}")
    for setup in SETUPS:
        off, on = got[(setup, "off")], got[(setup, "on")]
        assert all(r["steps"] == steps[setup] and r["skipped"] == 0 for r in off + on), (setup, off, on)
        s_off, s_on = median([r["step"] for r in off]), median([r["step"] for r in on])
        l_off, l_on = median([r["loop"] for r in off]), median([r["loop"] for r in on])
        figures[setup] = {
            "steps": steps[setup],
            "step_off_ms": round(s_off * 1e3, 3),
            "step_on_ms": round(s_on * 1e3, 3),
            "cost_ratio": round(s_on / s_off, 4),
            "cost_ms": round((s_on - s_off) * 1e3, 3),
            "loop_on_over_off": round(l_on / l_off, 4),
            "same_params": len({r["params"] for r in off + on}) == 1,
            "runs_step_off_ms": [round(r["step"] * 1e3, 3) for r in off],
            "runs_step_on_ms": [round(r["step"] * 1e3, 3) for r in on],
        }
        f = figures[setup]
        label = "single (1 process)" if setup == "single" else "ddp (2 ranks, gloo)"
        print(f"{label:<22}{steps[setup]:>6}{f['step_off_ms']:>8.2f} ms{f['step_on_ms']:>8.2f} ms"
              f"{f['cost_ratio']:>8.3f}x{f['cost_ms']:>+7.2f} ms{f['loop_on_over_off']:>12.3f}x"
              f"   same params: {f['same_params']}")  # fmt: skip
    figures["single_interleaved"] = f = inter
    print(f"{'single, interleaved':<22}{f['steps']:>6}{f['step_off_ms']:>8.2f} ms{f['step_on_ms']:>8.2f} ms"
          f"{f['cost_ratio']:>8.3f}x{f['cost_ms']:>+7.2f} ms (2 Runners, {f['block']} steps each in turn)")  # fmt: skip
    print("(medians over repeats of each run's median step time; loop: compute + data wait + sdc + logging)")
    print(f"-> {save_result('instability', figures)}")


if __name__ == "__main__":
    main()
