"""MkDocs hook: the site's pictures, drawn at build time from real small runs on the CPU, into ``docs/pictures/``
(not committed), before any page is read. Each is the run's own output: a run's time line
(``pitstop.goodput.timeline``) or a sweep's ``report.png``.

- ``timeline-killed-twice.png``: a run killed twice under the supervisor (``fault=random`` drawn in steps, seeded:
  attempt 1 dies at step 77, attempt 2 at step 107), each time restarted and resumed from its newest checkpoint.
- ``sweep-report.png``: a sweep's ``report.png`` (``-m ckpt=sync_save,async_dcp``).
- ``straggler.png``: the time line of a ``strategy=ddp`` run of two processes where ``fault=slow_rank`` slows rank 1
  and ``trainer.straggler`` names it.
- ``skipped-step.png``: the time line of a run where ``fault=nonfinite`` makes a loss NaN and the step is skipped.

They are cached: the key is a hash of what made them (``src/``, ``recipe/``, ``conf/`` and this file), kept in
``docs/pictures/.key``; a build with the same key runs nothing. A run that fails, or that does not show what its
picture is for, fails the build in one line naming the run and its log (under ``.cache/docs-pictures/``).

    python docs/pictures.py            # build them (what make docs does first), or say they are up to date
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(HERE, "pictures")
WORK = os.path.join(ROOT, ".cache", "docs-pictures")
MADE_BY = ("src", "recipe", "conf", "docs/pictures.py")
TINY = ["debug=tiny", "trainer.batch_size=32"]  # (32: steps long enough to be seen beside the program's start)

# picture: the run's overrides (besides paths and run_dir) and what the run must show for the picture to say it
RUNS: dict[str, list[str]] = {
    # seed 215, a mean of 80 steps: attempt 1 fails after 77 steps (resumes from the save of step 60), attempt 2
    # after 47 more (step 107: resumes from 100), attempt 3 would after 129: it finishes (pitstop.resilience.fault)
    "timeline-killed-twice": [
        *TINY,
        "trainer.max_steps=200",
        "trainer.eval_every_steps=50",
        "ckpt=sync_dcp",
        "ckpt.interval_steps=20",
        "fault=random",
        "fault.mtbf_steps=80",
        "fault.seed=215",
        "trainer.max_restarts=2",
    ],
    "straggler": [
        *TINY,
        "strategy=ddp",
        "trainer.max_steps=60",
        "trainer.eval_every_steps=30",
        "fault=slow_rank",
        "fault.rank=1",
        "fault.factor=3",
        "fault.from_step=20",
        "trainer.straggler.window=10",
    ],
    "skipped-step": [*TINY, "trainer.max_steps=80", "trainer.eval_every_steps=40", "fault=nonfinite", "fault.step=50"],
}
SWEEP = ["-m", "debug=tiny", "trainer.max_steps=20", "ckpt.interval_steps=5", "ckpt=sync_save,async_dcp"]
NAMES = (*RUNS, "sweep-report")
DRAWING = threading.Lock()


class PictureFailed(RuntimeError):
    pass


def key() -> str:
    """A hash of every file the pictures are made from (their paths and contents)."""
    h = hashlib.sha256()
    for part in MADE_BY:
        path = os.path.join(ROOT, part)
        files = [path] if os.path.isfile(path) else sorted(
            os.path.join(d, f) for d, dirs, fs in os.walk(path) for f in fs
            if "__pycache__" not in d and not f.endswith(".pyc")
        )  # fmt: skip
        for f in files:
            h.update(os.path.relpath(f, ROOT).encode() + b"\0")
            with open(f, "rb") as fh:
                h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


def up_to_date(k: str) -> bool:
    try:
        with open(os.path.join(OUT, ".key")) as f:
            return f.read().strip() == k and all(os.path.isfile(os.path.join(OUT, f"{n}.png")) for n in NAMES)
    except FileNotFoundError:
        return False


def run(name: str, args: list[str], log_path: str) -> None:
    """``python -m`` ``args`` in the work folder, its output to ``log_path``; PictureFailed naming both if it fails."""
    path = [os.path.join(ROOT, "src"), ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1"}  # (two runs at a time)
    env.pop("MLFLOW_TRACKING_URI", None)
    with open(log_path, "w") as log:  # (its own session: a run that hangs is stopped with the processes it started)
        p = subprocess.Popen([sys.executable, "-m", *args], cwd=WORK, stdout=log, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)  # fmt: skip
        try:
            p.wait(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise PictureFailed(f"docs picture {name}: `python -m {' '.join(args)}` did not end in 600 s; "
                                f"its log: {log_path}") from None  # fmt: skip
    if p.returncode != 0:
        raise PictureFailed(f"docs picture {name}: `python -m {' '.join(args)}` failed (exit {p.returncode}); "
                            f"its log: {log_path}")  # fmt: skip


def check(name: str, run_dir: str, log_path: str) -> None:
    """The run shows what its picture is for (else the picture would say something untrue)."""
    from pitstop.goodput.timeline import read

    line = read(run_dir)
    ends = [a.status for a in line.attempts]
    shows = {
        "timeline-killed-twice": ends == ["running", "running", "finished"],  # (killed: no end status written)
        "straggler": bool(line.stragglers),
        "skipped-step": bool(line.skips) and ends == ["finished"],
    }[name]
    if not shows:
        raise PictureFailed(f"docs picture {name}: the run in {run_dir} does not show it (attempts {ends}, "
                            f"{len(line.stragglers)} slow rank(s) named, {len(line.skips)} step(s) skipped); "
                            f"its log: {log_path}")  # fmt: skip


def build(force: bool = False) -> bool:
    """Make the pictures unless they are up to date; returns whether it ran anything."""
    k = key()
    if not force and up_to_date(k):
        return False
    t0 = time.time()
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    os.makedirs(OUT, exist_ok=True)
    paths = [f"paths.root_dir={WORK}"]
    run("data", ["recipe.prepare", *paths], os.path.join(WORK, "prepare.log"))
    with ThreadPoolExecutor(2) as pool:  # (two at a time: most of a tiny run is its program's start)
        for done in [pool.submit(picture, name, args, paths) for name, args in RUNS.items()] + [
            pool.submit(sweep_report, paths)
        ]:
            done.result()
    with open(os.path.join(OUT, ".key"), "w") as f:
        f.write(k + "\n")
    print(f"docs pictures: {len(NAMES)} drawn from real runs in {time.time() - t0:.0f} s ({OUT})", file=sys.stderr)
    return True


def picture(name: str, args: list[str], paths: list[str]) -> None:
    """One run, checked, and its time line drawn."""
    from pitstop.goodput.timeline import draw

    run_dir, log_path = os.path.join(WORK, name), os.path.join(WORK, f"{name}.log")
    run(name, ["recipe.train", *args, *paths, f"run_dir={run_dir}"], log_path)
    check(name, run_dir, log_path)
    with DRAWING:  # (pyplot is not thread-safe)
        draw(run_dir, os.path.join(OUT, f"{name}.png"))


def sweep_report(paths: list[str]) -> None:
    """The sweep, and its report.png."""
    sweep, log_path = os.path.join(WORK, "sweep"), os.path.join(WORK, "sweep-report.log")
    run("sweep-report", ["recipe.train", *SWEEP, *paths, f"hydra.sweep.dir={sweep}"], log_path)
    if not os.path.isfile(os.path.join(sweep, "report.png")):
        raise PictureFailed(f"docs picture sweep-report: the sweep wrote no {sweep}/report.png; its log: {log_path}")
    shutil.copyfile(os.path.join(sweep, "report.png"), os.path.join(OUT, "sweep-report.png"))


def on_pre_build(config) -> None:  # noqa: ANN001 - MkDocs' hook signature
    try:
        build()
    except PictureFailed as e:
        from mkdocs.exceptions import PluginError

        raise PluginError(str(e)) from None


if __name__ == "__main__":
    print("drawn" if build(force="--force" in sys.argv) else f"up to date ({OUT})")
