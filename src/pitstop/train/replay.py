"""``trainer.sdc.replay``: one process has no replica to compare with, so it takes a sampled step twice, from the same
state and the same batches, and compares the two results bitwise (``pitstop.train.sdc`` decides what follows).

Before a sampled step the state the step changes is copied (:class:`Snapshot`: parameters and buffers, optimizer
state, the LR schedule, the loss scale, every RNG) and the batches it fetches are kept (:class:`Recording`). After
it, the result's digest is taken, the copy put back, and the step taken again on the kept batches
(:class:`Replaying`); the replay's digest must be the first's. pitstop's steps are bitwise deterministic on the same
device, so a difference is a fault in the computation (a faulty core or memory read during the step) that did not
happen twice. What it cannot see: corruption of the state at rest (between steps), which both computations start
from; replicas (``strategy=ddp``) see that.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from pitstop.ckpt.contract import Target
from pitstop.parts.digest import bits_sum
from pitstop.parts.seed import rng_state, set_rng_state


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


class Snapshot:
    """A copy of what a step changes (not the data position: the replay takes the kept batches)."""

    def __init__(self, target: Target):
        state = target.state
        self.model = {k: v.detach().clone() for k, v in target.model.state_dict().items()}
        opt = target.optimizer.state_dict()
        self.optimizer = {
            "state": {i: {k: _clone(v) for k, v in s.items()} for i, s in opt["state"].items()},
            "param_groups": copy.deepcopy(opt["param_groups"]),
        }
        self.scheduler = copy.deepcopy(state.scheduler.state_dict())
        self.scaler = copy.deepcopy(state.precision.state_dict())
        self.rng = rng_state()

    def restore(self, target: Target) -> None:
        state = target.state
        target.model.load_state_dict(self.model)
        target.optimizer.load_state_dict(self.optimizer)
        state.scheduler.load_state_dict(self.scheduler)
        state.precision.load_state_dict(self.scaler)
        set_rng_state(self.rng)


def state_digest(target: Target) -> dict[str, int]:
    """The digest (``parts.digest.bits_sum``) of each tensor a step changes, by name: the model's state and the
    optimizer's."""
    out = {k: int(bits_sum(v)) for k, v in target.model.state_dict().items()}
    for i, s in target.optimizer.state_dict()["state"].items():
        out.update({f"optimizer.{i}.{k}": int(bits_sum(v)) for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


class Recording:
    """The step's batch stream, keeping what it hands out."""

    def __init__(self, batches: Any):
        self.batches, self.kept = batches, []

    def next(self) -> Any:
        batch = self.batches.next()
        self.kept.append(batch)
        return batch


class Replaying:
    """The kept batches again, in order."""

    def __init__(self, kept: list[Any]):
        self.it = iter(kept)

    def next(self) -> Any:
        return next(self.it)
