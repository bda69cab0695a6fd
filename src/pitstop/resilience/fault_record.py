"""``RUN_DIR/faults.jsonl``: what fault injection fired in a run dir, one line per fault (its key, time and process),
written before the fault acts. The one reader and writer of the file: a fault that fires once per run dir asks it
whether it already did (so the restarted job gets past it), ``fault=random`` counts its failures, and a launcher
asks whether fault injection killed a process (a test of its restarts, never a failure of the job's own).
"""

from __future__ import annotations

import json
import os
import time


def fired_records(run_dir: str) -> list[dict]:
    """The faults that already fired in this run dir (RUN_DIR/faults.jsonl): each its key, time and process."""
    path = os.path.join(run_dir, "faults.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def fired_keys(run_dir: str) -> list[str]:
    """The keys of the faults that already fired in this run dir."""
    return [r.get("key", "") for r in fired_records(run_dir)]


def killed_by_fault(run_dir: str, pid: int) -> bool:
    """Fault injection killed process ``pid`` (a fault writes its line, naming its process, before it kills)."""
    try:
        return any(isinstance(r, dict) and r.get("pid") == pid for r in fired_records(run_dir))
    except (OSError, ValueError, AttributeError, RecursionError):  # (a damaged file: no proof it was injected)
        return False


def count_fired(run_dir: str, prefix: str) -> int:
    return sum(1 for key in fired_keys(run_dir) if key.startswith(prefix))


def note_fired(run_dir: str, key: str) -> None:
    with open(os.path.join(run_dir, "faults.jsonl"), "a") as f:
        f.write(json.dumps({"key": key, "time": time.time(), "pid": os.getpid()}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def note_injected(run_dir: str, key: str, **fields: object) -> None:
    """What a fault that kills nothing injected (``fault=slow_rank``: the seconds it slept): a line with ``fields``
    and no process, so that no launcher takes it for a kill."""
    with open(os.path.join(run_dir, "faults.jsonl"), "a") as f:
        f.write(json.dumps({"key": key, "time": time.time(), **fields}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def first_time(run_dir: str, key: str) -> bool:
    """Record the fault in RUN_DIR/faults.jsonl; False if it already fired in this run dir."""
    if key in fired_keys(run_dir):
        return False
    note_fired(run_dir, key)
    return True
