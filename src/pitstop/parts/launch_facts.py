"""What one attempt knows of its launch: one typed value, made where the process starts and handed down.

An attempt is one run of the training loop in one process: the first, or one restarted after a failure by
pitstop's supervisor, torch's elastic agent, torchrun or SLURM.  How it was launched decides a few things
below the launcher: where its program start began (the ledger's first bucket), whether a restart is
automatic, whether a hang exits for a launcher to restart it, who is told of a preemption notice, and who
writes down why it failed.  Those facts are a :class:`LaunchFacts`, built once at the entry of the process
(:func:`facts_from_env` for a process that a launcher other than pitstop's started, the launcher's own
arguments for pitstop's supervisor and agent) and passed to the :class:`~pitstop.train.runner.Runner`; no module
below reads them from the environment.

Nothing here imports torch.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class LaunchFacts:
    program_start: float  # wall clock at which this attempt's program start began (its process's, or the job's)
    launched: bool = False  # a launcher restarts this process when it exits (supervisor, agent, torchrun, SLURM)
    supervised: bool = False  # pitstop's supervisor started it: the attempt writes down why it failed
    restart: int = 0  # 0 for a job's first attempt; > 0 for an automatic restart
    start_method: str | None = None  # "forkserver": a warm attempt (a fork of a pre-imported server); "spawn"
    agent_pid: int | None = None  # pitstop's launching process of an elastic job: told of a preemption notice
    health_seconds: float = 0.0  # of the program start: the node's health check before this attempt (ledger `health`)
    matmul_seconds: float | None = None  # that check's matmul: put on record once the attempt's setup is done


_import_seconds: float | None = None


def job_start() -> float:
    """When a job launched from this process started: the process's start for its first job (its imports are
    the job's program start); a later job of an in-process sweep is charged the same imports (every job of a
    sweep is accounted alike)."""
    global _import_seconds
    if _import_seconds is None:
        _import_seconds = max(0.0, time.time() - process_start_wall())
    return time.time() - _import_seconds


def facts_from_env(env: Mapping[str, str]) -> LaunchFacts:
    """A process that is one rank of torchrun, SLURM or torch's elastic agent (``RANK`` set), or one that a
    person started: what the environment such launchers set says (``TORCHELASTIC_RESTART_COUNT``)."""
    return LaunchFacts(
        program_start=job_start(),
        launched="RANK" in env,
        restart=int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
    )


def process_start_wall() -> float:
    """When this process started (wall clock), so imports count as start-up; now if unknown. The kernel gives the
    start in clock ticks since boot; its age is read against the boot-time clock (``/proc/stat``'s ``btime`` is
    whole seconds: up to 1 s off, 0.6 s too early on one machine here)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age if 0 <= age < 3600 else time.time()
    except (OSError, ValueError, IndexError, AttributeError):  # (no /proc, no CLOCK_BOOTTIME: not Linux)
        return time.time()


def error_file(run_dir: str) -> str:
    """Where a supervised attempt leaves the one line that says why it ended (read by the supervisor)."""
    return os.path.join(run_dir, ".last_error")


def record_error(run_dir: str, text: str) -> None:
    with open(error_file(run_dir), "w") as f:
        f.write(text)
