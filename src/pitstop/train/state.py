"""The state of a run besides the model and optimizer tensors, and the stream of training batches.

``Progress`` (step, samples seen) and ``TrainState`` (what a checkpoint restores: progress, the loader's
position, the LR schedule, the RNGs, the fingerprint, the loss scale) are saved and restored by every
checkpoint backend; ``StepResult`` is one optimizer step's outcome; ``Batches`` fetches training batches in
the watchdog's ``data`` phase and restarts stalled data workers once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from pitstop.ckpt.contract import Target
from pitstop.data.loader.base import TrainBatches
from pitstop.resilience.watchdog import DataStall, Watchdog
from pitstop.parts.batch import local_shard, map_tensors
from pitstop.parts.precision import Precision
from pitstop.parts.seed import rng_state, set_rng_state

log = logging.getLogger("pitstop")

TrainLoader = TrainBatches  # the training batches: a rank's share (ShardLoader), or replica groups' cut (ReplicaLoader)


@dataclass
class Progress:
    step: int = 0
    samples_seen: int = 0


class TrainState:
    """Everything besides model and optimizer tensors that a checkpoint must restore (``Stateful``)."""

    def __init__(
        self, progress: Progress, loader: TrainLoader, scheduler: LRScheduler, fingerprint: dict, precision: Precision
    ):
        self.progress, self.loader, self.scheduler, self._fingerprint = progress, loader, scheduler, fingerprint
        self.precision = precision

    @property
    def step(self) -> int:
        return self.progress.step

    def fingerprint(self) -> dict:
        """Config parts that must not change across a resume."""
        return self._fingerprint

    def state_dict(self) -> dict:
        state = {
            "step": self.progress.step,
            "samples_seen": self.progress.samples_seen,
            "loader": self.loader.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
            "fingerprint": self._fingerprint,
        }
        scaler = self.precision.state_dict()
        if scaler:  # fp16: the loss scale and its growth tracker
            state["scaler"] = scaler
        return state

    def load_state_dict(self, state: dict, peers: list[dict] | None = None) -> None:
        """``peers``: every saved rank's state (needed when the number of ranks changed)."""
        self.progress.step, self.progress.samples_seen = int(state["step"]), int(state["samples_seen"])
        self.loader.load_state_dict(state["loader"], peers=[p["loader"] for p in peers] if peers else None)
        self.scheduler.load_state_dict(state["scheduler"])
        self.precision.load_state_dict(state.get("scaler"))
        set_rng_state(state["rng"])


def live_state(target: Target) -> dict:
    """The whole live state of a run, as a peer heals from it (``strategy=ft``). Parameters and optimizer state
    by reference (they change only at the optimizer step, after the peer's heal has ended: it takes part in the
    step's all-reduce); buffers copied (the forward that runs meanwhile updates BatchNorm's statistics). A sharded
    tensor (FSDP inside a group: a DTensor) travels as this rank's shard; the same rank of the healing group holds
    the same shard of it (:func:`load_live_state` wraps it again)."""
    model = target.model.state_dict()
    buffers = {name for name, _ in target.model.named_buffers()}
    return {
        "model": {k: local_shard(v.clone() if k in buffers else v) for k, v in model.items()},
        "optimizer": map_tensors(local_shard, target.optimizer.state_dict()),
        "train": target.state.state_dict(),
    }


def load_live_state(target: Target, state: dict) -> None:
    current = target.model.state_dict()
    target.model.load_state_dict({k: _like(v, current.get(k)) for k, v in state["model"].items()})
    optimizer = state["optimizer"]
    params = [p for group in target.optimizer.param_groups for p in group["params"]]
    index = [i for group in optimizer["param_groups"] for i in group["params"]]
    of = dict(zip(index, params))  # the state dict's index of a parameter -> the parameter
    for i, entry in optimizer["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:  # (a step count stays a plain scalar)
                entry[key] = _like(value, of.get(i))
    target.optimizer.load_state_dict(optimizer)
    target.state.load_state_dict(state["train"])


def _like(value: Any, model: Any) -> Any:
    """A shard received from a peer, as a DTensor laid out like ``model`` (when ``model`` is one)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(model, DTensor) or isinstance(value, DTensor):
        return value
    return DTensor.from_local(
        value.to(model.device),
        model.device_mesh,
        model.placements,
        run_check=False,
        shape=model.shape,
        stride=model.stride(),
    )


@dataclass
class StepResult:
    """One optimizer step: its mean loss, this rank's samples, and where its seconds went besides compute;
    ``committed`` False: a replica group's step discarded because a peer failed during it (``strategy=ft``);
    ``skipped``: an unstable step, not applied (``trainer.instability``)."""

    loss: float
    samples: int
    data_wait: float
    staging: float
    committed: bool = True
    quorum: float = 0.0
    skipped: str | None = None  # why its update was not applied (trainer.instability), else None
    culprits: list[str] = field(default_factory=list)  # (skipped) the samples found non-finite alone
    keys: list[str] = field(default_factory=list)  # (skipped) this rank's samples of the step


class Batches:
    """The training batches, fetched in the watchdog's ``data`` phase.  When the data workers stall (a worker
    stuck in a read, a store that stopped answering), the watchdog raises ``DataStall`` once: the workers are
    restarted from the current data position and the fetch is tried again (a second stall in the same fetch
    propagates, and the attempt ends)."""

    def __init__(self, loader: TrainLoader, watchdog: Watchdog):
        self.loader, self.watchdog = loader, watchdog
        self.it = iter(loader)

    def next(self) -> Any:
        try:
            with self.watchdog.phase("data", heal=True):
                return next(self.it)
        except DataStall as e:
            stalled = e  # (its traceback holds the stuck workers' iterator until it is dropped below)
        with self.watchdog.phase("data"):  # the restart is data wait too; a stall in here is a hang
            log.warning("%s", stalled)
            stalled.__traceback__ = None  # the stuck workers stop (shut down, terminated if they do not)
            del stalled
            self.it.close()
            self.it = iter(self.loader)  # new ones resume from the position of the last batch received
            return next(self.it)

    def restart(self) -> None:
        """Fetch from the loader's position as it is now (a rollback moved it): the workers are started again."""
        self.it.close()
        self.it = iter(self.loader)

    def close(self) -> None:
        self.it.close()
