"""``trainer.instability``: a step whose loss or gradient norm is not finite, or whose loss spikes, is not applied.

Per step (``Guard.check``, called by the Stepper after the gradients are reduced, before anything changes): this
rank's loss and the norm of its gradients are checked; with more than one rank one all-reduce of two numbers (a
flag and the loss) makes the decision the same on every rank, and gives every rank the same mean loss, which the
spike check compares with the median of the last ``spike_window`` steps. Under replica groups (``strategy=ft``) the
gradients' norm after the groups' all-reduce is what every group sees alike (a NaN anywhere is a NaN everywhere).
With an fp16 loss scale the gradients are not looked at (the scaler's own overflow check owns them).

A step found unstable is skipped: the optimizer, the LR schedule, the loss scale and the parameters are left as they
were (the gradients are dropped, the buffers a forward changed, BatchNorm's statistics, are put back), the loader is
past its batches, the step counter does not advance. ``Instability.skipped`` then records it (the sample log's
``skip`` line, an event in ``metrics.jsonl``; the runner books its time as ``instability``) and escalates
(``Budget``): past ``max_skips`` within ``skip_window`` steps, a rollback to the newest verified checkpoint before
the first of them with the data position kept (``Runner.rollback``), and past ``max_rollbacks`` (counted in the run
dir), a stop in one line, exit status 2. ``on_instability=skip`` stops where it would roll back, ``stop`` at the
first unstable step.

A non-finite step with ``quarantine`` on: each rank runs its batches' forward again, one sample at a time (no
gradients, on the module itself, in eval mode: no collective, no statistics changed), and a sample whose loss alone
is not finite is quarantined, unless more than half of its batch is (then the model is at fault); every rank learns
the same keys, kept in ``RUN_DIR/instability.json``, dropped from every batch from now on, named in ``summary.json``.
A step explained so does not count against the budget: its cause is gone. A transient fault finds no such sample.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from typing import Any, Callable

import torch
from torch import nn

from pitstop.config.schema_loop import Instability as Settings
from pitstop.errors import ConfigError, Unrecoverable
from pitstop.parts.batch import local_shard, map_tensors
from pitstop.parts.precision import Precision
from pitstop.parts.task import Task
from pitstop.resilience.fault import Fault
from pitstop.strategy.base import Strategy
from pitstop.train.rollback import RunDirState, gathered

log = logging.getLogger("pitstop")


class InstabilityStop(Unrecoverable):
    """The run's instability budgets are used up (``trainer.instability``)."""


class SpikeMedian:
    """A loss above ``factor`` x the median of the last ``window`` accepted losses is a spike (once ``window`` losses
    are in: the warm-up). A spike is not added to the window."""

    def __init__(self, factor: float | None, window: int):
        self.factor, self.losses = factor, deque(maxlen=window)

    def spike(self, loss: float) -> float | None:
        """The median ``loss`` spiked over, or None (and ``loss`` joins the window)."""
        if self.factor is not None and len(self.losses) == self.losses.maxlen:
            median = statistics.median(self.losses)
            if loss > self.factor * median:
                return median
        self.losses.append(loss)
        return None


class Budget:
    """Escalation: ``skip`` (within budget), ``rollback`` or ``stop``. ``skips`` are the steps skipped within the
    window; a rollback starts a new count. ``rollbacks``: those so far in the run dir."""

    def __init__(self, on: str, max_skips: int, window: int, max_rollbacks: int, rollbacks: int = 0):
        self.on, self.max_skips, self.window, self.max_rollbacks = on, max_skips, window, max_rollbacks
        self.rollbacks, self.skips = rollbacks, []

    def skipped(self, step: int) -> str:
        if self.on == "stop":
            return "stop"
        self.skips = [s for s in self.skips if s > step - self.window] + [step]
        if len(self.skips) <= self.max_skips:
            return "skip"
        if self.on == "skip" or self.rollbacks >= self.max_rollbacks:
            return "stop"
        return "rollback"

    @property
    def began(self) -> int:
        """The first step of the trouble (the first skip within the window)."""
        return self.skips[0]

    def rolled_back(self) -> None:
        self.rollbacks += 1
        self.skips = []


