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

import logging
import os
import signal
import socket
import threading
import time
import uuid
from enum import Enum
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from pitstop.train import attempt as attempts
from pitstop.train.attempt import LaunchFacts, error_file, facts_from_env, process_start_wall, record_error
from pitstop.config import validate
from pitstop.errors import ConfigError, PitstopError
from pitstop.resilience.preempt import PREEMPTED_EXIT, Preempted
from pitstop.resilience.watchdog import HUNG_EXIT

log = logging.getLogger("pitstop.launch.launcher")


def nnodes(cfg: DictConfig) -> tuple[int, int]:
    """``strategy.nnodes``: N or "MIN:MAX" (elastic: the job runs on any number of nodes in the range)."""
    value = OmegaConf.select(cfg, "strategy.nnodes", default=1)
    text = str(value)
    try:
        lo, _, hi = text.partition(":")
        low, high = int(lo), int(hi or lo)
    except ValueError:
        low = high = 0
    if isinstance(value, bool) or low < 1 or high < low:
        raise ConfigError(f"strategy.nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {value!r}")
    return low, high


def nproc(cfg: DictConfig) -> int:
    n = OmegaConf.select(cfg, "strategy.nproc_per_node", default=1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"strategy.nproc_per_node must be a positive integer, got {n!r}")
    return n


class LaunchMode(str, Enum):
    IN_PROCESS = "in_process"  # one rank, run right here
    SUPERVISED = "supervised"  # one rank in a child process, started again when it dies (trainer.max_restarts)
    ELASTIC = "elastic"  # strategy.nproc_per_node ranks, started (and restarted) by torch's elastic agent
    CHILD = "child"  # this process already is one rank or attempt that a launcher started (torchrun,
    # SLURM, the elastic agent, pitstop's supervisor): run it, restarts are theirs


def started_by_launcher(env: Mapping[str, str]) -> bool:
    """This process is one rank that a launcher (torchrun, SLURM, torch's elastic agent) started: ``RANK`` is
    set. (pitstop's own supervisor hands its attempts :class:`LaunchFacts` instead of running this entry.)"""
    return "RANK" in env


def launch_mode(nproc_per_node: int, max_restarts: int, env: Mapping[str, str], max_nodes: int = 1) -> LaunchMode:
    """How ``recipe.train`` runs the job: a pure function of the config and the environment."""
    if started_by_launcher(env):
        return LaunchMode.CHILD
    if nproc_per_node > 1 or max_nodes > 1:
        return LaunchMode.ELASTIC
    return LaunchMode.SUPERVISED if max_restarts > 0 else LaunchMode.IN_PROCESS


def max_restarts(cfg: DictConfig) -> int:
    restarts = OmegaConf.select(cfg, "trainer.max_restarts", default=0) or 0
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise ConfigError(f"trainer.max_restarts must be an integer >= 0, got {restarts!r}")
    return restarts


