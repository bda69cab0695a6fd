"""A run's time line: its attempts on one wall clock, each stretch of time drawn where it happened: the start of each
attempt (program start, health check, init, restore), every step's data wait and compute, every evaluation and
save, the steps skipped by ``trainer.instability``, the gaps between attempts, how each attempt ended; with the steps
reached, the rollbacks, the corruptions found by ``trainer.sdc``, the heals and the slow ranks named by
``trainer.straggler``. Read from the run dir alone (``goodput.json``, ``metrics.jsonl``), so it draws any run, also
one that was killed:

    python -m recipe.goodput --timeline RUN_DIR        # -> RUN_DIR/timeline.png

Where each stretch lies comes from what the run writes anyway: a step's ``metrics.jsonl`` line is written as it ends
(``time``) with its ``fetch_seconds`` (the data wait) and ``compute_seconds`` before it; an evaluation runs right
after its step's line and its metrics are written as it ends; a save blocks right after them for its
``ckpt_block_seconds``; an attempt's start buckets (``goodput.json``) run one after the other from its start.

A job of replica groups (``strategy=ft``) draws one panel per group (``RUN_DIR/replica{K}/``). ``logger=mlflow``
draws it at the end of each attempt, in the tracker's own process, and logs it as the run's artifact.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field

from pitstop.goodput.ledger import STARTUP
from pitstop.statefile import GOODPUT, Damaged, integer, number, parse, read_records, record

log = logging.getLogger("pitstop.goodput")

SLACK = 0.002  # (seconds: ``time`` is written rounded to the millisecond)


@dataclass
class Span:
    """A stretch of one attempt's wall clock spent on one thing (a ledger bucket, or ``recovery_gap``)."""

    start: float  # seconds since the job's first attempt started
    end: float
    what: str
    attempt: int = 0  # its attempt's number (a gap: the attempt after it)


@dataclass
class Attempt:
    number: int
    start: float  # seconds since the job's first attempt started
    end: float  # its end, or (killed) the later of its last heartbeat and its last line in metrics.jsonl
    status: str
    buckets: dict[str, float]
    resumed_from: int | None
    heals: list[float] = field(default_factory=list)  # seconds since the job's start
    last_step: int | None = None  # the last step it finished


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
    spans: list[Span] = field(default_factory=list)  # where the time went, attempt by attempt, each in time order

    def present(self) -> list[str]:
        """The kinds of stretch this line has (what its legend lists), in the order an attempt meets them."""
        seen = {s.what for s in self.spans if s.end > s.start}
        return [w for w in ORDER if w in seen]


ORDER = (*STARTUP, "data_wait", "compute", "eval", "checkpoint", "instability", "recovery_gap")


