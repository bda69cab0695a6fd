"""Which node a process runs on, and the run dir's book of nodes (``RUN_DIR/nodes.json``): the attempts that failed
on each node and the nodes excluded from the job, with why and by what.

Several launchers (one per node) and ranks write the book, so each change is a read-modify-write under an exclusive
``flock`` of ``RUN_DIR/nodes.json.lock``, written atomically. A damaged book (a torn write, a hand edit) is kept
aside and named in one warning; the job goes on with an empty book (no node is excluded because of a file it cannot
read).

A node's name is ``PITSTOP_NODE_NAME`` if set (tests that run several "nodes" on one machine), else SLURM's
``SLURMD_NODENAME`` (the local cluster's nodes share one host name), else the host name.

The contract between the parts that exclude a node (node health, the straggler detector, the failures recorded
here) and the launchers that honour it: a process whose node is excluded exits with :data:`EXCLUDED_EXIT` after
:func:`exclude` recorded it; its launcher does not start it again on that node, and the job goes on without the
node if ``strategy.nnodes``'s minimum is left. The job's other ranks, when the exclusion is decided at run time,
exit with :data:`REFORM_EXIT` once the job's state is saved: their launchers start them again at once (no restart
budget used) and the job re-forms without the node.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

from pitstop.errors import PitstopError
from pitstop.statefile import NODES, SUSPECTS, read_state
from pitstop.telemetry.metrics import write_json_atomic

log = logging.getLogger("pitstop.nodes")

NODES_FILE = "nodes.json"
SUSPECTS_FILE = "suspects.json"  # the ranks the silent-corruption check found corrupted (written by train/sdc.py)
EXCLUDED_EXIT = 77  # this node was excluded from the job: its launcher does not start it again here
# the other ranks, when a node was excluded at run time (after a save): the job re-forms without it; the launcher
# restarts them at once, and it is not a failure (no restart budget used, not a crash loop's repeat)
REFORM_EXIT = 78
FAILURES_TO_EXCLUDE = 2  # attempts that failed on one node before it is excluded
MAX_FAILURES = 32  # failures kept per node (the newest)


class NodeExcluded(PitstopError):
    """This process's node is excluded from the job (exit status :data:`EXCLUDED_EXIT`; not restarted on it)."""


def node_name(env: Mapping[str, str] = os.environ) -> str:
    """This process's node: ``PITSTOP_NODE_NAME``, else ``SLURMD_NODENAME``, else the host name."""
    return env.get("PITSTOP_NODE_NAME") or env.get("SLURMD_NODENAME") or socket.gethostname()


def read_book(run_dir: str) -> dict[str, dict[str, Any]]:
    """``{node: {"failures": [...], "excluded": {...} or absent}}`` (empty if there is no book or it is damaged)."""
    doc = read_state(os.path.join(run_dir, NODES_FILE), NODES, keep_aside=False, then="no node is excluded by it")
    return dict(doc["nodes"]) if doc is not None else {}


def read_suspects(run_dir: str) -> list[dict]:
    """The ranks found corrupted in this run dir (``RUN_DIR/suspects.json``), oldest first, each naming its node
    (``host``); a damaged file is named in one warning and read as none (no node is suspected by it)."""
    doc = read_state(os.path.join(run_dir, SUSPECTS_FILE), SUSPECTS, keep_aside=False, then="no node is suspected")
    return list(doc["suspects"]) if doc is not None else []


def excluded(run_dir: str) -> dict[str, dict[str, Any]]:
    """The nodes excluded from the job: ``{node: {"why": ..., "by": ..., "time": ...}}``."""
    return {n: rec["excluded"] for n, rec in read_book(run_dir).items() if rec.get("excluded")}


def failures(run_dir: str, node: str) -> int:
    """The attempts recorded as failed on ``node``."""
    return len(read_book(run_dir).get(node, {}).get("failures", []))


@contextmanager
def _editing(run_dir: str) -> Iterator[dict[str, dict[str, Any]]]:
    """The book, to change in place: written back atomically when the block ends, under the book's lock."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, NODES_FILE)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released as the file closes)
        doc = read_state(path, NODES, keep_aside=True, then="the book of nodes starts again", logger=log)
        nodes = dict(doc["nodes"]) if doc is not None else {}
        yield nodes
        write_json_atomic(path, {"nodes": nodes}, fsync=True, indent=1, sort_keys=True)


def record_failure(run_dir: str, node: str, why: str, step: int | None = None) -> int:
    """An attempt failed on ``node`` (``why``: its one line): recorded; returns the failures on it so far."""
    with _editing(run_dir) as nodes:
        rec = dict(nodes.get(node, {}))
        past = list(rec.get("failures", []))
        entry: dict[str, Any] = {"time": round(time.time(), 3), "why": why[:500]}
        if step is not None:
            entry["step"] = int(step)
        past = (past + [entry])[-MAX_FAILURES:]
        rec["failures"] = past
        nodes[node] = rec
        return len(past)


def exclude(run_dir: str, node: str, why: str, by: str) -> bool:
    """Exclude ``node`` from the job (``by``: ``health``, ``failures``, ``straggler``, ``sdc``; ``why``: one line).
    Returns False if it was already excluded (the first reason stays: the decision is logged once)."""
    with _editing(run_dir) as nodes:
        rec = dict(nodes.get(node, {}))
        if rec.get("excluded"):
            return False
        rec["excluded"] = {"why": why[:500], "by": by, "time": round(time.time(), 3)}
        nodes[node] = rec
        return True


def readmit(run_dir: str, node: str) -> bool:
    """Take ``node`` off the excluded list (by hand, or a node found well again); its failures stay on record."""
    with _editing(run_dir) as nodes:
        rec = dict(nodes.get(node, {}))
        if not rec.pop("excluded", None):
            return False
        nodes[node] = rec
        return True
