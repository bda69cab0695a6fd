"""``hydra/launcher=slurm``: a sweep whose jobs cannot reach SLURM stops before it submits anything, in one line.

Without this, submitit's ``sbatch`` call fails only once the sweep starts, after its own 60 s of retries, with a
multi-line ``FailedJobError`` traceback.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from pitstop.errors import ConfigError, stop_command

WHERE = "hydra/launcher=slurm: SLURM is not reachable from here"


def check_reachable(timeout: float = 10.0) -> None:
    """Raise a one-line :class:`ConfigError` unless ``sbatch`` is on PATH and ``sinfo`` answers."""
    if shutil.which("sbatch") is None:
        raise ConfigError(
            f"{WHERE} (no sbatch on PATH): run the sweep where SLURM's commands are (a login node), or use "
            "hydra/launcher=submitit_local on this machine"
        )
    try:
        p = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        said = (e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or "").strip()
        raise ConfigError(
            f"{WHERE}: sinfo did not answer within {timeout:.0f} s"
            + (f" ({said.splitlines()[0]})" if said else "")
            + ": is slurmctld up, and SLURM_CONF right?"
        ) from None
    except OSError as e:
        raise ConfigError(f"{WHERE}: sinfo could not run ({e})") from None
    if p.returncode != 0:
        said = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
        raise ConfigError(f"{WHERE}: sinfo says '{said}': is slurmctld up, and SLURM_CONF right?")


class SlurmReachable(Callback):
    """Registered in ``conf/train.yaml`` under ``hydra.callbacks``; acts only in a sweep on submitit's SLURM
    launcher, before the first job is submitted."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if str(config.hydra.launcher.get("_target_") or "").endswith(".SlurmLauncher"):
            try:
                check_reachable()
            except ConfigError as e:  # (raised, Hydra would warn and submit anyway)
                stop_command(str(e))
