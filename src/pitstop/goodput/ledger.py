"""Where the wall clock went: every second of a job, across restarts, in exactly one bucket.

Within one process (an *attempt*), :class:`Ledger` times the loop's phases. Across attempts in the same
run dir, :class:`GoodputLog` keeps ``RUN_DIR/goodput.json``: one record per attempt (its measured
buckets, the step it reached, the steps it started from, and a mark of its cumulative work at every
checkpoint it started), rewritten at least every ``heartbeat`` seconds, at every checkpoint and at exit.
When an attempt resumes from step S, the work its predecessor did after S was thrown away; that is
moved from *productive*/*data wait* into *lost*.  Goodput = productive / total.

Job buckets (``goodput.json`` → ``totals``), with the names of Google's ml-goodput-measurement badput types
where they match:

- ``productive``     compute of steps whose results survive;
- ``data_wait``      waiting for input batches of surviving steps (data loading);
- ``checkpoint``     the loop blocked by saves: staging, writes, waiting for a save in flight (checkpoint save);
- ``eval``           evaluation of surviving steps;
- ``program_start``  process start → the runner exists: interpreter and imports (program startup);
- ``health``         the node's health check before it is used, in its launcher before the attempt exists (the
                     launcher hands the seconds down: ``LaunchFacts.health_seconds``; out of ``program_start``);
- ``init``           process groups, model, optimizer, data index, loaders, checkpointer (training preparation);
- ``restore``        reading the checkpoint it resumes from (checkpoint restore);
- ``compile``        ``torch.compile`` compiling the model at its first steps and evaluation (``trainer.compile``;
                     every attempt pays it again: part of the restart cost);
- ``recovery_gap``   for an automatic restart, the previous attempt's last record → this process's start
                     (infrastructure recovery from disruption);
- ``lost``           compute, data wait, evaluation and logging of steps computed again (wasted progress);
- ``quorum``         (``strategy=ft``) waiting for each step's quorum of replica groups, heals from a peer included;
- ``discarded``      (``strategy=ft``) steps computed and thrown away because a peer group failed during them;
- ``instability``    steps whose update was not applied (a non-finite or spiking loss), and the steps a rollback
                     threw away with the rollback's own restore (``trainer.instability``);
- ``sdc``            silent data corruption (``trainer.sdc``): the replicas' digest checks, and on a mismatch the
                     rollback's restore and the steps between the checkpoint it restored and the detection, which are
                     computed again;
- ``straggler``      the time the job lost waiting for its slowest rank (``trainer.straggler``): what its steps would
                     have taken at the median (other) ranks' pace, over the windows that rank was named slow for;
                     taken out of ``compute``;
- ``other``          logging and whatever the loop did outside those (e.g. the final close).

Restart cost R (``restart_seconds``, per automatic restart) = recovery_gap + program_start + health + init + restore +
compile of
the attempts a supervisor or the elastic agent started after a failure.

In-process ``-m`` sweeps: jobs after the first in one process import nothing; each is charged the
``program_start`` that the process measured for its first job, so every job is accounted as if started alone.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable

from pitstop.statefile import GOODPUT, read_state
from pitstop.telemetry.metrics import write_json_atomic

STARTUP = ("program_start", "health", "init", "restore", "compile")
REPLICA = ("quorum", "discarded")  # strategy=ft only (a table shows them when they are not zero)
# steps not applied or rolled back in the attempt, and the wait for a slow rank (a table shows them when not zero)
TROUBLE = ("instability", "sdc", "straggler")
SOMETIMES = (*REPLICA, *TROUBLE)
BUCKETS = (*STARTUP, "compute", "data_wait", "checkpoint", "eval", "logging", *REPLICA, *TROUBLE)
JOB_BUCKETS = (
    "productive",
    "data_wait",
    "checkpoint",
    "eval",
    *STARTUP,
    "recovery_gap",
    "lost",
    *REPLICA,
    *TROUBLE,
    "other",
)
WORK = ("compute", "data_wait", "eval", "logging")  # what is redone when steps are redone
MAX_MARKS = 16  # checkpoint marks kept per attempt (resumes come from recent checkpoints)
TIERS = ("local", "peer", "durable", "heal")  # where a restore's state came from (heal: a live replica, strategy=ft)


class Ledger:
    """This attempt's seconds per bucket; ``other`` = wall time since process start minus the rest."""

    def __init__(self, program_start: float, health: float = 0.0) -> None:
        """``program_start``: the wall clock at which this attempt's program start began (``LaunchFacts``);
        ``health``: seconds of it that the launcher spent on the node's health check (booked as ``health``)."""
        now = time.time()
        seconds = max(0.0, now - min(program_start, now))
        self.start_wall = now - seconds
        self.t0 = time.perf_counter() - seconds
        self.seconds = {b: 0.0 for b in BUCKETS}
        checked = min(max(0.0, health), seconds)
        self.seconds["program_start"] = seconds - checked
        self.seconds["health"] = checked
        self._open: tuple[str, float] | None = None  # the phase being measured now, since when

    def add(self, bucket: str, seconds: float) -> None:
        self.seconds[bucket] += seconds

    def move(self, source: str, bucket: str, seconds: float) -> None:
        """``seconds`` measured as ``source`` were spent on ``bucket`` (e.g. compiling inside an evaluation)."""
        self.seconds[source] -= seconds
        self.seconds[bucket] += seconds

    @contextmanager
    def measure(self, bucket: str):
        t = time.perf_counter()
        outer, self._open = self._open, (bucket, t)  # split() counts a phase in progress (a kill during it)
        try:
            yield
        finally:
            self.seconds[bucket] += time.perf_counter() - t
            self._open = outer

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def split(self) -> dict[str, float]:
        now = time.perf_counter()
        total = now - self.t0
        seconds = dict(self.seconds)
        if self._open is not None:
            seconds[self._open[0]] += now - self._open[1]
        out = {k: round(v, 4) for k, v in seconds.items()}
        out["other"] = round(max(0.0, total - sum(seconds.values())), 4)
        out["total"] = round(total, 4)
        return out

    def work(self) -> dict[str, float]:
        return {k: round(self.seconds[k], 4) for k in WORK}


