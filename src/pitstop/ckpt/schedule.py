"""When a save is due: every ``interval_steps``, every ``interval_seconds``, or ``interval=auto``
(Young–Daly from the measured blocking cost per save and the best MTBF known, see
:class:`pitstop.goodput.interval.AutoInterval`).  It knows nothing about how a save is written."""

from __future__ import annotations

import time
from typing import Callable

from pitstop.goodput.interval import AutoInterval


class SaveSchedule:
    def __init__(
        self,
        interval_steps: int | None,
        interval_seconds: float | None,
        save_last: bool,
        auto: AutoInterval | None = None,
    ):
        self.interval_steps, self.interval_seconds, self.save_last = interval_steps, interval_seconds, save_last
        self.auto = auto
        self.last_save_time = time.monotonic()
        self.saves = 0

    def due(self, step: int, last: bool, agree: Callable[[bool], bool]) -> bool:
        """``agree(flag)``: True if any rank says True (a time-based decision must be the same on every rank,
        or the save's collectives would hang)."""
        if last:
            return bool(self.save_last)
        if self.auto is not None and self.saves == 0:
            return True  # the first save measures what a save costs
        if self.interval_steps and step % int(self.interval_steps) == 0:
            return True
        seconds = self.auto.seconds if self.auto is not None else self.interval_seconds
        if seconds:
            return agree(time.monotonic() - self.last_save_time >= float(seconds))
        return False

    def started(self) -> None:
        self.saves += 1

    def finished_blocking(self) -> None:
        self.last_save_time = time.monotonic()

    def measured(self, cost_per_save: float, write_seconds: float) -> float | None:
        """Feed the measured costs to ``auto``; return the new interval if it moved, else None."""
        if self.auto is None:
            return None
        before = self.auto.seconds
        seconds = self.auto.update(cost_per_save, write_seconds)
        return seconds if seconds != before else None
