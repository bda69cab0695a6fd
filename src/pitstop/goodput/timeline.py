"""A run's time line: its attempts on one clock, coloured by the ledger's buckets, with its steps, saves,
evaluations, failures, restarts and heals, the steps skipped and the rollbacks of ``trainer.instability``, the
corruptions found by ``trainer.sdc`` and the slow ranks named by ``trainer.straggler``. Read from the run dir alone
(``goodput.json``, ``metrics.jsonl``), so it draws any run, also one that was killed:

    python -m recipe.goodput --timeline RUN_DIR        # -> RUN_DIR/timeline.png

A job of replica groups (``strategy=ft``) draws one panel per group (``RUN_DIR/replica{K}/``). ``logger=mlflow``
draws it at the end of each attempt, in the tracker's own process, and logs it as the run's artifact.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field

from pitstop.goodput.ledger import BUCKETS as LEDGER
from pitstop.statefile import GOODPUT, Damaged, parse

log = logging.getLogger("pitstop.goodput")

# The ledger's buckets, in the order an attempt meets them (its start, then the loop's); the colours are fixed so
# that pictures compare.
BUCKETS = (*LEDGER, "other")
COLOURS = {
    "other": "#e0e0e0",
    "program_start": "#9e9e9e",
    "health": "#80cbc4",
    "init": "#bdbdbd",
    "restore": "#ffb74d",
    "compute": "#43a047",
    "data_wait": "#e53935",
    "compile": "#8e24aa",
    "eval": "#1e88e5",
    "checkpoint": "#fdd835",
    "logging": "#6d4c41",
    "quorum": "#00acc1",
    "discarded": "#d81b60",
    "instability": "#ff6f00",
    "sdc": "#4a148c",
    "straggler": "#f06292",
    "recovery_gap": "#eeeeee",
}
ENDS = {
    "finished": ("#2e7d32", "finished"),
    "failed": ("#c62828", "failed"),
    "hung": ("#ef6c00", "hung"),
    "preempted": ("#6a1b9a", "preempted"),
    "reformed": ("#6a1b9a", "re-formed without a slow node"),
    "running": ("#c62828", "killed"),
}


@dataclass
class Attempt:
    number: int
    start: float  # seconds since the job's first attempt started
    end: float
    status: str
    buckets: dict[str, float]
    resumed_from: int | None
    heals: list[float] = field(default_factory=list)  # seconds since the job's start


@dataclass
class Line:
    """One run's (or replica group's) time line."""

    name: str
    attempts: list[Attempt]
    steps: list[tuple[float, int]]  # (seconds since the job's start, step)
    saves: list[tuple[float, int]]
    evals: list[tuple[float, int]]
    skips: list[tuple[float, int]] = field(default_factory=list)  # steps not applied (trainer.instability)
    rollbacks: list[tuple[float, int]] = field(default_factory=list)  # (when, the step rolled back to)
    sdc: list[tuple[float, int]] = field(default_factory=list)  # a corruption detected (then undone): at its step
    # a rank named slow (trainer.straggler): (when, the step it was named at, since which step, the rank)
    stragglers: list[tuple[float, int, int, int]] = field(default_factory=list)


def read(run_dir: str, name: str = "") -> Line:
    """The time line of one run dir (its ``goodput.json`` and ``metrics.jsonl``). A ``goodput.json`` that is damaged
    or of another shape: ValueError naming it (a drawing reads the user's file, it never moves it)."""
    path = os.path.join(run_dir, "goodput.json")
    try:
        records = parse(path, GOODPUT)["attempts"]
    except Damaged as e:
        raise ValueError(f"{path} is unreadable ({e}): no time line from it") from None
    if not records:
        raise ValueError(f"{run_dir}/goodput.json has no attempt")
    t0 = float(records[0]["start"])
    attempts = []
    for i, a in enumerate(records):
        start = float(a["start"]) - t0
        end = float(a.get("end") or a["start"]) - t0  # (killed: its last write, a heartbeat)
        heals = [start + float(h.get("seconds", 0.0)) for h in ((a.get("ft") or {}).get("heals") or [])]
        attempts.append(
            Attempt(
                int(a.get("attempt", i + 1)),
                start,
                end,
                str(a.get("status", "running")),
                {k: float(v) for k, v in (a.get("buckets") or {}).items() if k != "total"},
                a.get("resumed_from"),
                heals,
            )
        )
    steps, saves, evals, skips, rollbacks, sdc, slow = [], [], [], [], [], [], []
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            for line in f:
                try:
                    r = json.loads(line)
                    if not isinstance(r, dict) or "time" not in r or "step" not in r:
                        continue
                    at, step = float(r["time"]) - t0, int(r["step"])
                except (ValueError, TypeError):
                    continue  # (a line cut by a kill, or not one pitstop wrote)
                if "loss" in r:
                    steps.append((at, step))
                elif r.get("event") == "skip":
                    skips.append((at, step))
                elif r.get("event") == "rollback":
                    rollbacks.append((at, step))
                elif "ckpt_block_seconds" in r or "ckpt_local_block_seconds" in r:
                    saves.append((at, step))
                elif any(k.startswith("val_") for k in r):
                    evals.append((at, step))
                elif r.get("event") == "sdc":
                    sdc.append((at, step))
                elif r.get("event") == "straggler" and "since" in r:
                    try:
                        slow.append((at, step, int(r["since"]), int(r["rank"])))
                    except (KeyError, ValueError, TypeError):
                        continue
    except FileNotFoundError:
        pass
    name = name or os.path.basename(os.path.normpath(run_dir))
    return Line(name, attempts, steps, saves, evals, skips, rollbacks, sdc, slow)


def lines(run_dir: str) -> list[Line]:
    """A run dir's time lines: its own, or each replica group's (``strategy=ft``)."""
    if os.path.exists(os.path.join(run_dir, "goodput.json")):
        return [read(run_dir)]
    groups = sorted(
        (d for d in os.listdir(run_dir) if d.startswith("replica") and d[7:].isdigit()), key=lambda d: int(d[7:])
    )
    found, damaged = [], []
    for d in groups:
        if os.path.exists(os.path.join(run_dir, d, "goodput.json")):
            try:
                found.append(read(os.path.join(run_dir, d), d))
            except ValueError as e:  # (one group's damaged account: the others are still drawn)
                log.warning("%s", e)
                damaged.append(str(e))
    if not found and damaged:
        raise ValueError(damaged[0])
    if not found:
        raise FileNotFoundError(f"{run_dir} has no goodput.json (nor replica*/goodput.json): not a pitstop run dir")
    return found


def draw(run_dir: str, path: str | None = None) -> str:
    """Draw the run's time line to ``path`` (default ``RUN_DIR/timeline.png``); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    found = lines(run_dir)
    fig, axes = plt.subplots(len(found), 1, figsize=(11, 1.2 + 2.0 * len(found)), squeeze=False)
    used: set[str] = set()
    for ax, line in zip(axes[:, 0], found):
        used |= _panel(ax, line)
    handles = [Patch(color=COLOURS[b], label=b.replace("_", " ")) for b in (*BUCKETS, "recovery_gap") if b in used]
    fig.legend(handles=handles, loc="lower center", ncol=min(6, len(handles)), fontsize=8, frameon=False)
    axes[-1, 0].set_xlabel("seconds since the job started")
    fig.tight_layout(rect=(0, 0.1 if len(handles) > 6 else 0.06, 1, 1))
    path = path or os.path.join(run_dir, "timeline.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _panel(ax: object, line: Line) -> set[str]:
    """One time line: a bar per attempt split into its buckets (in the order an attempt meets them), the gaps
    between attempts, how each ended, and the steps (right axis), saves and evaluations on it."""
    used: set[str] = set()
    y = 0.0
    for prev, a in zip([None, *line.attempts[:-1]], line.attempts):
        if prev is not None and a.start > prev.end:
            ax.barh(
                y,
                a.start - prev.end,
                left=prev.end,
                height=0.5,
                color=COLOURS["recovery_gap"],
                hatch="//",
                edgecolor="#9e9e9e",
            )
            used.add("recovery_gap")
        span, total = max(a.end - a.start, 0.0), sum(a.buckets.values())
        left = a.start
        for b in BUCKETS:
            width = a.buckets.get(b, 0.0) * (span / total if total > span > 0 else 1.0)
            if width > 1e-3:
                ax.barh(y, width, left=left, height=0.5, color=COLOURS[b])
                used.add(b)
                left += width
        colour, said = ENDS.get(a.status, ENDS["running"])
        ax.plot([a.end], [y], marker="|" if a.status == "finished" else "x", color=colour, markersize=14, mew=2)
        label = f"attempt {a.number}" + (f", from step {a.resumed_from}" if a.resumed_from is not None else "")
        ax.annotate(f"{label}: {said}", (a.start, y + 0.32), fontsize=7, color=colour)
        for h in a.heals:
            ax.plot([h], [y], marker="*", color=COLOURS["quorum"], markersize=10)
    ax.set_yticks([])
    ax.set_ylim(-0.6, 1.0)
    ax.set_title(line.name, fontsize=9, loc="left")
    if line.steps:
        steps = ax.twinx()
        steps.plot([t for t, _ in line.steps], [s for _, s in line.steps], ".", color="#212121", markersize=2)
        marks = [(line.saves, "v", "#f9a825"), (line.evals, "o", "#1565c0")]
        marks += [(line.skips, "x", COLOURS["instability"]), (line.rollbacks, "<", "#000000")]
        marks.append((line.sdc, "X", COLOURS["sdc"]))
        for points, marker, colour in marks:
            steps.plot(
                [t for t, _ in points], [s for _, s in points], marker, color=colour, markersize=5, linestyle="none"
            )
        said = "saves: v, evals: o" + (", skipped: x, rolled back: <" if line.skips or line.rollbacks else "")
        said += ", sdc: X" if line.sdc else ""
        for at, step, since, rank in line.stragglers:  # (named at `step`, slow since `since`)
            steps.plot([at], [step], "D", color=COLOURS["straggler"], markersize=5)
            steps.annotate(f"rank {rank} slow since step {since}", (at, step), fontsize=6, color=COLOURS["straggler"])
        said += ", slow rank named: D" if line.stragglers else ""
        steps.set_ylabel(f"step ({said})", fontsize=7)
        steps.tick_params(labelsize=7)
    return used


if __name__ == "__main__":
    print(draw(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
