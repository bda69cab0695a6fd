"""Preemption notices: a signal that says the job will be killed soon (Kubernetes and spot instances send
SIGTERM, then SIGKILL after a grace period; SLURM sends ``--signal=USR1@90`` seconds before the time limit).

On a notice the loop finishes its current step, then (every rank at the same step) saves right away if the
measured cost of a save fits ``trainer.preempt_grace_seconds`` — else it keeps the newest complete checkpoint
and says so — waits until the save is durable, flushes logs and the ledger, and exits with status
``PREEMPTED_EXIT`` (75, EX_TEMPFAIL): *requeue me*, not *I failed*.  Running the same command again resumes
exactly where it stopped.  If a launcher had its own handler for that signal (submitit's checkpoint-and-requeue
for SIGUSR2 under ``hydra/launcher=slurm``), it is called after the save is durable, so the launcher requeues
the job as it would have, and the requeued job resumes from that save.
"""

from __future__ import annotations

import _thread
import atexit
import logging
import os
import queue
import signal
import threading
from collections.abc import Iterable
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable

from pitstop.errors import ConfigError

if TYPE_CHECKING:
    from pitstop.ckpt.contract import Checkpointer, Target
    from pitstop.goodput.ledger import Ledger
    from pitstop.resilience.watchdog import Watchdog

log = logging.getLogger("pitstop.resilience.preempt")

PREEMPTED_EXIT = 75  # EX_TEMPFAIL (sysexits.h): temporary failure, try again


class Preempted(Exception):
    """The job stopped on a preemption notice; its state is saved (or the newest checkpoint kept)."""

    exit_code = PREEMPTED_EXIT


class _HandlerLog:
    """Lines that signal handlers log, written by a thread of their own.  A Python signal handler runs between two
    bytecodes of the main thread, which may be in the middle of a logging call to the same file: a second write
    into that ``BufferedWriter`` raises ``RuntimeError: reentrant call`` and logging prints its traceback instead
    of the line (seen under SLURM, whose ``scancel --signal`` reaches a launcher twice).  A handler only puts the
    line on a ``SimpleQueue`` (its ``put`` is reentrant-safe); the thread takes the handler's lock like any other
    thread, after the main thread's write.  The thread runs while handlers of ours are installed (it would keep a
    later fork of this process from being a plain one: see ``pitstop.data.loader.server``); lines still queued
    when it stops, or at exit, are written then."""

    _STOP = ("", ())

    def __init__(self) -> None:
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        self.owner: tuple[int, threading.Thread] | None = None
        self.users = 0  # installed handler sets (in this process)
        atexit.register(self.drain)

    def start(self) -> None:
        """Called where handlers are installed (not in a handler: starting a thread takes locks)."""
        if self.owner is None or self.owner[0] != os.getpid() or not self.owner[1].is_alive():
            thread = threading.Thread(target=self._run, name="pitstop-signal-log", daemon=True)
            thread.start()
            self.owner, self.users = (os.getpid(), thread), 0
        self.users += 1

    def stop(self) -> None:
        """Called where handlers are restored: the last one stops the thread once it has written its lines."""
        self.users -= 1
        if self.users <= 0 and self.owner is not None and self.owner[0] == os.getpid():
            thread, self.owner = self.owner[1], None
            self.lines.put(self._STOP)
            thread.join(timeout=2)
        self.drain()

    def warning(self, msg: str, *args: object) -> None:
        if self.owner is None or self.owner[0] != os.getpid():
            log.warning(msg, *args)  # (no handler of ours is installed in this process: called directly)
        else:
            self.lines.put((msg, args))

    def resignal(self, signum: int, handler: Callable[[int, FrameType | None], None]) -> None:
        """Deliver ``signum`` to the main thread again shortly, from the thread, if ``handler`` still handles it."""
        self.lines.put((None, (signum, handler)))

    def _run(self) -> None:
        while (item := self.lines.get()) is not self._STOP:
            self._write(*item)

    def _write(self, msg: str | None, args: tuple) -> None:
        if msg is None:
            threading.Event().wait(0.05)
            if signal.getsignal(args[0]) == args[1]:
                # (as if the signal came again, to its Python handler only: a default action, had ours just been
                # put back, is not taken)
                _thread.interrupt_main(args[0])
        else:
            log.warning(msg, *args)

    def drain(self) -> None:
        while True:
            try:
                item = self.lines.get_nowait()
            except queue.Empty:
                return
            if item is not self._STOP and item[0] is not None:
                log.warning(item[0], *item[1])


