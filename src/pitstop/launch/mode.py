"""How ``recipe.train`` runs a job: a pure function of the config and the environment (:func:`launch_mode`)."""

from __future__ import annotations

from enum import Enum
from typing import Mapping


class LaunchMode(str, Enum):
    IN_PROCESS = "in_process"  # one rank, run right here
    SUPERVISED = "supervised"  # one rank in a child process, started again when it dies (trainer.max_restarts)
    ELASTIC = "elastic"  # strategy.nproc_per_node ranks, started (and restarted) by torch's elastic agent
    REPLICAS = "replicas"  # strategy=ft: a Lighthouse and strategy.replicas groups, each restarted alone
    REPLICA_GROUP = "replica_group"  # strategy=ft with strategy.replica_id=K: group K of a job on several machines
    CHILD = "child"  # this process already is one rank or attempt that a launcher started (torchrun,
    # SLURM, the elastic agent, pitstop's supervisor): run it, restarts are theirs


def started_by_launcher(env: Mapping[str, str]) -> bool:
    """This process is one rank that a launcher (torchrun, SLURM, torch's elastic agent) started: ``RANK`` is
    set. (pitstop's own supervisor hands its attempts :class:`LaunchFacts` instead of running this entry.)"""
    return "RANK" in env


def launch_mode(nproc_per_node: int, max_restarts: int, env: Mapping[str, str], max_nodes: int = 1) -> LaunchMode:
    """How ``recipe.train`` runs a job of one group of ranks: a pure function of the config and the environment."""
    if started_by_launcher(env):
        return LaunchMode.CHILD
    if nproc_per_node > 1 or max_nodes > 1:
        return LaunchMode.ELASTIC
    return LaunchMode.SUPERVISED if max_restarts > 0 else LaunchMode.IN_PROCESS