class Guard:
    """The per-step check and what a skipped step puts back (the Stepper holds it when ``enabled``)."""

    def __init__(
        self,
        settings: Settings,
        strategy: Strategy,
        precision: Precision,
        task: Task,
        fault: Fault,
        shares_data_order: bool,
    ):
        if settings.spike_factor is not None and shares_data_order:
            raise ConfigError(
                "trainer.instability.spike_factor needs one loss that every replica group agrees on: not with "
                "strategy=ft (non-finite steps are still skipped there); set it to null"
            )
        self.strategy, self.precision, self.task, self.fault = strategy, precision, task, fault
        self.spikes = SpikeMedian(settings.spike_factor, int(settings.spike_window))
        self.probe = bool(settings.quarantine) and strategy.name != "fsdp"  # (FSDP: a forward is a collective)
        self.grads = precision.scaler is None  # (fp16: the scaler owns inf gradients)
        self.buffers = not shares_data_order  # (replica groups: each group's own; the groups must decide alike)
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def before(self, model: nn.Module) -> None:
        """Before the step's forwards: a copy of the buffers they change (put back if the step is skipped)."""
        bufs = [b for b in model.buffers() if b is not None]
        if len(bufs) != len(self._buffers):
            self._buffers = [(b, b.detach().clone()) for b in bufs]
        else:
            for b, copy in self._buffers:
                copy.copy_(b.detach())

    def put_back(self) -> None:
        with torch.no_grad():
            for b, copy in self._buffers:
                b.copy_(copy)

    def check(self, step: int, loss: torch.Tensor, model: nn.Module) -> tuple[str | None, bool]:
        """``(why the step is unstable or None, whether it is non-finite)``, the same on every rank."""
        finite, here = bool(torch.isfinite(loss)), f"loss {loss.item()}"
        if finite and self.grads:
            grads = [local_shard(p.grad) for p in model.parameters() if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) if grads else torch.zeros(())
            finite, here = bool(torch.isfinite(norm)), f"gradient norm {norm.item()}"
        if finite and self.buffers:  # (what the forward changed: BatchNorm's statistics, a save would refuse them)
            bufs = [b for b, _ in self._buffers if b.is_floating_point()]
            finite, here = not bufs or bool(torch.stack([torch.isfinite(b).all() for b in bufs]).all()), "a buffer"
        mine, value = finite, float(loss) if finite else 0.0
        if self.strategy.world_size > 1:
            t = torch.tensor([0.0 if finite else 1.0, value], dtype=torch.float64, device=self.strategy.device)
            self.strategy.all_reduce_sum(t)
            finite, value = bool(t[0].item() == 0), float(t[1].item()) / self.strategy.world_size
        if not finite:
            own = "" if mine else f" (here: {here})"
            return f"non-finite loss, gradient norm or buffer at step {step}{own}", True
        median = self.spikes.spike(value)
        if median is not None:
            return f"loss spike at step {step}: {value:.4g} > {self.spikes.factor:g} x the median {median:.4g}", False
        return None, False

    def culprits(self, step: int, held: list[tuple[Any, list[str]]], model: nn.Module) -> list[str]:
        """The keys, over every rank, whose loss alone is not finite (each rank looks at its own batches)."""
        mine: list[str] = []
        if self.probe:
            net = getattr(model, "module", model)  # (DDP: the module itself, whose forward is no collective)
            was = net.training
            net.eval()
            try:
                with torch.no_grad(), self.precision.autocast():
                    for batch, keys in held:
                        bad = []
                        for i, k in enumerate(keys):
                            one = map_tensors(lambda t, i=i, n=len(keys): t[i : i + 1] if _rows(t, n) else t, batch)
                            if not bool(torch.isfinite(self.fault.loss(step, [k], self.task.loss(net, one)))):
                                bad.append(k)
                        if 2 * len(bad) <= len(keys):  # (more than half: the model is at fault, not the data)
                            mine.extend(bad)
            finally:
                net.train(was)
        return sorted({k for keys in gathered(self.strategy, mine) for k in keys})


