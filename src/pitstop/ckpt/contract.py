"""The checkpointer contract, as the training loop sees it, and the records of a save.

:class:`Checkpointer` is what every ``conf/ckpt/`` option implements, ``none`` included; the saving backends
share one implementation of its lifecycle (:mod:`.manager`).  Nothing here imports ``torch.distributed``.

The saved state (the same for every backend, so checkpoints are interchangeable):
- ``model`` and ``optim``: from DCP's ``get_state_dict`` (the same keys for plain, DDP and FSDP models);
- ``train.rank{R}``: the rest of each rank's state — step and sample counters, LR schedule, data-loader
  position, every RNG state and the config fingerprint — as JSON bytes in a uint8 tensor, so nothing is
  ever unpickled: ``torch.load`` always runs with ``weights_only=True``.
"""

from __future__ import annotations

import sys
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar

if TYPE_CHECKING:
    from pitstop.goodput.interval import IntervalPolicy


def save_errors() -> tuple[type[BaseException], ...]:
    """What a failed save raises: any ``Exception``, and DCP's ``CheckpointException`` (a ``BaseException``) once
    DCP is loaded (a save that raised it had loaded it: nothing is imported here for it)."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return (Exception,) if api is None else (Exception, api.CheckpointException)


T = TypeVar("T")


class StrategyLike(Protocol):
    """What a checkpointer uses of the job's strategy (a ``pitstop.strategy.base.Strategy``; its torch types are
    left open here, as this module imports no torch)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def device(self) -> Any: ...  # a torch.device

    def ckpt_group(self) -> Any: ...  # the process group for checkpoint collectives (a ProcessGroup), or None

    def init_local_group(self, store_path: str) -> None: ...

    def sync_buffers(self, model: Any) -> None: ...  # model: Target.model

    def broadcast_object(self, obj: T, src: int = 0) -> T: ...

    def any(self, flag: bool) -> bool: ...

    def agree(self, flag: bool) -> bool: ...

    def barrier(self) -> None: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    @property
    def replicated(self) -> bool: ...  # every rank holds the whole model (DDP)


class TrainStateLike(Protocol):
    """What a checkpoint holds besides model and optimizer tensors (``pitstop.train.runner.TrainState``)."""

    step: int

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict, peers: list[dict] | None = None) -> None: ...

    def fingerprint(self) -> dict: ...


@dataclass
class Target:
    """What is saved and restored: the (wrapped) model, its optimizer and the rest of the train state."""

    model: Any  # a torch.nn.Module, wrapped by the strategy (this module imports no torch)
    optimizer: Any  # its torch.optim.Optimizer
    state: TrainStateLike


@dataclass(frozen=True)
class SaveResult:
    """What :meth:`Checkpointer.maybe_save` did: seconds the loop was blocked, and the step of the save it
    started (None if none was due)."""

    blocked: float = 0.0
    started: int | None = None


