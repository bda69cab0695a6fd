"""Fault injection: kill the job on purpose to see what a configuration loses and that it resumes.

Each fault fires once per run dir (``RUN_DIR/faults.jsonl`` remembers it), so the restarted job gets past it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from typing import Any

log = logging.getLogger("pitstop.fault")


class NoFault:
    name = "none"

    def __init__(self, **_: Any):
        pass

    def after_step(self, runner: Any) -> None:
        pass


class CrashAtStep(NoFault):
    """SIGKILL this process at the end of step ``step`` (after that step's save, if any, was started).

    With an async checkpoint backend this lands while the save is staging or being written in the
    background; with a sync backend, between saves.
    """

    name = "crash_at_step"

    def __init__(self, step: int, rank: int = 0, **_: Any):
        if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
            from pitstop.errors import ConfigError

            raise ConfigError(f"fault.step must be a positive integer, got {step!r}")
        self.step, self.rank = step, rank

    def after_step(self, runner: Any) -> None:
        if runner.step == self.step and runner.strategy.rank == self.rank and _first_time(runner.run_dir, self):
            self.fire()

    def fire(self) -> None:
        log.warning("fault injection: SIGKILL at step %d", self.step)
        os.kill(os.getpid(), signal.SIGKILL)


class StallAtStep(CrashAtStep):
    """Rank ``rank`` stops responding at the end of step ``step`` (sleeps ``seconds``), so its peers hit the
    collective timeout (``strategy.timeout``) and the job fails with a clear message instead of hanging."""

    name = "stall"

    def __init__(self, step: int, rank: int = 0, seconds: float = 3600, **kw: Any):
        super().__init__(step=step, rank=rank, **kw)
        self.seconds = float(seconds)

    def fire(self) -> None:
        log.warning("fault injection: rank %d stalls for %.0f s at step %d", self.rank, self.seconds, self.step)
        time.sleep(self.seconds)


def _first_time(run_dir: str, fault: CrashAtStep) -> bool:
    """Record the fault in RUN_DIR/faults.jsonl; False if it already fired in this run dir."""
    ledger = os.path.join(run_dir, "faults.jsonl")
    key = f"{fault.name}@{fault.step}"
    if os.path.isfile(ledger):
        with open(ledger) as f:
            if any(json.loads(line).get("key") == key for line in f if line.strip()):
                return False
    with open(ledger, "a") as f:
        f.write(json.dumps({"key": key, "time": time.time(), "pid": os.getpid()}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return True
