"""``fault=slow_rank``: a fail-slow rank, for ``trainer.straggler`` (``pitstop/train/straggler.py``).

From step ``from_step`` (for ``steps`` steps, or to the end) rank ``rank``'s work takes ``factor`` times as long: at
the start of each backward (a hook on the loss's gradient: before any of this rank's gradients, so before any of its
gradient buckets is ready and its all-reduce can start) it sleeps ``(factor - 1)`` x its own work per micro-batch,
as measured by the fault itself on the steps before: the median of its last few forwards + backwards (the sleeps left
out) and its share of the median optimizer step (the optimizer's step divided among the step's micro-batches): the
work ``trainer.straggler`` times. It slows nothing until it has measured three micro-batches after the attempt's
first. A slow device
looks like this: the rank's own work is longer, and every other rank waits for it in the gradient all-reduce.

What it slept in all is on record in ``RUN_DIR/faults.jsonl`` (a ``slow_rank:slept`` line, written as the run
closes, with ``seconds`` and ``steps``; :func:`slept`), so that a test or a benchmark compares what the detector
booked with what was injected. Unlike a kill, the line names no process (it is no failure of one).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import Any

import torch

from pitstop.errors import ConfigError
from pitstop.resilience.fault import FaultContext, NoFault, check_step
from pitstop.resilience.fault_record import fired_records, note_injected
from pitstop.resilience.node_book import excluded

log = logging.getLogger("pitstop.resilience.fault")

KEY = "slow_rank:slept"


def slept(run_dir: str) -> float:
    """The seconds ``fault=slow_rank`` slept in this run dir, over its attempts."""
    return sum(float(r.get("seconds", 0.0)) for r in fired_records(run_dir) if r.get("key") == KEY)


class SlowRank(NoFault):
    """Rank ``rank``'s forward + backward takes ``factor`` times as long from step ``from_step`` on (``steps`` steps;
    None: to the end)."""

    name = "slow_rank"

    def __init__(
        self,
        rank: int = 1,
        factor: float = 1.5,
        from_step: int = 1,
        steps: int | None = None,
        replica: int | str | None = None,
    ):
        self.replica, self.rank, self.factor = replica, int(rank), float(factor)
        self.from_step, self.steps = int(from_step), None if steps is None else int(steps)
        self.recent: deque[float] = deque(maxlen=9)  # this rank's own work per micro-batch, its sleeps left out
        self.optimizer_steps: deque[float] = deque(maxlen=9)  # its optimizer's steps
        self._opt_t0 = 0.0
        self.total, self.slowed = 0.0, 0
        self._t0 = self._slept = 0.0
        self._last_step = 0
        self._warm = False

    def bind(self, ctx: FaultContext) -> None:
        if self.rank >= ctx.world_size and excluded(ctx.run_dir):  # (the job re-formed smaller without its node)
            log.info("fault=slow_rank: rank %d left the job with its excluded node: nothing to slow", self.rank)
            self.ctx, self.rank = ctx, -1  # (no rank of this job)
            return
        super().bind(ctx)
        check_step(self.from_step, ctx)
        if ctx.rank != self.rank:
            return
        if ctx.model is None:
            raise ConfigError("fault=slow_rank slows a rank's backward: it needs the model")
        ctx.model.register_forward_pre_hook(self._forward)
        if ctx.optimizer is not None:
            ctx.optimizer.register_step_pre_hook(self._optimizer_starts)
            ctx.optimizer.register_step_post_hook(self._optimizer_ended)

    def _optimizer_starts(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._opt_t0 = time.perf_counter()

    def _optimizer_ended(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.optimizer_steps.append(time.perf_counter() - self._opt_t0)

    def pace(self) -> float:
        """This rank's work per micro-batch: forward + backward, and its share of the optimizer's step."""
        steps = self.optimizer_steps
        share = statistics.median(steps) / max(1, self.ctx.grad_accum_steps) if steps else 0.0
        return statistics.median(self.recent) + share

    def _forward(self, module: Any, args: Any) -> None:
        if torch.is_grad_enabled():  # (an evaluation's forward is no work of a step)
            self._t0 = time.perf_counter()

    def _slows(self, step: int) -> bool:
        return step >= self.from_step and (self.steps is None or step < self.from_step + self.steps)

    def loss(self, step: int, keys: list[str], loss: Any) -> Any:
        if self.ctx.rank != self.rank or not loss.requires_grad:
            return loss
        self._slept, self._step = 0.0, step

        def backward_starts(grad: torch.Tensor) -> torch.Tensor:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
            if self._slows(step) and len(self.recent) >= 3:  # (its pace known: a few micro-batches measured)
                pause = (self.factor - 1.0) * self.pace()
                time.sleep(pause)
                self._slept += pause
                self.total += pause
                if step != self._last_step:
                    self.slowed += 1
                    self._last_step = step
                    if self.slowed == 1:
                        log.warning("fault injection: rank %d works %gx as long from step %d", self.rank, self.factor,
                                    step)  # fmt: skip
            return grad

        loss.register_hook(backward_starts)
        return loss

    def _backward_ended(self) -> None:
        """(Queued at the backward's start: it runs before DDP's wait for the all-reduce.) The first micro-batch of
        the attempt (lazy set-up, cold caches) is no measure of the rank's pace."""
        if self._warm:
            self.recent.append(max(0.0, time.perf_counter() - self._t0 - self._slept))
        self._warm = True

    def close(self) -> None:
        if getattr(self, "ctx", None) is not None and self.ctx.rank == self.rank and self.slowed:
            note_injected(self.ctx.run_dir, KEY, seconds=round(self.total, 4), steps=self.slowed)
            self.slowed = 0  # (once)
