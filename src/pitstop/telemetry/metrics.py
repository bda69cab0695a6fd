"""Run-dir metric files: ``metrics.jsonl`` (one line per step) and ``summary.json`` (at the end)."""

from __future__ import annotations

import json
import os
import threading
from typing import Any


class MetricsFile:
    """Appends one JSON line per step; buffered, flushed at log cadence and at close.  The file is created at
    the first write, so a run that fails during setup leaves no metrics file behind."""

    def __init__(self, path: str, enabled: bool = True):
        from pitstop.config.secrets import redact  # (only a run's metrics need it, not every atomic write's reader)

        self.path, self.enabled, self.f, self.redact = path, enabled, None, redact

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.f is None:
            self.f = open(self.path, "a", buffering=1 << 16)
        self.f.write(json.dumps(self.redact(record), separators=(",", ":")) + "\n")

    def flush(self) -> None:
        if self.f is not None:
            self.f.flush()

    def close(self) -> None:
        self.enabled = False
        if self.f is not None:
            self.f.close()
            self.f = None


def write_text_atomic(path: str, text: str, fsync: bool = True) -> None:
    """Replace ``path`` with ``text`` in one step: readers see the old file or the new one, never a mix.
    The temp name is per process and thread, so concurrent writers (parallel sweep jobs; the hang watchdog's thread
    recording a hang while the loop's thread writes its heartbeat) never share one."""
    tmp = f"{path}.{os.getpid()}.{threading.get_native_id()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        if fsync:  # durable, not only atomic
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: str, obj: object, fsync: bool = True, **dump: Any) -> None:
    dump = {"indent": 2, "sort_keys": True, "default": str, **dump}
    write_text_atomic(path, json.dumps(obj, **dump), fsync=fsync)
