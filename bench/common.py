"""Helpers shared by the benchmarks: compose the real conf/ the way tests do, prepare data once, and write a
benchmark's figures as a result file (``bench/results/<name>.json``) that the docs site reads at build time."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# ddp(2) on the quick start's model, nothing but the steps: no tracker, no checkpoint, no progress bar, one batch of
# evaluation, full batches only (the detectors' benchmarks, bench/sdc.py and bench/straggler.py)
DDP_LOOP = [
    "strategy=ddp",
    "logger=none",
    "ckpt=none",
    "trainer.progress_bar=false",
    "trainer.eval_max_batches=1",
    "loader.drop_last=true",
]


def compose(overrides: list[str], config_name: str = "train"):
    from pitstop.config import compose as compose_config

    return compose_config(str(ROOT / "conf"), overrides, str(ROOT), config_name)


def ensure_data(overrides: list[str] = ()) -> None:
    from recipe.prepare import prepare

    prepare(compose(list(overrides), config_name="prepare").data)


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def fmt_row(cols, widths):
    return "  ".join(str(c).ljust(w) for c, w in zip(cols, widths))


def machine() -> dict:
    """Where a figure was measured: cores, CPU, GPU (or none), torch."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cores": os.cpu_count(), "cpu": cpu, "gpu": gpu, "torch": torch.__version__}


def save_result(name: str, figures: dict, argv: list[str] | None = None) -> Path:
    """``bench/results/<name>.json``: the figures, the command that printed them, the commit, the date and the
    machine. The docs show a figure only from such a file (docs/hooks.py), with its command, date and machine."""
    try:
        git = ["git", "-C", str(ROOT)]
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        # (what the figures depend on: not the docs, nor the result files a run before this one rewrote)
        code = ["src", "recipe", "conf", "bench", "pyproject.toml", ":(exclude)bench/results"]
        changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "--", *code],
                                 capture_output=True, text=True, timeout=10)  # fmt: skip
        # (a tree with uncommitted changes to the code says so: the figures are of the commit plus them)
        commit = (commit.stdout.strip() + ("+changes" if changed.stdout.strip() else "")) or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    args = sys.argv[1:] if argv is None else argv
    doc = {
        "name": name,
        "command": " ".join(["python", f"bench/{Path(sys.argv[0]).name}", *args]),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "figures": figures,
    }
    out = ROOT / "bench" / "results" / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"(figures written to {out.relative_to(ROOT)})")
    return out


def train(args: list[str], run_dir: str, timeout: float = 1800) -> dict:
    """``python -m recipe.train ARGS`` in a fresh process (this checkout's src first); its summary.json. A failed run
    ends the benchmark with its stderr's tail."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    argv = [sys.executable, "-m", "recipe.train", *args]
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{p.stderr[-2000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)
