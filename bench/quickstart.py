"""The quick start's figures: the job `make train` runs (``python -m recipe.train``, every default) timed whole, and
the CPU budget's two splits of the cores side by side.

    python bench/quickstart.py [--repeats 3]

Per repeat, alternating: the default job (``strategy.cpu_threads=auto``: the loop gets the cores the loader's workers
leave, here 1 intra-op thread beside 2 workers on 2 cores) and the same job with ``strategy.cpu_threads=<cores>`` (the
loop's threads and the workers contend for the cores). Each run is a fresh process with a fresh run dir. Medians of:
wall clock (process start to exit, as a user waits for it), goodput and its parts from the run's ledger (productive,
program start, init, evaluation, data wait) and the validation accuracy. Figures: ``bench/results/quickstart.json``.

What it leaves out: the prepare step (the shards are written once, before), MLflow (``make train`` logs to it; its
cost is ``bench/overhead.py``'s), and cold caches (a first, untimed run warms the page cache and ``.pyc`` files).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, ensure_data, median, save_result

# What bench/results/quickstart.json's figures are, and the code they measure (read by the docs' results page,
# bench/figures.py, without running this script). auto: strategy.cpu_threads=auto (the default); contended:
# strategy.cpu_threads=<cores> (the loop's threads and the loader's workers contend for the cores). Medians.
FIGURES = {
    "repeats": ("", "runs of each split, alternating", None),
    "cores": ("", "this machine's cores", None),
    "*.wall_s": ("s", "the job's wall clock, process start to exit, as a user waits for it", None),
    "*.wall_s_min": ("s", "the fastest run's wall clock", None),
    "*.wall_s_max": ("s", "the slowest run's wall clock", None),
    "*.goodput": ("%", "productive seconds over wall seconds (the run's ledger)", None),
    "*.goodput_min": ("%", "the lowest run's goodput", None),
    "*.goodput_max": ("%", "the highest run's goodput", None),
    "*.val_accuracy": ("%", "the validation accuracy at the end", None),
    "*.productive_s": ("s", "seconds of productive compute", None),
    "*.program_start_s": ("s", "process start to the runner existing (interpreter, imports)", None),
    "*.init_s": ("s", "building the job (model, optimizer, loaders, checkpointer)", None),
    "*.eval_s": ("s", "evaluation", None),
    "*.data_wait_s": ("s", "waiting for batches", None),
}
MEASURES = ["src", "recipe", "conf"]

PARTS = ("productive", "program_start", "init", "eval", "data_wait")


def run(run_dir: Path, extra: list[str]) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-m", "recipe.train", "logger=none", f"run_dir={run_dir}", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"recipe.train failed ({p.returncode}): {p.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    totals = summary["goodput"]["totals"]
    out = {"wall_s": wall, "goodput": summary["goodput"]["goodput"], "val_accuracy": summary["metrics"]["val_accuracy"]}
    return out | {f"{k}_s": totals[k] for k in PARTS}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    ensure_data()
    cores = os.cpu_count() or 1
    splits = {"auto": [], "contended": [f"strategy.cpu_threads={cores}"]}
    with tempfile.TemporaryDirectory(prefix="pitstop-bench-") as tmp:
        run(Path(tmp) / "warm", ["trainer.epochs=1"])
        rows: dict[str, list[dict]] = {name: [] for name in splits}
        for i in range(a.repeats):
            for name, extra in splits.items():
                rows[name].append(run(Path(tmp) / f"{name}{i}", extra))
    figures: dict = {"repeats": a.repeats, "cores": cores}
    print(f"# the default job (make train's, logger=none), {a.repeats} alternating runs each, medians; {cores} cores")
    print(f"{'split':28} {'wall s':>7} {'goodput':>8} " + " ".join(f"{k + ' s':>15}" for k in PARTS) + "  val acc")
    for name, runs in rows.items():
        med = {k: median([r[k] for r in runs]) for k in runs[0]}
        med |= {"wall_s_min": min(r["wall_s"] for r in runs), "wall_s_max": max(r["wall_s"] for r in runs)}
        med |= {"goodput_min": min(r["goodput"] for r in runs), "goodput_max": max(r["goodput"] for r in runs)}
        figures[name] = med
        label = "auto (1 thread + workers)" if name == "auto" else f"cpu_threads={cores} (contended)"
        parts = " ".join(f"{med[k + '_s']:>15.2f}" for k in PARTS)
        print(f"{label:28} {med['wall_s']:>7.2f} {med['goodput']:>8.1%} {parts}  {med['val_accuracy']:.4f}")
    auto, contended = figures["auto"], figures["contended"]
    print(
        f"cpu_threads=auto / contended: wall clock {auto['wall_s'] / contended['wall_s']:.2f}x, productive seconds "
        f"{auto['productive_s'] / contended['productive_s']:.2f}x"
    )
    save_result("quickstart", figures)


if __name__ == "__main__":
    main()