class Checkpointer(ABC):
    """The contract of a ``ckpt`` option, as the training loop uses it (its methods in the order it calls them).

    One instance per rank; every rank calls the same methods at the same steps (a save of a sharded model is a
    collective). The loop calls :meth:`setup` once, then :meth:`restore` once (a fresh run: None), then every step
    :meth:`wait_staging` just before ``optimizer.step()`` and :meth:`maybe_save` after it; :meth:`wait` where it
    needs a background save settled (before a rollback, after a preemption notice's save); and :meth:`close` at the
    end, on a failure too. (:meth:`poll` is the backends' own: their :meth:`maybe_save` settles a finished save
    with it.) A rollback calls :meth:`restore` with ``at_most`` and then
    :meth:`discard_after`.

    An implementation must:

    - count a save only once every file of it is written (a commit marker last): a process killed at any moment
      leaves either a complete checkpoint or one that :meth:`restore` skips;
    - restore bitwise: the model, the optimizer and ``target.state`` exactly as they were saved, so that the
      resumed run's steps equal the uninterrupted run's;
    - not block the loop longer than it must in :meth:`maybe_save` (a background save copies what the next
      ``optimizer.step()`` changes by :meth:`wait_staging`, and writes while the loop goes on);
    - on a failed save, keep the older checkpoints intact, count the failure in :meth:`stats` and let the run go on
      (``ckpt.on_error=raise``: raise :class:`~pitstop.errors.CheckpointError`); :meth:`close` raises when the
      last save failed, so a run never reports success without its final checkpoint.

    A new saving backend should subclass ``pitstop.ckpt.manager.CheckpointManager``, which implements this whole
    lifecycle (schedule, retention, tiers, commit, failures) and asks a subclass only to write one save
    (``_write``); ``pitstop.ckpt.none.NoCheckpoint`` is the smallest complete implementation.
    """

    name: str = "base"
    """The option's name, as runs and summaries show it."""
    root: str | None = None
    """Where checkpoints go (a folder or a URL); None: nowhere (``ckpt=none``)."""
    last_started: int | None = None
    """The step of the newest save started (in flight or done)."""
    last_durable: int | None = None
    """The step of the newest save to the durable tier (``ckpt.dir``) started."""
    last_committed: int | None = None
    """The step of the newest save to the durable tier that completed."""
    load_callbacks: tuple[Callable[[str], None], ...] = ()
    pinned: int | None = None
    """Retention keeps the newest checkpoint at or before this step (a rollback's target)."""
    restored_from: str | None = None
    """The tier the last restore read (``local``, ``peer`` or ``durable``); None: nothing was restored."""

    def on_load(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(path)`` as a restore starts reading a checkpoint it verified (fault injection)."""
        self.load_callbacks = (*self.load_callbacks, callback)

    @abstractmethod
    def setup(
        self,
        strategy: StrategyLike,
        report: Callable[[dict, int], None],
        intervals: IntervalPolicy | None = None,
        node: str | None = None,
    ) -> None:
        """Bind to the job: ``strategy`` (ranks, collectives), ``report(metrics, step)`` (per-save costs),
        ``intervals``: what ``interval=auto`` knows of the job's failures (ignored by fixed intervals), ``node``:
        this process's node name (the local tier's copies go to another node)."""

    @abstractmethod
    def restore(self, target: Target, at_most: int | None = None) -> int | None:
        """Load the checkpoint chosen by ``ckpt.load`` into ``target``; return its step, or None to start fresh.
        ``at_most`` (a rollback): the newest verified checkpoint of this run with a step at most that, whatever
        ``ckpt.load`` says; None if there is none."""

    def discard_after(self, step: int) -> None:
        """Remove the complete checkpoints newer than ``step`` (after a rollback to ``step``: they hold the steps
        rolled back, which a restart must never resume from)."""

    @abstractmethod
    def maybe_save(self, target: Target, step: int, *, last: bool = False, force: bool = False) -> SaveResult:
        """Save ``target`` at ``step`` if due (``last``: the final step; ``force``: now, e.g. on a preemption)."""

    @abstractmethod
    def wait_staging(self) -> float:
        """Called before ``optimizer.step()`` changes parameters and optimizer state: a background copy of them
        finishes here (what forward changes was copied when the save started). Returns seconds waited."""

    @abstractmethod
    def wait(self) -> float:
        """Wait until the save in flight (if any) is durable or failed. Returns seconds waited."""

    @abstractmethod
    def poll(self) -> None:
        """Settle a background save that has finished (commit it, or report its failure) without waiting."""

    @abstractmethod
    def close(self) -> None:
        """Wait for the last save and release resources; raise if the run must not count as a success."""

    @abstractmethod
    def stats(self) -> dict:
        """Per-run figures for summary.json (saves, failures, blocking and total seconds, bytes)."""


@dataclass
class SaveRecord:
    step: int
    path: str
    last: bool = False
    tier: str = "durable"  # durable (ckpt.dir) | local (ckpt.local.dir)
    throttle_mbps: float | None = None
    started: float = field(default_factory=time.perf_counter)
    block_seconds: float = 0.0
    total_seconds: float | None = None
    finished: float | None = None  # when the write became durable (set from the writer's thread)
    copied: float | None = None  # ckpt.local.replicas: when its copy to the partner node ended (the copy's thread)
    bytes: int = 0
    error: str | None = None


@dataclass
class Pending:
    """A save still running in the background: ``staging`` (host copy; may be None) then ``upload`` (write)."""

    record: SaveRecord
    upload: Future
    staging: Future | None = None


def interrupt_in(error: BaseException) -> BaseException | None:
    """The :class:`~pitstop.errors.Interrupt` (a hang) that ``error`` is or wraps (DCP wraps each rank's exception in
    its own), to be raised as itself: a hang inside a save or a restore is a hang, not their failure."""
    from pitstop.errors import Interrupt

    if isinstance(error, Interrupt):
        return error
    return next((inner for _, inner in _per_rank(error) if isinstance(inner, Interrupt)), None)


def _per_rank(error: BaseException) -> list[tuple[int, object]]:
    """(rank, that rank's exception) for each failure DCP wrapped in ``error`` (its ``failures``), by rank; [] if
    it wraps none."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict):
        return []
    return [(rank, exc[0] if isinstance(exc, tuple) else exc) for rank, exc in sorted(failures.items())]


def one_line(error: BaseException) -> str:
    """A one-line description of a save/load failure (DCP wraps per-rank tracebacks; keep the cause)."""
    ranks = _per_rank(error)
    if ranks:
        return "; ".join(
            f"rank {rank}: {one_line(inner) if isinstance(inner, BaseException) else str(inner)[:200]}"
            for rank, inner in ranks
        )
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:400]
