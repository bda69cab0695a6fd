"""Strategies side by side: samples/s of single vs ddp(2) vs fsdp(2) on the same model and global batch,
and the per-save blocking time of each checkpoint backend under ddp(2) and fsdp(2).

    python bench/strategy.py [--steps 60]

Every configuration runs as the real command (``python -m recipe.train ...``) in a subprocess, one after
the other; figures come from each run's ``summary.json`` (compute + data-wait time, and the checkpoint
manager's own per-save blocking time). On a 2-core CPU machine two ranks share the cores, so this shows
the framework's overhead more than a speed-up; on GPUs each rank gets a device.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

from common import ROOT, ensure_data

MODEL = ["model=resnet18", "data.channels=3", "data.image_size=32", "data.mean=[0.5,0.5,0.5]", "data.std=[0.5,0.5,0.5]"]


def run(args: list[str], run_dir: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "recipe.train",
        *MODEL,
        "logger=none",
        "trainer.progress_bar=false",
        "trainer.eval_max_batches=1",
        f"run_dir={run_dir}",
        *args,
    ]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"failed: {' '.join(args)}\n{p.stderr[-2000:]}")
    with open(f"{run_dir}/summary.json") as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--global-batch", type=int, default=64)
    args = ap.parse_args()
    ensure_data()
    tmp = tempfile.mkdtemp(prefix="pitstop-bench-strategy-")
    gb, steps = args.global_batch, args.steps
    common = [f"trainer.max_steps={steps}", f"trainer.eval_every_steps={steps}", "loader.num_workers=1"]
    print(f"# samples/s, ResNet-18 on digits 32x32, global batch {gb}, {steps} steps, no checkpoints")
    base = None
    for name, extra in [
        ("single", ["strategy=single", f"trainer.batch_size={gb}"]),
        ("ddp(2)", ["strategy=ddp", f"trainer.batch_size={gb // 2}"]),
        ("fsdp(2)", ["strategy=fsdp", f"trainer.batch_size={gb // 2}"]),
    ]:
        s = run([*common, *extra, "ckpt=none"], f"{tmp}/{name.replace('(', '').replace(')', '')}")
        w = s["wall_clock"]
        busy = w["compute"] + w["data_wait"]
        sps = s["samples_seen"] / busy
        base = base or sps
        print(
            f"{name:<9} {sps:8.1f} samples/s in the loop ({sps / base:.2f}x single)   "
            f"wall {w['total']:.1f} s, startup {w['program_start'] + w['init'] + w['restore']:.1f} s"
        )
    print("\n# per-save blocking time (median over saves every 5 steps), ResNet-18 + SGD state")
    print(f"{'backend':<18}{'ddp(2)':>12}{'fsdp(2)':>12}")
    for ckpt in ["sync_save", "sync_dcp", "async_dcp", "async_dcp_pinned"]:
        cells = []
        for strat in ["ddp", "fsdp"]:
            s = run(
                [
                    *common,
                    f"strategy={strat}",
                    f"trainer.batch_size={gb // 2}",
                    f"ckpt={ckpt}",
                    "ckpt.interval_steps=5",
                ],
                f"{tmp}/{strat}-{ckpt}",
            )
            rows = [json.loads(line) for line in open(f"{tmp}/{strat}-{ckpt}/metrics.jsonl")]
            blocks = sorted(r["ckpt_block_seconds"] for r in rows if "ckpt_block_seconds" in r)[1:]  # drop the first
            cells.append(blocks[len(blocks) // 2] * 1e3 if blocks else float("nan"))
        print(f"{ckpt:<18}{cells[0]:>10.1f}ms{cells[1]:>10.1f}ms")


if __name__ == "__main__":
    main()
