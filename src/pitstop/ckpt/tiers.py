"""Where checkpoints go: the durable tier (``ckpt.dir``) and the optional local tier (``ckpt.local``: tmpfs
or a node-local disk, saved more often, purged once a durable save is newer), each with its root, retention,
schedule and the loop time spent in its saves."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from pitstop import fsurl
from pitstop.ckpt import layout
from pitstop.config import checks
from pitstop.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from pitstop.ckpt.contract import SaveRecord, StrategyLike
    from pitstop.ckpt.schedule import SaveSchedule
    from pitstop.goodput.interval import AutoInterval


log = logging.getLogger("pitstop.ckpt")


class Tier:
    """One place checkpoints go: its root, retention, schedule and the loop's measured time in its saves."""

    def __init__(
        self,
        name: str,
        root: str,
        keep_last_k: int,
        interval_steps: int | None,
        interval_seconds: float | None,
        save_last: bool,
    ):
        self.name, self.root, self.keep_last_k = name, root, keep_last_k
        self.interval_steps, self.interval_seconds, self.save_last = interval_steps, interval_seconds, save_last
        self.schedule: SaveSchedule | None = None  # made in setup()
        self.blocked_total = 0.0

    def make_schedule(self, auto: AutoInterval | None) -> None:
        """``auto``: an AutoInterval for ``interval=auto`` (then the fixed intervals are null), else None."""
        from pitstop.ckpt.schedule import SaveSchedule

        self.schedule = SaveSchedule(self.interval_steps, self.interval_seconds, self.save_last, auto)


def copied(record: SaveRecord) -> None:
    """(the copy's thread) A local save's copy to the partner node ended (``ckpt.local.replicas``)."""
    record.copied = time.perf_counter()


def complete_seconds(
    records: list[SaveRecord], tier: str, is_async: bool, replicated: bool, last: int | None = 5
) -> float:
    """A save of ``tier``'s start to complete, the mean over its newest ``last`` good saves (None: all), for
    ``interval=auto`` (never a save before the previous one is complete) and the summary: an async save is complete
    once written; a local save copied to a partner node (``replicated``), once its copy ended, with any backend (the
    copy is off the loop); a synchronous save without a copy, when the loop goes on (0)."""
    if replicated:
        done = [r.copied - r.started for r in records if r.tier == tier and r.error is None and r.copied]
    elif is_async:
        done = [r.total_seconds for r in records if r.tier == tier and r.error is None and r.total_seconds]
    else:
        return 0.0
    done = done[-last:] if last else done
    return sum(done) / len(done) if done else 0.0


def figures(records: list[SaveRecord], tier: str) -> dict:
    """A tier's figures for ``summary.json``: its saves, failures and their costs."""
    mine = [r for r in records if r.tier == tier]
    ok = [r for r in mine if r.error is None]
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    return {
        "saves": len(ok),
        "failures": sum(1 for r in mine if r.error is not None),
        "block_seconds_total": round(sum(r.block_seconds for r in mine), 4),
        "block_seconds_mean": round(mean([r.block_seconds for r in ok]), 5),
        "total_seconds_mean": round(mean([r.total_seconds or 0.0 for r in ok]), 5),
        "bytes_last": ok[-1].bytes if ok else 0,
    }


LOCAL_AUTO_DIR = f"/dev/shm/pitstop-{os.getuid()}"  # (per user: the local tier's dir must be this user's alone)


def local_settings(local: Mapping[str, Any] | None, durable_root: str, is_async: bool) -> dict | None:
    """Check ``ckpt.local``; None when the local tier is off (``ckpt.local.dir`` null)."""
    local = dict(local or {})
    where = local.get("dir")
    if where in (None, "", False):
        return None
    where = LOCAL_AUTO_DIR if where == "auto" else str(where)
    if fsurl.is_url(where):
        raise ConfigError(
            f"ckpt.local.dir={where}: the local tier is a local dir (tmpfs such as /dev/shm, or a "
            f"node-local disk); remote checkpoints go to ckpt.dir"
        )
    where = os.path.abspath(where)
    durable = os.path.abspath(durable_root)
    if not fsurl.is_url(durable_root) and os.path.commonpath([where, durable]) in (where, durable):
        raise ConfigError(
            f"ckpt.local.dir={where} overlaps ckpt.dir={durable}: the local tier must be another "
            f"place (tmpfs such as /dev/shm, or a node-local disk)"
        )
    steps, seconds, interval = local.get("interval_steps"), local.get("interval_seconds"), local.get("interval")
    if interval not in (None, "auto"):
        raise ConfigError(f"ckpt.local.interval={interval!r}: use auto or null")
    if interval is None and not steps and not seconds:
        raise ConfigError(
            "ckpt.local.dir is set but the local tier has no interval: set ckpt.local.interval_steps, "
            "ckpt.local.interval_seconds or ckpt.local.interval=auto"
        )
    keep = local.get("keep_last_k", 2)
    if not checks.is_integer(keep) or keep < 1 or (is_async and keep < 2):
        raise ConfigError(
            f"ckpt.local.keep_last_k must be an integer >= {2 if is_async else 1}"
            f"{' with async saves (the newest may still be in flight)' if is_async else ''}, got {keep!r}"
        )
    replicas = local.get("replicas", 0)
    if replicas not in (0, 1) or isinstance(replicas, bool):
        raise ConfigError(
            f"ckpt.local.replicas={replicas!r}: use 1 (a copy of each local save on another node) or 0 (none)"
        )
    return {
        "replicas": int(replicas),
        "dir": where,
        "interval_steps": None if interval == "auto" else steps,
        "interval_seconds": None if interval == "auto" else seconds,
        "auto": interval == "auto",
        "keep": keep,
    }


def open_local(
    strategy: StrategyLike, durable_root: str, c: dict | None, make_auto: Callable[[], AutoInterval]
) -> Tier | None:
    """The local tier lives in ``<ckpt.local.dir>/<run id>``: the run id is kept in ``ckpt.dir``, so a run dir
    deleted and made again never resumes from a stale local checkpoint of the old one.  A local dir that
    cannot be written is not fatal: the run goes on with the durable tier only, and says so."""
    if c is None:
        return None
    run_id = layout.run_id(durable_root) if strategy.rank == 0 else None
    run_id = strategy.broadcast_object(run_id)
    root = os.path.join(c["dir"], run_id)
    problem = None
    try:
        layout.check_writable(root, key="ckpt.local.dir", private=True)
    except CheckpointError as e:
        problem = str(e)
    if strategy.any(problem is not None):  # every rank uses the local tier, or none does
        log.warning(
            "local checkpoint tier off: %s; saving to the durable tier (ckpt.dir) only",
            problem or "not writable on another rank",
        )
        return None
    local = Tier("local", root, c["keep"], c["interval_steps"], c["interval_seconds"], False)
    local.make_schedule(make_auto() if c["auto"] else None)
    every = [
        f"{c['interval_steps']} steps" if c["interval_steps"] else "",
        f"{c['interval_seconds']} s" if c["interval_seconds"] else "",
    ]
    log.info(
        "local checkpoint tier: %s (%s; keep %d)",
        root,
        "interval=auto" if c["auto"] else "every " + " or ".join(e for e in every if e),
        c["keep"],
    )
    return local
