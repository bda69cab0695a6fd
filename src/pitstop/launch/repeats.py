"""A failure a restart cannot fix: the same failure, on the same rank, at the same step, twice in a row.

A shape bug on an epoch's last batch, a NaN the same batches always make, an out-of-memory at the same step: a
restart resumes from the checkpoint, replays the same steps and fails the same way, until the restart budget is
gone (11 identical attempts for ``trainer.max_restarts=10``). Each failed attempt leaves a line in
``RUN_DIR/failures.jsonl`` (its rank, its attempt, the step it reached, what it was); a failure that repeats the
rank's previous one (the same exception type and first line, or the same signal) with no progress past the step of
that one (its step is not higher) is a crash loop: the job stops in one line, exit status 2, instead of restarting.
A failure that does not repeat is restarted as before. Preemptions, hangs and configuration errors keep their own
rules (they never reach here).

Pure functions of the run dir, the same for pitstop's supervisor (which reads the attempt's verdict from its exit
status), torch's elastic agent (the rank that finds the loop stops its agent) and each replica group.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass

from pitstop.statefile import integer, optional, read_records, record, string

FILE = "failures.jsonl"
MARKER = ".crash_loop"  # the one line, for a launcher whose attempt could not exit with CRASH_LOOP_EXIT itself
CRASH_LOOP_EXIT = 3  # an attempt's exit status: its failure repeated the one before (the supervisor stops)

SHAPE = record(
    {"rank": integer(0), "attempt": integer(0), "what": string},
    {"step": optional(integer(0))},
)


@dataclass(frozen=True)
class Failure:
    rank: int
    attempt: int  # the restart number of the attempt (0: the first)
    step: int | None  # the step it had reached (None: before its first)
    what: str  # ``ValueError: expected a batch of 64, got 14``, or ``killed by signal 9``


def signature(error: BaseException) -> str:
    """What an exception was, the same on every attempt that fails the same way: its type and first line, with what
    differs from one process to the next (addresses, ports, pids, times) made alike."""
    lines = [ln for ln in str(error).splitlines() if ln.strip()]
    first = lines[0].strip() if lines else ""
    first = re.sub(r"0x[0-9a-fA-F]+", "0x…", first)
    first = re.sub(r"(?<![\w.])\d{5,}(?![\w.])", "N", first)  # (pids, ports, epoch seconds; a step is shorter)
    return f"{type(error).__name__}: {first}"[:300] if first else type(error).__name__


def history(run_dir: str) -> list[Failure]:
    """Every failure on record in ``run_dir``, oldest first (a damaged line is skipped and said once)."""
    path = os.path.join(run_dir, FILE)
    if not os.path.exists(path):
        return []
    return [Failure(**{k: r.get(k) for k in ("rank", "attempt", "step", "what")}) for r in read_records(path, SHAPE)]


def previous(past: list[Failure], failure: Failure) -> Failure | None:
    """The failure ``failure`` repeats, if it does: the same rank's last failure before it was the same one, and
    no step past it was reached since."""
    mine = [f for f in past if f.rank == failure.rank]
    if not mine:
        return None
    last = mine[-1]
    if last.what != failure.what:
        return None
    progressed = failure.step is not None and (last.step is None or failure.step > last.step)
    return None if progressed else last


def this_launch(past: list[Failure]) -> list[Failure]:
    """The failures of the latest launch. A launch numbers its attempts from 0 up (every failed rank of an attempt
    writes a line), so it is the tail of the file whose attempt numbers never go down."""
    start = len(past)
    while start > 0 and (start == len(past) or past[start - 1].attempt <= past[start].attempt):
        start -= 1
    return past[start:]


def without_progress(past: list[Failure]) -> int:
    """How many of the latest launch's failed attempts came with no progress: no step past the furthest step an
    earlier failure of the launch had reached (a launch's first failure always counts as progress). Each costs the
    restart budget one restart more than a failure after progress (:func:`budget_line`): a job that fails at new
    steps is doing work between its failures (Llama 3's 419 interruptions in 54 days); one that fails again where it
    failed before, in another way, is likely to go on doing so."""
    reached: dict[int, int | None] = {}
    for f in this_launch(past):
        if f.step is not None:
            reached[f.attempt] = max(f.step, reached.get(f.attempt) or 0)
        else:
            reached.setdefault(f.attempt, None)
    count, before = 0, None
    for attempt in sorted(reached):
        step = reached[attempt]
        if attempt != min(reached) and (step is None or (before is not None and step <= before)):
            count += 1
        if step is not None:
            before = step if before is None else max(before, step)
    return count


def budget_line(failures: int, extra: int, limit_key: str, limit: int) -> str:
    """The restart budget as used: ``failures`` failed attempts, ``extra`` of them without progress (counted twice)."""
    dearer = f", {extra} of them with no step past the failure before (each counts 2)" if extra else ""
    return f"{failures} failure(s){dearer}: {failures + extra} of {limit_key}={limit}"


def note(run_dir: str, failure: Failure) -> Failure | None:
    """Record ``failure`` (one line, appended) and return the failure it repeats, or None."""
    repeated = previous(history(run_dir), failure)
    line = json.dumps(asdict(failure), separators=(",", ":")) + "\n"
    try:
        fd = os.open(os.path.join(run_dir, FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, line.encode())  # (one write of one line: ranks append side by side)
        finally:
            os.close(fd)
    except OSError:
        pass  # (a run dir that cannot be written: the failure itself is what the user must see)
    return repeated


def verdict(failure: Failure, repeated: Failure, run_dir: str) -> str:
    """The one line a crash loop stops the job with."""
    at = f"step {failure.step}" if failure.step is not None else "start-up (before the first step)"
    log = "train.log" if failure.rank == 0 else f"rank{failure.rank}.log"
    return (
        f"the same failure happened twice at {at} on rank {failure.rank}, with no progress between (attempts "
        f"{repeated.attempt + 1} and {failure.attempt + 1}): {failure.what}; a restart replays it, so the job stops "
        f"instead of using up its restarts: fix the cause and run the same command again to resume (the traceback: "
        f"{os.path.join(run_dir, log)})"
    )


def mark(run_dir: str, line: str) -> None:
    """Leave the verdict for the launcher (an attempt under torch's agent cannot choose its exit status's meaning)."""
    from pitstop.telemetry.metrics import write_text_atomic

    write_text_atomic(os.path.join(run_dir, MARKER), line)


def marked(run_dir: str, since: float) -> str | None:
    """The verdict an attempt of this launch left (written at or after ``since``, wall clock), or None."""
    path = os.path.join(run_dir, MARKER)
    try:
        if os.lstat(path).st_mtime < since - 1:
            return None
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(2000).strip() or None
    except OSError:
        return None