_handler_log = _HandlerLog()
_LOGGING = os.path.dirname(logging.__file__) + os.sep


def _inside_logging(frame: FrameType | None) -> bool:
    """Whether the interrupted main thread is in a logging call (which turns any exception into a printed
    traceback: an exception raised by a handler there would be swallowed)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith(_LOGGING):
            return True
        frame = frame.f_back
    return False


def parse_signals(names: Iterable[str] | None) -> list[signal.Signals]:
    out = []
    for name in list(names or []):
        key = str(name).upper()
        key = key if key.startswith("SIG") else f"SIG{key}"
        if key not in signal.Signals.__members__ or key in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(
                f"trainer.preempt_signals: {name!r} is not a signal that can be caught; use e.g. [SIGTERM, SIGUSR1]"
            )
        out.append(signal.Signals[key])
    return out


class _Handlers:
    """Signal handlers for ``self.signals`` (main thread only), ``_on_signal`` each; ``forward()`` hands the
    notice received to the handler each replaced, ``close()`` restores them."""

    signals: list[signal.Signals]
    received: signal.Signals | None
    _previous: dict[signal.Signals, Any]
    _logging = False  # (this set started the signal-log thread: close() stops it)

    def _install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            _handler_log.start()
            self._logging = True
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        self._replaced = dict(self._previous)  # (for forward(), also once close() has put them back)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        raise NotImplementedError

    def forward(self) -> None:
        """Hand the notice on to the handler that was installed before ours, once our save is durable: under
        submitit (``hydra/launcher=slurm``) that is its checkpoint-and-requeue handler for SIGUSR2, which
        requeues the job and exits.  Nothing happens when there was none (the default action is not taken)."""
        if self.received is None:
            return
        previous = getattr(self, "_replaced", {}).get(self.received)
        if callable(previous) and previous not in (signal.default_int_handler,):
            log.warning(
                "handing the %s notice on to the handler installed before pitstop's (%s)",
                self.received.name,
                getattr(previous, "__qualname__", previous),
            )
            previous(int(self.received), None)

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self._logging:  # (a forked attempt ends with os._exit: no atexit)
            self._logging = False
            _handler_log.stop()


class PreemptionNotice(_Handlers):
    """Installs the handlers (main thread only) and remembers the first notice; ``close()`` restores them."""

    def __init__(self, signals: Iterable[str] | None, grace_seconds: float, agent_pid: int | None = None):
        """``agent_pid``: the launching process of pitstop's elastic job (``LaunchFacts.agent_pid``)."""
        self.signals, self.grace = parse_signals(signals), float(grace_seconds)
        self.received: signal.Signals | None = None
        self._agent = agent_pid
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> Callable[[], None]:
        # A rank of pitstop's elastic launch tells the launching process of a notice that may have reached it
        # alone (SLURM's --signal USR1/USR2): the notice becomes the whole job's (the agent hands it to every
        # rank and waits for their saves), not one rank's exit 75 that the agent would restart in place.
        self._install()
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_sigmask"):
            # (a process forked from a server that blocks SIGUSR1/SIGUSR2, the elastic agent's: the notices it got
            # meanwhile are delivered now, to these handlers; any other signal's mask is left as the launcher set it)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1, signal.SIGUSR2} & set(self.signals))
        return self.close

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
            _handler_log.warning(
                "preemption notice (%s): finishing this step, then saving and exiting", self.received.name
            )
            # (Not SIGTERM or SIGINT: with those the agent itself stops ranks, e.g. the peers of a failed rank;
            # a scheduler's SIGTERM reaches every process of the job, the agent's too.)
            if (
                self._agent is not None
                and self._agent != os.getpid()
                and self.received not in (signal.SIGTERM, signal.SIGINT)
            ):
                try:
                    os.kill(self._agent, signum)
                except OSError:  # (gone, or not ours to signal: the ranks still save and exit 75)
                    pass
        else:
            _handler_log.warning("another %s: already stopping for a preemption notice", signal.Signals(signum).name)


