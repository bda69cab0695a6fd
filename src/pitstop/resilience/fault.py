"""Fault injection: kill the job on purpose to see what a configuration loses and that it resumes.

``bug`` raises the same error at its step in every attempt (a deterministic bug: what the crash-loop check is
tested with). ``crash_at_step``, ``stall`` and ``during_save`` fire once per run dir (``RUN_DIR/faults.jsonl`` remembers
them), so the restarted job gets past them. ``random`` fires in every attempt after a time (or a number of steps)
drawn from an exponential distribution (mean ``mtbf_seconds``, or ``mtbf_steps``; seeded by (seed, attempt)), so a job
with ``trainer.max_restarts`` sees a reproducible Poisson stream of failures.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from pitstop.errors import ConfigError
from pitstop.resilience.fault_record import count_fired, first_time, note_fired

if TYPE_CHECKING:
    from pitstop.ckpt.contract import Checkpointer

log = logging.getLogger("pitstop.resilience.fault")


def _kill(reason: str) -> None:
    log.warning("fault injection: SIGKILL (%s)", reason)
    for h in logging.getLogger().handlers:
        h.flush()
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class FaultContext:
    """What a fault needs to know about the job (passed in; a fault never reaches into the runner)."""

    run_dir: str
    rank: int
    world_size: int
    total_steps: int
    max_restarts: int
    start_wall: float  # when this process started (time.time())
    checkpointer: Checkpointer  # its root and the step of the newest save started
    grad_accum_steps: int = 1  # micro-batches per step
    # registers a call made (with the checkpoint's path) as a restore starts reading a checkpoint it verified
    on_restore: Callable[[Callable[[str], None]], None] | None = None
    # strategy=ft: registers a call made (with the step) when this process starts sending its state to a healing
    # peer; None under other strategies
    on_heal_served: Callable[[Callable[[int], None]], None] | None = None
    # strategy=ft: registers a call made (with the step) as this process starts applying the state a peer sent it
    on_heal: Callable[[Callable[[int], None]], None] | None = None
    model: Any = None  # the (wrapped) model: fault=bitflip corrupts one of its parameters
    optimizer: Any = None  # the optimizer: fault=slow_rank times its step (part of a rank's work)
    sample_keys: Callable[[], set[str]] | None = None  # the training split's sample keys (read when called)


class Fault(ABC):
    """The contract of a ``fault`` option: a failure injected on purpose (a kill, a stall, a bad value), to see what a
    configuration loses and that it recovers. Every rank builds one; the loop calls :meth:`bind` once at setup (after
    the checkpointer is built, before the restore), :meth:`after_micro_batch`, :meth:`loss` and :meth:`after_step` in
    and after each step, :meth:`during_eval` in evaluations, and :meth:`close` at the end, on a failure too.

    An implementation refuses in :meth:`bind`, with a one-line :class:`~pitstop.errors.ConfigError`, settings that
    would never fire (a step past the last, a rank the job lacks, a phase needing a checkpointer or replica groups it
    has not): a test meant to kill a run must not pass because nothing happened. It fires only on its ``rank`` and, if
    meant once, once per run dir (``pitstop.resilience.fault_record``: the restarted attempt gets past it); does
    nothing beyond the failure it stands for (what recovers from it must recover from the real one); and stops its
    threads and timers in :meth:`close`. Subclass :class:`NoFault` (every hook a no-op) and override what you need.
    """

    name: str = "base"
    """The option's name, as the run's log and ``faults.jsonl`` show it."""
    rank: int = 0  # the rank it fires on

    @abstractmethod
    def bind(self, ctx: FaultContext) -> None:
        """Check the settings against the job (ranks, steps, checkpointing); raise ConfigError; arm timers."""

    @abstractmethod
    def after_step(self, step: int) -> None:
        """Called on every rank after each step (and its save, if one was started)."""

    def after_micro_batch(self, step: int, micro_batch: int) -> None:
        """Called inside step ``step`` after the backward of micro-batch ``micro_batch`` (1-based) when that is
        not the step's last (``trainer.grad_accum_steps`` > 1): a kill in the middle of an accumulation window."""

    def during_eval(self, step: int, batch: int) -> None:
        """Called inside the evaluation after step ``step``, after its ``batch``-th batch (1-based) was computed."""

    def loss(self, step: int, keys: list[str], loss: Any) -> Any:
        """The loss of step ``step``'s micro-batch of samples ``keys``, as the fault makes it (numeric faults)."""
        return loss

    @abstractmethod
    def close(self) -> None:
        """Disarm (the job ends)."""


