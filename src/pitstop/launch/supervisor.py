"""``strategy=single`` with ``trainer.max_restarts=N``: pitstop's own supervisor restarts the one process."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from pitstop.errors import ConfigError, CrashLoop, PitstopError
from pitstop.launch import repeats, vetting
from pitstop.launch.attempt import run_attempt, start_warm
from pitstop.launch.repeats import CRASH_LOOP_EXIT, Failure
from pitstop.launch.plan import LaunchPlan
from pitstop.notices import notices_blocked
from pitstop.resilience import node_book
from pitstop.resilience.fault_record import killed_by_fault
from pitstop.resilience.node_book import EXCLUDED_EXIT, REFORM_EXIT, node_name
from pitstop.resilience.preempt import PREEMPTED_EXIT, LauncherNotice, Preempted
from pitstop.parts import launch_facts
from pitstop.parts.launch_facts import LaunchFacts, error_file

log = logging.getLogger("pitstop.launch")


def supervise(cfg: DictConfig, job: LaunchPlan, run_dir: str) -> dict:
    """``strategy=single`` with ``trainer.max_restarts=N``: run the job in a child process and start it
    again (it resumes from its newest checkpoint) when it dies — killed, crashed, out of memory — up to N
    times. A configuration error (exit status 2) would fail again, so it is not restarted; data and
    storage errors may be transient (a remote store down for a while) and are.

    Restarts are warm (:func:`start_warm`): attempts are forks of a pre-imported server, so a restart
    costs the detection of the failure, the fork, init and restore, not a cold start. The first attempt's
    ledger counts from the supervisor's own start (its imports and the server's are program start)."""

    ctx = start_warm(cfg, job)
    os.makedirs(run_dir, exist_ok=True)
    cfg_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    job_start = launch_facts.job_start()
    main = threading.current_thread() is threading.main_thread()
    children: list[BaseProcess] = []
    notice = LauncherNotice(job.trainer.preempt_signals, lambda: children)  # (USR1/USR2: to the attempt)
    previous = signal.signal(signal.SIGTERM, _exit_on_signal) if main else None  # SIGTERM -> the finally runs
    try:
        notice.install()
        return attempts(ctx, cfg_yaml, run_dir, job, job_start, started=children.append, notice=notice)
    except Preempted:
        notice.forward()  # (submitit's requeue, once the attempt's save is durable)
        raise
    finally:
        notice.close()
        if main:
            signal.signal(signal.SIGTERM, previous)  # a later job in this process (a sweep) gets the old one


def attempts(
    ctx: BaseContext,
    cfg_yaml: str,
    run_dir: str,
    job: LaunchPlan,
    job_start: float,
    started: Callable[[BaseProcess], None] | None = None,
    name: str = "attempt",
    notice: LauncherNotice | None = None,
) -> dict:
    """Run attempts of one job (or one replica group) in ``run_dir`` until one finishes, restarting a failed one up
    to ``job.restarts`` times; ``started(process)``
    is told of each attempt's process (a launcher of several groups stops them all on its way out); after the
    launcher's preemption ``notice`` (a ``LauncherNotice``) no attempt starts."""
    import json

    os.makedirs(run_dir, exist_ok=True)
    errors = error_file(run_dir)
    max_restarts, limit_key, grace = job.restarts, job.restarts_key, job.grace
    check = vetting.launcher_check(ctx, cfg_yaml, run_dir, job)
    attempt, reforms = -1, 0  # (re-formations after a node's exclusion: restarts that use no budget)
    while True:
        attempt += 1
        if notice is not None and notice.received is not None:  # (the notice came between two attempts)
            raise Preempted(f"preempted ({notice.received.name}); run the same command again to resume ({run_dir})")
        if os.path.exists(errors):
            os.remove(errors)
        # The attempt's program start: the job's start for the first, this moment for a restart (the clock of
        # /proc's process start times is too coarse for sub-second restarts). The node's health check is in it.
        start = job_start if attempt == 0 else time.time()
        health, matmul = vetting.vet(run_dir, job.nodes, job.nodes_text, check)
        facts = LaunchFacts(
            program_start=start,
            health_seconds=health,
            matmul_seconds=matmul,
            launched=True,
            supervised=True,
            restart=attempt,
            start_method=ctx.get_start_method(),  # recorded in goodput.json (forkserver: a warm attempt)
        )
        child = ctx.Process(target=run_attempt, args=(cfg_yaml, run_dir, facts), name=f"pitstop-{name}{attempt}")
        # (the warm fork server, started by the first attempt, must outlive a scheduler's notice to the job's
        # processes: it reports the attempts' exit status; the attempt unblocks the notices once it handles them)
        with notices_blocked():
            child.start()
            if started is not None:
                started(child)  # (a notice from here on is handed to it by the launcher)
        if notice is not None and notice.received is not None:  # (one that came while it was starting)
            try:
                os.kill(child.pid, notice.received)
            except OSError:
                pass
        try:
            child.join()
        finally:  # the supervisor interrupted (Ctrl-C, SIGTERM from a scheduler): a notice for the attempt too
            if child.is_alive():
                child.terminate()  # SIGTERM: a preemption notice, the attempt saves within its grace period
                child.join(grace + 30)
                if child.is_alive():
                    child.kill()
            if child.exitcode == PREEMPTED_EXIT:
                raise Preempted(f"preempted after a notice; run the same command again to resume ({run_dir})")
        code = child.exitcode
        if code == 0:
            with open(os.path.join(run_dir, "summary.json")) as f:
                return json.load(f)
        if os.path.exists(errors):
            with open(errors) as f:
                why = f.read().strip()
        else:
            why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        if code == 2:
            raise ConfigError(why)
        if code == CRASH_LOOP_EXIT:  # (the attempt found its failure repeated the one before: said in `why`)
            raise CrashLoop(why)
        if code == REFORM_EXIT:  # (a node was excluded at run time, the state saved: the job re-forms at once)
            reforms += 1
            log.info("%s %d ended to re-form the job without an excluded node; starting it again", name, attempt + 1)
            continue
        if code == EXCLUDED_EXIT:  # (the attempt excluded its own node: it is not started on it again)
            node = node_name()
            rec = node_book.excluded(run_dir).get(node, {"why": why, "by": "the attempt"})
            raise vetting.refuse(run_dir, node, str(rec["why"]), str(rec["by"]), job.nodes, job.nodes_text)
        if vetting.failed_here(run_dir, why, job.nodes):  # (the node's failures: a job of several nodes leaves it)
            node = node_name()
            raise vetting.refuse(run_dir, node, f"attempts failed on it twice (the last: {why})", "failures",
                                 job.nodes, job.nodes_text)  # fmt: skip
        if code is not None and code < 0:  # killed: nothing in the attempt could say so; the same signal at the same
            loop = killed(run_dir, attempt, -code, child.pid)  # step as the last is a loop too (out-of-memory kills)
            if loop:
                raise CrashLoop(loop)
        extra = repeats.without_progress(repeats.history(run_dir))  # (a failure where the last one was costs 2)
        budget = repeats.budget_line(attempt + 1 - reforms, extra, limit_key, max_restarts)
        if attempt + 1 - reforms + extra > max_restarts:
            raise PitstopError(
                f"the job failed (last: {why}); its restarts are used up ({budget}) — see {run_dir}/train.log"
            )
        log.warning("%s %d failed (%s); restarting (%s)", name, attempt + 1, why, budget)


def killed(run_dir: str, attempt: int, signum: int, pid: int | None) -> str | None:
    """Record an attempt killed by ``signum`` (at the step its ``goodput.json`` record had reached); the crash-loop
    verdict if it repeats the failure before it.  A kill that pitstop's fault injection made (``faults.jsonl`` names
    the process) is no failure of the job's: it is a test of its restarts, never a loop."""
    from pitstop.statefile import GOODPUT, read_state

    if pid is not None and killed_by_fault(run_dir, pid):
        return None

    doc = read_state(os.path.join(run_dir, "goodput.json"), GOODPUT, keep_aside=False, logger=None)
    attempts = doc["attempts"] if doc else []
    step = attempts[-1].get("step") if attempts else None
    failure = Failure(0, attempt, step, f"killed by signal {signum} ({signal.Signals(signum).name})")
    repeated = repeats.note(run_dir, failure)
    return repeats.verdict(failure, repeated, run_dir) if repeated is not None else None


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
