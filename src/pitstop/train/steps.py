"""How many optimizer steps a run has: ``trainer.max_steps``, or the batches of ``trainer.epochs`` over
``trainer.grad_accum_steps`` — recomputed after a resume at another world size, with the LR schedule
re-planned to decay over the steps left; and after which steps the loop evaluates, and one evaluation pass."""

from __future__ import annotations

from dataclasses import dataclass

import logging
from typing import Any, Callable, Iterator, TypeVar

from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from pitstop.config.schema_loop import Trainer
from pitstop.data.loader.base import ShardLoader
from pitstop.errors import ConfigError
from pitstop.parts.lr import planned_steps, replan
from pitstop.parts.precision import Precision
from pitstop.parts.task import Task
from pitstop.strategy.base import Strategy
from pitstop.strategy.groups import ReplicaGroups
from pitstop.train.state import TrainLoader

T = TypeVar("T")

log = logging.getLogger("pitstop")


def batches_left(loader: TrainLoader, epochs: int) -> int:
    """Batches each rank has left of ``epochs`` from the loader's position, at this world size."""
    left = max(0, loader.steps_per_epoch() - loader.batches) if loader.epoch < epochs else 0
    return left + sum(loader.steps_per_epoch(e) for e in range(loader.epoch + 1, epochs))


def total_steps(trainer: Trainer, loader: TrainLoader, accum: int) -> int:
    if trainer.max_steps is not None:
        return int(trainer.max_steps)
    # (with gradient accumulation a step takes grad_accum_steps batches; a window may span two epochs)
    batches = batches_left(loader, int(trainer.epochs))  # (at setup: the loader is at the start)
    if batches < accum:
        raise ConfigError(
            f"trainer.epochs={trainer.epochs} is {batches} batch(es) per rank, fewer than "
            f"trainer.grad_accum_steps={accum}: not one step; train longer or accumulate less"
        )
    return batches // accum


@dataclass
class RunLength:
    """The run's bound in steps, kept as the world changes: ``trainer.max_steps``, or ``trainer.epochs`` of the
    loader's batches re-counted after a resume at another world size and, under replica groups, after each committed
    step (the LR schedule re-planned to decay over the steps left)."""

    trainer: Trainer
    loader: TrainLoader
    accum: int
    scheduler: LRScheduler
    groups: ReplicaGroups
    strategy: Strategy  # (its world size)

    def after_resume(self, step: int, total: int, why: str = "resumed") -> int:
        """The new bound after a resume (with ``trainer.epochs``). Under replica groups (a loader that cuts one global
        order among the groups: ``fetches_left``) it comes from the data position, and the restored or healed
        schedule's plan is kept as it is, re-planned only after committed steps, the same in every group (a group's
        own restore or heal comes at another moment than its peers'); otherwise from the batches left at this world
        size."""
        if self.trainer.max_steps is not None:
            return total
        epochs = int(self.trainer.epochs)
        if self.groups.shares_data_order:
            return step + self.loader.fetches_left(epochs, self.groups.participants) // self.accum
        return steps_at_this_world_size(
            step, self.loader, epochs, self.accum, self.scheduler, total, self.strategy.world_size, why
        )

    def after_step(self, step: int, total: int) -> int:
        """The bound after a committed step: unchanged, but under replica groups with ``trainer.epochs``, where the
        epochs end where the data position says (:func:`steps_with_groups`)."""
        if self.trainer.max_steps is not None or not self.groups.shares_data_order:
            return total
        epochs, groups = int(self.trainer.epochs), self.groups.participants
        return steps_with_groups(step, self.loader, epochs, self.accum, self.scheduler, total, groups)