def check_step(step: int, ctx: FaultContext) -> None:
    """A fault aimed at step ``step`` must name a step of this run (1 .. its last), else it would never fire."""
    if not 1 <= step <= ctx.total_steps:
        raise ConfigError(
            f"fault.step={step} is not a step of this run (1..{ctx.total_steps}): the fault would never fire; "
            f"choose a step in that range"
        )


class NoFault(Fault):
    name = "none"
    rank = 0

    def __init__(self, replica: int | str | None = None):
        self.replica = replica  # strategy=ft: which replica group it is aimed at (read by the runner's assembly)

    def bind(self, ctx: FaultContext) -> None:
        if not 0 <= int(self.rank) < ctx.world_size:
            raise ConfigError(
                f"fault.rank={self.rank} but the job has {ctx.world_size} rank(s); use 0..{ctx.world_size - 1}"
            )
        self.ctx = ctx

    def after_step(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


PHASES = ("step", "eval", "restore", "heal")


class CrashAtStep(NoFault):
    """SIGKILL this process at the end of step ``step`` (after that step's save, if any, was started).

    With an async checkpoint backend this lands while the save is staging or being written in the
    background; with a sync backend, between saves.  ``micro_batch=K`` (with ``trainer.grad_accum_steps`` >
    K): inside step ``step`` instead, after its K-th micro-batch's backward (gradients half accumulated).
    ``phase``: where it fires: ``step`` (the end of step ``step``), ``eval`` (inside the first evaluation at or
    after step ``step``, after its first batch), ``restore`` (as the first restore of a checkpoint of step
    ``step`` or later starts reading it, once its files are verified), ``heal`` (``strategy=ft``: as this process
    starts applying the state a live peer sent it, in the first heal at step ``step`` or later).
    """

    name = "crash_at_step"

    def __init__(
        self,
        step: int,
        rank: int = 0,
        micro_batch: int | None = None,
        replica: int | str | None = None,
        phase: str = "step",
    ):
        self.replica = replica
        self.step, self.rank = int(step), rank
        self.micro_batch = None if micro_batch is None else int(micro_batch)
        if phase not in PHASES:
            raise ConfigError(f"fault.phase={phase!r}: use one of {', '.join(PHASES)}")
        if phase != "step" and self.micro_batch is not None:
            raise ConfigError(f"fault.micro_batch is a point inside a step: it needs fault.phase=step, not {phase}")
        self.phase = phase

    def _bind_step(self, ctx: FaultContext) -> None:
        NoFault.bind(self, ctx)
        check_step(self.step, ctx)
        if self.micro_batch is not None and self.micro_batch >= ctx.grad_accum_steps:
            raise ConfigError(
                f"fault.micro_batch={self.micro_batch} needs trainer.grad_accum_steps > "
                f"{self.micro_batch} (it is {ctx.grad_accum_steps}): the fault would never fire"
            )

    def after_step(self, step: int) -> None:
        if (
            self.phase == "step"
            and self.micro_batch is None
            and step == self.step
            and self.ctx.rank == self.rank
            and first_time(self.ctx.run_dir, self.key())
        ):
            self.fire()

    def after_micro_batch(self, step: int, micro_batch: int) -> None:
        if (
            micro_batch == self.micro_batch
            and step == self.step
            and self.ctx.rank == self.rank
            and first_time(self.ctx.run_dir, self.key())
        ):
            self.fire()

    def during_eval(self, step: int, batch: int) -> None:
        if self.phase == "eval" and step >= self.step and self.ctx.rank == self.rank:
            if first_time(self.ctx.run_dir, self.key()):
                self.fire()

    def _restoring(self, path: str) -> None:
        from pitstop.ckpt.layout import step_of

        if step_of(path) >= self.step and first_time(self.ctx.run_dir, self.key()):
            self.fire()

    def _healing(self, step: int) -> None:
        if step >= self.step and first_time(self.ctx.run_dir, self.key()):
            self.fire()

    def bind(self, ctx: FaultContext) -> None:
        self._bind_step(ctx)
        if self.phase == "restore" and ctx.rank == self.rank:
            if ctx.on_restore is None:
                raise ConfigError("fault.phase=restore fires in a checkpoint's restore: it needs a ckpt backend")
            ctx.on_restore(self._restoring)
        if self.phase == "heal" and ctx.rank == self.rank:
            if ctx.on_heal is None:
                raise ConfigError(
                    "fault.phase=heal fires as a replica group applies the state a live peer sent: it needs strategy=ft"
                )
            ctx.on_heal(self._healing)

    def key(self) -> str:
        where = f".{self.micro_batch}" if self.micro_batch is not None else ""
        return f"{self.name}@{self.step}{where}" + (f"/{self.phase}" if self.phase != "step" else "")

    def where(self) -> str:
        if self.phase == "eval":
            return f"in the evaluation after step {self.step}"
        if self.phase == "restore":
            return f"in the restore of a checkpoint of step {self.step} or later"
        if self.phase == "heal":
            return f"in a heal from a live peer at step {self.step} or later"
        return f"at step {self.step}" + (f", after micro-batch {self.micro_batch}" if self.micro_batch else "")

    def fire(self) -> None:
        _kill(self.where())


class StallAtStep(CrashAtStep):
    """Rank ``rank`` stops responding at the end of step ``step`` (sleeps ``seconds``, once per run dir).
    Hang detection (``trainer.hang``) ends the attempt within a few step-times and a launcher restarts it
    (``trainer.max_restarts``, ``strategy.max_restarts``); with it off, the peers of the stalled rank hit the
    collective timeout (``strategy.timeout``) and the job fails with a clear message instead of hanging."""

    name = "stall"

    def __init__(self, step: int, rank: int = 0, seconds: float = 3600, hold_gil: bool = False, **kw: Any):
        super().__init__(step=step, rank=rank, **kw)
        self.seconds, self.hold_gil = float(seconds), bool(hold_gil)

    def fire(self) -> None:
        log.warning(
            "fault injection: rank %d stalls for %.0f s %s%s",
            self.rank,
            self.seconds,
            self.where(),
            " holding the GIL" if self.hold_gil else "",
        )
        if self.hold_gil:  # libc sleep() through ctypes.PyDLL: a native call that keeps the GIL
            import ctypes

            ctypes.PyDLL(None).sleep(max(1, int(self.seconds)))
        else:
            time.sleep(self.seconds)


class BugAtStep(NoFault):
    """A deterministic bug: rank ``rank`` raises ``ValueError`` at the end of step ``step`` in every attempt that
    reaches it, as a shape bug on an epoch's last, partial batch would (not once per run dir: a restart resumes from
    a checkpoint before it and replays it; what the crash-loop check is tested with). ``phase=heal``
    (``strategy=ft``): in every heal at step ``step`` or later instead, as the group applies the state a peer sent
    (a state it cannot take: its restarts heal again and fail the same way)."""

    name = "bug"

    def __init__(self, step: int, rank: int = 0, replica: int | str | None = None, phase: str = "step"):
        self.replica = replica
        self.step, self.rank = int(step), rank
        if phase not in ("step", "heal"):
            raise ConfigError(f"fault.phase={phase!r}: fault=bug fires at the end of a step or in a heal: step or heal")
        self.phase = phase

    def bind(self, ctx: FaultContext) -> None:
        super().bind(ctx)
        check_step(self.step, ctx)
        if self.phase == "heal" and ctx.rank == self.rank:
            if ctx.on_heal is None:
                raise ConfigError("fault.phase=heal fires as a replica group applies a peer's state: strategy=ft")
            ctx.on_heal(self._healing)

    def after_step(self, step: int) -> None:
        if self.phase == "step" and step == self.step and self.ctx.rank == self.rank:
            raise ValueError(f"expected a batch of 64, got 14 (fault=bug: a deterministic bug at step {step})")

    def _healing(self, step: int) -> None:
        if step >= self.step:
            raise ValueError(f"expected a batch of 64, got 14 (fault=bug: in every heal from step {self.step} on)")


class PreemptAtStep(CrashAtStep):
    """A preemption notice: ``signal`` (SIGTERM, as Kubernetes sends; SIGUSR2 as submitit asks SLURM to send)
    to this process at the end of step ``step``, once per run dir (the handler of ``pitstop.resilience.preempt``
    turns it into: finish the step, save, exit 75)."""

    name = "preempt"

    def __init__(self, step: int, rank: int = 0, signal: str = "SIGTERM", **kw: Any):
        from pitstop.resilience.preempt import parse_signals

        super().__init__(step=step, rank=rank, **kw)
        self.signal = parse_signals([signal])[0]

    def fire(self) -> None:
        log.warning("fault injection: preemption notice (%s) %s", self.signal.name, self.where())
        os.kill(os.getpid(), self.signal)


class RandomFault(NoFault):
    """SIGKILL at a random moment in every attempt, drawn from (``seed``, attempt number): ``mtbf_seconds``, after a
    time ~ Exponential(mean ``mtbf_seconds``) from process start (a timer thread: it can hit any phase); or
    ``mtbf_steps``, at the end of the attempt's K-th step, K ~ Exponential(mean ``mtbf_steps``) rounded up (after
    that step's save started; the same steps on every machine, however fast)."""

    name = "random"

    def __init__(
        self,
        mtbf_seconds: float | None = None,
        seed: int = 0,
        rank: int = 0,
        replica: int | str | None = None,
        mtbf_steps: float | None = None,
    ):
        if (mtbf_seconds is None) == (mtbf_steps is None):
            raise ConfigError(
                f"fault=random needs one of fault.mtbf_seconds (wall clock) and fault.mtbf_steps (steps), got "
                f"{mtbf_seconds} and {mtbf_steps}: set one of them, e.g. fault.mtbf_steps=100"
            )
        self.replica, self.in_steps = replica, mtbf_steps is not None
        self.mtbf, self.seed, self.rank = float(mtbf_steps if self.in_steps else mtbf_seconds), int(seed), rank
        self.timer: threading.Timer | None = None
        self.fails_at: int | None = None  # (mtbf_steps) the step this attempt fails at, once its first step ends

    def bind(self, ctx: FaultContext) -> None:
        super().bind(ctx)
        if ctx.max_restarts < 1:
            raise ConfigError(
                "fault=random kills every attempt eventually; set trainer.max_restarts (e.g. 100) "
                "so the job is restarted and can finish"
            )
        if ctx.rank != self.rank:
            return
        import numpy as np

        self.n = n = count_fired(ctx.run_dir, self.name)
        ttf = float(np.random.default_rng([self.seed, n]).exponential(self.mtbf))
        if self.in_steps:
            self.steps = max(1, math.ceil(ttf))
            log.info("fault=random: attempt %d fails after %d steps (mtbf %g steps)", n + 1, self.steps, self.mtbf)
            return
        delay = max(0.0, ttf - (time.time() - ctx.start_wall))
        log.info("fault=random: attempt %d fails %.1f s after its start (mtbf %.0f s)", n + 1, ttf, self.mtbf)
        run_dir = ctx.run_dir

        def fire() -> None:
            note_fired(run_dir, f"{self.name}#{n}")
            _kill(f"random failure {n + 1}, {ttf:.1f} s after start")

        self.timer = threading.Timer(delay, fire)
        self.timer.daemon = True
        self.timer.start()

    def after_step(self, step: int) -> None:
        if self.in_steps and self.ctx.rank == self.rank:
            self.fails_at = step - 1 + self.steps if self.fails_at is None else self.fails_at
            if step >= self.fails_at:
                note_fired(self.ctx.run_dir, f"{self.name}#{self.n}")
                _kill(f"random failure {self.n + 1}, at step {step}: this attempt's step {self.steps}")

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


class DuringSave(NoFault):
    """SIGKILL while a checkpoint is being written (files on disk, commit marker not yet), once per run dir:
    the first save started at or after step ``step``. Proves a half-written checkpoint never breaks resume."""

    name = "during_save"

    def __init__(self, step: int = 1, rank: int = 0, replica: int | str | None = None):
        self.replica = replica
        self.step, self.rank = int(step), rank
        self.armed = False  # the watcher was started, or the fault fired in an earlier attempt
        self.stop = threading.Event()

    def bind(self, ctx: FaultContext) -> None:
        super().bind(ctx)
        if ctx.checkpointer.root is None:
            raise ConfigError("fault=during_save needs checkpoints: choose a backend, e.g. ckpt=async_dcp")

    def after_step(self, step: int) -> None:
        started = self.ctx.checkpointer.last_started
        if self.armed or self.ctx.rank != self.rank or started is None or started < self.step:
            return
        self.armed = True
        if not count_fired(self.ctx.run_dir, self.name):
            threading.Thread(target=self._watch, daemon=True, name="pitstop-fault").start()

    def _watch(self) -> None:
        from pitstop.ckpt.layout import is_complete, step_dir
        from pitstop.ckpt.storage import dir_bytes
        from pitstop.fsurl import is_url

        ckpt = self.ctx.checkpointer
        pause = 0.02 if is_url(ckpt.root) else 0.001  # (a listing of an object store is a request)
        while not self.stop.is_set():
            path = step_dir(ckpt.root, ckpt.last_started)  # the save in progress (not a purge)
            if not is_complete(path) and dir_bytes(path) > 0:  # (in an object store: a whole file, no marker)
                note_fired(self.ctx.run_dir, self.name)
                _kill(f"during the write of {path.rstrip('/').rsplit('/', 1)[-1]}")
            time.sleep(pause)

    def close(self) -> None:
        self.stop.set()


class DuringHeal(NoFault):
    """``strategy=ft``: SIGKILL as this group starts sending its live state to a group that heals from it (the
    first heal it serves at or after step ``step``), once per run dir. The healing group's transfer fails: it asks
    the next quorum for another peer, or restores from the newest durable checkpoint when none is ahead of it."""

    name = "during_heal"

    def __init__(self, step: int = 1, rank: int = 0, replica: int | str | None = None):
        self.replica = replica
        self.step, self.rank = int(step), rank

    def bind(self, ctx: FaultContext) -> None:
        super().bind(ctx)
        if ctx.on_heal_served is None:
            raise ConfigError("fault=during_heal kills a replica group as a peer heals from it: it needs strategy=ft")
        if ctx.rank == self.rank and not count_fired(ctx.run_dir, self.name):
            ctx.on_heal_served(self._serving)

    def _serving(self, step: int) -> None:
        if step >= self.step and first_time(self.ctx.run_dir, self.name):
            _kill(f"while a peer heals from this group's state at step {step}")
