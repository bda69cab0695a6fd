"""The contract of a ``logger`` option (an experiment tracker), and ``logger=none``."""

from __future__ import annotations

from abc import ABC, abstractmethod


class Logger(ABC):
    """The contract of a ``logger`` option: an experiment tracker the run's metrics and parameters go to.

    Only rank 0 holds a real one. The loop calls :meth:`start` once, after the restore (so a resumed run reopens
    the same tracker run), :meth:`log_metrics` from the training loop's thread at every log window, evaluation and
    event, and :meth:`close` once at the end, also when the run fails. ``metrics.jsonl`` and ``summary.json`` are
    written whatever the logger does: a tracker is a copy for people, not the record.

    An implementation must not block the loop in :meth:`log_metrics` (queue, and send from a thread of its own), must
    never raise out of it for a tracker that is down (log a warning once and go on: training must not stop for its
    tracker), and writes only where its config says (its tracking store). The parameters it is handed were already
    masked for credentials (``pitstop.config.secrets``).
    """

    name: str = "base"
    """The option's name, as runs and summaries show it."""

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
