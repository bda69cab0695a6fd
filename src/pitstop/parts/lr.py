"""Learning-rate schedules (as ``_partial_`` targets completed by the runner with ``total_steps``).

A schedule's factor is a callable object, so its plan is part of the checkpoint (``LambdaLR`` saves the
attributes of callable objects) and can be re-planned: after a resume at another world size in
``trainer.epochs`` mode the steps left change, and :func:`replan` stretches or shrinks the rest of the decay
over them from the factor the run had reached (a schedule planned for the old length would stop decaying
too early, or sit at its floor for the rest of the run)."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler


class WarmupCosine:
    """Linear warm-up for ``warmup_steps``, then cosine decay to ``min_lr_ratio`` x the base lr at
    ``total_steps``. The decay's progress runs from ``anchor_progress`` at ``anchor_step`` to 1 at
    ``total_steps`` (anchored at the warm-up's end unless re-planned)."""

    def __init__(self, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0):
        self.total_steps = int(total_steps)
        self.warmup_steps = min(int(warmup_steps), max(self.total_steps - 1, 0))
        self.min_lr_ratio = float(min_lr_ratio)
        self.anchor_step, self.anchor_progress = self.warmup_steps, 0.0

    def progress(self, step: int) -> float:
        done = self.anchor_progress + (1 - self.anchor_progress) * (step - self.anchor_step) / max(
            1, self.total_steps - self.anchor_step
        )
        return min(1.0, done)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * self.progress(step)))

    def replan(self, step: int, total_steps: int) -> None:
        """From ``step`` on, the rest of the decay spans up to ``total_steps`` (continuous at ``step``)."""
        if step > self.warmup_steps:
            self.anchor_step, self.anchor_progress = int(step), self.progress(step)
        self.total_steps = int(total_steps)


class Constant:
    def __call__(self, step: int) -> float:
        return 1.0

    def replan(self, step: int, total_steps: int) -> None:
        pass


def warmup_cosine(optimizer: Optimizer, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0) -> LambdaLR:
    """Linear warm-up for ``warmup_steps``, then cosine decay to ``min_lr_ratio`` x the base lr."""
    return LambdaLR(optimizer, WarmupCosine(total_steps, warmup_steps, min_lr_ratio))


def constant(optimizer: Optimizer, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, Constant())


def planned_steps(scheduler: LRScheduler) -> int | None:
    """The step a schedule's plan ends at (as saved with the checkpoint); None if it has no such plan."""
    factors = getattr(scheduler, "lr_lambdas", None) or [None]
    return getattr(factors[0], "total_steps", None)


def replan(scheduler: LRScheduler, step: int, total_steps: int) -> bool:
    """Re-plan a schedule for ``total_steps`` from ``step`` on; False if it cannot be (not one of these)."""
    factors = getattr(scheduler, "lr_lambdas", None)
    if not factors or not all(hasattr(f, "replan") for f in factors):
        return False
    for f in factors:
        f.replan(step, total_steps)
    return True
