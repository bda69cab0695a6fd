"""``fault=bad_node``: one node of the job is bad for the whole run, to test that it is found and not used.

``how=fail``: every attempt on ``fault.node`` fails at start (as its fault is bound, in the Runner's setup): the
launchers record each failed attempt on that node (``RUN_DIR/nodes.json``) and exclude it after
``node_book.FAILURES_TO_EXCLUDE``. ``how=unwritable``: the node's checkpoint dir cannot be written; the launcher's
health check (``pitstop.launch.health``) probes it through :func:`unwritable` and the node is not used.

A node the job does not have is refused before anything runs (:func:`check_node`, called by the launcher).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

from pitstop.errors import ConfigError
from pitstop.resilience.fault import FaultContext, NoFault
from pitstop.resilience.node_book import node_name

log = logging.getLogger("pitstop.resilience.fault")


class BadNode(NoFault):
    name = "bad_node"

    def __init__(self, node: str, how: str = "fail", replica: int | str | None = None):
        super().__init__(replica)
        self.node, self.how = str(node), how

    def bind(self, ctx: FaultContext) -> None:
        super().bind(ctx)
        if self.how == "fail" and node_name() == self.node:
            log.warning("fault injection: node %s is bad (fault=bad_node): this attempt fails at start", self.node)
            raise RuntimeError(f"fault=bad_node: node {self.node} fails every attempt at start")


def unwritable(fault: Any, node: str) -> bool:
    """Whether ``fault`` (the config's ``fault`` section) makes ``node``'s checkpoint dir unwritable."""
    return bool(
        fault is not None
        and str(fault.get("_target_", "")).endswith(".BadNode")
        and fault.get("how") == "unwritable"
        and str(fault.get("node")) == node
    )


def check_node(fault: Any, max_nodes: int, ckpt: Any = None, env: Mapping[str, str] = os.environ) -> None:
    """Refuse a ``fault.node`` (``fault=bad_node``, ``fault=lose_node``) the job does not have: under SLURM the
    allocation's node list says which nodes it has; elsewhere a job of one node has this node alone (a job of several
    nodes cannot tell: any other name may be one of its nodes). ``how=unwritable`` needs a checkpoint dir (``ckpt``,
    the config's section: not ``ckpt=none``)."""
    if fault is None or not str(fault.get("_target_", "")).endswith((".BadNode", ".NodeLoss")):
        return  # (fault=lose_node names its node the same way)
    node = str(fault.get("node"))
    if fault.get("how") == "unwritable" and (ckpt is None or str(ckpt.get("_target_", "")).endswith(".NoCheckpoint")):
        raise ConfigError(
            "fault.how=unwritable makes the node's checkpoint dir unwritable, but ckpt=none has none: choose a ckpt "
            "backend (ckpt=sync_save, ckpt=async_dcp, ...)"
        )
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if nodelist:
        have = expand_nodelist(nodelist)
        if node not in have:
            raise ConfigError(
                f"fault.node={node} is not a node of this SLURM job ({', '.join(have)}); name one of them"
            )
    elif max_nodes == 1 and node != node_name(env):
        raise ConfigError(
            f"fault.node={node} but this one-node job runs on node {node_name(env)} (PITSTOP_NODE_NAME, "
            f"SLURMD_NODENAME or the host name); name that node"
        )


def expand_nodelist(nodelist: str) -> list[str]:
    """A SLURM node list's hosts, as ``scontrol show hostnames`` lists them: ``n[1-2],gpu07`` -> n1, n2, gpu07."""
    import re

    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip()):
        prefix, ranges = m.group(1), m.group(2)
        if not ranges:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                hosts.append(prefix + lo)
                continue
            for i in range(int(lo), int(hi) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}")
    return hosts
