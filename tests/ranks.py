"""Ranks as real processes for tests that need a process group of their own (real gloo, one process per rank):
start them, take one result from each, and never leave one behind (joined, or killed when it does not end)."""

from __future__ import annotations

from typing import Any


def results(procs: list[Any], queue: Any, timeout: float) -> dict:
    """Start ``procs`` (processes that each put one ``(rank, result)`` on ``queue``) and return their results by rank;
    a rank that puts nothing within ``timeout`` seconds raises ``queue.Empty`` (a hang, named by the test)."""
    for p in procs:
        p.start()
    try:
        return dict(queue.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
