"""Errors that pitstop reports as one clear line (what is at fault, what to do)."""

import sys
from typing import NoReturn


def stop_command(message: str) -> NoReturn:
    """End the command with ``error: <message>`` and exit status 2 from inside a Hydra callback: Hydra turns any
    exception a callback raises into a warning and goes on (writing the run dir), but lets ``SystemExit`` through."""
    print(f"error: {message}", file=sys.stderr)
    sys.stderr.flush()
    raise SystemExit(2)


class PitstopError(Exception):
    """Base class: the entry points print ``error: <message>`` and exit with status 2."""


class ConfigError(PitstopError):
    """A configuration value is invalid; raised before training starts."""


class CrashLoop(PitstopError):
    """An attempt failed the same way as the one before it, with no progress between: a restart would replay it."""


class Unrecoverable(PitstopError):
    """The run stopped itself for a reason no restart can fix (its instability budgets are used up, nothing to roll
    back to): exit status 2, never restarted by a launcher."""


class NoRollbackPoint(Unrecoverable):
    """A rollback found no verified checkpoint at or before the step it must go back to; nothing was deleted."""


class DataError(PitstopError):
    """The data set is missing, corrupt or inconsistent with its index."""


class CheckpointError(PitstopError):
    """A checkpoint could not be written or read, or does not match this run."""


class FingerprintMismatch(CheckpointError):
    """The checkpoint was written by a run with another data set, seed, model or batch size."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint's bytes are not what its writer recorded (a checksum or length differs, a file or the checksum
    manifest is missing), or its metadata would construct something other than plain checkpoint state."""


class Interrupt(PitstopError):
    """Raised into the main thread from outside what it is doing (the hang watchdog): wherever it lands (inside a
    save's write, a wait for staging, a restore's read) it is never that operation's failure, and passes through."""
