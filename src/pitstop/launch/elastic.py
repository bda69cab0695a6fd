"""Several ranks: torch's elastic agent starts them as warm forks, restarts them (``strategy.max_restarts``),
hands a preemption notice to all of them, and its failures are reported as the one rank that explains them.

A job on one node (``strategy.nnodes=1``, and each group of several ranks of ``strategy=ft``) listens on loopback
alone: torch's stores listen on every interface whatever host they are given, so the rendezvous store is hosted
here on a socket bound to loopback (the agent joins it as a client, ``is_host=False``); the agent's shared store
for the ranks is turned off and rank 0 hosts theirs on loopback (``local_addr=127.0.0.1``, see
``pitstop.strategy.ddp.DDP._store``); Gloo's pairs listen on loopback (``GLOO_SOCKET_IFNAME=lo``, unless set).
Several nodes: the store must be reachable from the others, and torch places it."""

from __future__ import annotations

import logging
import os
import signal
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from pitstop.config import schema
from pitstop.errors import CrashLoop, PitstopError
from pitstop.launch import repeats, vetting
from pitstop.launch.attempt import start_warm, worker
from pitstop.launch.plan import LaunchPlan
from pitstop.launch.failures import first_line, first_line_of, lost_peer, root_failure, silent_ranks
from pitstop.launch.rendezvous import check_capacity, hosts_store, poll_sooner, rendezvous
from pitstop.resilience.preempt import PREEMPTED_EXIT, Preempted
from pitstop.resilience.watchdog import HUNG_EXIT
from pitstop.parts import launch_facts

if TYPE_CHECKING:
    from torch.distributed import TCPStore
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig

log = logging.getLogger("pitstop.launch")


