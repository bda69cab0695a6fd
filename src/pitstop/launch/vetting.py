"""Whether this node may be used, decided by its launcher before the first rendezvous and before each restart.

A node is not used when it is excluded in ``RUN_DIR/nodes.json`` (by anything: :mod:`pitstop.resilience.node_book`),
when it fails its health check (:mod:`pitstop.launch.health`), and, where the job can go on without it, when attempts
failed on it ``node_book.FAILURES_TO_EXCLUDE`` times or the silent-corruption check named it
(``RUN_DIR/suspects.json``): where the job cannot, those may be the job's own (a deterministic bug fails on any
node), and the crash-loop check and the restart budget decide as before. A job of one node marks nothing in the book
(it has nowhere else to go): a check that fails there stops it in one line.

What follows an exclusion: the job goes on without the node if ``strategy.nnodes``'s minimum is left (this node's
launcher ends with :class:`NodeExcluded`, exit status ``EXCLUDED_EXIT``), else it stops in one line naming the nodes
and why (exit status 2; the line is left for the other nodes' launchers as a crash loop's is, so they stop with it).
Under SLURM the nodes left are the allocation's (``SLURM_JOB_NODELIST``) less the excluded ones; elsewhere
``strategy.nnodes``'s maximum less the excluded ones.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

from pitstop.errors import PitstopError
from pitstop.launch import health, repeats
from pitstop.launch.health import Report
from pitstop.resilience import node_book
from pitstop.resilience.bad_node import expand_nodelist
from pitstop.resilience.node_book import NodeExcluded
from pitstop.statefile import integer, read_records, record, string

if TYPE_CHECKING:
    from pitstop.launch.plan import LaunchPlan

log = logging.getLogger("pitstop.launch")
REFORMS_FILE = "reforms.jsonl"  # (one line per rank of an agent that exited REFORM_EXIT, at which restart)
REFORM = record({"node": string, "agent": integer(0), "restart": integer(0)})


def suspected(run_dir: str, node: str) -> dict | None:
    """The newest silent-corruption suspect record that names ``node`` (``host``), or None."""
    mine = [s for s in node_book.read_suspects(run_dir) if s.get("host") == node]
    return mine[-1] if mine else None


def verdict(
    run_dir: str, node: str, nodes: tuple[int, int], check: Callable[[], Report] | None
) -> tuple[str, str] | None:
    """``(why, by)`` if ``node`` must not be used, else None. ``nodes``: ``strategy.nnodes``'s (min, max); ``check``:
    the health check to run (None: off). Failures and suspicion exclude a node only where the job can go on without
    it: where it cannot, they may be the job's own (a bug fails on any node), and the crash-loop check and the
    restart budget decide as before."""
    rec = node_book.read_book(run_dir).get(node, {})
    if rec.get("excluded"):
        was = rec["excluded"]
        return f"it was excluded from this run by {was['by']} ({was['why']})", str(was["by"])
    spare = goes_on_without(run_dir, node, nodes)
    failures = rec.get("failures", [])
    if spare and len(failures) >= node_book.FAILURES_TO_EXCLUDE:
        return f"{len(failures)} attempts failed on it (the last: {failures[-1]['why'][:200]})", "failures"
    suspect = suspected(run_dir, node) if spare else None
    if suspect is not None:
        return f"the silent-corruption check named it at step {suspect['step']} (suspects.json)", "sdc"
    if check is not None:
        report = check()
        if report.failed is not None:
            return report.line(), "health"
        log.info("%s", report.line())
    return None


def goes_on_without(run_dir: str, node: str, nodes: tuple[int, int], env: Mapping[str, str] = os.environ) -> bool:
    """Whether the job has ``strategy.nnodes``'s minimum left without ``node`` (and the nodes already excluded)."""
    low, high = nodes
    if high == 1:
        return False
    return _left(set(node_book.excluded(run_dir)) | {node}, high, env) >= low


def nodes_left(run_dir: str, max_nodes: int, env: Mapping[str, str] = os.environ) -> tuple[list[str], int]:
    """The excluded nodes, and how many of the job's nodes are left."""
    out = node_book.excluded(run_dir)
    return sorted(out), _left(set(out), max_nodes, env)


