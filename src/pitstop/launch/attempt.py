"""One attempt: how its process starts warm (a fork of a pre-imported server) and how it runs and ends, the
same under pitstop's supervisor and torch's elastic agent."""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pitstop.errors import ConfigError, Interrupt, PitstopError, Unrecoverable
from pitstop.launch import repeats, vetting
from pitstop.launch.failures import lost_peer
from pitstop.launch.plan import LaunchPlan
from pitstop.launch.repeats import CRASH_LOOP_EXIT, Failure, signature
from pitstop.resilience.node_book import EXCLUDED_EXIT, REFORM_EXIT, NodeExcluded
from pitstop.resilience.preempt import PREEMPTED_EXIT, Preempted
from pitstop.parts.launch_facts import LaunchFacts, process_start_wall, record_error


def worker(
    cfg_yaml: str,
    run_dir: str,
    method: str = "spawn",
    job_start: float | None = None,
    agent: int | None = None,
    health: float = 0.0,
    matmul: float | None = None,
) -> dict:
    """The entry point of each rank that torch's elastic agent starts: a fork of the agent's pre-imported server
    (``method`` forkserver: warm) or a fresh interpreter (spawn). ``agent``: the launching process, told of a
    preemption notice; ``health``, ``matmul``: its launcher's health check of the node (the first ranks'; the node's
    first local rank records the matmul's timing).
    The agent's facts (its arguments and ``RANK``/``TORCHELASTIC_RESTART_COUNT``) become this attempt's
    :class:`LaunchFacts`. A restarted rank checks its node first (:func:`vet_restart`)."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    # Program start: the first ranks count from the job's start (the launching process's imports, the
    # rendezvous, and a server's imports or their own); a restarted rank from its own start (a fork: now).
    if restart == 0 and job_start is not None:
        start = job_start
    elif method == "forkserver":
        start = time.time()
    else:
        start = process_start_wall()
    if restart > 0:
        health, matmul = vet_restart(cfg_yaml, run_dir, agent, int(os.environ["RANK"]))
    first = int(os.environ.get("LOCAL_RANK", "0") or 0) == 0
    facts = LaunchFacts(
        program_start=start,
        launched=True,
        restart=restart,
        start_method=method,
        agent_pid=agent,
        health_seconds=health,
        matmul_seconds=matmul if first else None,
    )
    return run_attempt(cfg_yaml, run_dir, facts, int(os.environ["RANK"]))


def vet_restart(cfg_yaml: str, run_dir: str, agent: int | None, rank: int) -> tuple[float, float | None]:
    """Before a restart under torch's agent (which restarts ranks by itself), the rank checks its node: the node's
    first local rank runs the health check, every rank reads the book of nodes. A node not to use stops its agent:
    exit ``EXCLUDED_EXIT`` (the job goes on without it; its launcher says so) or, if the job cannot go on, the one
    line left for every launcher (as a crash loop's). Returns what ``vetting.vet`` does."""
    from pitstop.launch import health, vetting
    from pitstop.launch.plan import nnodes
    from pitstop.resilience.node_book import EXCLUDED_EXIT, NodeExcluded, node_name

    cfg = OmegaConf.create(cfg_yaml)
    nodes = nnodes(OmegaConf.select(cfg, "strategy.nnodes", default=1))
    text = str(OmegaConf.select(cfg, "strategy.nnodes", default=1))
    first = int(os.environ.get("LOCAL_RANK", "0") or 0) == 0
    node = node_name()
    enabled = bool(OmegaConf.select(cfg, "trainer.health.enabled", default=True))
    check = (lambda: health.checks(cfg, run_dir, node)) if first and enabled else None
    try:
        return vetting.vet(run_dir, nodes, text, check, node)
    except PitstopError as e:
        log_to(run_dir, rank)
        logging.getLogger("pitstop").error("%s", e)
        if isinstance(e, NodeExcluded):
            vetting.stop_agent(agent)
            raise SystemExit(EXCLUDED_EXIT) from None
        facts = LaunchFacts(program_start=time.time(), launched=True, agent_pid=agent)
        stop_job(run_dir, str(e), facts)
        raise SystemExit(2) from None


def run_attempt(cfg_yaml: str, run_dir: str, facts: LaunchFacts, rank: int = 0) -> dict:
    """One attempt in a process a launcher started (pitstop's supervisor or torch's elastic agent): log to the
    run dir, run the Runner, and end as the launcher expects. A preemption notice exits with PREEMPTED_EXIT.
    Under the supervisor (``facts.supervised``) any failure is written down in one line (read by the
    supervisor) and the exit status says its kind (2: a configuration error, not worth a restart;
    ``CRASH_LOOP_EXIT``: the same failure as the attempt before, with no progress between); under the agent the
    exception propagates (the agent records it), and a crash loop stops the agent (:func:`crash_loop`)."""
    from pitstop.train.runner import Runner
    from pitstop.train.straggler import Reform

    log_to(run_dir, rank)
    logger = logging.getLogger("pitstop")
    runner = None
    try:
        runner = Runner(OmegaConf.create(cfg_yaml), run_dir, facts)
        return runner.run()
    except Preempted as e:
        logger.warning("%s", e)
        raise SystemExit(PREEMPTED_EXIT) from None
    except (NodeExcluded, Reform) as e:  # (its node excluded: do not start it here again; or re-form without it)
        logger.warning("%s", e)
        if isinstance(e, NodeExcluded):
            if not facts.supervised:  # (torch's agent would start it here again: it is stopped, its launcher says why)
                vetting.stop_agent(facts.agent_pid)
            raise SystemExit(EXCLUDED_EXIT) from None
        if not facts.supervised:  # (the agent's restart for it is a re-formation: no restart of the budget)
            vetting.note_reform(run_dir, facts.agent_pid, facts.restart)
        raise SystemExit(e.exit_code) from None
    except ConfigError as e:
        logger.error("%s", e)
        if not facts.supervised:
            raise
        record_error(run_dir, str(e))
        raise SystemExit(2) from None
    except BaseException as e:
        if isinstance(e, SystemExit) and e.code == REFORM_EXIT:  # the job re-forms without an excluded node: no
            vetting.note_reform(run_dir, facts.agent_pid, facts.restart)  # failure, its launcher restarts it at once
            raise
        if isinstance(e, PitstopError):
            logger.error("%s", e)
        elif facts.supervised:
            logger.exception("attempt failed")
        loop = None
        # (a hang, an interrupt: their own rules; a rank that only lost its peer did not fail on its own, and a kill
        # of the peer is no loop of this rank's)
        if isinstance(e, Unrecoverable):  # (the run stopped itself: no restart can fix it, stop as a loop does)
            loop = stop_job(run_dir, str(e), facts)
        elif not isinstance(e, (SystemExit, KeyboardInterrupt, Interrupt)) and not lost_peer(str(e)):
            step = runner.step if runner is not None and hasattr(runner, "progress") else None
            limit = restart_limit(cfg_yaml) if not facts.supervised and facts.agent_pid else None
            # (the supervisor records its attempts' failures on the node itself; a node excluded for its failures
            # is the verdict, before a crash loop's: the job may go on without it)
            node = node_failed(cfg_yaml, run_dir, signature(e), facts, step) if limit is not None else None
            if node is None:
                loop = crash_loop(run_dir, Failure(rank, facts.restart, step, signature(e)), facts, limit)
            else:
                loop = node or None
        elif not facts.supervised and lost_peer(str(e)):
            peers_loop(run_dir, facts)
        if not facts.supervised:
            raise
        text = str(e) if isinstance(e, PitstopError) else f"{type(e).__name__}: {e}".splitlines()[0][:300]
        record_error(run_dir, loop or text)
        raise SystemExit(CRASH_LOOP_EXIT if loop else 1) from None


def node_failed(cfg_yaml: str, run_dir: str, what: str, facts: LaunchFacts, step: int | None) -> str | None:
    """Record this attempt's failure on this node (once per node and attempt); None if that does not exclude it. On
    the failure that excludes the node (the job can go on without it: ``vetting.failed_here``) this node's agent is
    stopped and "" is returned: the job goes on without the node, and its launcher says so."""
    from pitstop.launch import vetting
    from pitstop.launch.plan import nnodes
    from pitstop.resilience.node_book import NodeExcluded, node_name

    text = str(OmegaConf.select(OmegaConf.create(cfg_yaml), "strategy.nnodes", default=1))
    nodes = nnodes(text)
    if not vetting.failed_here(run_dir, what, nodes, step, tag=f"[agent {facts.agent_pid} restart {facts.restart}]"):
        return None
    err = vetting.refuse(
        run_dir, node_name(), f"attempts failed on it twice (the last: {what})", "failures", nodes, text
    )
    logging.getLogger("pitstop").error("%s", err)
    vetting.stop_agent(facts.agent_pid)
    return "" if isinstance(err, NodeExcluded) else stop_job(run_dir, str(err), facts)


def restart_limit(cfg_yaml: str) -> int | None:
    """torch's agent's limit, ``strategy.max_restarts`` (None where the config cannot say: its failure is the one to
    report)."""
    try:
        limit = OmegaConf.select(OmegaConf.create(cfg_yaml), "strategy.max_restarts", default=None)
        return int(limit) if limit is not None else None
    except Exception:  # noqa: BLE001 - a config that does not parse failed the attempt already
        return None


def crash_loop(run_dir: str, failure: Failure, facts: LaunchFacts, limit: int | None = None) -> str | None:
    """Record this attempt's failure; if it repeats the one before (:mod:`pitstop.launch.repeats`), the one line
    that stops the job. Under torch's agent the verdict is left for the launcher and the agent is told to stop
    (SIGHUP, which the agent handles by stopping every rank, and which is no preemption notice by default): it would
    otherwise restart the ranks into the same failure."""
    repeated = repeats.note(run_dir, failure)
    if repeated is None:
        if facts.supervised or not facts.agent_pid or limit is None:  # (the supervisor weighs its own budget)
            return None
        # Under torch's agent, which counts every restart as one: a failure with no progress since the one before
        # costs one more (repeats.without_progress); the rank stops the agent when that is past its limit.
        extra = repeats.without_progress(repeats.history(run_dir))
        used = facts.restart - vetting.reforms(run_dir, facts.agent_pid)  # (re-formations use no restart)
        if (extra == 0 and used == facts.restart) or used + 1 + extra <= int(limit):  # (else torch's count decides)
            return None
        budget = repeats.budget_line(used + 1, extra, "strategy.max_restarts", int(limit))
        line = f"the job failed (last: rank {failure.rank}: {failure.what}); its restarts are used up ({budget})"
        logging.getLogger("pitstop").error("%s", line)
        return stop_job(run_dir, line, facts)
    line = repeats.verdict(failure, repeated, run_dir)
    logging.getLogger("pitstop").error("%s", line)
    return stop_job(run_dir, line, facts)


def stop_job(run_dir: str, line: str, facts: LaunchFacts) -> str:
    """End the job with ``line`` and no restart: the supervisor reads the attempt's exit status; torch's agent is
    told to stop (SIGHUP) and the launcher finds ``line`` marked in the run dir."""
    if not facts.supervised and facts.agent_pid:
        repeats.mark(run_dir, line)
        try:
            os.kill(facts.agent_pid, signal.SIGHUP)
        except OSError:
            pass
    return line


def peers_loop(run_dir: str, facts: LaunchFacts) -> None:
    """A rank under torch's agent that lost its peer: if the peer's rank stopped its own agent on a crash loop (its
    verdict in the shared run dir, left during this attempt), stop this node's agent too (SIGHUP): on another node it
    would restart its ranks into a rendezvous that the looping node never joins, and fail after strategy.timeout
    with a line about the rendezvous instead of the loop's."""
    if facts.agent_pid and repeats.marked(run_dir, facts.program_start) is not None:
        try:
            os.kill(facts.agent_pid, signal.SIGHUP)
        except OSError:
            pass


def warm_modules(cfg: DictConfig) -> set[str]:
    """What every attempt imports, imported once in the server it is forked from: torch, the runner, the entry
    point's imports and every module the config names (``_target_``). Imported lazily by every attempt otherwise:
    torch._dynamo by the optimizer's constructor (~1 s of a cold attempt's init here), fsspec by the data index
    (~0.3 s), pitstop.goodput.model at the end."""
    from pitstop.config.build import target_modules

    return {
        "torch",
        "torch._dynamo",
        "fsspec",
        "pitstop.goodput.model",
        "pitstop.train.runner",
        "pitstop.launch.launcher",
        *target_modules(cfg),
    }


def start_warm(cfg: DictConfig, job: LaunchPlan) -> Any:
    """The multiprocessing context this launcher starts its attempts or ranks with, its server running.

    ``trainer.warm_restarts`` (the default): ``forkserver``, whose server is a copy of this launcher forked while
    it is still single-threaded, with :func:`warm_modules` imported first (``pitstop.data.loader.server.start``,
    the one place a fork server starts; a fresh interpreter that imports them where this process already has
    threads, or where the ranks run on GPUs). Each attempt is a fork of it: no interpreter start, no imports, for
    the first attempt as for a restart. Else ``spawn``: each attempt a fresh interpreter.

    A scheduler's notice reaches every process of the job step: the children's resource tracker (a fresh
    interpreter) would die of it, come back and print KeyError tracebacks; their fork server would die of it
    (SIGUSR1's default action), which looks to their parent as if every child had ended. Both start with the
    notices blocked (the server also ignores them), so they never act on one; each child unblocks them once its
    own handlers are in (``PreemptionNotice.install``), and a notice that came before is delivered then."""
    import multiprocessing as mp
    from multiprocessing import resource_tracker

    from pitstop.data.loader import server
    from pitstop.launch.rendezvous import on_gpus
    from pitstop.notices import notices_blocked

    # (ranks on GPUs: a fresh interpreter, as a fork of a process that asked the CUDA driver for its devices, as
    # the capacity check does, could not use CUDA)
    fork = not on_gpus(job.strategy)
    with notices_blocked():
        if job.trainer.warm_restarts and server.start(warm_modules(cfg), fork=fork) != "none":
            return mp.get_context("forkserver")
        resource_tracker.ensure_running()
    return mp.get_context("spawn")


def log_to(run_dir: str, rank: int) -> None:
    fmt = logging.Formatter(f"[%(asctime)s][rank{rank}][%(name)s][%(levelname)s] - %(message)s")
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(logging.INFO)
    handler = logging.FileHandler(os.path.join(run_dir, "train.log" if rank == 0 else f"rank{rank}.log"))
    handler.setFormatter(fmt)
    root.addHandler(handler)
    if rank == 0:
        console = logging.StreamHandler()
        console.setFormatter(fmt)
        root.addHandler(console)
