"""``RUN_DIR/health.json``: each node's recent matmul timings from its health checks (``pitstop.launch.health``), the
reference the other nodes' checks compare against.

A timing is put on record by the attempt that the check let start, once its setup is done (``Runner.setup``): a check
whose job was then refused (a bad config) leaves nothing in the run dir, and a node that never ran an attempt is no
reference. Several nodes write the file, so each change is a read-modify-write under a ``flock``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time

from pitstop.statefile import HEALTH, read_state
from pitstop.telemetry.metrics import write_json_atomic

log = logging.getLogger("pitstop.health")

HEALTH_FILE = "health.json"
KEEP = 8  # timings kept per node


def timings(run_dir: str) -> dict[str, list[float]]:
    """``{node: [seconds, ...]}`` (empty if there is no record or it is damaged)."""
    doc = read_state(os.path.join(run_dir, HEALTH_FILE), HEALTH, keep_aside=False, then="no reference from it")
    return {n: list(r.get("matmul", [])) for n, r in (doc["nodes"] if doc is not None else {}).items()}


def record_timing(run_dir: str, node: str, seconds: float) -> None:
    """Add ``node``'s timing (the newest ``KEEP`` are kept)."""
    path = os.path.join(run_dir, HEALTH_FILE)
    try:
        with open(path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # (released as the file closes)
            doc = read_state(path, HEALTH, keep_aside=True, then="the health record starts again", logger=log)
            nodes = dict(doc["nodes"]) if doc is not None else {}
            past = list(nodes.get(node, {}).get("matmul", []))
            nodes[node] = {"matmul": (past + [round(seconds, 6)])[-KEEP:], "time": round(time.time(), 3)}
            write_json_atomic(path, {"nodes": nodes}, fsync=False, indent=1, sort_keys=True)
    except OSError as e:  # (a record lost costs one reference, never the run)
        log.warning("the health check's timing could not be recorded in %s (%s)", path, e)
