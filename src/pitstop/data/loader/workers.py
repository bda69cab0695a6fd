"""Data workers' lifecycle: each worker dies with its trainer (a killed trainer leaves no orphan reading shards)."""

from __future__ import annotations

import logging
import os
import signal


from pitstop.notices import NOTICES

log = logging.getLogger("pitstop.data.loader")

# A data worker, the workers' fork server and multiprocessing's resource tracker ignore the scheduler's notices
# (pitstop.notices); by default each of them would end (the tracker then comes back and prints KeyError
# tracebacks for the semaphores it no longer knows), and a fork server forked from a trainer would run the handler
# the trainer had at that instant (submitit's requeue, a second time).
# What the hang watchdog sends a data worker to have its threads' stacks written to stderr: a real-time signal,
# which no scheduler sends (SIGUSR2 was, until it met submitit's notices).
STACKS_SIGNAL = int(signal.SIGRTMIN) + 2 if hasattr(signal, "SIGRTMIN") else int(signal.SIGUSR2)


def worker_init(worker_id: int, parent: int, trainer: int) -> None:
    """A worker is not the trainer: it must not keep signal handlers of the trainer's (a preemption notice
    caught and ignored by a worker keeps it alive after its loader is gone; SIGTERM ends it), it ignores the
    scheduler's notices meant for the trainer (:data:`NOTICES`), it ends when the ``trainer`` process does, and
    on :data:`STACKS_SIGNAL` it writes its threads' stacks to stderr (the hang watchdog asks for them).

    Ending with the trainer: torch's own check compares the worker's parent pid with the one it saw at its
    start, but that parent is the fork server (``parent``), which outlives a killed trainer while it has
    children; a worker of a trainer killed by SIGKILL or the OOM killer would wait for work forever and hold
    the job's stdout and stderr open (a supervisor's or CI's pipe never ends). So a thread watches the trainer
    (a pidfd on Linux) and exits the worker when it is gone, also if it was gone before the worker started;
    and the kernel kills the worker if its parent dies (PR_SET_PDEATHSIG)."""
    import faulthandler

    for sig in (signal.SIGTERM, signal.SIGURG):  # a preemption notice to the whole job, the watchdog's wake-up
        signal.signal(sig, signal.SIG_DFL)
    for sig in NOTICES:
        signal.signal(sig, signal.SIG_IGN)
    _write_where(trainer)
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    _die_with_parent()
    if os.getppid() != parent:
        os._exit(1)
    _exit_with(trainer)


def _write_where(pid: int) -> None:
    """This worker's stdout and stderr go where process ``pid``'s go now (as a fork of it would), not where
    the fork server's went when it started (a log file or a test's capture since replaced)."""
    for fd in (1, 2):
        try:
            target = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:  # not Linux, or not reopenable (a socket): keep the fork server's
            continue
        os.dup2(target, fd)
        os.close(target)


def _exit_with(pid: int) -> None:
    """Exit this process (at once, status 1) when process ``pid`` ends; now if it already has."""
    import select
    import threading
    import time

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # no pidfds here: ask once a second
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])  # readable once the process has ended
        else:
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                except PermissionError:
                    pass
                time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="pitstop-exit-with-trainer", daemon=True).start()


def _die_with_parent() -> None:
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
