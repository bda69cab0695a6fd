"""When to save: the interval policy a checkpointer is handed.

``IntervalPolicy`` is what the job knows of its failures (an MTBF and where it came from, the failures
observed in the run dir so far); a tier with ``interval=auto`` turns it into an ``AutoInterval``, which
recomputes Young–Daly from the measured save cost after every save.  Tiers with fixed intervals
(``interval_steps`` / ``interval_seconds``) ignore it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from pitstop.goodput.model import ASSUMED_MTBF, fmt_duration, young_daly

log = logging.getLogger("pitstop.goodput.interval")


@dataclass(frozen=True)
class IntervalPolicy:
    mtbf_seconds: float | None = None  # a configured MTBF (None: none known)
    source: str = ""  # the key it came from, e.g. fault.mtbf_seconds
    failures: int = 0  # failures observed in this run dir so far
    job_seconds: float = 0.0  # the job's wall clock so far (observed MTBF = job_seconds / failures)

    def prefer(self, mtbf_seconds: float | None, source: str) -> IntervalPolicy:
        """The same policy with a more specific MTBF, when one is set (``ckpt.mtbf_seconds`` over the fault's)."""
        return replace(self, mtbf_seconds=mtbf_seconds, source=source) if mtbf_seconds else self

    def auto(self, key: str = "ckpt.interval") -> AutoInterval:
        return AutoInterval(self.mtbf_seconds, self.source, self.failures, self.job_seconds, key=key)


class AutoInterval:
    """``ckpt.interval=auto``: the save interval from measured save cost and the best MTBF known.

    MTBF: ``ckpt.mtbf_seconds``, else ``fault.mtbf_seconds``, else failures observed in this run dir
    (job wall clock / failures), else one a day (with a log line saying so). The first save comes after
    the first step, to measure C; after every save the interval is recomputed (logged when it moves by more
    than 10%). An async save is never due before the previous one is durable, so T >= W.
    """

    def __init__(
        self,
        mtbf: float | None,
        source: str,
        observed_failures: int = 0,
        observed_seconds: float = 0.0,
        key: str = "ckpt.interval",
    ):
        self.key = key
        if mtbf is None and observed_failures > 0 and observed_seconds > 0:
            mtbf, source = (
                observed_seconds / observed_failures,
                f"{observed_failures} failure(s) observed in this run dir",
            )
        if mtbf is None:
            mtbf, source = ASSUMED_MTBF, "assumed: no MTBF known yet (set ckpt.mtbf_seconds)"
            log.info(
                f"{key}=auto: no MTBF known yet (ckpt.mtbf_seconds, fault.mtbf_seconds, or failures "
                "observed in this run dir); assuming one failure a day until one is; first save after step 1 "
                "to measure its cost"
            )
        self.mtbf, self.source = float(mtbf), source
        self.seconds: float | None = None  # None until a save cost is measured

    def update(self, save_cost: float, write_seconds: float) -> float:
        t = max(young_daly(save_cost, self.mtbf), write_seconds, 1e-3)
        if self.seconds is not None and abs(t - self.seconds) <= 0.1 * self.seconds:
            return self.seconds  # small drifts of the running average do not move the interval
        log.info(
            f"{self.key}=auto: save every %s (blocking cost %.3f s per save, MTBF %s: %s)",
            fmt_duration(t),
            save_cost,
            fmt_duration(self.mtbf),
            self.source,
        )
        self.seconds = t
        return t