def steps_at_this_world_size(
    step: int,
    loader: TrainLoader,
    epochs: int,
    accum: int,
    scheduler: LRScheduler,
    total: int,
    world_size: int,
    why: str = "resumed",
) -> int:
    """``trainer.epochs`` after a resume: the steps left are the batches left of the epochs at *this* world
    size (a checkpoint written by another number of ranks, e.g. after a node was lost or came back, leaves
    the rest of its epoch to more or fewer ranks; a skipped step or a rollback moved the data position: ``why``).
    The LR schedule (as saved) is re-planned to decay over them. Returns the new total."""
    new_total = step + batches_left(loader, epochs) // accum
    planned = planned_steps(scheduler) or total
    if new_total != planned:
        fits = replan(scheduler, step, new_total)
        log.info(
            "%s at step %d at world size %d: %d epochs end at step %d (were %d); %s",
            why,
            step,
            world_size,
            epochs,
            new_total,
            planned,
            "the LR schedule decays over the steps left from where it was"
            if fits
            else f"the LR schedule ({type(scheduler).__name__}) cannot be re-planned and keeps its length",
        )
    return new_total


def steps_with_groups(
    step: int, loader: TrainLoader, epochs: int, accum: int, scheduler: LRScheduler, total: int, groups: int
) -> int:
    """``strategy=ft`` with ``trainer.epochs``: the steps left are the fetches left of the epochs from the committed
    data position, over ``accum``, if the ``groups`` of the last step stay (a missing group's share makes an epoch
    take more steps; a group that comes back, fewer). Whenever that differs from the LR schedule's own plan, the
    schedule is re-planned to decay over the steps left. The decision reads only what every group holds alike after
    a committed step (the position, the quorum, the schedule's state, which a heal copies), never this process's
    own count. Returns the new total (the loop's bound)."""
    new_total = step + loader.fetches_left(epochs, groups) // accum
    planned = planned_steps(scheduler) or total
    if new_total != planned:
        fits = replan(scheduler, step, new_total)
        log.info(
            "%d replica group(s) from step %d: %d epochs end at step %d (were %d)%s",
            groups,
            step,
            epochs,
            new_total,
            planned,
            "" if fits else f"; {type(scheduler).__name__} keeps its length",
        )
    return new_total


class EvalSchedule:
    """After which steps the loop evaluates: every ``trainer.eval_every_steps``, else when an epoch has ended
    (with accumulation an epoch can end inside a step); and after the last step."""

    def __init__(self, every: int | None, loader: TrainLoader):
        self.every, self.loader, self.evaluated_epochs = every, loader, 0

    def epochs_ended(self) -> int:
        return self.loader.epoch + int(self.loader.batches >= self.loader.steps_per_epoch())

    def resumed(self) -> None:
        """The loader is where the checkpoint left it: the epochs ended before are evaluated already."""
        self.evaluated_epochs = self.epochs_ended()

    def due(self, step: int, total_steps: int) -> bool:
        if self.every:
            return step % self.every == 0 or step == total_steps
        ended = self.epochs_ended()
        due = ended > self.evaluated_epochs or step == total_steps
        self.evaluated_epochs = ended
        return due


def evaluate(
    model: nn.Module,
    task: Task,
    loader: ShardLoader,
    max_batches: int | None,
    strategy: Strategy,
    precision: Precision,
    to_device: Callable[[Any], Any],
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """One pass over the evaluation split (at most ``max_batches``): the task's metrics, reduced over ranks.
    Every rank runs the same number of forwards (they are collectives under DDP/FSDP): see ``iterate_once``.
    ``on_batch(i)``: called as the i-th batch (1-based) is handed on, after the one before it was computed."""
    passes = loader.iterate_once(max_batches, share=strategy.broadcast_object)
    batches = ((to_device(b), counted) for b, counted in passes)
    if on_batch is not None:
        batches = _told(batches, on_batch)
    with precision.autocast():
        return task.evaluate(model, batches, strategy.all_reduce_sum, strategy.device)


def _told(items: Iterator[T], on_item: Callable[[int], None]) -> Iterator[T]:
    for i, item in enumerate(items, 1):
        if i > 1:
            on_item(i - 1)
        yield item
