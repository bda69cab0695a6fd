"""Where the wall clock went: every second of a job, across restarts, in exactly one bucket.

Within one process (an *attempt*), :class:`Ledger` times the loop's phases. Across attempts in the same
run dir, :class:`GoodputLog` keeps ``RUN_DIR/goodput.json``: one record per attempt (its measured
buckets, the step it reached, the steps it started from, and a mark of its cumulative work at every
checkpoint it started), rewritten at least every ``heartbeat`` seconds, at every checkpoint and at exit.
When an attempt resumes from step S, the work its predecessor did after S was thrown away; that is
moved from *productive*/*data wait* into *lost*.  Goodput = productive / total.

Job buckets (``goodput.json`` → ``totals``):

- ``productive``  compute of steps whose results survive;
- ``data_wait``   waiting for input batches (of surviving steps);
- ``checkpoint``  the loop blocked by saves (staging, writes, waiting for a save in flight);
- ``startup``     process start → first step (imports, process groups, data index, restore), plus, for an
                  automatic restart, the time between the previous attempt's last record and this start;
- ``lost``        compute, data wait, evaluation and logging of steps that were computed again;
- ``other``       evaluation, logging and whatever the loop did outside those (e.g. the final close).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from typing import Any

from pitstop.metrics import write_json_atomic

BUCKETS = ("startup", "compute", "data_wait", "checkpoint", "eval", "logging")
JOB_BUCKETS = ("productive", "data_wait", "checkpoint", "startup", "lost", "other")
WORK = ("compute", "data_wait", "eval", "logging")  # what is redone when steps are redone
MAX_MARKS = 16  # checkpoint marks kept per attempt (resumes come from recent checkpoints)


def process_start_wall() -> float:
    """When this process started (wall clock), so imports count as start-up; now if unknown."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        start = btime + ticks / os.sysconf("SC_CLK_TCK")
        return start if 0 <= time.time() - start < 3600 else time.time()
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class Ledger:
    """This attempt's seconds per bucket; ``other`` = wall time since process start minus the rest."""

    _first_in_process = True

    def __init__(self) -> None:
        # The first run of a process counts from process start (imports are start-up); a later one in the
        # same process (jobs of an in-process sweep) from its own creation.
        self.start_wall = process_start_wall() if Ledger._first_in_process else time.time()
        Ledger._first_in_process = False
        self.t0 = time.perf_counter() - max(0.0, time.time() - self.start_wall)
        self.seconds = {b: 0.0 for b in BUCKETS}
        self.seconds["startup"] = time.perf_counter() - self.t0  # interpreter start -> here

    def add(self, bucket: str, seconds: float) -> None:
        self.seconds[bucket] += seconds

    @contextmanager
    def measure(self, bucket: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[bucket] += time.perf_counter() - t

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def split(self) -> dict[str, float]:
        total = self.elapsed()
        out = {k: round(v, 4) for k, v in self.seconds.items()}
        out["other"] = round(max(0.0, total - sum(self.seconds.values())), 4)
        out["total"] = round(total, 4)
        return out

    def work(self) -> dict[str, float]:
        return {k: round(self.seconds[k], 4) for k in WORK}


class GoodputLog:
    """``RUN_DIR/goodput.json``: the attempts so far and the job's totals (rank 0 writes it)."""

    def __init__(self, run_dir: str, ledger: Ledger, enabled: bool = True, heartbeat: float = 0.1):
        self.path = os.path.join(run_dir, "goodput.json")
        self.ledger, self.enabled, self.heartbeat = ledger, enabled, heartbeat
        self.previous = self._read_attempts()
        self.attempt: dict[str, Any] = {
            "attempt": len(self.previous) + 1, "pid": os.getpid(), "start": round(ledger.start_wall, 3),
            "end": None, "status": "running", "auto_restart": _auto_restart(), "resumed_from": None,
            "step": 0, "saves": 0, "buckets": {}, "marks": {}}
        self._last_write, self._interval = 0.0, heartbeat

    def _read_attempts(self) -> list[dict]:
        try:
            with open(self.path) as f:
                return list(json.load(f).get("attempts", []))
        except FileNotFoundError:
            return []
        except (OSError, ValueError):  # unreadable: start a fresh account rather than fail the run
            if self.enabled:
                os.replace(self.path, self.path + ".corrupt")
            return []

    # ---- observed failures (for ckpt.interval=auto) ---------------------------------------------------
    def failures(self) -> int:
        return sum(1 for a in self.previous if a.get("status") != "finished")

    def job_seconds(self) -> float:
        return self.totals()["total"]

    # ---- updates ----------------------------------------------------------------------------------------
    def resumed(self, step: int | None) -> None:
        self.attempt["resumed_from"] = step
        self.attempt["step"] = step or 0
        if self.previous:  # only the mark this resume used is still needed: keep the file small
            prev = self.previous[-1]
            prev["marks"] = {k: v for k, v in prev.get("marks", {}).items() if k == str(step)}

    def mark(self, step: int) -> None:
        """A checkpoint of ``step`` was started: remember the work done up to it (and write now)."""
        marks = self.attempt["marks"]
        marks[str(step)] = self.ledger.work()
        self.attempt["saves"] = self.attempt.get("saves", 0) + 1
        while len(marks) > MAX_MARKS:  # a resume from an older one counts this attempt's work as lost
            marks.pop(next(iter(marks)))
        self.write(step)

    def tick(self, step: int) -> None:
        if self.enabled and time.monotonic() - self._last_write >= self._interval:
            self.write(step)

    def write(self, step: int, status: str = "running") -> dict:
        self.attempt.update(step=step, status=status, end=round(time.time(), 3),
                            buckets=self.ledger.split())
        doc = {"attempts": [*self.previous, self.attempt]}
        doc.update(account(doc["attempts"]))
        if self.enabled:
            t0 = time.perf_counter()
            write_json_atomic(self.path, doc, fsync=status != "running", indent=1, sort_keys=False)
            self._last_write = time.monotonic()
            # Never more than ~2% of the loop's time, however many attempts the file holds.
            self._interval = max(self.heartbeat, 50 * (time.perf_counter() - t0))
        return doc

    def totals(self) -> dict[str, float]:
        return account([*self.previous, {**self.attempt, "buckets": self.ledger.split()}])["totals"]


def _auto_restart() -> bool:
    """Started by a supervisor or the elastic agent after a failure (not by a person)."""
    return int(os.environ.get("PITSTOP_RESTART_COUNT", "0") or 0) > 0 or \
        int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def account(attempts: list[dict]) -> dict[str, Any]:
    """Job totals per bucket from the attempts' own ledgers (see the module docstring)."""
    t = {b: 0.0 for b in JOB_BUCKETS}
    for i, a in enumerate(attempts):
        b = a.get("buckets") or {}
        nxt = attempts[i + 1] if i + 1 < len(attempts) else None
        lost = {k: 0.0 for k in WORK}
        if nxt is not None:
            resume = nxt.get("resumed_from") or 0
            if resume >= a.get("step", 0):
                base = None  # nothing of this attempt was redone
            elif str(resume) in a.get("marks", {}):
                base = a["marks"][str(resume)]
            else:  # resumed from before anything this attempt saved: all its work is redone
                base = {k: 0.0 for k in WORK}
            if base is not None:
                lost = {k: max(0.0, b.get(k, 0.0) - base.get(k, 0.0)) for k in WORK}
        t["productive"] += b.get("compute", 0.0) - lost["compute"]
        t["data_wait"] += b.get("data_wait", 0.0) - lost["data_wait"]
        t["checkpoint"] += b.get("checkpoint", 0.0)
        t["startup"] += b.get("startup", 0.0)
        t["lost"] += sum(lost.values())
        t["other"] += b.get("eval", 0.0) + b.get("logging", 0.0) - lost["eval"] - lost["logging"] + b.get("other", 0.0)
        if i > 0 and a.get("auto_restart"):  # the gap: the previous attempt's unrecorded tail + restart
            prev = attempts[i - 1]
            gap = a.get("start", 0.0) - (prev.get("end") or a.get("start", 0.0))
            t["startup"] += max(0.0, gap)
    total = sum(t.values())
    totals = {k: round(v, 3) for k, v in t.items()}
    totals["total"] = round(total, 3)
    return {"totals": totals, "goodput": round(t["productive"] / total, 4) if total > 0 else 0.0,
            "attempts_count": len(attempts),
            "restarts": max(0, len(attempts) - 1),
            "failures": sum(1 for a in attempts[:-1] if a.get("status") != "finished")
            + (1 if attempts and attempts[-1].get("status") == "failed" else 0)}


def table(doc: dict) -> str:
    """A short, aligned text table of the job's buckets."""
    totals, total = doc["totals"], doc["totals"]["total"] or 1e-9
    lines = [f"goodput {doc['goodput'] * 100:.1f}% over {total:.1f} s wall clock, "
             f"{doc['attempts_count']} attempt(s), {doc['failures']} failure(s)"]
    for k in JOB_BUCKETS:
        lines.append(f"  {k:<11} {totals[k]:>9.2f} s  {totals[k] / total * 100:5.1f}%")
    return "\n".join(lines)