def elastic(cfg: DictConfig, job: LaunchPlan, run_dir: str) -> dict:
    """``job.ranks`` ranks on this node (of ``strategy.nnodes``), started and restarted by torch's elastic agent
    in this process; a failed rank is named, a preemption notice is the whole job's."""
    strategy = job.strategy
    assert isinstance(strategy, (schema.DDP, schema.FT))
    endpoint, run_id = rendezvous(strategy, run_dir, job.nodes[1])
    check_capacity(strategy, job.ranks)  # (no torch on a machine without GPUs)
    # Warm ranks: the agent starts (and restarts) them as forks of a pre-imported server, not as fresh
    # interpreters; the first ones are charged this job's start (the server's imports are their program start).
    # Started after the checks (a refused job starts nothing), before the agent's own imports.
    ctx = start_warm(cfg, job)
    method = ctx.get_start_method()
    cfg_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    # This node's health before the first rendezvous: a node not to use ends here (the job goes on without it, or
    # stops in one line); the seconds are the first ranks' ledger's `health` (a restart's: the rank checks itself).
    health = vetting.vet(run_dir, job.nodes, job.nodes_text, vetting.launcher_check(ctx, cfg_yaml, run_dir, job))
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )
    from torch.distributed.launcher.api import elastic_launch

    from pitstop.resilience.preempt import JobNotice

    job_start = launch_facts.job_start()
    one_node = job.nodes[1] == 1
    if one_node:
        # (a given rdzv_endpoint's port is kept; its host can only be this machine: one node)
        endpoint = f"127.0.0.1:{endpoint.rsplit(':', 1)[1]}"
        if os.path.isdir("/sys/class/net/lo"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # (the ranks inherit it)
            # NCCL's bootstrap listener too (one node: its data goes over NVLink/PCIe or shared memory, never a
            # socket). Not yet run on a GPU here; a user's own NCCL_SOCKET_IFNAME wins.
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    store = None  # (kept referenced until the agent is done: the store's server lives as long as this object)
    if one_node:
        # A port the user gave is used as given; one picked for us is picked again by the kernel as the store starts
        # listening (a port found free a moment earlier can be listened on by then: another job's store, say).
        pinned = bool(getattr(job.strategy, "master_port", None) or getattr(job.strategy, "rdzv_endpoint", None))
        store = rendezvous_store(endpoint if pinned else "127.0.0.1:0", job.rendezvous_timeout)
        endpoint = f"127.0.0.1:{store.port}"
    config = agent_config(job, endpoint, run_id, method, run_dir)
    poll_sooner(config.max_nodes)
    nodes = job.nodes_text
    where = f"this node of {nodes} (rendezvous {endpoint}, max_restarts={job.restarts})"
    log.info("launching %d ranks on %s", job.ranks, where)
    notice = JobNotice(job.notices, lambda msg, sig: SignalException(msg, sigval=sig))
    try:
        notice.install()  # (inside: a notice that waited, blocked, is delivered by it and raises here)
        results = elastic_launch(config, worker)(cfg_yaml, run_dir, method, job_start, os.getpid(), *health)
    except (RendezvousClosedError, RendezvousTimeoutError, RendezvousConnectionError) as e:
        vetting.raise_if_excluded(run_dir, job, job_start)  # (this node's rank excluded it and stopped its agent)
        loop = repeats.marked(run_dir, job_start)  # (another node's rank found a crash loop and stopped its agent)
        if loop is not None:
            raise CrashLoop(loop) from None
        raise rendezvous_failed(e, endpoint, job, run_dir) from None
    except SignalException as e:
        # torch's agent, stopped by a signal, leaves its rendezvous open (its keep-alive thread goes on beating): the
        # store outlives this job, or that thread's failures would print after the job's one line
        _OPEN_AFTER_A_SIGNAL.append(store)
        vetting.raise_if_excluded(run_dir, job, job_start)  # (a rank found its node excluded and stopped the agent)
        loop = repeats.marked(run_dir, job_start)  # (a rank found the same failure twice and stopped the agent)
        if loop is not None:
            raise CrashLoop(loop) from None
        if e.sigval not in job.notices:
            raise
        raise Preempted(
            f"preempted after a notice ({e.sigval.name}); run the same command again to resume ({run_dir})"
        ) from None
    except ChildFailedError as e:
        vetting.raise_if_excluded(run_dir, job, job_start)
        loop = repeats.marked(run_dir, job_start)  # (the agent had no restart left when the rank stopped it)
        if loop is not None:
            raise CrashLoop(loop) from None
        error = rank_failed(e, job, run_dir, run_id)
        if (getattr(root_failure(e.failures)[1], "exitcode", 0) or 0) < 0:  # (killed: its rank could not record it)
            vetting.failed_here(run_dir, str(error), job.nodes)
        raise error from None
    finally:
        notice.close()
        del store
    return results[min(results)]  # keyed by global rank: this node's first


def rendezvous_failed(e: Exception, endpoint: str, job: LaunchPlan, run_dir: str) -> PitstopError:
    """The one line for a rendezvous this node could not complete: closed (the job ended or failed elsewhere), or
    not joined in time."""
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

    if isinstance(e, RendezvousClosedError):
        return PitstopError(
            f"the job's rendezvous at {endpoint} is closed: the job already ended or failed on "
            f"another node (see {run_dir}/train.log); start a new job (a new run_dir resumes nothing, "
            f"the same one resumes from its checkpoints)"
        )
    return PitstopError(
        f"this node could not join the job's rendezvous at {endpoint} within strategy.timeout="
        f"{job.rendezvous_timeout} s ({type(e).__name__}: {first_line_of(e)}); start node 0 first, check the "
        f"address and that strategy.nnodes={job.nodes_text} nodes come up"
    )


_OPEN_AFTER_A_SIGNAL: list = []  # rendezvous stores of jobs whose agent a signal stopped (see run's SignalException)


def rendezvous_store(endpoint: str, timeout: float) -> TCPStore:
    """The rendezvous store of a job on one node, on ``endpoint``'s port of loopback (listening there alone)."""
    from datetime import timedelta

    from pitstop.strategy.ddp import loopback_store

    port = int(endpoint.rsplit(":", 1)[1])
    try:
        return loopback_store(port, 1, timedelta(seconds=timeout), wait_for_workers=False)
    except PitstopError as e:
        raise PitstopError(f"{e} (strategy.master_port={port}: pick another or leave it null)") from None


def agent_config(job: LaunchPlan, endpoint: str, run_id: str, method: str, run_dir: str) -> LaunchConfig:
    """Torch's ``LaunchConfig`` for this node's agent. Preemption notices are the job's: the agent stops on the
    first (ours, from the scheduler or handed on by a rank), gives every rank the same signal and waits for their
    saves; it never restarts a preempted rank (torch handles the other termination signals)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    min_nodes, max_nodes = job.nodes
    # one node: this process hosts the rendezvous store on loopback (see rendezvous_store); the agent joins it
    is_host = hosts_store(os.environ, endpoint) if max_nodes > 1 else False
    torch_handles = [s for s in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if signal.Signals[s] not in job.notices]
    timeout = job.rendezvous_timeout
    # A fresh bootstrap store per rendezvous round, hosted by rank 0: several nodes, because a node that joins later
    # starts at restart count 0, so the ranks' per-attempt key prefix cannot tell the rounds apart in a store shared
    # across rounds; one node, because the agent's shared store listens on every interface, and rank 0's on loopback.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=job.ranks,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={
            "join_timeout": timeout,
            "read_timeout": timeout,
            "timeout": timeout,
            "last_call_timeout": job.last_call_seconds,
            "keep_alive_interval": 1,
            "keep_alive_max_attempt": 5,
            **({} if is_host is None else {"is_host": is_host}),
        },
        local_addr="127.0.0.1" if max_nodes == 1 else None,  # (the ranks' MASTER_ADDR: rank 0's store on loopback)
        max_restarts=job.restarts + vetting.reform_allowance(job),
        monitor_interval=0.05,  # (a rank's exit noticed within 0.05 s: a poll of its processes, cheap)
        start_method=method,
        shutdown_timeout=int(job.grace) + 30,
        signals_to_handle=",".join(torch_handles),
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(run_dir, "elastic")),
    )


def rank_failed(e: ChildFailedError, job: LaunchPlan, run_dir: str, run_id: str) -> BaseException:
    """The one error that explains a ``ChildFailedError``: a preemption, a hang, or the rank whose failure explains
    the others (a rank killed without an error of its own, when its peers only lost it)."""
    rank, failure = root_failure(e.failures)
    if getattr(failure, "exitcode", None) == PREEMPTED_EXIT:
        return Preempted(f"preempted after a notice; run the same command again to resume ({run_dir})")
    if getattr(failure, "exitcode", None) == HUNG_EXIT:
        return PitstopError(
            f"rank {rank} hung (no progress within trainer.hang's limits); its stacks are in "
            f"{run_dir}/hang.rank{rank}.txt, see {run_dir}/train.log and rank*.log"
        )
    why = first_line(failure)
    if "timeout" in why.lower() or "timed out" in why.lower():
        why += f"; a peer stopped responding for strategy.timeout={job.strategy_timeout:g} s"
    silent = silent_ranks(os.path.join(run_dir, "elastic"), run_id, job.ranks, rank)
    if silent and lost_peer(why):  # the agent saw the peer's error first
        return PitstopError(
            f"rank {', '.join(map(str, silent))} failed (no error of its own: killed by a signal, "
            f"e.g. SIGKILL or the OOM killer; rank {rank} then lost its peer: {why}); see "
            f"{run_dir}/train.log and rank*.log"
        )
    return PitstopError(f"rank {rank} failed ({why}); see {run_dir}/train.log and rank*.log")
