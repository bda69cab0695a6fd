"""Going back, in-process, to the newest verified checkpoint at or before a step, and the run-dir state that makes
what a rollback skipped outlive the attempt.

A rollback (:class:`Rollback`, called through ``Runner.rollback``) waits for the save in flight, restores the newest
checkpoint of a step at most ``at_most`` that verifies on every rank (every rank takes the same one), and then either
keeps the data position it had (``keep_data``: the batches of the steps rolled back, and any after them up to now,
are skipped exactly once) or takes the checkpoint's (they are trained on again, as after a restart). The checkpoints
newer than the one restored hold the steps thrown away: they are removed, so that a restart never resumes from them.

``RUN_DIR/instability.json`` (:class:`RunDirState`, shape ``statefile.INSTABILITY``): per checkpoint step C that a
rollback with ``keep_data`` went back to, every rank's loader position at the moment of the rollback. Whenever C is
restored again (a later rollback, or a restart after a kill) that position is applied, at any world size (the
loaders' ``peers``), so the skipped data stays skipped. It also holds the sample keys quarantined and the number of
rollbacks so far (the budget of ``trainer.instability.max_rollbacks`` counts across restarts). Rank 0 writes it,
atomically; every rank keeps the same copy in memory.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from pitstop.ckpt.contract import Checkpointer, Target
from pitstop.errors import CheckpointError, NoRollbackPoint
from pitstop.statefile import INSTABILITY, read_state
from pitstop.strategy.base import Strategy
from pitstop.telemetry.metrics import write_json_atomic
from pitstop.train.state import Batches, TrainLoader

log = logging.getLogger("pitstop")

MAX_EPOCHS_KEPT = 100_000  # steps whose epoch is remembered (a rollback names the epochs of the steps it throws away)


class RunDirState:
    """``RUN_DIR/instability.json``, read by every rank at setup (a damaged one kept aside by rank 0, named in one
    warning), written by rank 0."""

    def __init__(self, run_dir: str, is_main: bool):
        self.path, self.is_main = os.path.join(run_dir, "instability.json"), is_main
        doc = read_state(
            self.path,
            INSTABILITY,
            keep_aside=is_main,
            then="the data skipped by earlier rollbacks and the quarantined samples are not known to this attempt",
            logger=log if is_main else None,
        )
        doc = doc or {}
        self.skips: dict[str, dict] = dict(doc.get("skips", {}))
        self.quarantined: list[str] = list(doc.get("quarantined", []))
        self.rollbacks: int = int(doc.get("rollbacks", 0))

    def write(self) -> None:
        if self.is_main:
            doc = {"skips": self.skips, "quarantined": self.quarantined, "rollbacks": self.rollbacks}
            write_json_atomic(self.path, doc, fsync=True, indent=1)


def gathered(strategy: Strategy, obj: Any) -> list[Any]:
    """``obj`` of every rank, by rank, on every rank (a rollback's rare collective: a broadcast from each)."""
    if strategy.world_size == 1:
        return [obj]
    return [strategy.broadcast_object(obj if strategy.rank == r else None, src=r) for r in range(strategy.world_size)]


class Rollback:
    """The in-process rollback's mechanics (the Runner re-plans the run's length after it)."""

    def __init__(self, strategy: Strategy, ckpt: Checkpointer, target: Target, loader: TrainLoader, state: RunDirState):
        self.strategy, self.ckpt, self.target, self.loader, self.state = strategy, ckpt, target, loader, state
        self.epochs: dict[int, int] = {}  # step -> its epoch (the sample log's rollback line names them)

    def stepped(self, step: int, epoch: int) -> None:
        self.epochs[step] = epoch
        if len(self.epochs) > MAX_EPOCHS_KEPT:
            self.epochs.pop(next(iter(self.epochs)))

    def apply_skip(self, step: int) -> bool:
        """The checkpoint of ``step`` was restored: if a rollback went back to it keeping its data position, that
        position is the data position again (at this world size). Whether one was applied."""
        skip = self.state.skips.get(str(step))
        if skip is None:
            return False
        loaders = skip["loaders"]
        same = len(loaders) == self.strategy.world_size
        self.loader.load_state_dict(loaders[self.strategy.rank] if same else loaders[0], peers=loaders)
        log.info(
            "step %d: the data a rollback skipped (from step %s) stays skipped%s",
            step,
            skip.get("from", "?"),
            "" if same else f" (recorded by {len(loaders)} rank(s), resumed on {self.strategy.world_size})",
        )
        return True

    def __call__(self, at_most: int, why: str, keep_data: bool, batches: Batches | None, discard: bool = True) -> int:
        """Back to the newest verified checkpoint of a step at most ``at_most``; its step. ``NoRollbackPoint`` (one
        line, exit status 2, nothing deleted) when there is none. ``discard``: this process removes the newer
        checkpoints (replica groups: the group that writes them, alone)."""
        frm = self.target.state.step
        t0 = time.perf_counter()
        self.ckpt.wait()  # (a save in flight: it becomes durable, or fails, first)
        position = self.loader.state_dict() if keep_data else None
        where = self.ckpt.root or "ckpt=none"
        try:
            to = self.ckpt.restore(self.target, at_most=at_most)
        except CheckpointError as e:
            raise NoRollbackPoint(
                f"{why}; cannot roll back to a checkpoint at or before step {at_most}: {e}; stopped, nothing deleted"
            ) from None
        if to is None:
            hint = "ckpt=none saves none: choose a ckpt option" if self.ckpt.root is None else "save more often"
            raise NoRollbackPoint(
                f"{why}; no verified checkpoint at or before step {at_most} in {where} to roll back to: stopped at "
                f"step {frm}, nothing deleted ({hint}, e.g. ckpt=sync_dcp ckpt.interval_steps=N)"
            )
        if position is not None:
            self.loader.load_state_dict(position)
            skip = {"world_size": self.strategy.world_size, "loaders": gathered(self.strategy, position)}
            self.state.skips[str(to)] = {**skip, "from": frm, "why": why[:200]}
        else:
            self.apply_skip(to)
        self.state.rollbacks += 1
        self.state.write()
        if discard:
            self.ckpt.discard_after(to)
        if batches is not None:
            batches.restart()
        log.warning(
            "%s: rolled back from step %d to the checkpoint of step %d in %.2f s; %s",
            why,
            frm,
            to,
            time.perf_counter() - t0,
            "the data of the steps in between is skipped" if keep_data else "the steps in between are taken again",
        )
        return to