class GoodputLog:
    """``RUN_DIR/goodput.json``: the attempts so far and the job's totals (rank 0 writes it)."""

    def __init__(
        self,
        run_dir: str,
        ledger: Ledger,
        enabled: bool = True,
        heartbeat: float = 0.1,
        *,
        auto_restart: bool = False,
        start_method: str | None = None,
        extra: Callable[[], dict[str, Any]] | None = None,
    ):
        """``auto_restart``: started by a supervisor or an agent after a failure (not by a person);
        ``start_method``: forkserver for a warm attempt (see ``LaunchFacts``); ``extra()``: more facts of the
        attempt, written with it (``strategy=ft``: its heals and discarded steps)."""
        self.extra = extra
        self.path = os.path.join(run_dir, "goodput.json")
        self.ledger, self.enabled, self.heartbeat = ledger, enabled, heartbeat
        self.previous = self._read_attempts()
        self.attempt: dict[str, Any] = {
            "attempt": len(self.previous) + 1,
            "pid": os.getpid(),
            "start": round(ledger.start_wall, 3),
            "end": None,
            "status": "running",
            "auto_restart": auto_restart,
            "restored": False,
            "resumed_from": None,
            "start_method": start_method,
            "step": 0,
            "saves": 0,
            "buckets": {},
            "marks": {},
        }
        self._last_write, self._interval = 0.0, heartbeat
        self._writing = threading.RLock()
        # On record from the start: an attempt killed during init (or restore) still has its time accounted
        # and counts as an attempt (the next one's recovery gap starts where this record ends).
        self.write(0)

    def withdraw(self) -> None:
        """This attempt never ran (a config error): leave the account as it was before it."""
        if not self.enabled:
            return
        if self.previous:
            doc = {"attempts": self.previous}
            doc.update(account(self.previous))
            write_json_atomic(self.path, doc, fsync=True, indent=1, sort_keys=False)
        else:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass

    def _read_attempts(self) -> list[dict]:
        # Damaged or of another shape (a torn write, a hand edit, a file planted in the run dir): a fresh account
        # rather than a run that cannot start; the file is kept aside (by rank 0, which owns it) and named.
        doc = read_state(
            self.path,
            GOODPUT,
            keep_aside=self.enabled,
            then="the goodput account and the failure history that ckpt.interval=auto uses start again from this "
            "attempt",
            logger=logging.getLogger("pitstop.goodput") if self.enabled else None,  # (rank 0 says it, once)
        )
        return list(doc["attempts"]) if doc is not None else []

    # ---- observed failures (for ckpt.interval=auto) ---------------------------------------------------
    def failures(self) -> int:
        return sum(1 for a in self.previous if a.get("status") != "finished")

    def job_seconds(self) -> float:
        return self.totals()["total"]

    # ---- updates ----------------------------------------------------------------------------------------
    def resumed(self, step: int | None, tier: str | None = None) -> None:
        """The restore is done: this attempt continues from ``step`` (None: from the beginning), read from ``tier``
        (one of ``TIERS``: where its state came from; the restore's seconds are booked by it)."""
        self.attempt.update(restored=True, resumed_from=step, step=step or 0)
        if step is not None and tier in TIERS:
            self.attempt["restored_from"] = tier
        prev = _last_restored(self.previous)
        if prev is not None:  # only the mark this resume used is still needed: keep the file small
            prev["marks"] = {k: v for k, v in prev.get("marks", {}).items() if k == str(step)}

    def mark(self, step: int) -> None:
        """A checkpoint of ``step`` was started: remember the work done up to it (and write now)."""
        marks = self.attempt["marks"]
        marks[str(step)] = self.ledger.work()
        self.attempt["saves"] = self.attempt.get("saves", 0) + 1
        while len(marks) > MAX_MARKS:  # a resume from an older one counts this attempt's work as lost
            marks.pop(next(iter(marks)))
        self.write(step)

    def rolled_back(self, to: int, frm: int, bucket: str, why: str) -> None:
        """This attempt went back from step ``frm`` to the checkpoint of step ``to`` in-process: the work done since
        that checkpoint (since the attempt's start, if it was not this attempt's) moves to ``bucket``, the marks of
        the steps thrown away are dropped, and the rollback is on record (written now)."""
        marks = self.attempt["marks"]
        base = marks.get(str(to)) or {k: 0.0 for k in WORK}
        moved = 0.0
        for k in WORK:
            seconds = max(0.0, self.ledger.seconds[k] - base.get(k, 0.0))
            self.ledger.move(k, bucket, seconds)
            moved += seconds
        self.attempt["marks"] = {s: w for s, w in marks.items() if int(s) <= to}
        entry = {"to": to, "from": frm, "bucket": bucket, "seconds": round(moved, 4), "why": why[:200]}
        self.attempt.setdefault("rollbacks", []).append(entry)
        self.write(to)

    def tick(self, step: int) -> None:
        if self.enabled and time.monotonic() - self._last_write >= self._interval:
            self.write(step)

    def write(self, step: int, status: str = "running") -> dict:
        with self._writing:  # (the hang watchdog's thread records a hang while the loop's may write its heartbeat)
            return self._write(step, status)

    def _write(self, step: int, status: str) -> dict:
        if status == "running" and self.attempt.get("status") == "hung":
            status = "hung"  # (a heartbeat after the watchdog declared the hang does not take it back)
        self.attempt.update(step=step, status=status, end=round(time.time(), 3), buckets=self.ledger.split())
        if self.extra is not None:
            self.attempt.update(self.extra())
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


