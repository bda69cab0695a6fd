"""Numeric faults: a loss that is not finite, for ``trainer.instability`` (``pitstop/train/instability.py``).

``nonfinite`` makes the loss of one step NaN on one rank, once per run dir (``RUN_DIR/faults.jsonl``): a transient
fault, which skipping the step gets past. ``poison`` makes the loss of every batch holding one sample NaN, every
time it is seen (and that sample's loss alone, when it is looked at by itself): a bad record, which only never
feeding it again gets past. Both multiply the loss by NaN, so its gradients are NaN too, as a real one's are.
"""

from __future__ import annotations

import logging
from typing import Any

from pitstop.errors import ConfigError
from pitstop.resilience.fault import FaultContext, NoFault, check_step
from pitstop.resilience.fault_record import first_time

log = logging.getLogger("pitstop.resilience.fault")


def _nan(loss: Any) -> Any:
    return loss * float("nan")


class NonFiniteAtStep(NoFault):
    """The loss of step ``step`` is NaN on rank ``rank``, once per run dir."""

    name = "nonfinite"

    def __init__(self, step: int, rank: int = 0, replica: int | str | None = None):
        self.replica = replica
        self.step, self.rank = int(step), rank

    def bind(self, ctx: FaultContext) -> None:
        super().bind(ctx)
        check_step(self.step, ctx)

    def loss(self, step: int, keys: list[str], loss: Any) -> Any:
        if step != self.step or self.ctx.rank != self.rank:
            return loss
        if not first_time(self.ctx.run_dir, f"nonfinite:{self.step}:{self.rank}"):
            return loss
        log.warning("fault injection: the loss of step %d is NaN on rank %d", step, self.rank)
        return _nan(loss)


class PoisonSample(NoFault):
    """Every loss computed over sample ``sample`` is NaN, on whichever rank reads it, every time."""

    name = "poison"

    def __init__(self, sample: str, replica: int | str | None = None):
        self.replica, self.sample, self.rank = replica, str(sample), 0

    def bind(self, ctx: FaultContext) -> None:
        super().bind(ctx)
        keys = ctx.sample_keys() if ctx.sample_keys is not None else None
        if keys is not None and self.sample not in keys:
            near = sorted(keys)[:3]
            raise ConfigError(
                f"fault.sample={self.sample!r} is no sample of the training split ({len(keys)} samples, e.g. "
                f"{', '.join(near)}): the fault would never fire"
            )

    def loss(self, step: int, keys: list[str], loss: Any) -> Any:
        return _nan(loss) if self.sample in keys else loss
