"""The contract of a ``strategy`` option: where the model runs, how ranks cooperate, and the collectives
that checkpointing and evaluation use (on a dedicated gloo group when there are several ranks)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from pitstop.strategy.groups import ONE_GROUP, ReplicaGroups


class Strategy(ABC):
    name: str = "base"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    compute_dtype: torch.dtype | None = None  # set when the strategy itself casts for compute (FSDP's policy)
    channels_last_params: bool = True  # can hold 4-D parameters in channels_last (FSDP2 cannot shard them)
    # every rank holds the whole model, bitwise equal to the others' after each step (DDP's replicas): what
    # trainer.sdc compares
    replicated: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def pin_memory(self) -> bool:
        return self.device.type == "cuda"

    @abstractmethod
    def setup(self) -> None:
        """Choose the device and join the process group (if any)."""

    @abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """Place (and replicate or shard) the model."""

    @abstractmethod
    def no_sync(self, model: nn.Module) -> ContextManager:
        """Around the backward of a gradient-accumulation micro-batch that is not the last of its step: the
        gradients stay local (no all-reduce / reduce-scatter); the last micro-batch's backward reduces them all."""

    def watch_gradients(self, model: nn.Module, ready: Callable[[], None]) -> bool:
        """Call ``ready()`` on this rank as each of its gradients is ready, before any wait for its collective
        (``trainer.straggler`` times a rank's work apart from its waits). False: this strategy cannot say."""
        return False

    @abstractmethod
    def to_device(self, batch: Any) -> Any:
        """Move a batch to the device (non-blocking from pinned memory on CUDA)."""

    @abstractmethod
    def sync_buffers(self, model: nn.Module) -> None:
        """Make every rank's buffers rank 0's before they are saved."""

    @abstractmethod
    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (the training group)."""

    def agree(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is on any, decided on the training group (main thread only). Use it
        while an async save may be in flight: its writer thread runs collectives on the checkpoint group, and
        two threads' collectives on one group interleave differently on each rank (a deadlock)."""
        t = torch.tensor([float(flag)], device=self.device)
        return bool(self.all_reduce_sum(t).item() > 0)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape and dtype on each), in rank order, on the training group (main thread)."""
        return [t]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        return [obj]

    @abstractmethod
    def ckpt_group(self) -> Any:
        """The process group for checkpoint collectives (None: no process group)."""

    @abstractmethod
    def init_local_group(self, store_path: str) -> None:
        """Make a one-rank process group for savers that need one, if none exists."""

    @abstractmethod
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""

    @abstractmethod
    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is True on any."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait for every rank."""

    def share_cores(self, loader_workers: int) -> None:
        """Before ``setup``: the loader's worker processes, which share this machine's cores with the loop (a run
        on the CPU sets its intra-op threads from it). Nothing to do here."""

    @property
    def groups(self) -> ReplicaGroups:
        """What replica groups add to the loop (``strategy=ft``); every other strategy: one group that always
        commits (:mod:`pitstop.strategy.groups`)."""
        return ONE_GROUP

    @abstractmethod
    def teardown(self) -> None:
        """Leave the process group this strategy joined (idempotent)."""