def _restored(attempt: dict) -> bool:
    """The attempt got through its restore (records of an older pitstop do not say: they all did)."""
    return bool(attempt.get("restored", True))


def _last_restored(attempts: list[dict]) -> dict | None:
    return next((a for a in reversed(attempts) if _restored(a)), None)


def account(attempts: list[dict]) -> dict[str, Any]:
    """Job totals per bucket from the attempts' own ledgers (see the module docstring).

    The work an attempt did after step S is lost when the next attempt that *restored* resumed from S; an
    attempt killed before its restore ended (in program start or init) says nothing about what survives."""
    t = {b: 0.0 for b in JOB_BUCKETS}
    restart_costs = []
    for i, a in enumerate(attempts):
        b = a.get("buckets") or {}
        nxt = next((n for n in attempts[i + 1 :] if _restored(n)), None)
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
        for k in STARTUP:
            t[k] += b.get(k, 0.0)
        t["init"] += b.get("startup", 0.0)  # goodput.json of an older pitstop: one startup bucket
        t["lost"] += sum(lost.values())
        for k in (*REPLICA, *TROUBLE):
            t[k] += b.get(k, 0.0)
        t["eval"] += b.get("eval", 0.0) - lost["eval"]
        t["other"] += b.get("logging", 0.0) - lost["logging"] + b.get("other", 0.0)
        if i > 0 and a.get("auto_restart"):  # the gap: the previous attempt's unrecorded tail + restart
            prev = attempts[i - 1]
            gap = max(0.0, a.get("start", 0.0) - (prev.get("end") or a.get("start", 0.0)))
            t["recovery_gap"] += gap
            restart_costs.append(gap + sum(b.get(k, 0.0) for k in STARTUP) + b.get("startup", 0.0))
    by_tier: dict[str, list[float]] = {}
    for a in attempts:
        if a.get("restored_from") in TIERS:
            by_tier.setdefault(a["restored_from"], []).append((a.get("buckets") or {}).get("restore", 0.0))
    total = sum(t.values())
    totals = {k: round(v, 3) for k, v in t.items()}
    totals["total"] = round(total, 3)
    return {
        "totals": totals,
        "goodput": round(t["productive"] / total, 4) if total > 0 else 0.0,
        "attempts_count": len(attempts),
        "restarts": max(0, len(attempts) - 1),
        "restart_seconds": round(sum(restart_costs) / len(restart_costs), 3) if restart_costs else None,
        # the restores' seconds by where their state came from (local, peer, durable, heal), and how many
        "restore_by_tier": {k: {"seconds": round(sum(v), 3), "count": len(v)} for k, v in sorted(by_tier.items())},
        "failures": sum(1 for a in attempts[:-1] if a.get("status") != "finished")
        + (1 if attempts and attempts[-1].get("status") == "failed" else 0),
    }


def table(doc: dict) -> str:
    """A short, aligned text table of the job's buckets."""
    totals, total = doc["totals"], doc["totals"]["total"] or 1e-9
    lines = [
        f"goodput {doc['goodput'] * 100:.1f}% over {total:.1f} s wall clock, "
        f"{doc['attempts_count']} attempt(s), {doc['failures']} failure(s)"
    ]
    for k in JOB_BUCKETS:
        if k in SOMETIMES and not totals.get(k):
            continue
        lines.append(f"  {k:<14} {totals[k]:>9.2f} s  {totals[k] / total * 100:5.1f}%")
    if doc.get("restore_by_tier"):
        parts = ", ".join(f"{k} {v['seconds']:.2f} s ({v['count']}x)" for k, v in doc["restore_by_tier"].items())
        lines.append(f"  restore by tier: {parts}")
    if doc.get("restart_seconds") is not None:
        lines.append(f"  restart cost R {doc['restart_seconds']:>9.2f} s per automatic restart")
    return "\n".join(lines)
