"""One optimizer step, with the collaborators it uses passed in (the Runner builds it once, in setup).

quorum (strategy=ft) -> per micro-batch: fetch, forward, backward (reduced on the last one only)
  -> reduce across replica groups + commit -> the instability check (an unstable step stops here, not applied)
  -> clip -> wait for a save's staging -> optimizer + schedule
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from pitstop.ckpt.contract import Checkpointer
from pitstop.data.dataset import ShardedDataset
from pitstop.data.loader.base import ShardLoader
from pitstop.goodput.ledger import Ledger
from pitstop.parts.precision import Precision
from pitstop.parts.task import Task
from pitstop.resilience.fault import Fault
from pitstop.resilience.watchdog import Watchdog
from pitstop.strategy.base import Strategy
from pitstop.strategy.groups import ReplicaGroups
from pitstop.train.assembly import channels_last
from pitstop.train.instability import Guard
from pitstop.train.metering import StepMeter
from pitstop.train.state import Batches, Progress, StepResult, TrainLoader
from pitstop.train.steps import evaluate
from pitstop.train.straggler import Stragglers


@dataclass
class Stepper:
    """``trainer.grad_accum_steps`` micro-batches per optimizer step, in ``trainer.precision``."""

    progress: Progress
    strategy: Strategy
    groups: ReplicaGroups
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    precision: Precision
    task: Task
    data: ShardedDataset  # its ``on_device`` runs on each batch once it is on the device
    loader: TrainLoader
    ckpt: Checkpointer
    fault: Fault
    ledger: Ledger
    watchdog: Watchdog
    meter: StepMeter
    accum: int
    batch_size: int
    grad_clip: float | None
    channels_last: bool
    guard: Guard | None = None  # trainer.instability (None: off, a non-finite loss raises)
    micro: int = 1  # the micro-batch being taken (the sample log names it)
    straggler: Stragglers | None = None  # trainer.straggler: times this rank's work apart from its waits

    def evaluate(
        self, loader: ShardLoader, max_batches: int | None, on_batch: Callable[[int], None] | None = None
    ) -> dict[str, float]:
        """One pass of the model over ``loader``'s split in this step's precision (``steps.evaluate``)."""
        args = (self.model, self.task, loader, max_batches, self.strategy, self.precision, self.device_batch)
        return evaluate(*args, on_batch=on_batch)

    def __call__(self, batches: Batches) -> StepResult:
        step = self.progress.step + 1
        t = time.perf_counter()
        with self.watchdog.phase("peers"):  # (waits for peer replica groups: a peer's stall is not a hang here)
            self.groups.begin_step()  # (strategy=ft) the step's quorum: a group that is behind heals here
        quorum = time.perf_counter() - t
        self.optimizer.zero_grad(set_to_none=True)
        guard = self.guard
        if guard is not None:
            guard.before(self.model)
        losses, samples, wait, held = [], 0, 0.0, []
        work = self.straggler if self.straggler is not None and self.straggler.on else None
        for micro in range(1, self.accum + 1):
            self.micro = micro
            t = time.perf_counter()
            batch = self.device_batch(batches.next())
            wait += time.perf_counter() - t
            keys = list(getattr(self.loader, "last_keys", ()))
            if guard is not None:  # (an unstable step looks for its bad sample in them)
                held.append((batch, keys))
            samples += len(batch[-1]) if isinstance(batch, (list, tuple)) else self.batch_size
            if micro == 1:
                self.meter.first_batch(batch)  # its shapes, for counting a step's FLOPs once
            if work is not None:
                work.start()
            with self.strategy.no_sync(self.model) if micro < self.accum else nullcontext():
                with self.precision.autocast():
                    loss = self.fault.loss(step, keys, self.task.loss(self.model, batch))
                self.precision.backward(loss / self.accum if self.accum > 1 else loss)
            if work is not None:
                work.stop(synced=micro == self.accum)
            losses.append(loss.detach())
            if micro < self.accum:
                self.fault.after_micro_batch(step, micro)
        loss = losses[0] if self.accum == 1 else torch.stack(losses).float().mean()
        if guard is None and not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()} at step {step}; lower optim.lr or check the data")
        with self.watchdog.phase("peers"):
            self.groups.reduce_gradients(self.model)  # (strategy=ft) averaged over the step's replica groups
            committed = self.groups.commit()
        if not committed:
            if work is not None:
                work.discard()
            return StepResult(loss.item(), samples, wait, 0.0, committed=False, quorum=quorum)
        why, nonfinite = guard.check(step, loss, self.model) if guard is not None else (None, False)
        if why is not None:  # not applied: gradients dropped, buffers put back; the loader is past its batches
            guard.put_back()  # (before the look for a bad sample: the model as it was before the step)
            if work is not None:
                work.discard()
            culprits = guard.culprits(step, held, self.model) if nonfinite else []
            self.optimizer.zero_grad(set_to_none=True)
            self.loader.commit()
            keys = [k for _, ks in held for k in ks]
            return StepResult(loss.item(), samples, wait, 0.0, quorum=quorum, skipped=why, culprits=culprits, keys=keys)
        del held
        self.loader.commit()  # (strategy=ft) the step's samples, every group's, are consumed
        t = time.perf_counter()
        self.precision.unscale(self.optimizer)  # (fp16) clipping reads the true gradients
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        optimizing = time.perf_counter() - t
        staging = self.ckpt.wait_staging()  # staging must finish before params change
        self.ledger.add("checkpoint", staging)
        # (what forward changes, BatchNorm statistics, was copied when the save started)
        t = time.perf_counter()
        self.precision.step(self.optimizer)
        self.scheduler.step()
        if work is not None:  # (the optimizer is this rank's work too: no collective in it)
            work.extra(optimizing + time.perf_counter() - t)
        return StepResult(loss.item(), samples, wait, staging, quorum=quorum)

    def device_batch(self, batch: Any) -> Any:
        batch = self.data.on_device(self.strategy.to_device(batch))
        return channels_last(batch) if self.channels_last else batch