def run(cfg: DictConfig, run_dir: str) -> dict:
    from pitstop.data.loader.server import quiet_resource_tracker

    # Ranks and attempts use the resource tracker this process starts: their data workers' semaphores too.
    quiet_resource_tracker()
    n, restarts, (min_nodes, max_nodes) = nproc(cfg), max_restarts(cfg), nnodes(cfg)
    mode = launch_mode(n, restarts, os.environ, max_nodes)
    if mode == LaunchMode.SUPERVISED:
        return supervise(cfg, run_dir, restarts)
    if mode in (LaunchMode.IN_PROCESS, LaunchMode.CHILD):
        from pitstop.train.runner import Runner

        if mode == LaunchMode.CHILD and "RANK" in os.environ:  # a rank torchrun/SLURM started: train.log or rankR.log
            os.makedirs(run_dir, exist_ok=True)
            _log_to(run_dir, int(os.environ["RANK"]))

        return Runner(cfg, run_dir, facts_from_env(os.environ)).run()
    validate(cfg)
    _check_capacity(cfg, n)
    endpoint, run_id = _rendezvous(cfg, run_dir, max_nodes)
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from pitstop.resilience.preempt import JobNotice, parse_signals

    # Warm ranks: the agent starts (and restarts) them as forks of a pre-imported server, not as fresh
    # interpreters; the first ones are charged this job's start (the server's imports are their program start).
    warm = OmegaConf.select(cfg, "trainer.warm_restarts", default=True)
    method = warm_context(cfg).get_start_method() if warm else "spawn"
    job_start = attempts.job_start()
    # Preemption notices are the job's: the agent stops on the first (ours, from the scheduler or handed on by
    # a rank), gives every rank the same signal and waits for their saves; it never restarts a preempted rank.
    notices = parse_signals(OmegaConf.select(cfg, "trainer.preempt_signals", default=["SIGTERM"]))
    grace = float(OmegaConf.select(cfg, "trainer.preempt_grace_seconds", default=30) or 0)
    torch_handles = [s for s in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if signal.Signals[s] not in notices]
    timeout = int(float(OmegaConf.select(cfg, "strategy.timeout", default=300)))
    if max_nodes > 1:
        # A fresh bootstrap store per rendezvous round: a node that joins later starts at restart count 0, so
        # the ranks' per-attempt key prefix cannot tell the rounds apart in a store shared across rounds.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=n,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={
            "join_timeout": timeout,
            "read_timeout": timeout,
            "timeout": timeout,
            "last_call_timeout": int(OmegaConf.select(cfg, "strategy.last_call_seconds", default=5)),
            "keep_alive_interval": 1,
            "keep_alive_max_attempt": 5,
        },
        max_restarts=int(OmegaConf.select(cfg, "strategy.max_restarts", default=0) or 0),
        monitor_interval=0.2,
        start_method=method,
        shutdown_timeout=int(grace) + 30,
        signals_to_handle=",".join(torch_handles),
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(run_dir, "elastic")),
    )
    nodes = f"{min_nodes}" if min_nodes == max_nodes else f"{min_nodes}:{max_nodes}"
    log.info(
        "launching %d ranks on this node of %s (rendezvous %s, max_restarts=%d)",
        n,
        nodes,
        endpoint,
        config.max_restarts,
    )
    notice = JobNotice(notices, lambda msg, sig: SignalException(msg, sigval=sig)).install()
    try:
        results = elastic_launch(config, worker)(
            OmegaConf.to_yaml(cfg, resolve=True), run_dir, method, job_start, os.getpid()
        )
    except RendezvousClosedError:
        raise PitstopError(
            f"the job's rendezvous at {endpoint} is closed: the job already ended or failed on "
            f"another node (see {run_dir}/train.log); start a new job (a new run_dir resumes nothing, "
            f"the same one resumes from its checkpoints)"
        ) from None
    except (RendezvousTimeoutError, RendezvousConnectionError) as e:
        raise PitstopError(
            f"this node could not join the job's rendezvous at {endpoint} within strategy.timeout="
            f"{timeout} s ({type(e).__name__}: {_first_line_of(e)}); start node 0 first, check the "
            f"address and that strategy.nnodes={OmegaConf.select(cfg, 'strategy.nnodes')} nodes "
            f"come up"
        ) from None
    except SignalException as e:
        if e.sigval not in notices:
            raise
        raise Preempted(
            f"preempted after a notice ({e.sigval.name}); run the same command again to resume ({run_dir})"
        ) from None
    except ChildFailedError as e:
        rank, failure = _root_failure(e.failures)
        if getattr(failure, "exitcode", None) == PREEMPTED_EXIT:
            raise Preempted(f"preempted after a notice; run the same command again to resume ({run_dir})") from None
        if getattr(failure, "exitcode", None) == HUNG_EXIT:
            raise PitstopError(
                f"rank {rank} hung (no progress within trainer.hang's limits); its stacks are in "
                f"{run_dir}/hang.rank{rank}.txt, see {run_dir}/train.log and rank*.log"
            ) from None
        why = _first_line(failure)
        if "timeout" in why.lower() or "timed out" in why.lower():
            why += f"; a peer stopped responding for strategy.timeout={OmegaConf.select(cfg, 'strategy.timeout')} s"
        silent = _silent_ranks(os.path.join(run_dir, "elastic"), config.run_id, n, rank)
        if silent and _lost_peer(why):  # the agent saw the peer's error first
            raise PitstopError(
                f"rank {', '.join(map(str, silent))} failed (no error of its own: killed by a signal, "
                f"e.g. SIGKILL or the OOM killer; rank {rank} then lost its peer: {why}); see "
                f"{run_dir}/train.log and rank*.log"
            ) from None
        raise PitstopError(f"rank {rank} failed ({why}); see {run_dir}/train.log and rank*.log") from None
    finally:
        notice.close()
    return results[min(results)]  # keyed by global rank: this node's first


