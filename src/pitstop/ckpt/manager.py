"""The save lifecycle every saving backend shares: :class:`CheckpointManager` implements the
:class:`~pitstop.ckpt.contract.Checkpointer` contract once — restore (with fallback, :mod:`.restore`), one
save in flight (staging, upload, commit or failure), retention, the tiers (:mod:`.tiers`) and the
accounting.  A backend only says how it writes (:meth:`CheckpointManager._write`, returning the futures of
a background save, if any) and, optionally, how it reads.  The layout on disk is :mod:`.layout`, when a
save is due is :mod:`.schedule`, the file formats are :mod:`.formats`, DCP's state-dict calls :mod:`.dcp`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from abc import abstractmethod
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping
from typing import Any, Callable

from pitstop import fsurl
from pitstop.ckpt import dcp, integrity, layout, orphans, throttle
from pitstop.ckpt import restore as fallback
from pitstop.ckpt.contract import (
    Checkpointer,
    Pending,
    SaveRecord,
    SaveResult,
    StrategyLike,
    Target,
    interrupt_in,
    one_line,
)
from pitstop.ckpt.finite import NonFiniteState, refuse_nonfinite
from pitstop.ckpt.formats import encode_json, read_checkpoint
from pitstop.ckpt.peer_copy import Replicator
from pitstop.ckpt.storage import dir_bytes
from pitstop.ckpt.tiers import Tier, complete_seconds, copied, figures, local_settings, open_local
from pitstop.errors import CheckpointError, ConfigError
from pitstop.goodput.interval import IntervalPolicy

log = logging.getLogger("pitstop.ckpt")


class CheckpointManager(Checkpointer):
    """The saving backends' common part; a subclass implements :meth:`_write` (and may override :meth:`_read`)."""

    name = "base"
    is_async = False
    full_state = False  # gather the full (unsharded) state on rank 0 instead of per-rank shards

    def __init__(
        self,
        dir: str,
        interval_steps: int | None = None,
        interval_seconds: float | None = None,
        keep_last_k: int = 3,
        save_last: bool = True,
        load: int | str = "auto",
        on_error: str = "raise",
        load_model_only: bool = False,
        throttle_mbps: float | None = None,
        interval: str | None = None,
        mtbf_seconds: float | None = None,
        local: Mapping[str, Any] | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ):
        if self.is_async and keep_last_k == 1:
            raise ConfigError(
                "ckpt.keep_last_k=1 is unsafe with async saves (the newest may still be in flight); "
                "use 2 or more, or 0 to keep all"
            )
        if interval not in (None, "auto"):
            raise ConfigError(
                f"ckpt.interval={interval!r}: use auto (Young–Daly from measured save cost and MTBF) "
                f"or null with ckpt.interval_steps / ckpt.interval_seconds"
            )
        self.root = str(dir).rstrip("/") if fsurl.is_url(dir) else str(dir)
        if fsurl.is_url(self.root):
            if throttle_mbps:
                raise ConfigError(
                    f"ckpt.throttle_mbps limits reads and writes of a local dir; ckpt.dir={self.root} is remote: "
                    f"set ckpt.throttle_mbps=null (throttle the store itself instead)"
                )
            fsurl.use_options(self.root, fsurl.storage_options(storage_options, "ckpt.storage_options"))
        self.auto, self.mtbf_seconds = interval == "auto", mtbf_seconds
        if self.auto:  # the measured interval replaces the fixed ones
            interval_steps = interval_seconds = None
        self.load_spec, self.on_error = load, on_error
        self.load_model_only, self.throttle_mbps = bool(load_model_only), throttle_mbps
        self.durable = Tier("durable", self.root, keep_last_k, interval_steps, interval_seconds, save_last)
        self._local_cfg = local_settings(local, self.root, self.is_async)
        self.local: Tier | None = None  # ckpt.local: made in setup() (its dir is per run)
        self.records: list[SaveRecord] = []
        self.pending: Pending | None = None
        self.failures = 0
        self._done: list[SaveRecord] = []  # finished in the background, not yet reported
        self._lock = threading.Lock()
        self._purger: ThreadPoolExecutor | None = None
        self.purge_failures = 0  # retention deletes that failed (logged; summary.json, metrics)
        self._purge_failed: list[str] = []  # their one-line reasons, not yet reported
        self._closed = False
        self._sd = dcp.StateDicts(self.full_state)  # DCP's per-run state-dict analysis, kept
        self.last_started = self.last_durable = self.last_committed = None
        self.replicator: Replicator | None = None  # ckpt.local.replicas=1: made in setup()

    # ---- wiring -------------------------------------------------------------------------------------
    def setup(
        self,
        strategy: StrategyLike,
        report: Callable[[dict, int], None],
        intervals: IntervalPolicy | None = None,
        node: str | None = None,
    ) -> None:
        self.strategy, self.report = strategy, report
        self.rank, self.world_size = strategy.rank, strategy.world_size
        self.group = strategy.ckpt_group()
        integrity.signing_key()  # (a key too short to sign anything stops the run here, in one line: exit 2)
        if layout.is_link(self.root):  # (cleanup and retention would delete in whatever it points at)
            raise ConfigError(
                f"ckpt.dir {self.root} is a symbolic link (to {os.readlink(self.root)[:80]}): pitstop removes partial "
                f"and old checkpoints in ckpt.dir, never through a link; set ckpt.dir to the real dir instead"
            )
        if self.rank == 0:
            layout.check_writable(self.root)
            self._purger = ThreadPoolExecutor(1, thread_name_prefix="pitstop-ckpt-purge")
        strategy.barrier()
        if self.throttle_mbps:  # (a stand-in for a network volume: its restore reads at that speed too)
            throttle.slow_volume(self.root, self.throttle_mbps)
        policy = (intervals or IntervalPolicy()).prefer(self.mtbf_seconds, "ckpt.mtbf_seconds")
        self.durable.make_schedule(policy.auto() if self.auto else None)
        self.local = open_local(strategy, self.root, self._local_cfg, lambda: policy.auto(key="ckpt.local.interval"))
        timeout = getattr(getattr(strategy, "inner", strategy), "timeout", None) or 3 * orphans.ORPHAN_WAIT
        if self.local is not None and self._local_cfg["replicas"]:
            self.replicator = Replicator.start(strategy, self.local, node, timeout, self.name, self.full_state)
        # (before anything is restored or saved: see pitstop.ckpt.orphans; ranks of other machines wait meanwhile in
        # the next collective, within the group's timeout)
        orphans.end_orphans(self.root, min(orphans.ORPHAN_WAIT, timeout / 3))
        self._setup_backend()

    def _setup_backend(self) -> None:
        """Per-run resources of a backend (stagers, checkpoint processes)."""

    # ---- restore (with fallback: .restore) ---------------------------------------------------------
    def restore(self, target: Target, at_most: int | None = None) -> int | None:
        self._sd.info(target)  # per-run analysis for saves, done during setup rather than at the first save
        peers = self.replicator
        if peers is not None and at_most is None:  # (before training: a local dir too small for two copies)
            peers.check_space(fallback.state_bytes(self.strategy, self.root, target), self.strategy.replicated)
        if self.load_spec in (None, "none", False) and at_most is None:
            return None
        if at_most is not None and self._purger is not None:  # (retention still deleting: done before the listing)
            self._purger.submit(int).result()
        local_root = self.local.root if self.local is not None else None
        spec = self.load_spec if at_most is None else "auto"
        # (with copies on peers, a node's local dir alone never holds a whole checkpoint: see .peer)
        listed = local_root if peers is None else None
        choice = fallback.candidates(self.strategy, self.root, listed, spec, at_most)
        if not choice and at_most is not None:
            return None
        explicit = spec != "auto"
        tiers: dict[str, str] = {}
        if peers is not None and at_most is None and spec == "auto":
            choice, tiers = fallback.with_peers(peers, choice)

        def load(path: str) -> None:
            self.restored_from = fallback.tier_of(path, local_root, tiers)
            self._load(path, target)

        step = fallback.first_loadable(
            self.strategy, choice, explicit, load, self.root, local_root, lambda: target.state.step, tiers
        )
        if step is None:
            self.restored_from = None
        return step

    def discard_after(self, step: int) -> None:
        local_root = self.local.root if self.local is not None else None
        if self.replicator is not None:  # (each node's own saves and copies: the copy in flight first)
            self.replicator.discard_after(step)
        fallback.discard_after(self.strategy, self.root, local_root, step)

    def _load(self, path: str, target: Target) -> None:
        fallback.verify(self.strategy, path)
        for callback in self.load_callbacks:
            callback(path)
        read = self._read(path, target)
        fallback.load_into(path, target, read, self.rank, self.world_size, self.load_model_only)

    def _read(self, path: str, target: Target) -> tuple[dict[str, dict], Callable[[], tuple]]:
        return read_checkpoint(path, target.model, target.optimizer, self.group)

    # ---- save ---------------------------------------------------------------------------------------
    def maybe_save(self, target: Target, step: int, *, last: bool = False, force: bool = False) -> SaveResult:
        self.poll()
        self._report_finished()
        for tier in self._tiers():
            if tier.schedule.auto is not None and tier.schedule.saves:
                self._measure_auto(tier, step)
        tier = self._due_tier(step, last, force)
        if tier is None:
            return SaveResult()
        t0 = time.perf_counter()
        self.wait()  # at most one save in flight
        self.last_started = step
        if tier is self.durable:
            self.last_durable = step
        tier.schedule.started()
        if tier is self.durable and self.local is not None:
            self.local.schedule.finished_blocking()  # a durable save restarts the local tier's clock too
        record = SaveRecord(
            step=step,
            path=layout.step_dir(tier.root, step),
            last=last,
            tier=tier.name,
            throttle_mbps=self.throttle_mbps if tier is self.durable else None,
        )
        leftover: str | None = None
        per_node = tier is self.local and self.replicator is not None  # (each node's leader cleans its own)
        if self.rank == 0 or (per_node and self.replicator.leads):
            try:
                layout.remove(record.path)  # a partial leftover of the same step (e.g. after a crash), if any
                if per_node:
                    self.replicator.forget(step)  # (and the copies of an earlier save of that step)
            except OSError as e:
                leftover = one_line(e)
        try:
            if self.strategy.any(leftover is not None):  # (every rank writes, or none does)
                raise CheckpointError(f"a leftover of step {step} is in the way: {leftover or 'see rank 0'}")
            pending = self._write(self._app_state(target), record)
        except dcp.ERRORS as e:  # handled per on_error
            self._reraise_interrupt(e)
            self._failed(record, e)
        else:
            if pending is None:
                self._committed(record)
            else:
                pending.upload.add_done_callback(lambda _: setattr(record, "finished", time.perf_counter()))
                self.pending = pending
        block = time.perf_counter() - t0
        record.block_seconds += block
        tier.blocked_total += block
        tier.schedule.finished_blocking()
        return SaveResult(blocked=block, started=step)

    def _tiers(self) -> list[Tier]:
        return [self.durable] if self.local is None else [self.durable, self.local]

    def _tier(self, record: SaveRecord) -> Tier:
        return self.local if record.tier == "local" and self.local is not None else self.durable

    def _due_tier(self, step: int, last: bool, force: bool) -> Tier | None:
        """The durable tier when it is due (and always for the last step or a forced save: a preempted machine
        takes its local tier with it), else the local tier when it is due."""
        agree = self.strategy.agree
        if force or self.durable.schedule.due(step, last, agree):
            return self.durable
        if self.local is not None and not last and self.local.schedule.due(step, False, agree):
            return self.local
        return None

    def _measure_auto(self, tier: Tier, step: int) -> None:
        """Young–Daly from this attempt's measured blocking cost per save of ``tier`` (staging waits included)
        and, for async saves, never before the last one became durable."""
        cost = tier.blocked_total / max(tier.schedule.saves, 1)
        replicated = tier is self.local and self.replicator is not None
        write = complete_seconds(self.records[-10:], tier.name, self.is_async, replicated)
        moved = tier.schedule.measured(cost, write)
        if moved is not None:
            key = "ckpt_interval_seconds" if tier is self.durable else "ckpt_local_interval_seconds"
            self.report({key: moved}, step)

    def _app_state(self, target: Target) -> dict:
        self.strategy.sync_buffers(target.model)
        model_sd, optim_sd = self._sd.get(target)
        refuse_nonfinite(model_sd, optim_sd)  # (never a checkpoint of a NaN: refused, the run goes on)
        return {"model": model_sd, "optim": optim_sd, f"train.rank{self.rank}": encode_json(target.state.state_dict())}

    def wait_staging(self) -> float:
        p = self.pending
        if p is None or p.staging is None:
            return 0.0
        t0 = time.perf_counter()
        try:
            p.staging.result()
        except dcp.ERRORS as e:  # the upload future carries the same failure
            self._reraise_interrupt(e)
            log.debug("staging failed: %s", e)
        p.staging = None
        waited = time.perf_counter() - t0
        p.record.block_seconds += waited
        self._tier(p.record).blocked_total += waited
        return waited

    def wait(self) -> float:
        if self.pending is None:
            return 0.0
        t0 = time.perf_counter()
        self.wait_staging()
        p, self.pending = self.pending, None
        try:
            p.upload.result()
        except dcp.ERRORS as e:  # handled per on_error
            self._reraise_interrupt(e)
            self._failed(p.record, e)
        else:
            self._committed(p.record)
        return time.perf_counter() - t0

    def poll(self) -> None:
        if self.pending is not None and self.pending.upload.done():
            self.wait()

    @staticmethod
    def _reraise_interrupt(error: BaseException) -> None:
        """A hang raised into the main thread while it waited here is the hang, not this save's failure."""
        interrupt = interrupt_in(error)
        if interrupt is not None:
            raise interrupt

    def _committed(self, record: SaveRecord) -> None:
        """A save became durable: account for it and purge old checkpoints (rank 0, in the background)."""
        record.total_seconds = (record.finished or time.perf_counter()) - record.started
        if record.tier == "durable":  # (a node-local tier may go with the node a notice is about)
            self.last_committed = max(record.step, self.last_committed or 0)
        if self.rank == 0:
            record.bytes = dir_bytes(record.path)
            if self._purger is not None:
                tier = self._tier(record)
                if tier is self.durable or self.replicator is None:  # (with copies, each node purges its own)
                    self._purger.submit(self._purge, layout.purge, tier.root, tier.keep_last_k, self.pinned)
                if tier is self.durable and self.local is not None and self.replicator is None:
                    self._purger.submit(self._purge, layout.purge_up_to, self.local.root, record.step)  # (no more use)
        if self.replicator is not None:  # the copy, in its own thread; a durable save purges the older local ones
            if record.tier == "local":  # (a local save is complete once copied: what interval=auto measures)
                self.replicator.copy(record.step, True).add_done_callback(lambda f: f.result() and copied(record))
            else:
                self.replicator.purge(record.step)
        with self._lock:
            self._done.append(record)

    def _purge(self, purge: Callable[..., None], *args: object) -> None:
        """Retention, in the purger's thread: a delete that fails is said in one line and counted (never silent:
        on a store, a retention that quietly stopped working would grow the bucket without bound)."""
        try:
            purge(*args)
        except Exception as e:  # noqa: BLE001 - any failure: the checkpoints stay, the run goes on, it is told
            reason = one_line(e)
            log.warning("checkpoint retention failed: %s; the checkpoint stays on disk (ckpt.keep_last_k)", reason)
            with self._lock:
                self.purge_failures += 1
                self._purge_failed.append(reason)

    def _failed(self, record: SaveRecord, error: BaseException) -> None:
        record.error = one_line(error)
        self.failures += 1
        local = record.tier == "local"
        if local and self.replicator is not None:  # (every rank takes part in each copy, or says why not)
            self.replicator.copy(record.step, False)
        log.error(
            "%scheckpoint at step %d failed: %s (it is not committed; older checkpoints are intact%s)",
            "local-tier " if local else "",
            record.step,
            record.error,
            "; the durable tier is unaffected" if local else "",
        )
        if not layout.is_complete(record.path) and (self.rank == 0 or local):
            try:
                layout.remove(record.path)  # (a local tier may be per node: every rank cleans)
            except OSError as e:
                log.warning("the failed checkpoint's files stay (no commit marker: never loaded): %s", one_line(e))
        with self._lock:
            self._done.append(record)
        if self.on_error == "raise" and not local and not isinstance(error, NonFiniteState):  # (a tmpfs full, a NaN)
            raise CheckpointError(f"checkpoint at step {record.step} failed: {record.error}") from error

    def _report_finished(self) -> None:
        with self._lock:
            done, self._done = self._done, []
            purge_failed, self._purge_failed = self._purge_failed, []
        if purge_failed:
            self.report({"ckpt_purge_failed": float(len(purge_failed))}, self.last_started or 0)
        for rec in done:
            self.records.append(rec)
            metrics = {"ckpt_block_seconds": rec.block_seconds, "ckpt_failed": float(rec.error is not None)}
            if rec.error is None:
                metrics.update(ckpt_total_seconds=rec.total_seconds, ckpt_bytes=float(rec.bytes))
            if rec.tier == "local":
                metrics = {k.replace("ckpt_", "ckpt_local_", 1): v for k, v in metrics.items()}
            self.report(metrics, rec.step)

    def close(self) -> None:
        """Wait for the last save; never let the run end successfully with a save in flight or failed.
        Only the first call does anything (the runner also calls it on the way out of a failed run)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            if self._purger is not None:  # (before the last report: its failures are counted too)
                self._purger.shutdown(wait=True)
                self._purger = None
            self._report_finished()
            self._shutdown()
        durable = [r for r in self.records if r.tier == "durable"]
        last = durable[-1] if durable else None
        if self.replicator is not None:  # (the copy in flight first; every node frees its own local dir)
            self.replicator.close(self.local is not None and last is not None and last.last and last.error is None)
        if self.local is not None and last is not None and last.last and last.error is None and self.rank == 0:
            layout.free_dir(self.local.root)  # the run is complete: free the tmpfs
        if last is not None and last.error is not None and (self.on_error == "raise" or last.last):
            # The final save failed (or failures must fail the run): never report success.
            raise CheckpointError(f"the last checkpoint (step {last.step}) failed: {last.error}")

    def _shutdown(self) -> None:
        """Release per-run backend resources (also after a failure)."""

    def stats(self) -> dict:
        """The durable tier's figures (``local_*``: the local tier's, when it is on)."""
        out = {"backend": self.name, **figures(self.records, "durable"), "purge_failures": self.purge_failures}
        if self.local is not None:
            out.update({f"local_{k}": v for k, v in figures(self.records, "local").items()})
            out["local_dir"] = self.local.root
        if self.replicator is not None:
            out.update(self.replicator.stats())
            # (a local save's start to its copy's end: what ckpt.local.interval=auto waits for)
            out["local_replicated_seconds_mean"] = round(complete_seconds(self.records, "local", True, True, None), 5)
        out["restored_from"] = self.restored_from  # (local, peer or durable; None: started afresh)
        return out

    # ---- backend hook ---------------------------------------------------------------------------------
    @abstractmethod
    def _write(self, app_state: dict, record: SaveRecord) -> Pending | None:
        """Write ``app_state`` to ``record.path``: return None once it is committed (a synchronous save), or
        the futures of a save that goes on in the background (the lifecycle here waits for and commits it)."""
