"""How ``recipe.train`` runs a job: a pure function of the config and the environment (:func:`launch_mode`),
and the config keys it reads."""

from __future__ import annotations

from enum import Enum
from typing import Mapping

from omegaconf import DictConfig, OmegaConf

from pitstop.config import checks
from pitstop.errors import ConfigError


def nnodes(cfg: DictConfig) -> tuple[int, int]:
    """``strategy.nnodes``: N or "MIN:MAX" (elastic: the job runs on any number of nodes in the range)."""
    value = OmegaConf.select(cfg, "strategy.nnodes", default=1)
    text = str(value)
    try:
        lo, _, hi = text.partition(":")
        low, high = int(lo), int(hi or lo)
    except ValueError:
        low = high = 0
    if isinstance(value, bool) or low < 1 or high < low:
        raise ConfigError(f"strategy.nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {value!r}")
    return low, high


def nproc(cfg: DictConfig) -> int:
    n = OmegaConf.select(cfg, "strategy.nproc_per_node", default=1)
    return checks.integer("strategy.nproc_per_node", n)


class LaunchMode(str, Enum):
    IN_PROCESS = "in_process"  # one rank, run right here
    SUPERVISED = "supervised"  # one rank in a child process, started again when it dies (trainer.max_restarts)
    ELASTIC = "elastic"  # strategy.nproc_per_node ranks, started (and restarted) by torch's elastic agent
    CHILD = "child"  # this process already is one rank or attempt that a launcher started (torchrun,
    # SLURM, the elastic agent, pitstop's supervisor): run it, restarts are theirs


def started_by_launcher(env: Mapping[str, str]) -> bool:
    """This process is one rank that a launcher (torchrun, SLURM, torch's elastic agent) started: ``RANK`` is
    set. (pitstop's own supervisor hands its attempts :class:`LaunchFacts` instead of running this entry.)"""
    return "RANK" in env


def launch_mode(nproc_per_node: int, max_restarts: int, env: Mapping[str, str], max_nodes: int = 1) -> LaunchMode:
    """How ``recipe.train`` runs the job: a pure function of the config and the environment."""
    if started_by_launcher(env):
        return LaunchMode.CHILD
    if nproc_per_node > 1 or max_nodes > 1:
        return LaunchMode.ELASTIC
    return LaunchMode.SUPERVISED if max_restarts > 0 else LaunchMode.IN_PROCESS


def max_restarts(cfg: DictConfig) -> int:
    restarts = OmegaConf.select(cfg, "trainer.max_restarts", default=0) or 0
    return checks.integer("trainer.max_restarts", restarts, at_least=0)