def _records(run_dir: str, t0: float) -> list[tuple[float, dict]]:
    """``metrics.jsonl``'s timed lines, (seconds since the job's start, the record), through the one checked reader
    of JSON-lines files (a FIFO or a link in its place, a line cut by a kill or nested too deep: passed over and
    said, never a crash or a hang)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.lexists(path):
        return []
    return [(float(r["time"]) - t0, r) for r in read_records(path, TIMED, then="left out of the time line")]


TIMED = record({"time": number(), "step": integer()})


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
                # (its last heartbeat's step; step 0 is the ledger's start value: no step taken)
                a.get("step") if a.get("step") not in (a.get("resumed_from"), 0, None) else None,
            )
        )
    line = Line(name or os.path.basename(os.path.normpath(run_dir)), attempts, [], [], [])
    per_attempt: list[list[tuple[float, dict]]] = [[] for _ in attempts]
    for at, r in _records(run_dir, t0):
        step = int(r["step"])
        k = _attempt_of(attempts, at)
        per_attempt[k].append((at, r))
        if "loss" in r:
            line.steps.append((at, step))
        elif r.get("event") == "skip":
            line.skips.append((at, step))
        elif r.get("event") == "rollback":
            line.rollbacks.append((at, step))
        elif "ckpt_block_seconds" in r or "ckpt_local_block_seconds" in r:
            line.saves.append((at, step))
        elif any(k.startswith("val_") for k in r):
            line.evals.append((at, step))
        elif r.get("event") == "sdc":
            line.sdc.append((at, step))
        elif r.get("event") == "straggler" and "since" in r:
            try:
                line.stragglers.append((at, step, int(r["since"]), int(r["rank"])))
            except (KeyError, ValueError, TypeError):
                continue
    for i, (a, recs) in enumerate(zip(attempts, per_attempt)):
        if recs:
            a.end = max(a.end, max(at for at, _ in recs))  # (a killed attempt ran until its last line at least)
        if i and a.start > attempts[i - 1].end:
            line.spans.append(Span(attempts[i - 1].end, a.start, "recovery_gap", a.number))
        line.spans += sorted(_spans(a, recs), key=lambda s: s.start)  # (a save's line may come after the next step's)
    return line


def _attempt_of(attempts: list[Attempt], at: float) -> int:
    """The attempt a line written at ``at`` belongs to: the first whose span holds it (in-process reruns of one
    program overlap: each attempt's start is the program's), else the last one started before it (a killed
    attempt's last lines come after its last heartbeat)."""
    held = [i for i, a in enumerate(attempts) if a.start - SLACK <= at <= a.end + SLACK]
    return held[0] if held else max((i for i, a in enumerate(attempts) if a.start <= at + SLACK), default=0)


def _num(r: dict, key: str) -> float:
    try:
        return max(float(r.get(key) or 0.0), 0.0)
    except (TypeError, ValueError):
        return 0.0


def _spans(a: Attempt, recs: list[tuple[float, dict]]) -> list[Span]:
    """Where one attempt's time went, from its start buckets and its lines in ``metrics.jsonl``."""
    out: list[Span] = []
    first = min((at - _num(r, "compute_seconds") - _num(r, "fetch_seconds") for at, r in recs if "loss" in r),
                default=a.end)  # fmt: skip
    at = a.start
    for b in STARTUP:  # (one after the other from the attempt's start, up to its first step)
        width = a.buckets.get(b, 0.0)
        if width > 0 and at < first:
            out.append(Span(at, min(at + width, first), b, a.number))
        at += width
    step_end: dict[int, float] = {}  # (this attempt's steps and evaluations: where a save starts)
    eval_end: dict[int, float] = {}
    done = first  # where the loop's last stretch ended
    for at, r in recs:
        step = int(r["step"])
        if "loss" in r:
            compute, fetch = _num(r, "compute_seconds"), _num(r, "fetch_seconds")
            if fetch:
                out.append(Span(at - compute - fetch, at - compute, "data_wait", a.number))
            out.append(Span(at - compute, at, "compute", a.number))
            step_end[step] = done = at
            a.last_step = max(a.last_step or 0, step)
        elif r.get("event") == "skip":  # (the step ran, then was not applied)
            out.append(Span(min(done, at), at, "instability", a.number))
            done = at
        elif any(k.startswith("val_") for k in r):
            out.append(Span(min(step_end.get(step, at), at), at, "eval", a.number))
            eval_end[step] = done = at
        elif "ckpt_block_seconds" in r or "ckpt_local_block_seconds" in r:
            block = _num(r, "ckpt_block_seconds") + _num(r, "ckpt_local_block_seconds")
            begin = max(step_end.get(step, at - block), eval_end.get(step, 0.0))
            out.append(Span(begin, begin + block, "checkpoint", a.number))
            done = max(done, begin + block)
    return out


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
    from pitstop.goodput.timeline_draw import draw as drawn

    return drawn(lines(run_dir), path or os.path.join(run_dir, "timeline.png"))


if __name__ == "__main__":
    print(draw(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
