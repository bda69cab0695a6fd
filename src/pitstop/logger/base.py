from __future__ import annotations

from typing import Any


class NullLogger:
    name = "none"

    def __init__(self, **_: Any):
        pass

    def start(self, run_dir: str, params: dict, tags: dict | None = None) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def close(self, status: str = "FINISHED") -> dict:
        return {}