def _left(out: set[str], max_nodes: int, env: Mapping[str, str]) -> int:
    """How many of the job's nodes are not in ``out``: the allocation's (SLURM), else ``max_nodes`` less them."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if nodelist:
        return len([n for n in expand_nodelist(nodelist) if n not in out])
    return max(0, max_nodes - len(out))


def refuse(run_dir: str, node: str, why: str, by: str, nodes: tuple[int, int], text: str) -> PitstopError:
    """The error this node's launcher ends with: :class:`NodeExcluded` if the job goes on without it, else one line
    that stops the job (left for the other launchers as a crash loop's line is)."""
    low, high = nodes
    if high == 1:
        return PitstopError(f"{why}; the job has no other node (strategy.nnodes={text}): fix the node and run again")
    if node_book.exclude(run_dir, node, why, by):
        log.error("node %s is excluded from the job (%s): %s", node, by, why)
    excluded, left = nodes_left(run_dir, high)
    if left >= low:
        return NodeExcluded(
            f"node {node} is not used: {why}; the job goes on without it ({left} node(s) left, strategy.nnodes={text})"
        )
    book = node_book.excluded(run_dir)
    names = "; ".join(f"{n}: {book[n]['why'][:200]}" for n in excluded)
    line = (
        f"the job cannot go on: {len(excluded)} node(s) excluded ({names}) and strategy.nnodes={text} needs {low}, "
        f"{left} left; readmit a node (node_book.readmit) or lower the minimum"
    )
    repeats.mark(run_dir, line)
    return PitstopError(line)


def vet(
    run_dir: str, nodes: tuple[int, int], text: str, check: Callable[[], Report] | None, node: str | None = None
) -> tuple[float, float | None]:
    """Check this node before it is used (``check``: its health check, None when ``trainer.health`` is off); the
    seconds it took (the ledger's ``health``) and the matmul's timing for the record (the attempt records it once its
    setup is done: ``LaunchFacts.matmul_seconds``). Raises what :func:`refuse` returns when it must not be used."""
    t0 = time.perf_counter()
    node = node or node_book.node_name()
    reports: list[Report] = []

    def checked() -> Report:
        reports.append(check())  # type: ignore[misc]
        return reports[-1]

    found = verdict(run_dir, node, nodes, checked if check is not None else None)
    if found is not None:
        raise refuse(run_dir, node, found[0], found[1], nodes, text)
    return time.perf_counter() - t0, reports[-1].matmul if reports else None


def failed_here(
    run_dir: str, why: str, nodes: tuple[int, int], step: int | None = None, tag: str | None = None
) -> bool:
    """An attempt failed on this node: recorded (once per ``tag``: the ranks of one node fail in the same attempt);
    True when that makes the node one to exclude: ``FAILURES_TO_EXCLUDE`` failures, and the job can go on without it
    (:func:`verdict`)."""
    node = node_book.node_name()
    try:
        past = node_book.read_book(run_dir).get(node, {}).get("failures", [])
        if tag is not None and any(str(f["why"]).startswith(tag) for f in past):
            count = len(past)
        else:
            count = node_book.record_failure(run_dir, node, f"{tag} {why}" if tag else why, step)
    except OSError:
        return False
    return count >= node_book.FAILURES_TO_EXCLUDE and goes_on_without(run_dir, node, nodes)


def excluded_since(run_dir: str, since: float, node: str | None = None) -> dict | None:
    """This node's exclusion if it was decided at or after ``since`` (wall clock), else None."""
    rec = node_book.excluded(run_dir).get(node or node_book.node_name())
    return rec if rec is not None and float(rec.get("time", 0)) >= since - 1 else None


def stop_agent(agent_pid: int | None) -> None:
    """Tell torch's elastic agent of this rank to stop (SIGHUP: it stops every rank and does not restart them)."""
    if agent_pid:
        try:
            os.kill(agent_pid, signal.SIGHUP)
        except OSError:
            pass


def launcher_check(ctx: Any, cfg_yaml: str, run_dir: str, job: LaunchPlan) -> Callable[[], Report] | None:
    """The health check a launcher runs (in a fork of its warm server, ``ctx``), or None with ``trainer.health`` off."""
    if not job.trainer.health.enabled:
        return None
    node = node_book.node_name()
    return lambda: health.run_checks(ctx, cfg_yaml, run_dir, node)


def raise_if_excluded(run_dir: str, job: LaunchPlan, since: float) -> None:
    """After torch's agent stopped: if a rank of this node excluded it (at or after ``since``), the launcher's one
    error (the job goes on without this node, or it cannot go on)."""
    node = node_book.node_name()
    rec = excluded_since(run_dir, since, node)
    if rec is not None:
        raise refuse(run_dir, node, str(rec["why"]), str(rec["by"]), job.nodes, job.nodes_text) from None


def reform_allowance(job: LaunchPlan) -> int:
    """Restarts torch's agent may make beyond ``strategy.max_restarts``: one per node an elastic job may lose to an
    exclusion at run time (``trainer.straggler.action=exclude``), for the re-formations, which use no restart of the
    budget; the ranks hold real failures to ``strategy.max_restarts`` themselves (:func:`reforms`)."""
    low, high = job.nodes
    action = getattr(getattr(job.trainer, "straggler", None), "action", None)
    return high - low if action == "exclude" else 0


def _reforms_file(run_dir: str) -> str:
    return os.path.join(run_dir, REFORMS_FILE)


def note_reform(run_dir: str, agent_pid: int | None, restart: int) -> None:
    """A rank of this node's agent exits with ``REFORM_EXIT`` at its agent's restart ``restart``: remembered, so that
    the restart the agent makes for it is not counted against the budget (one line per agent and restart)."""
    if not agent_pid:
        return
    line = json.dumps({"node": node_book.node_name(), "agent": agent_pid, "restart": restart}) + "\n"
    try:
        with open(_reforms_file(run_dir), "a") as f:
            f.write(line)
    except OSError:
        pass


def reforms(run_dir: str, agent_pid: int | None) -> int:
    """How many of ``agent_pid``'s restarts were re-formations (not failures)."""
    if not agent_pid or not os.path.exists(_reforms_file(run_dir)):
        return 0
    seen = {r["restart"] for r in read_records(_reforms_file(run_dir), REFORM) if r["agent"] == agent_pid}
    return len(seen)
