"""Where the wall clock went: every second of the run is put in exactly one bucket."""

from __future__ import annotations

import time
from contextlib import contextmanager

BUCKETS = ("startup", "compute", "data_wait", "checkpoint", "eval", "logging")


class Ledger:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.seconds = {b: 0.0 for b in BUCKETS}

    def add(self, bucket: str, seconds: float) -> None:
        self.seconds[bucket] += seconds

    @contextmanager
    def measure(self, bucket: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[bucket] += time.perf_counter() - t

    def split(self) -> dict[str, float]:
        total = time.perf_counter() - self.t0
        out = {k: round(v, 4) for k, v in self.seconds.items()}
        out["other"] = round(max(0.0, total - sum(self.seconds.values())), 4)
        out["total"] = round(total, 4)
        return out
