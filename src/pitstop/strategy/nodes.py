"""Several nodes, one job: what every rank must agree on before the first step.

Each node starts its own agent (``torchrun``, SLURM, a Kubernetes pod) with its own command line, so
nothing guarantees that they run the same job, share the run dir or keep their caches apart. Right after
the process group forms, :func:`check_nodes` checks, collectively (every rank raises the same one-line
``ConfigError``, nobody waits for a peer that has left):

- the config: every rank's resolved config equals rank 0's, except the keys that are legitimately
  node-local (paths, cache and local-tier dirs, ranks per node, threads, the rendezvous port);
- the run dir (and ``ckpt.dir`` when it is a local path): a file rank 0 writes there is seen by every
  rank, i.e. it is one shared directory (checkpoints, the ledger and the sample logs live there);
- ``loader.cache_dir``: node-local (one download per shard per node relies on it), i.e. no two nodes
  see each other's marker in it.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from pitstop.config import flatten
from pitstop.errors import ConfigError

if TYPE_CHECKING:
    from pitstop.strategy.base import Strategy

# Keys that may differ between nodes: where things are on this node, how many ranks and threads it runs.
NODE_LOCAL = (
    "run_dir",
    "paths",
    "ckpt.dir",
    "loader.cache_dir",
    "ckpt.local.dir",
    "logger.tracking_uri",
    "strategy.nproc_per_node",
    "strategy.cpu_threads",
    "strategy.master_port",
    "strategy.oversubscribe",
    "trainer.progress_bar",
    "sweep",
    "hydra",
)


def node_id() -> str:
    """This rank's node: the agent's group rank (several agents may share one host) and the host name."""
    return f"node {os.environ.get('GROUP_RANK', '0')} ({socket.gethostname()})"


def check_nodes(strategy: Strategy, cfg: DictConfig, run_dir: str) -> None:
    """Refuse (on every rank alike) a job whose ranks disagree on the config, the shared run dir or the
    node-local cache. A no-op for one rank."""
    if strategy.world_size <= 1:
        return
    import torch.distributed as dist

    group = strategy.ckpt_group()
    me = {"node": node_id(), "group_rank": os.environ.get("GROUP_RANK", "0"), "config": flat_config(cfg)}
    token = uuid.uuid4().hex[:12]
    dirs = _shared_dirs(cfg, run_dir)
    if strategy.rank == 0:
        for d in dirs:
            os.makedirs(d, exist_ok=True)
            open(os.path.join(d, f".shared-{token}"), "w").close()
    token = strategy.broadcast_object(token)
    cache = OmegaConf.select(cfg, "loader.cache_dir", default=None)
    marker = None
    if cache and int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one marker per node
        marker = os.path.join(cache, f".node-{token}-{me['group_rank']}")
        os.makedirs(cache, exist_ok=True)
        open(marker, "w").close()
    strategy.barrier()
    me["dirs"] = [(d, os.path.exists(os.path.join(d, f".shared-{token}"))) for d in dirs]  # this rank's paths
    me["cache_markers"] = sorted(f.rsplit("-", 1)[1] for f in _listdir(cache) if f.startswith(f".node-{token}-"))
    everyone: list[Any] = [None] * strategy.world_size
    dist.all_gather_object(everyone, me, group=group)
    strategy.barrier()
    if marker:
        os.remove(marker)
    if strategy.rank == 0:
        for d in dirs:
            os.remove(os.path.join(d, f".shared-{token}"))
    problem = disagreement(everyone)
    if problem:
        raise ConfigError(problem)


def disagreement(ranks: list[dict]) -> str | None:
    """The first thing the ranks disagree on, as one line (None: they agree). ``ranks[r]`` is rank r's view."""
    first = ranks[0]
    for r, view in enumerate(ranks[1:], start=1):
        diff = _diff(first["config"], view["config"])
        if diff:
            key, a, b = diff
            return (
                f"the nodes were started with different configs: {key}={a} on rank 0 ({first['node']}) but "
                f"{key}={b} on rank {r} ({view['node']}); start every node with the same overrides"
            )
    for r, view in enumerate(ranks):
        for i, (path, seen) in enumerate(view["dirs"]):
            if not seen:
                what = "run_dir" if i == 0 else "ckpt.dir"
                return (
                    f"{what} is not shared between the nodes: rank {r} ({view['node']}) does not see rank 0's "
                    f"files in {path} (rank 0's: {first['dirs'][i][0]}); put it on a filesystem every node "
                    f"mounts"
                )
    for view in ranks:
        others = [g for g in view["cache_markers"] if g != view["group_rank"]]
        if others:
            return (
                f"loader.cache_dir is shared by nodes {view['group_rank']} and {others[0]} ({view['node']}): it "
                f"must be node-local (each node keeps its own copy of the shards); give each node its own, "
                f"e.g. PITSTOP_CACHE_DIR on a local disk"
            )
    return None


def flat_config(cfg: DictConfig) -> dict[str, str]:
    """The resolved config as ``{dotted.key: value}``, without the node-local keys."""
    return {
        k: v
        for k, v in flatten(cfg).items()
        if not any(k == local or k.startswith(local + ".") for local in NODE_LOCAL)
    }


def _diff(a: dict[str, str], b: dict[str, str]) -> tuple[str, str, str] | None:
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            return key, a.get(key, "(absent)"), b.get(key, "(absent)")
    return None


def _shared_dirs(cfg: DictConfig, run_dir: str) -> list[str]:
    dirs = [os.path.abspath(run_dir)]
    ckpt = OmegaConf.select(cfg, "ckpt.dir", default=None)
    saves = not str(OmegaConf.select(cfg, "ckpt._target_", default="")).endswith("NoCheckpoint")
    if ckpt and saves and "://" not in str(ckpt) and os.path.abspath(ckpt) != dirs[0]:
        dirs.append(os.path.abspath(ckpt))
    return dirs


def _listdir(path: str | None) -> list[str]:
    try:
        return os.listdir(path) if path else []
    except OSError:
        return []


def all_reduce_latency(strategy: Strategy, reps: int = 5) -> float | None:
    """Node health's last check, which needs the process group: the median seconds of a one-element all-reduce
    across the job's ranks (after one untimed), measured right after the group forms; None for one rank."""
    if strategy.world_size <= 1:
        return None
    import statistics
    import time

    import torch

    t = strategy.to_device(torch.zeros(1))
    strategy.all_reduce_sum(t).cpu()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        strategy.all_reduce_sum(t).cpu()  # (.cpu(): waits for it on a GPU)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
