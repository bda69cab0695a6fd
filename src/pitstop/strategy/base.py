"""The contract of a ``strategy`` option: where the model runs, how ranks cooperate, and the collectives
that checkpointing and evaluation use (on a dedicated gloo group when there are several ranks)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import cached_property
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from pitstop.strategy.groups import ONE_GROUP, ReplicaGroups


class Collectives:
    """The collectives this process has entered, counted where the loop enters them (the gradient reduce, a
    strategy's small ones), and the one it is in: what a hang report compares across the ranks
    (``pitstop.resilience.hang_peers``). Each rank enters the same ones in the same order, so a rank stuck outside
    one has a lower count than its peers waiting inside it. An add and two stores per collective; the watchdog's
    thread reads them. ``with collectives.enter(what):`` around one collective (not nested)."""

    __slots__ = ("entered", "inside")

    def __init__(self) -> None:
        self.entered: int = 0
        self.inside: str | None = None

    def enter(self, what: str) -> Collectives:
        self.entered += 1
        self.inside = what
        return self

    def __enter__(self) -> Collectives:
        return self

    def __exit__(self, *exc: object) -> None:
        self.inside = None


class Strategy(ABC):
    """The contract of a ``strategy`` option: where this process's model runs and how the ranks cooperate.

    One instance per process (per rank). The loop calls, in this order: :meth:`share_cores` (before anything
    else), :meth:`setup` (choose the device, join the process group; after it ``rank``, ``local_rank``,
    ``world_size`` and ``device`` are this process's), :meth:`wrap` once on the model, then every step
    :meth:`to_device` on each micro-batch, :meth:`no_sync` around every micro-batch's backward but the last, and
    :meth:`all_reduce_sum` / :meth:`agree` / :meth:`any` where all ranks decide together; :meth:`sync_buffers`
    before a save; :meth:`teardown` at the end, also after a failure.

    An implementation must:

    - run every collective on every rank, in the same order, from the main thread: the loop relies on it to
      never deadlock (a checkpoint's background writer uses :meth:`ckpt_group`, a group of its own);
    - leave the gradients reduced after the last micro-batch's backward, so that ``optimizer.step()`` on each rank
      gives the same update (or the same shard of it);
    - be idempotent in :meth:`teardown`, which runs on the way out of a failed run too;
    - raise a :class:`~pitstop.errors.ConfigError` (one line: the key, the value, the fix) for settings it
      cannot run with, from ``__init__`` or :meth:`setup`, before any step.

    A single-process strategy answers the collectives itself (sum of one, its own object); subclass
    ``pitstop.strategy.single.Single`` or ``pitstop.strategy.ddp.DDP`` rather than this class where you can.
    """

    name: str = "base"
    """The option's name, as runs and summaries show it."""
    rank: int = 0
    """This process's rank in the training group (0 .. ``world_size`` - 1), set by :meth:`setup`."""
    local_rank: int = 0
    """This process's rank on its node (its GPU index), set by :meth:`setup`."""
    world_size: int = 1
    """Ranks in the training group, set by :meth:`setup`."""
    device: torch.device = torch.device("cpu")
    """Where the model and the batches go, set by :meth:`setup`."""
    compute_dtype: torch.dtype | None = None
    """Set when the strategy itself casts for compute (FSDP's mixed-precision policy); None otherwise."""
    channels_last_params: bool = True
    """Whether it can hold 4-D parameters in channels_last (FSDP2 cannot shard them)."""
    replicated: bool = False
    """Every rank holds the whole model, bitwise equal to the others' after each step (DDP's replicas): what
    ``trainer.sdc`` compares."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs, tracks and writes the run's files."""
        return self.rank == 0

    @cached_property
    def collectives(self) -> Collectives:
        """This process's count of collectives entered (see :class:`Collectives`)."""
        return Collectives()

    @property
    def pin_memory(self) -> bool:
        """Whether the loader pins its batches (for non-blocking copies to the device): on CUDA."""
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
