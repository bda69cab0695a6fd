"""``strategy=ft``: one command starts a Lighthouse and the replica groups, each under its own supervisor.

    python -m recipe.train strategy=ft strategy.replicas=2 ckpt=async_dcp

Group ``K`` runs in ``RUN_DIR/replica{K}/`` (its train.log, metrics, ledger, sample log, summary) as a warm
attempt (a fork of a pre-imported server, as :mod:`pitstop.launch.supervisor` starts them). When it dies, its
supervisor starts it again up to ``strategy.max_restarts`` times, alone: the other groups go on, and the new
attempt heals from one of them. A group of several ranks (``strategy.nproc_per_node``) is a process of its own
running torch's elastic agent (as ``strategy=ddp`` does): when one of its ranks dies the agent restarts the group's
ranks, and only those. The durable checkpoints are the job's (``ckpt.dir``, shared): the group at
place 0 of each step's quorum writes them, so if every group dies the same command resumes from the newest.
``RUN_DIR/summary.json`` is the job's: each group's summary, restarts per group.

A restarted group heals from a live peer's state over pitstop's heal transport
(:mod:`pitstop.strategy.heal_transport`), which serves it only to, and accepts it only from, a process holding the
job's secret, ``PITSTOP_FT_SECRET``: when this launcher starts the Lighthouse it makes one
(``secrets.token_hex(32)``, unless the environment has one) before it starts any group, and the groups inherit it. A
job on several machines (``strategy.lighthouse`` given) needs the same value exported on every machine, e.g.
``export PITSTOP_FT_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')`` once, passed on by the
scheduler; a group without one stops in one line. It is never written to the config, the run dir, the logs or a
tracker. When this launcher starts the Lighthouse the whole job is on this machine, and every socket of it listens
on loopback: the Lighthouse, each group's manager server, store and heal transport, and Gloo
(``GLOO_SOCKET_IFNAME=lo`` unless set); with ``strategy.lighthouse`` given they listen on every interface (the
group's store excepted: its ranks share a machine), and the secret guards the heal's state.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import threading
import time
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Callable

from omegaconf import DictConfig, OmegaConf

from pitstop.config import schema
from pitstop.errors import CrashLoop
from pitstop.launch.attempt import start_warm
from pitstop.launch.plan import LaunchPlan
from pitstop.launch.supervisor import _exit_on_signal, attempts
from pitstop.resilience.preempt import LauncherNotice, Preempted
from pitstop.telemetry.metrics import write_json_atomic
from pitstop.parts import launch_facts

if TYPE_CHECKING:
    from torchft.coordination import LighthouseServer

log = logging.getLogger("pitstop.launch")


def replica_dir(run_dir: str, k: int) -> str:
    return os.path.join(run_dir, f"replica{k}")


def job_secret() -> None:
    """The job's secret in this process's environment (kept if there is one), for the groups it starts."""
    from pitstop.strategy.ft_keys import SECRET_ENV

    os.environ.setdefault(SECRET_ENV, secrets.token_hex(32))


class LocalLighthouse:
    """A torchft Lighthouse on loopback, and the address its groups reach it by (``http://127.0.0.1:PORT``;
    torchft's own ``address()`` names the host, which a server on loopback does not answer on)."""

    def __init__(self, server: LighthouseServer):
        self._server = server
        self._port = int(server.address().rstrip("/").rsplit(":", 1)[1])

    def address(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def shutdown(self) -> None:
        self._server.shutdown()


def start_lighthouse(strategy: schema.FT) -> LocalLighthouse:
    """A torchft Lighthouse in this process, on loopback (its server runs in threads of its own): the process that
    starts it starts the whole job on this machine, so it holds the job's secret too (:func:`job_secret`)."""
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as e:
        from pitstop.errors import ConfigError

        raise ConfigError(f"strategy=ft needs torchft ({e}): pip install -e '.[ft]'") from None
    job_secret()
    return LocalLighthouse(
        LighthouseServer(
            bind="127.0.0.1:0",
            min_replicas=strategy.min_replicas,
            join_timeout_ms=100,  # a quorum forms this long after the first group asks (the others join later)
            quorum_tick_ms=20,
            heartbeat_timeout_ms=strategy.heartbeat_ms,
        )
    )


def check_room(job: LaunchPlan) -> None:
    """Room on this machine for the groups it starts (CPU cores, or a GPU per rank of a group)."""
    from pitstop.launch.rendezvous import check_capacity, on_gpus

    s = job.replica_groups
    assert s is not None
    if s.replica_id is not None or on_gpus(s):  # a group's ranks need a GPU each (groups here may share them)
        check_capacity(s, s.nproc_per_node)
    else:  # every process of every group on this machine's cores
        check_capacity(s, s.replicas * s.nproc_per_node, "strategy.replicas x strategy.nproc_per_node")


def run_group(cfg: DictConfig, job: LaunchPlan, run_dir: str) -> dict:
    """Group ``strategy.replica_id`` of a job started on several machines, restarted alone: its ranks under torch's
    elastic agent, restarted together (which checks this machine's room for them), or its one rank supervised."""
    from pitstop.launch.elastic import elastic
    from pitstop.launch.supervisor import supervise

    s = job.replica_groups
    assert s is not None and s.replica_id is not None
    if job.ranks > 1:
        return elastic(cfg, job.group(), replica_dir(run_dir, s.replica_id))
    return supervise(cfg, job, replica_dir(run_dir, s.replica_id))


def run_replicas(cfg: DictConfig, job: LaunchPlan, run_dir: str) -> dict:
    """``strategy=ft`` started here: a Lighthouse on loopback and ``strategy.replicas`` groups, each restarted
    alone (their summaries, restarts and heals in ``RUN_DIR/summary.json``)."""
    import multiprocessing as mp

    check_room(job)  # (no torch on a machine without GPUs: a refused job starts nothing)
    strategy = job.replica_groups
    assert strategy is not None
    ranks = job.ranks
    if not strategy.lighthouse:  # the whole job on this machine (a Lighthouse elsewhere: the secret is the user's)
        # (before any process of the job starts: the warm server's attempts and the groups' agents inherit both)
        job_secret()
        if os.path.isdir("/sys/class/net/lo"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # Gloo's pairs listen on loopback alone
    # (groups of one rank: attempts of the warm server, started now; several: each group's agent has its own)
    ctx = start_warm(cfg, job) if ranks == 1 else mp.get_context("spawn")
    groups = strategy.replicas
    os.makedirs(run_dir, exist_ok=True)
    lighthouse = start_lighthouse(strategy) if not strategy.lighthouse else None
    address = strategy.lighthouse or lighthouse.address()
    job_start = launch_facts.job_start()
    grace = job.grace
    results: dict[int, dict] = {}
    errors: dict[int, BaseException] = {}
    children: list[BaseProcess] = []
    started: dict[int, int] = {k: 0 for k in range(groups)}

    def group(k: int) -> None:
        own = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        own.strategy.replica_id, own.strategy.lighthouse = k, address

        def seen(child: BaseProcess) -> None:
            children.append(child)
            started[k] += 1

        try:
            if ranks > 1:  # the group's own elastic agent, in a process of its own, restarts its ranks
                results[k] = agent_group(OmegaConf.to_yaml(own), job.group(), replica_dir(run_dir, k), k, seen, notice)
            else:
                results[k] = attempts(
                    ctx,
                    OmegaConf.to_yaml(own),
                    replica_dir(run_dir, k),
                    job,
                    job_start,
                    started=seen,
                    name=f"replica{k}-attempt",
                    notice=notice,
                )
        except BaseException as e:  # noqa: BLE001 - reported below, after every group ended
            if isinstance(e, CrashLoop):  # a restart cannot fix it: the job stops (the others save and leave)
                e = CrashLoop(str(e) if str(e).startswith("replica group") else f"replica group {k}: {e}")
                errors[k] = e
                notice.hand_on(notice.signals[0] if notice.signals else signal.SIGTERM, f"replica group {k} loops")
                return
            errors[k] = e
            running = groups - len(results) - len(errors)
            if running and running < strategy.min_replicas and notice.signals:  # they cannot step any more:
                notice.hand_on(notice.signals[0], f"replica group {k} ended, {running} left of min_replicas")

    main = threading.current_thread() is threading.main_thread()
    # (a scheduler's USR1/USR2 notice to the launcher goes to every group's attempt; none starts after it)
    notice = LauncherNotice(job.trainer.preempt_signals, lambda: children)
    previous = signal.signal(signal.SIGTERM, _exit_on_signal) if main else None
    threads = [
        threading.Thread(target=group, args=(k,), name=f"pitstop-replica{k}", daemon=True) for k in range(groups)
    ]
    t0 = time.time()
    try:
        notice.install()
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.5)
    finally:
        stop_all(children, grace + (90 if ranks > 1 else 30))  # (an agent waits up to grace + 30 s for its ranks)
        notice.close()  # (after the joins: a notice meanwhile must not kill the launcher)
        if main:
            signal.signal(signal.SIGTERM, previous)
        if lighthouse is not None:
            lighthouse.shutdown()
    if ranks > 1:  # (one agent process per group; its attempts are those of its ledger that this launch started)
        started = {k: this_launch_attempts(run_dir, k, job_start - 0.01) for k in range(groups)}
    out = write_job_summary(run_dir, groups, ranks, results, errors, started, time.time() - t0)
    loops = [errors[k] for k in sorted(errors) if isinstance(errors[k], CrashLoop)]
    if loops:  # (exit status 2 and no requeue, whatever the other groups did: the same failure would follow)
        raise loops[0]
    if errors and not results:  # no group finished the job
        failed = [errors[k] for k in sorted(errors) if not isinstance(errors[k], Preempted)]
        if not failed:
            notice.forward()  # (submitit's requeue, once the groups' saves are durable)
            raise Preempted(f"preempted after a notice; run the same command again to resume ({run_dir})")
        raise failed[0]  # (not "run the same command again": a group failed for good)
    if errors:  # (a group that left on a notice, its node going away, or failed for good: the others finished)
        log.warning(
            "replica groups %s ended before the job; the others finished it: %s",
            sorted(errors),
            out["ft_job"]["errors"],
        )
    return out


def stop_all(children: list[BaseProcess], patience: float) -> None:
    """On the way out of the launcher (finished, or interrupted): a notice to every group still running, then a
    kill for those still alive after ``patience`` seconds."""
    for child in children:
        if child.is_alive():
            child.terminate()
    for child in children:
        child.join(patience)
        if child.is_alive():
            child.kill()


def write_job_summary(
    run_dir: str,
    groups: int,
    ranks: int,
    results: dict[int, dict],
    errors: dict[int, BaseException],
    started: dict[int, int],
    wall: float,
) -> dict:
    """``RUN_DIR/summary.json``, the job's: the first group's summary (the same parameters in every group), with the
    job's facts under ``ft_job`` (restarts, heals and discarded steps per group, each group's end, the errors)."""
    facts = {
        "replicas": groups,
        "ranks_per_group": ranks,
        "ft": replica_account(run_dir, groups),
        "wall_seconds": round(wall, 3),
        "attempts_per_group": {str(k): started[k] for k in range(groups)},
        "groups": {
            str(k): {key: results[k].get(key) for key in ("final_step", "params_sha256", "ft")} for k in sorted(results)
        },
        "errors": {str(k): str(e).splitlines()[0][:300] for k, e in errors.items()},
    }
    out = {**results[min(results)], "ft_job": facts} if results else {"ft_job": facts}
    write_json_atomic(os.path.join(run_dir, "summary.json"), out)
    return out


def agent_group(
    cfg_yaml: str, job: LaunchPlan, run_dir: str, k: int, started: Callable[[BaseProcess], None], notice: LauncherNotice
) -> dict:
    """Replica group ``k`` of several ranks: a fresh process runs torch's elastic agent for them (its signal
    handlers need a main thread of their own); its result, or why it failed, as :func:`attempts` gives them. The
    agent starts with the scheduler's notices blocked: one that comes before its handlers are in waits for them
    (``JobNotice.install``), and the launcher's ``notice`` hands it any that reaches the launcher."""
    import json
    import multiprocessing as mp

    from pitstop.errors import ConfigError, PitstopError
    from pitstop.launch.repeats import CRASH_LOOP_EXIT
    from pitstop.notices import notices_blocked
    from pitstop.resilience.preempt import PREEMPTED_EXIT
    from pitstop.parts.launch_facts import error_file

    os.makedirs(run_dir, exist_ok=True)
    errors = error_file(run_dir)
    if os.path.exists(errors):
        os.remove(errors)
    if notice.received is not None:  # (the job was told to stop before this group started)
        raise Preempted(f"preempted ({notice.received.name}); run the same command again to resume ({run_dir})")
    child = mp.get_context("spawn").Process(
        target=_agent_main, args=(cfg_yaml, job, run_dir, k), name=f"pitstop-replica{k}-agent"
    )
    with notices_blocked():
        child.start()
        started(child)
    if notice.received is not None:  # (one that came while it was starting)
        try:
            os.kill(child.pid, notice.received)
        except OSError:
            pass
    child.join()
    if child.exitcode == 0:
        with open(os.path.join(run_dir, "summary.json")) as f:
            return json.load(f)
    if child.exitcode == PREEMPTED_EXIT:
        raise Preempted(f"preempted after a notice; run the same command again to resume ({run_dir})")
    try:
        with open(errors) as f:
            why = f.read().strip()
    except OSError:
        why = f"its agent ended with exit status {child.exitcode}"
    raise {2: ConfigError, CRASH_LOOP_EXIT: CrashLoop}.get(child.exitcode or 0, PitstopError)(why)


def _agent_main(cfg_yaml: str, job: LaunchPlan, run_dir: str, k: int) -> None:
    """The process of a replica group of several ranks: their elastic agent (restarts: ``strategy.max_restarts``)."""
    import sys

    from pitstop.errors import ConfigError
    from pitstop.launch.elastic import elastic
    from pitstop.launch.repeats import CRASH_LOOP_EXIT
    from pitstop.resilience.preempt import PREEMPTED_EXIT
    from pitstop.parts.launch_facts import record_error

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"[replica{k} agent] %(levelname)s %(message)s")
    try:
        elastic(OmegaConf.create(cfg_yaml), job, run_dir)
    except Preempted:
        raise SystemExit(PREEMPTED_EXIT) from None
    except BaseException as e:  # noqa: BLE001 - one line for the launcher, which names the group
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        record_error(run_dir, f"replica group {k}: {text if isinstance(e, CrashLoop) else text[:300]}")
        code = 2 if isinstance(e, ConfigError) else CRASH_LOOP_EXIT if isinstance(e, CrashLoop) else 1
        raise SystemExit(code) from None


def this_launch_attempts(run_dir: str, k: int, since: float) -> int:
    """Attempts of group ``k`` in its ledger that started at ``since`` or later (this launch's)."""
    import json

    try:
        with open(os.path.join(replica_dir(run_dir, k), "goodput.json")) as f:
            return sum(1 for a in json.load(f)["attempts"] if float(a.get("start", 0.0)) >= since)
    except (OSError, ValueError, KeyError):
        return 0


def replica_account(run_dir: str, groups: int) -> dict:
    """Failures, restarts, heals and discarded steps of every group over all its attempts (their ledgers)."""
    import json
    import statistics

    per, heals = {}, []
    for k in range(groups):
        try:
            with open(os.path.join(replica_dir(run_dir, k), "goodput.json")) as f:
                attempts = json.load(f)["attempts"]
        except (OSError, ValueError, KeyError):
            attempts = []
        own = [h["seconds"] for a in attempts for h in (a.get("ft") or {}).get("heals", [])]
        heals += own
        per[str(k)] = {
            "attempts": len(attempts),
            "restarts": max(0, len(attempts) - 1),
            "failures": sum(1 for a in attempts[:-1] if a.get("status") != "finished")
            + (1 if attempts and attempts[-1].get("status") == "failed" else 0),
            "heals": len(own),
            "discarded_steps": sum((a.get("ft") or {}).get("discarded_steps", 0) for a in attempts),
            "quorum_seconds": round(sum((a.get("ft") or {}).get("quorum_seconds", 0.0) for a in attempts), 3),
        }
    return {
        "groups": per,
        "heals": len(heals),
        "heal_seconds_median": round(statistics.median(heals), 4) if heals else None,
        "discarded_steps": sum(g["discarded_steps"] for g in per.values()),
    }
