"""Run-dir metric files: ``metrics.jsonl`` (one line per step) and ``summary.json`` (at the end)."""

from __future__ import annotations

import json
import os
from typing import Any


class MetricsFile:
    """Appends one JSON line per step; buffered, flushed at log cadence and at close."""

    def __init__(self, path: str, enabled: bool = True):
        self.f = open(path, "a", buffering=1 << 16) if enabled else None

    def write(self, record: dict[str, Any]) -> None:
        if self.f is not None:
            self.f.write(json.dumps(record, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        if self.f is not None:
            self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


def write_json_atomic(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
