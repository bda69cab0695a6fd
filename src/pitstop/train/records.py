"""What a run writes down as it goes, one collaborator of the Runner: ``metrics.jsonl``, the tracker run, the sample
log (the exactly-once proof) and this attempt's line in the goodput log, which says how the attempt ended."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pitstop.errors import ConfigError, FingerprintMismatch
from pitstop.goodput.ledger import GoodputLog
from pitstop.resilience.preempt import Preempted
from pitstop.resilience.watchdog import Hung
from pitstop.telemetry.logger.base import Logger
from pitstop.telemetry.metrics import MetricsFile
from pitstop.train.sample_log import SampleLog

log = logging.getLogger("pitstop")


@dataclass
class Records:
    """Built in the order setup builds their writers (the goodput log first); ``logger`` is None once the tracker
    run has ended, ``samples`` unless ``data.record_sample_ids``."""

    goodput: GoodputLog | None = None
    metrics_file: MetricsFile | None = None
    logger: Logger | None = None
    samples: SampleLog | None = None

    def report(self, metrics: dict[str, float], step: int) -> None:
        """Metrics of a step or of a component (e.g. a save's costs): the tracker and ``metrics.jsonl``."""
        if self.logger is not None:  # (None once the run has ended)
            self.logger.log_metrics(metrics, step)
        self.metrics_file.write({"step": step, **metrics, "time": round(time.time(), 3)})

    def started(
        self,
        step: int,
        resumed_from: int | None,
        healed: bool,
        world_size: int,
        samples: int,
        epochs: int | None,
        tier: str | None = None,
    ) -> None:
        """After restore: the attempt's start in the goodput log, the sample log's header (the data the attempt
        starts from: ``samples`` per epoch, over ``epochs`` or to ``trainer.max_steps``) and a resume's event."""
        self.goodput.resumed(resumed_from, "heal" if healed else tier)
        self.goodput.write(step)
        if self.samples is not None:
            self.samples.header(resumed_from, world_size, samples, epochs, healed)
        if resumed_from is not None:
            log.info("resumed from step %d", resumed_from)
            self.metrics_file.write({"event": "resume", "step": step})

    def outcome(self, step: int, committed: bool, quorum: int | None) -> None:
        """Whether the step of a quorum of replica groups committed: one line per step in the sample log."""
        if self.samples is not None and quorum is not None:
            self.samples.outcome(step, committed, quorum)

    def skipped(self, step: int, epoch: int, why: str, loss: float) -> None:
        """Step ``step`` was not applied (``trainer.instability``): the sample log and ``metrics.jsonl``."""
        if self.samples is not None:
            self.samples.skipped(step, epoch, why)
        value = loss if loss == loss and abs(loss) != float("inf") else str(loss)  # (JSON has no NaN)
        self.metrics_file.write(
            {"event": "skip", "step": step, "value": value, "why": why, "time": round(time.time(), 3)}
        )

    def rolled_back(
        self, to: int, frm: int, keep_data: bool, epochs: dict[int, int], why: str, bucket: str, seconds: float
    ) -> None:
        """An in-process rollback from step ``frm`` to ``to``: the sample log (what the steps thrown away took),
        ``metrics.jsonl`` (an event), the goodput log (their work moves to ``bucket``)."""
        if self.samples is not None:
            self.samples.rolled_back(to, frm, keep_data, epochs, why)
        event = {"event": "rollback", "step": to, "from": frm, "bucket": bucket, "seconds": round(seconds, 4)}
        self.metrics_file.write({**event, "why": why[:200], "time": round(time.time(), 3)})
        self.goodput.rolled_back(to, frm, bucket, why)

    def flush(self) -> None:
        """What a resume would not redo, on disk (at a save's start, before a preemption's exit)."""
        self.metrics_file.flush()
        if self.samples is not None:
            self.samples.flush()

    def close_tracker(self, status: str) -> dict:
        """End the tracker run (FINISHED, or FAILED on the way out of a failed run); only the first call counts."""
        logger, self.logger = self.logger, None
        return (logger.close(status) or {}) if logger is not None else {}

    def hung(self, step: int) -> None:
        """The watchdog's thread, on a hang: the attempt is recorded as hung (the main thread is stuck)."""
        if self.goodput is not None:
            self.goodput.write(step, status="hung")

    def failed(self, exc: BaseException | None, step: int, preempted: bool) -> None:
        """On the way out of a failed run: the attempt is recorded as failed. A config error, or a changed config
        refused at resume, is no attempt: it leaves nothing a later run would count. A hang and a preemption are
        recorded as such (also when a launcher's handler exits after one)."""
        if isinstance(exc, (ConfigError, FingerprintMismatch)):
            self.goodput.withdraw()
        elif exc is not None and not isinstance(exc, (Preempted, Hung)) and not preempted:
            self.goodput.write(step, status="failed")

    def straggler(self, step: int, fields: dict) -> None:
        """A rank named slow, or well again (``train.straggler``): a line in ``metrics.jsonl`` (the time line marks it)
        and, when named, metrics in the tracker."""
        self.metrics_file.write({"event": "straggler", "step": step, **fields, "time": round(time.time(), 3)})
        if self.logger is not None and "ratio" in fields:  # (strategy=ft: a slow group is named by its replica id)
            who = ("straggler_rank", fields["rank"]) if "rank" in fields else ("straggler_replica", fields["replica"])
            self.logger.log_metrics({who[0]: float(who[1]), "straggler_ratio": fields["ratio"]}, step)

    def sdc_found(self, step: int, fields: dict) -> None:
        """Silent data corruption found at ``step`` (``train.sdc``): a line in ``metrics.jsonl`` (the time line marks
        it) and a metric in the tracker."""
        self.metrics_file.write({"event": "sdc", "step": step, **fields, "time": round(time.time(), 3)})
        if self.logger is not None:
            self.logger.log_metrics({"sdc_detected": 1.0}, step)
