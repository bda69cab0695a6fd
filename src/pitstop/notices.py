"""The notices a scheduler sends to every process of a job step, and how a process started by pitstop is kept out
of their way.

SLURM's ``--signal=USR1@90`` and submitit's ``scancel --signal=USR2`` reach every process of the step: the trainer,
its data workers and their fork server, multiprocessing's resource tracker, DCP's checkpoint process. They are the
trainer's alone; by default each of the others would end (a checkpoint process in the middle of the very save the
notice asked for). A process started inside :func:`notices_blocked` (fork + exec, or a thread that later starts
one) inherits them blocked, so a notice never reaches it.
"""

from __future__ import annotations

import contextlib
import signal
from typing import Iterator

NOTICES = (signal.SIGUSR1, signal.SIGUSR2)


@contextlib.contextmanager
def notices_blocked() -> Iterator[None]:
    """Block :data:`NOTICES` in this thread for the time of the block: a process or thread started inside inherits
    them blocked, so a notice never reaches it; this process gets any that came meanwhile after it."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, NOTICES)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
