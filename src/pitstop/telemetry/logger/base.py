"""The contract of a ``logger`` option (an experiment tracker), and ``logger=none``."""

from __future__ import annotations

from abc import ABC, abstractmethod


class Logger(ABC):
    name: str = "base"

    @abstractmethod
    def start(self, run_dir: str, params: dict, tags: dict | None = None) -> None:
        """Open (or, for a resumed run dir, reopen) the run; ``params``: the flat resolved config."""

    @abstractmethod
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Hand metrics over without blocking the loop."""

    @abstractmethod
    def close(self, status: str = "FINISHED") -> dict:
        """Flush and end the run (FINISHED or FAILED); return what summary.json should know (e.g. a run id)."""


class NullLogger(Logger):
    name = "none"

    def __init__(self):
        pass

    def start(self, run_dir: str, params: dict, tags: dict | None = None) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def close(self, status: str = "FINISHED") -> dict:
        return {}
