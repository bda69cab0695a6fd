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

import dataclasses
import logging
import os

from omegaconf import DictConfig

from pitstop.launch import health, vetting
from pitstop.launch.attempt import log_to
from pitstop.launch.elastic import elastic
from pitstop.launch.mode import LaunchMode
from pitstop.launch.plan import plan
from pitstop.launch.supervisor import supervise
from pitstop.parts.launch_facts import facts_from_env
from pitstop.resilience.bad_node import check_node
from pitstop.resilience.node_book import node_name


def run(cfg: DictConfig, run_dir: str) -> dict:
    """Train the composed config ``cfg`` in ``run_dir`` and return its summary (``RUN_DIR/summary.json``'s content).

    What ``python -m recipe.train`` calls once Hydra has composed the config and chosen the run dir. It plans how
    the job runs from the config and the environment (``pitstop.launch.plan``): in this process, under a supervisor
    that restarts attempts (``trainer.max_restarts``), one process per rank through torch's elastic agent, or
    replica groups (``strategy=ft``); a job started by ``torchrun`` or SLURM is one rank of it. A config error
    raises :class:`~pitstop.errors.ConfigError` before anything starts; a run that fails raises a
    :class:`~pitstop.errors.PitstopError` naming what failed; a preempted one (saved, to be requeued) raises
    ``pitstop.resilience.preempt.Preempted``. Calling it from Python (a notebook, a test) needs a config made by
    :func:`pitstop.config.compose`."""
    from pitstop.data.loader.server import quiet_resource_tracker

    # Ranks and attempts use the resource tracker this process starts: their data workers' semaphores too.
    quiet_resource_tracker()
    job = plan(cfg, os.environ)
    check_node(cfg.get("fault"), job.nodes[1], cfg.get("ckpt"))  # (fault=bad_node: a node the job has)
    if job.mode == LaunchMode.REPLICAS:  # strategy=ft: this command starts the Lighthouse and the groups
        from pitstop.launch.replicas import run_replicas

        return run_replicas(cfg, job, run_dir)
    if job.mode == LaunchMode.REPLICA_GROUP:  # one group of a job started on several machines: restarted alone
        from pitstop.launch.replicas import run_group

        return run_group(cfg, job, run_dir)
    if job.mode == LaunchMode.SUPERVISED:
        return supervise(cfg, job, run_dir)
    if job.mode == LaunchMode.ELASTIC:
        return elastic(cfg, job, run_dir)
    from pitstop.train.runner import Runner

    from pitstop.resilience.node_book import EXCLUDED_EXIT, REFORM_EXIT, NodeExcluded
    from pitstop.train.straggler import Reform

    if job.mode == LaunchMode.CHILD:  # a rank torchrun/SLURM started: train.log or rankR.log
        os.makedirs(run_dir, exist_ok=True)
        log_to(run_dir, int(os.environ["RANK"]))
    facts = facts_from_env(os.environ)
    # This process is the attempt (no launcher of pitstop's restarts it): it checks its node itself, the node's first
    # local rank running the health check.
    node = node_name()
    first = int(os.environ.get("LOCAL_RANK", "0") or 0) == 0
    check = (lambda: health.checks(cfg, run_dir, node)) if first and job.trainer.health.enabled else None
    seconds, matmul = vetting.vet(run_dir, job.nodes, job.nodes_text, check, node)
    try:
        return Runner(cfg, run_dir, dataclasses.replace(facts, health_seconds=seconds, matmul_seconds=matmul)).run()
    except (NodeExcluded, Reform) as e:  # (this node is excluded, or the job re-forms without one: the launcher's cue)
        logging.getLogger("pitstop").warning("%s", e)
        raise SystemExit(EXCLUDED_EXIT if isinstance(e, NodeExcluded) else REFORM_EXIT) from None