def said(events: list[str]) -> str:
    """The unstable steps in a few words: each kind once, with how often (the last 5 kinds)."""
    counts: dict[str, int] = {}
    for e in events:
        counts[e] = counts.get(e, 0) + 1
    return "; ".join(f"{e} ({n} times)" if n > 1 else e for e, n in list(counts.items())[-5:])


def _rows(t: torch.Tensor, n: int) -> bool:
    return t.dim() > 0 and t.shape[0] == n


class Instability:
    """What the runner does with a skipped step: record it, quarantine what was found, escalate."""

    def __init__(
        self,
        settings: Settings,
        state: RunDirState,
        loader: Any,
        record: Callable[[int, str, float], None],
        rollback: Callable[[int, str], int],
        pin: Callable[[int | None], None],
    ):
        """``pin(step)``: retention keeps the newest checkpoint at or before ``step`` (None: no longer)."""
        self.settings, self.state, self.loader, self.record, self.rollback = settings, state, loader, record, rollback
        self.pin = pin
        s = settings
        self.budget = Budget(s.on_instability, s.max_skips, s.skip_window, s.max_rollbacks, state.rollbacks)
        self.events: list[str] = []  # the unstable steps, said in the stop line
        self.skipped_steps = 0
        loader.quarantined = frozenset(state.quarantined)

    def skipped(self, step: int, why: str, loss: float, culprits: list[str], keys: list[str]) -> bool:
        """Step ``step`` was skipped for ``why``: True if the run rolled back."""
        self.skipped_steps += 1
        self.record(step, why, loss)
        new = [k for k in culprits if k not in self.state.quarantined]
        if new:
            self.state.quarantined.extend(new)
            self.state.write()
            self.loader.quarantined = frozenset(self.state.quarantined)
            log.warning(
                "%s: sample(s) %s are non-finite alone: quarantined (RUN_DIR/instability.json), never fed again",
                why,
                ", ".join(new),
            )
            return False
        self.events.append(why.split(" (here")[0].split(":")[0])
        action = self.budget.skipped(step)
        self.pin(self.budget.began - 1 if self.budget.skips else None)  # (retention keeps what a rollback needs)
        s = self.settings
        if action == "skip":
            count = len(self.budget.skips)
            log.warning("%s: the step is skipped (%d of trainer.instability.max_skips=%d)", why, count, s.max_skips)
            return False
        if action == "rollback":
            began = self.budget.began
            reason = f"{len(self.budget.skips)} unstable steps within {s.skip_window} (from step {began}; {why})"
            self.rollback(began - 1, reason)
            self.budget.rolled_back()
            self.pin(None)
            return True
        shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
        if s.on_instability == "stop":
            limit = "trainer.instability.on_instability=stop"
        else:
            limit = f"trainer.instability.max_skips={s.max_skips} within skip_window={s.skip_window} steps"
            if s.on_instability == "rollback":
                limit += f" after {self.budget.rollbacks} rollback(s) (max_rollbacks={s.max_rollbacks})"
        raise InstabilityStop(
            f"training is unstable: {said(self.events)}; {limit}: stopped at step {step - 1}; the last step's "
            f"samples (this rank): {shown or 'none'}; lower optim.lr, set trainer.grad_clip, or check those samples"
        )

    def stats(self) -> dict:
        """For summary.json."""
        return {
            "skipped_steps": self.skipped_steps,
            "rollbacks": self.state.rollbacks,
            "quarantined": list(self.state.quarantined),
        }