class JobNotice(_Handlers):
    """The launching process of an elastic job (torch's elastic agent runs in it): the first preemption notice
    it gets — from the scheduler, or handed on by a rank — stops the agent, which gives every rank the same
    signal (a notice: they save and exit 75) and waits ``trainer.preempt_grace_seconds`` + 30 s for them.
    Later notices are only logged (another would cut that wait short)."""

    def __init__(self, signals: list[signal.Signals], exception: Callable[[str, signal.Signals], BaseException]):
        self.signals, self.exception = signals, exception
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> "JobNotice":
        self._install()
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_sigmask"):
            # (an agent started with the notices blocked, a replica group's: one that came meanwhile is its now)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1, signal.SIGUSR2} & set(self.signals))
        return self

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            _handler_log.warning(
                "another %s: the ranks are already saving for a preemption notice", signal.Signals(signum).name
            )
            return
        if _inside_logging(frame):  # (logging would print the exception and go on: the notice would be lost)
            _handler_log.resignal(signum, self._on_signal)
            return
        self.received = signal.Signals(signum)
        _handler_log.warning("preemption notice (%s): every rank saves and stops", self.received.name)
        raise self.exception(f"preemption notice ({self.received.name})", self.received)


class LauncherNotice(_Handlers):
    """A launcher of attempt processes (pitstop's supervisor, the replica groups' launcher): a scheduler's notice
    (SLURM's ``scancel --signal`` or ``--signal=USR1@N`` reach every process of the job step, the launcher's too)
    is handed to the attempts it runs, once: each finishes its step, saves and exits 75, and the launcher, which
    the signal would otherwise have killed, waits for them and starts no new attempt (``received``). SIGTERM and
    SIGINT keep their own path (the launcher stops and terminates its attempts, a notice too)."""

    def __init__(self, signals: Iterable[str] | None, children: Callable[[], list]):
        """``children()``: the attempt processes running now."""
        self.signals = [s for s in parse_signals(signals) if s not in (signal.SIGTERM, signal.SIGINT)]
        self.children = children
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> "LauncherNotice":
        self._install()
        return self

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.hand_on(signal.Signals(signum), "preemption notice")

    def hand_on(self, sig: signal.Signals, why: str) -> None:
        """Give ``sig`` (a notice) to every running attempt, once, and start no new one (also from a launcher's
        thread: e.g. fewer replica groups are left than can step)."""
        if self.received is not None:
            return  # (the attempts have it: another would only be logged by each)
        self.received = sig
        _handler_log.warning("%s (%s): the attempts save and stop; no new attempt starts", why, sig.name)
        signum = int(sig)
        for child in list(self.children()):
            if child.is_alive() and child.pid is not None:
                try:
                    os.kill(child.pid, signum)
                except OSError:  # (it has just ended)
                    pass


def save_for_notice(
    ckpt: Checkpointer, target: Target, step: int, grace: float, why: str, ledger: Ledger, watchdog: Watchdog
) -> None:
    """After a notice every rank is here after the same step: save this step if a save (as measured, start to
    durable) fits the grace period and none is under way, then wait until the newest save is durable (or has
    failed, per ``ckpt.on_error``) before the process goes."""
    took = float(ckpt.stats().get("total_seconds_mean") or 0.0)
    under_way = ckpt.last_durable == step  # (a local-tier save of this step is not enough: the node may go)
    saving = ckpt.root is not None and (under_way or took <= grace)  # this step's durable save
    if ckpt.root is None:
        log.warning("preempted (%s) at step %d: no checkpoints (ckpt=none), the next run starts over", why, step)
    elif under_way:
        log.warning("preempted (%s) at step %d: the save of this step is already under way", why, step)
    elif took > grace:
        log.warning(
            "preempted (%s) at step %d: a save takes ~%.1f s, more than trainer.preempt_grace_seconds=%g; "
            "keeping the newest checkpoint (durable tier: step %s, or the one in flight if it completes)",
            why,
            step,
            took,
            grace,
            ckpt.last_committed,
        )
    else:
        with watchdog.phase("checkpoint"):
            ledger.add("checkpoint", ckpt.maybe_save(target, step, force=True).blocked)
    with ledger.measure("checkpoint"), watchdog.phase("checkpoint"):
        ckpt.wait()  # (a failed save raises here, or per ckpt.on_error=warn is logged and not committed)
    if saving:
        if ckpt.last_committed == step:  # said once it is durable, not when it started
            log.warning("preempted (%s) at step %d: saved it", why, step)
        else:
            log.error("preempted (%s) at step %d: its save failed; the newest complete checkpoint stays", why, step)
