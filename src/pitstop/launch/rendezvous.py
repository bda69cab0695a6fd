"""Where the ranks of a job meet: a free local port for one node, node 0's address for several (given, or
from the SLURM allocation), and whether this machine has room for the ranks asked for."""

from __future__ import annotations

import os
import socket
import uuid
from typing import Mapping

from pitstop.config import schema
from pitstop.errors import ConfigError


def on_gpus(strategy: schema.Single) -> bool:
    """Whether the ranks run on GPUs: ``strategy.device`` allows it and torch sees one. Without a GPU driver's
    device files (NVIDIA's or ROCm's) there is none, and torch (seconds to import) is not asked."""
    if strategy.device == "cpu":
        return False
    if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd")):
        return False
    import torch

    return torch.cuda.is_available()


def check_capacity(strategy: schema.DDP | schema.FT, n: int, what_asks: str = "strategy.nproc_per_node") -> None:
    """Room on this machine for ``n`` processes: a GPU each where the ranks run on GPUs, else a CPU core each
    (unless ``strategy.oversubscribe``)."""
    if on_gpus(strategy):
        import torch

        have, what = torch.cuda.device_count(), "GPUs"
    else:
        have, what = os.cpu_count() or 1, "CPU cores"
    if n > have and not strategy.oversubscribe:
        raise ConfigError(
            f"{what_asks}={n} but this machine has {have} {what}; lower it or set strategy.oversubscribe=true"
        )


def rendezvous(strategy: schema.DDP | schema.FT, run_dir: str, max_nodes: int) -> tuple[str, str]:
    """The rendezvous endpoint and job id. One node: a free local port and a fresh id. Several: every node
    is given the same ``strategy.rdzv_endpoint`` (node 0's address, whose agent hosts the store) and the id is
    the run dir's name (pinned, the same on every node). A replica group's ranks meet on this machine."""
    if isinstance(strategy, schema.FT):
        return f"127.0.0.1:{_port(None)}", f"pitstop-{uuid.uuid4().hex[:8]}"
    endpoint = strategy.rdzv_endpoint
    slurm_nodes = int(os.environ.get("SLURM_STEP_NUM_NODES", "1") or 1)  # srun's step (submitit's tasks)
    if slurm_nodes > max_nodes:
        raise ConfigError(
            f"this SLURM job step runs on {slurm_nodes} nodes but strategy.nnodes="
            f"{strategy.nnodes}; set strategy.nnodes={slurm_nodes} "
            f"(= hydra.launcher.nodes) and strategy.rdzv_endpoint=slurm"
        )
    if endpoint == "slurm":
        endpoint = slurm_endpoint(os.environ, strategy.master_port)
    if max_nodes == 1 and not endpoint:
        return f"127.0.0.1:{_port(strategy.master_port)}", f"pitstop-{uuid.uuid4().hex[:8]}"
    if not endpoint or ":" not in str(endpoint):
        raise ConfigError(
            f"strategy.nnodes={strategy.nnodes} needs "
            f"strategy.rdzv_endpoint=HOST:PORT (node 0's address), got {endpoint!r}"
        )
    import hashlib

    name = os.path.basename(os.path.normpath(run_dir))
    return str(endpoint), f"pitstop-{hashlib.sha1(name.encode()).hexdigest()[:12]}"


def slurm_endpoint(env: Mapping[str, str], port: int | None = None) -> str:
    """``strategy.rdzv_endpoint=slurm``: the allocation's first node (node 0, whose agent hosts the rendezvous)
    and a port derived from the job id (two jobs sharing a node do not collide), or ``strategy.master_port``."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ConfigError(
            "strategy.rdzv_endpoint=slurm outside a SLURM allocation (no SLURM_JOB_NODELIST); give HOST:PORT"
        )
    return f"{first_host(nodelist)}:{int(port or 20000 + int(env.get('SLURM_JOB_ID', '0') or 0) % 20000)}"


def hosts_store(env: Mapping[str, str], endpoint: str) -> bool | None:
    """Whether this node's agent hosts the rendezvous store, where SLURM says which node this is: the node named
    by ``strategy.rdzv_endpoint=slurm`` (the allocation's first). None elsewhere (torch decides by the address).
    Torch's guess -- the endpoint's address is one of this machine's -- is true on every node of a cluster whose
    nodes share a machine (containers, the local test cluster): the store then lives on whichever agent binds
    first, and losing that node loses the rendezvous of an elastic job that should go on without it."""
    node, nodelist = env.get("SLURMD_NODENAME"), env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not node or not nodelist or endpoint.rsplit(":", 1)[0] != first_host(nodelist):
        return None  # (not SLURM, or an endpoint given by address: torch's guess)
    return node == first_host(nodelist)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[07-08,11],cpu3`` -> ``gpu07``."""
    import re

    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ConfigError(f"cannot read the SLURM node list {nodelist!r}; give strategy.rdzv_endpoint=HOST:PORT")
    prefix, ranges = m.group(1), m.group(2)
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")


def _port(want: int | None) -> int:
    """A free port on loopback: ``strategy.master_port`` if given (refused in one line if taken)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", int(want or 0)))
        except OSError as e:
            raise ConfigError(
                f"strategy.master_port={want} is not free ({e.strerror}); pick another or leave it null"
            ) from None
        return s.getsockname()[1]


def poll_sooner(max_nodes: int) -> float | None:
    """Make torch's rendezvous notice sooner that the last node has joined.  While a node waits for the others it
    re-reads the shared state once a second (``dynamic_rendezvous``'s ``_delay(seconds=1)``), and serves it from a
    cache of the same age (``_BackendRendezvousStateHolder``'s ``cache_duration=1``), both to spare the store: so
    every restart of a job on several nodes waits about a second for nothing (1.0 of the 1.4 s from a lost node to
    its ranks' restart, measured by ``bench/peer_restore.py``).  Both become ``max_nodes / 1000`` s, between 0.1 and
    torch's 1 s (the store then answers at most ~1,000 such reads a second whatever the job's size, as with torch's
    own at 1,000 nodes), and the random wait before a first restart's join (up to 0.3 s, to spread the nodes' joins)
    shrinks in proportion.  Returns the new wait, or None where this torch lacks either piece (nothing changed)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    delay, holder = getattr(dr, "_delay", None), getattr(dr, "_BackendRendezvousStateHolder", None)
    params = getattr(getattr(getattr(holder, "__init__", None), "__code__", None), "co_varnames", ())
    if not callable(delay) or holder is None or "cache_duration" not in params:
        return None
    wait = min(1.0, max(0.1, max_nodes / 1000))
    poll = getattr(delay, "pitstop_original", delay)
    init = getattr(holder.__init__, "pitstop_original", holder.__init__)

    def sooner(seconds: float | tuple[float, float]) -> None:
        if isinstance(seconds, tuple):  # (a first restart's jitter, (0, 0.3) s, spreads nodes' joins: as much less)
            seconds = (seconds[0] * wait, seconds[1] * wait)
        poll(seconds=wait if seconds == 1 else seconds)

    def fresher(self: object, backend: object, settings: object, cache_duration: float = wait) -> None:
        init(self, backend, settings, min(cache_duration, wait))

    sooner.pitstop_original, fresher.pitstop_original = poll, init  # type: ignore[attr-defined]
    dr._delay, holder.__init__ = sooner, fresher
    return wait
