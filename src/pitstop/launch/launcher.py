"""One command starts every rank: compose once, resolve one run dir, then launch through torch's elastic agent.

    python -m recipe.train strategy=ddp strategy.nproc_per_node=2

The parent (the Hydra job) validates the config, resolves it to YAML and calls ``elastic_launch``; each
rank rebuilds the same config from that YAML and runs the :class:`~pitstop.train.runner.Runner` in the shared
run dir. Only rank 0 logs to ``train.log``, the console, the tracker and the progress bar; rank R logs to
``rank{R}.log``. With ``strategy.max_restarts=N`` the agent restarts all ranks when one dies, and they
auto-resume from the newest complete checkpoint. Under ``torchrun``/SLURM (``RANK`` already set) nothing
is spawned: this process is one of the ranks.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

from pitstop.launch.attempt import log_to
from pitstop.launch.elastic import elastic
from pitstop.launch.mode import LaunchMode, launch_mode, max_restarts, nnodes, nproc
from pitstop.launch.supervisor import supervise
from pitstop.parts.launch_facts import facts_from_env


def run(cfg: DictConfig, run_dir: str) -> dict:
    from pitstop.data.loader.server import quiet_resource_tracker

    # Ranks and attempts use the resource tracker this process starts: their data workers' semaphores too.
    quiet_resource_tracker()
    if OmegaConf.select(cfg, "strategy.replicas") is not None and "RANK" not in os.environ:  # strategy=ft
        if OmegaConf.select(cfg, "strategy.replica_id") is None:  # this command starts the Lighthouse and groups
            from pitstop.launch.replicas import run_replicas

            return run_replicas(cfg, run_dir)
        k = int(cfg.strategy.replica_id)  # one group of a job started on several machines: restarted alone
        from pitstop.launch.replicas import check_config, replica_dir

        check_config(cfg)  # (this machine's room for the group: elastic's own check; one rank always fits)
        if int(cfg.strategy.nproc_per_node) > 1:  # its ranks under torch's elastic agent, restarted together
            return elastic(cfg, replica_dir(run_dir, k), int(cfg.strategy.nproc_per_node), 1, 1)
        return supervise(cfg, replica_dir(run_dir, k), int(cfg.strategy.max_restarts))
    n, restarts, (min_nodes, max_nodes) = nproc(cfg), max_restarts(cfg), nnodes(cfg)
    mode = launch_mode(n, restarts, os.environ, max_nodes)
    if mode == LaunchMode.SUPERVISED:
        return supervise(cfg, run_dir, restarts)
    if mode in (LaunchMode.IN_PROCESS, LaunchMode.CHILD):
        from pitstop.train.runner import Runner

        if mode == LaunchMode.CHILD and "RANK" in os.environ:  # a rank torchrun/SLURM started: train.log or rankR.log
            os.makedirs(run_dir, exist_ok=True)
            log_to(run_dir, int(os.environ["RANK"]))

        return Runner(cfg, run_dir, facts_from_env(os.environ)).run()
    return elastic(cfg, run_dir, n, min_nodes, max_nodes)