def worker(
    cfg_yaml: str, run_dir: str, method: str = "spawn", job_start: float | None = None, agent: int | None = None
) -> dict:
    """The entry point of each rank that torch's elastic agent starts: a fork of the agent's pre-imported server
    (``method`` forkserver: warm) or a fresh interpreter (spawn). ``agent``: the launching process, told of a
    preemption notice. The agent's facts (its arguments and ``RANK``/``TORCHELASTIC_RESTART_COUNT``) become
    this attempt's :class:`LaunchFacts`."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    # Program start: the first ranks count from the job's start (the launching process's imports, the
    # rendezvous, and a server's imports or their own); a restarted rank from its own start (a fork: now).
    if restart == 0 and job_start is not None:
        start = job_start
    elif method == "forkserver":
        start = time.time()
    else:
        start = process_start_wall()
    facts = LaunchFacts(program_start=start, launched=True, restart=restart, start_method=method, agent_pid=agent)
    return run_attempt(cfg_yaml, run_dir, facts, int(os.environ["RANK"]))


def run_attempt(cfg_yaml: str, run_dir: str, facts: LaunchFacts, rank: int = 0) -> dict:
    """One attempt in a process a launcher started (pitstop's supervisor or torch's elastic agent): log to the
    run dir, run the Runner, and end as the launcher expects. A preemption notice exits with PREEMPTED_EXIT.
    Under the supervisor (``facts.supervised``) any failure is written down in one line (read by the
    supervisor) and the exit status says its kind (2: a configuration error, not worth a restart); under the
    agent the exception propagates (the agent records it)."""
    from pitstop.train.runner import Runner

    _log_to(run_dir, rank)
    logger = logging.getLogger("pitstop")
    try:
        return Runner(OmegaConf.create(cfg_yaml), run_dir, facts).run()
    except Preempted as e:
        logger.warning("%s", e)
        raise SystemExit(PREEMPTED_EXIT) from None
    except PitstopError as e:
        logger.error("%s", e)
        if not facts.supervised:
            raise
        record_error(run_dir, str(e))
        raise SystemExit(2 if isinstance(e, ConfigError) else 1) from None
    except BaseException as e:
        if not facts.supervised:
            raise
        logger.exception("attempt failed")
        record_error(run_dir, f"{type(e).__name__}: {e}".splitlines()[0][:300])
        raise SystemExit(1) from None


def warm_context(cfg: DictConfig) -> Any:
    """A multiprocessing context whose children start warm: a fork server (a clean process: no threads, no
    CUDA context) imports torch, the runner and every module the config names (``_target_``) once; each
    attempt is then a fork of it and pays no interpreter start or imports again."""
    import multiprocessing as mp

    from pitstop.config.build import target_modules
    from pitstop.data.loader.server import entry_point_imports

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    # Imported lazily by every attempt: torch._dynamo by the optimizer's constructor (~1 s of a cold attempt's
    # init here), fsspec by the data index (~0.3 s), pitstop.goodput.model at the end. What the entry point imports
    # too (each child runs it again as __mp_main__).
    modules = {
        "torch",
        "torch._dynamo",
        "fsspec",
        "pitstop.goodput.model",
        "pitstop.train.runner",
        "pitstop.launch.launcher",
        *entry_point_imports(),
        *target_modules(cfg),
    }
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(sorted(modules))
    return ctx


def supervise(cfg: DictConfig, run_dir: str, max_restarts: int) -> dict:
    """``strategy=single`` with ``trainer.max_restarts=N``: run the job in a child process and start it
    again (it resumes from its newest checkpoint) when it dies — killed, crashed, out of memory — up to N
    times. A configuration error (exit status 2) would fail again, so it is not restarted; data and
    storage errors may be transient (a remote store down for a while) and are.

    Restarts are warm (:func:`warm_context`): attempts are forks of a pre-imported server, so a restart
    costs the detection of the failure, the fork, init and restore, not a cold start. The first attempt's
    ledger counts from the supervisor's own start (its imports and the server's are program start)."""
    import multiprocessing as mp

    validate(cfg)
    os.makedirs(run_dir, exist_ok=True)
    cfg_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    warm = OmegaConf.select(cfg, "trainer.warm_restarts", default=True)
    ctx = warm_context(cfg) if warm else mp.get_context("spawn")
    job_start = attempts.job_start()
    grace = float(OmegaConf.select(cfg, "trainer.preempt_grace_seconds", default=30) or 0)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_signal) if main else None  # SIGTERM -> the finally runs
    try:
        return _attempts(ctx, cfg_yaml, run_dir, max_restarts, job_start, grace)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)  # a later job in this process (a sweep) gets the old one


def _attempts(ctx: Any, cfg_yaml: str, run_dir: str, max_restarts: int, job_start: float, grace: float = 30.0) -> dict:
    import json

    errors = error_file(run_dir)
    for attempt in range(max_restarts + 1):
        if os.path.exists(errors):
            os.remove(errors)
        # The attempt's program start: the job's start for the first, this moment for a restart (the clock of
        # /proc's process start times is too coarse for sub-second restarts).
        facts = LaunchFacts(
            program_start=job_start if attempt == 0 else time.time(),
            launched=True,
            supervised=True,
            restart=attempt,
            start_method=ctx.get_start_method(),  # recorded in goodput.json (forkserver: a warm attempt)
        )
        child = ctx.Process(target=run_attempt, args=(cfg_yaml, run_dir, facts), name=f"pitstop-attempt{attempt}")
        child.start()
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
        if attempt < max_restarts:
            log.warning(
                "attempt %d failed (%s); restarting (%d of trainer.max_restarts=%d)",
                attempt + 1,
                why,
                attempt + 1,
                max_restarts,
            )
    raise PitstopError(
        f"the job failed {max_restarts + 1} times (last: {why}); "
        f"trainer.max_restarts={max_restarts} is used up — see {run_dir}/train.log"
    )


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _log_to(run_dir: str, rank: int) -> None:
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


def _check_capacity(cfg: DictConfig, n: int) -> None:
    import torch

    if torch.cuda.is_available() and OmegaConf.select(cfg, "strategy.device", default="auto") != "cpu":
        have, what = torch.cuda.device_count(), "GPUs"
    else:
        have, what = os.cpu_count() or 1, "CPU cores"
    if n > have and not OmegaConf.select(cfg, "strategy.oversubscribe", default=False):
        raise ConfigError(
            f"strategy.nproc_per_node={n} but this machine has {have} {what}; "
            f"lower it or set strategy.oversubscribe=true"
        )


def _rendezvous(cfg: DictConfig, run_dir: str, max_nodes: int) -> tuple[str, str]:
    """The rendezvous endpoint and job id. One node: a free local port and a fresh id. Several: every node
    is given the same ``strategy.rdzv_endpoint`` (node 0's address, whose agent hosts the store) and the id is
    the run dir's name (pinned, the same on every node)."""
    endpoint = OmegaConf.select(cfg, "strategy.rdzv_endpoint", default=None)
    slurm_nodes = int(os.environ.get("SLURM_STEP_NUM_NODES", "1") or 1)  # srun's step (submitit's tasks)
    if slurm_nodes > max_nodes:
        raise ConfigError(
            f"this SLURM job step runs on {slurm_nodes} nodes but strategy.nnodes="
            f"{OmegaConf.select(cfg, 'strategy.nnodes')}; set strategy.nnodes={slurm_nodes} "
            f"(= hydra.launcher.nodes) and strategy.rdzv_endpoint=slurm"
        )
    if endpoint == "slurm":
        endpoint = slurm_endpoint(os.environ, OmegaConf.select(cfg, "strategy.master_port", default=None))
    if max_nodes == 1 and not endpoint:
        return f"127.0.0.1:{_port(cfg)}", f"pitstop-{uuid.uuid4().hex[:8]}"
    if not endpoint or ":" not in str(endpoint):
        raise ConfigError(
            f"strategy.nnodes={OmegaConf.select(cfg, 'strategy.nnodes')} needs "
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


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[07-08,11],cpu3`` -> ``gpu07``."""
    import re

    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ConfigError(f"cannot read the SLURM node list {nodelist!r}; give strategy.rdzv_endpoint=HOST:PORT")
    prefix, ranges = m.group(1), m.group(2)
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")


def _first_line_of(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[0][:200] if lines else "no message"


def _port(cfg: DictConfig) -> int:
    want = OmegaConf.select(cfg, "strategy.master_port", default=None)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", int(want or 0)))
        except OSError as e:
            raise ConfigError(
                f"strategy.master_port={want} is not free ({e.strerror}); pick another or leave it null"
            ) from None
        return s.getsockname()[1]


# A rank that failed only because a peer went away: what it says explains nothing.
_LOST_PEER = (
    "connection closed by peer",
    "connection reset by peer",
    "remote worker crashing",
    "broken pipe",
    "communicator was aborted",
)


def _lost_peer(message: str) -> bool:
    return any(p in message.lower() for p in _LOST_PEER)


def _root_failure(failures: Mapping[int, Any]) -> tuple[int, Any]:
    """The failure that explains the others: a preempted or hung rank, else one killed or failing on its own,
    before ranks that then lost their peer (the earliest of a kind; a killed rank's exit may be noticed after
    its peer's error, so the earliest failure alone can name the wrong rank)."""

    def rank_of(item: tuple[int, Any]) -> tuple[int, float]:
        failure = item[1]
        code = getattr(failure, "exitcode", None)
        kind = 0 if code in (PREEMPTED_EXIT, HUNG_EXIT) else 2 if _lost_peer(_first_line(failure)) else 1
        return kind, float(getattr(failure, "timestamp", 0) or 0)

    return min(failures.items(), key=rank_of)


def _silent_ranks(log_dir: str, run_id: str, n: int, reported: int) -> list[int]:
    """The ranks of this launch's last attempt that left no error file (the agent's logs under ``log_dir``):
    ranks that did not raise but died, by a signal. The agent reports one failure, the first it noticed; a
    SIGKILLed rank's exit may be noticed after the error of the peer that lost it."""
    import glob

    attempts = glob.glob(os.path.join(glob.escape(log_dir), f"{glob.escape(run_id)}_*", "attempt_*"))
    if not attempts:
        return []
    last = max(attempts, key=lambda d: int(d.rsplit("_", 1)[1]) if d.rsplit("_", 1)[1].isdigit() else -1)
    return [r for r in range(n) if r != reported and not os.path.exists(os.path.join(last, str(r), "error.json"))]


def _first_line(failure: Any) -> str:
    msg = getattr(failure, "message", None) or ""
    if isinstance(msg, dict):
        msg = msg.get("message", "") or str(msg)
    lines = [ln for ln in str(msg).splitlines() if ln.strip()]
    code = getattr(failure, "exitcode", None)
    return (lines[-1][:300] if lines else "no message") + (f", exit code {code}" if code is not None else "")
