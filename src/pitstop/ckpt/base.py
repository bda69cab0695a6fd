"""The checkpointer contract, and the save lifecycle every saving backend shares.

:class:`Checkpointer` is what the training loop sees; every ``conf/ckpt/`` option implements it, ``none``
included.  :class:`CheckpointManager` implements it once for the saving backends: restore (with
fallback), the save lifecycle (one save in flight; staging, upload, commit or failure; retention) and the
accounting.  A backend only says how it writes (:meth:`CheckpointManager._write`, returning the futures of
a background save, if any) and, optionally, how it reads.  The layout on disk is :mod:`.layout`, when a
save is due is :mod:`.schedule`, the file formats are :mod:`.formats`.

The saved state (the same for every backend, so checkpoints are interchangeable):
- ``model`` and ``optim``: from DCP's ``get_state_dict`` (the same keys for plain, DDP and FSDP models);
- ``train.rank{R}``: the rest of each rank's state — step and sample counters, LR schedule, data-loader
  position, every RNG state and the config fingerprint — as JSON bytes in a uint8 tensor, so nothing is
  ever unpickled: ``torch.load`` always runs with ``weights_only=True``.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from pitstop import fsurl
from pitstop.ckpt import layout
from pitstop.ckpt.formats import encode_json, read_checkpoint
from pitstop.ckpt.storage import dir_bytes
from pitstop.errors import CheckpointError, ConfigError, FingerprintMismatch

log = logging.getLogger("pitstop.ckpt")

# DCP reports failures as CheckpointException, which derives from BaseException, not Exception.
ERRORS = (Exception, CheckpointException)


class TrainStateLike(Protocol):
    """What a checkpoint holds besides model and optimizer tensors (``pitstop.train.runner.TrainState``)."""

    step: int

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict, peers: list[dict] | None = None) -> None: ...

    def fingerprint(self) -> dict: ...


@dataclass
class Target:
    """What is saved and restored: the (wrapped) model, its optimizer and the rest of the train state."""

    model: nn.Module
    optimizer: Any
    state: TrainStateLike


@dataclass(frozen=True)
class SaveResult:
    """What :meth:`Checkpointer.maybe_save` did: seconds the loop was blocked, and the step of the save it
    started (None if none was due)."""

    blocked: float = 0.0
    started: int | None = None


class Checkpointer(ABC):
    """The contract of a ``ckpt`` option, as the training loop uses it (in this order)."""

    name: str = "base"
    root: str | None = None  # where checkpoints go (None: nowhere)
    last_started: int | None = None  # the step of the newest save started (in flight or done)

    @abstractmethod
    def setup(
        self,
        strategy: Any,
        report: Callable[[dict, int], None],
        *,
        fault_mtbf: float | None = None,
        failures: int = 0,
        job_seconds: float = 0.0,
    ) -> None:
        """Bind to the job: ``strategy`` (ranks, collectives), ``report(metrics, step)`` (per-save costs);
        the rest informs ``ckpt.interval=auto`` (an MTBF from fault injection, failures seen so far)."""

    @abstractmethod
    def restore(self, target: Target) -> int | None:
        """Load the checkpoint chosen by ``ckpt.load`` into ``target``; return its step, or None to start fresh."""

    @abstractmethod
    def maybe_save(self, target: Target, step: int, *, last: bool = False, force: bool = False) -> SaveResult:
        """Save ``target`` at ``step`` if due (``last``: the final step; ``force``: now, e.g. on a preemption)."""

    @abstractmethod
    def wait_staging(self) -> float:
        """Called before ``optimizer.step()`` changes parameters and optimizer state: a background copy of them
        finishes here (what forward changes was copied when the save started). Returns seconds waited."""

    @abstractmethod
    def wait(self) -> float:
        """Wait until the save in flight (if any) is durable or failed. Returns seconds waited."""

    @abstractmethod
    def poll(self) -> None:
        """Settle a background save that has finished (commit it, or report its failure) without waiting."""

    @abstractmethod
    def close(self) -> None:
        """Wait for the last save and release resources; raise if the run must not count as a success."""

    @abstractmethod
    def stats(self) -> dict:
        """Per-run figures for summary.json (saves, failures, blocking and total seconds, bytes)."""


@dataclass
class SaveRecord:
    step: int
    path: str
    last: bool = False
    tier: str = "durable"  # durable (ckpt.dir) | local (ckpt.local.dir)
    throttle_mbps: float | None = None
    started: float = field(default_factory=time.perf_counter)
    block_seconds: float = 0.0
    total_seconds: float | None = None
    finished: float | None = None  # when the write became durable (set from the writer's thread)
    bytes: int = 0
    error: str | None = None


@dataclass
class Pending:
    """A save still running in the background: ``staging`` (host copy; may be None) then ``upload`` (write)."""

    record: SaveRecord
    upload: Future
    staging: Future | None = None


def one_line(error: BaseException) -> str:
    """A one-line description of a save/load failure (DCP wraps per-rank tracebacks; keep the cause)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, exc in sorted(failures.items()):
            inner = exc[0] if isinstance(exc, tuple) else exc
            parts.append(f"rank {rank}: {one_line(inner) if isinstance(inner, BaseException) else str(inner)[:200]}")
        return "; ".join(parts)
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:400]


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
        self.schedule: Any = None  # SaveSchedule, made in setup()
        self.blocked_total = 0.0

    def make_schedule(self, auto: Any) -> None:
        """``auto``: an AutoInterval for ``interval=auto`` (then the fixed intervals are null), else None."""
        from pitstop.ckpt.schedule import SaveSchedule

        self.schedule = SaveSchedule(self.interval_steps, self.interval_seconds, self.save_last, auto)


LOCAL_AUTO_DIR = "/dev/shm/pitstop"


def _positive_or_null(*settings: tuple[str, Any]) -> None:
    for key, v in settings:
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise ConfigError(f"{key} must be a positive number or null, got {v!r}")


def _local_settings(local: Any, durable_root: str, is_async: bool) -> dict | None:
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
    _positive_or_null(("ckpt.local.interval_steps", steps), ("ckpt.local.interval_seconds", seconds))
    if interval not in (None, "auto"):
        raise ConfigError(f"ckpt.local.interval={interval!r}: use auto or null")
    if interval is None and not steps and not seconds:
        raise ConfigError(
            "ckpt.local.dir is set but the local tier has no interval: set ckpt.local.interval_steps, "
            "ckpt.local.interval_seconds or ckpt.local.interval=auto"
        )
    keep = local.get("keep_last_k", 2)
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1 or (is_async and keep < 2):
        raise ConfigError(
            f"ckpt.local.keep_last_k must be an integer >= {2 if is_async else 1}"
            f"{' with async saves (the newest may still be in flight)' if is_async else ''}, got {keep!r}"
        )
    return {
        "dir": where,
        "interval_steps": None if interval == "auto" else steps,
        "interval_seconds": None if interval == "auto" else seconds,
        "auto": interval == "auto",
        "keep": keep,
    }


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
        load: Any = "auto",
        on_error: str = "raise",
        load_model_only: bool = False,
        throttle_mbps: float | None = None,
        interval: Any = None,
        mtbf_seconds: float | None = None,
        local: Any = None,
        storage_options: Any = None,
        **_: Any,
    ):
        if on_error not in ("raise", "warn"):
            raise ConfigError(f"ckpt.on_error must be 'raise' or 'warn', got {on_error!r}")
        _positive_or_null(
            ("ckpt.interval_steps", interval_steps),
            ("ckpt.interval_seconds", interval_seconds),
            ("ckpt.mtbf_seconds", mtbf_seconds),
            ("ckpt.throttle_mbps", throttle_mbps),
        )
        if isinstance(keep_last_k, bool) or not isinstance(keep_last_k, int) or keep_last_k < 0:
            raise ConfigError(f"ckpt.keep_last_k must be an integer >= 0 (0 keeps all), got {keep_last_k!r}")
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
                    f"ckpt.throttle_mbps limits writes to a local dir; ckpt.dir={self.root} is remote: "
                    f"set ckpt.throttle_mbps=null (throttle the store itself instead)"
                )
            fsurl.use_options(self.root, fsurl.storage_options(storage_options, "ckpt.storage_options"))
        self.auto, self.mtbf_seconds = interval == "auto", mtbf_seconds
        if self.auto:  # the measured interval replaces the fixed ones
            interval_steps = interval_seconds = None
        self.load_spec, self.on_error = load, on_error
        self.load_model_only, self.throttle_mbps = bool(load_model_only), throttle_mbps
        self.durable = Tier("durable", self.root, keep_last_k, interval_steps, interval_seconds, save_last)
        self._local_cfg = _local_settings(local, self.root, self.is_async)
        self.local: Tier | None = None  # ckpt.local: made in setup() (its dir is per run)
        self.records: list[SaveRecord] = []
        self.pending: Pending | None = None
        self.failures = 0
        self._done: list[SaveRecord] = []  # finished in the background, not yet reported
        self._lock = threading.Lock()
        self._purger: ThreadPoolExecutor | None = None
        self._closed = False
        self._sd_info: tuple | None = None  # DCP's per-run state-dict analysis (see _state_dicts)
        self.last_started = None

    # ---- wiring -------------------------------------------------------------------------------------
    def setup(
        self,
        strategy: Any,
        report: Callable[[dict, int], None],
        *,
        fault_mtbf: float | None = None,
        failures: int = 0,
        job_seconds: float = 0.0,
    ) -> None:
        from pitstop.goodput.model import AutoInterval

        self.strategy, self.report = strategy, report
        self.rank, self.world_size = strategy.rank, strategy.world_size
        self.group = strategy.ckpt_group()
        if self.rank == 0:
            layout.check_writable(self.root)
            self._purger = ThreadPoolExecutor(1, thread_name_prefix="pitstop-ckpt-purge")
        strategy.barrier()
        mtbf, source = (
            (self.mtbf_seconds, "ckpt.mtbf_seconds")
            if self.mtbf_seconds
            else (fault_mtbf, "fault.mtbf_seconds")
            if fault_mtbf
            else (None, "")
        )
        self.durable.make_schedule(AutoInterval(mtbf, source, failures, job_seconds) if self.auto else None)
        self._setup_local(lambda: AutoInterval(mtbf, source, failures, job_seconds, key="ckpt.local.interval"))
        self._setup_backend()

    def _setup_local(self, make_auto: Callable[[], Any]) -> None:
        """The local tier lives in ``<ckpt.local.dir>/<run id>``: the run id is kept in ``ckpt.dir``, so a run dir
        deleted and made again never resumes from a stale local checkpoint of the old one.  A local dir that
        cannot be written is not fatal: the run goes on with the durable tier only, and says so."""
        c = self._local_cfg
        if c is None:
            return
        run_id = layout.run_id(self.root) if self.rank == 0 else None
        run_id = self.strategy.broadcast_object(run_id)
        root = os.path.join(c["dir"], run_id)
        problem = None
        try:
            layout.check_writable(root, key="ckpt.local.dir")
        except CheckpointError as e:
            problem = str(e)
        if self.strategy.any(problem is not None):  # every rank uses the local tier, or none does
            log.warning(
                "local checkpoint tier off: %s; saving to the durable tier (ckpt.dir) only",
                problem or "not writable on another rank",
            )
            return
        self.local = Tier("local", root, c["keep"], c["interval_steps"], c["interval_seconds"], False)
        self.local.make_schedule(make_auto() if c["auto"] else None)
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

    def _setup_backend(self) -> None:
        """Per-run resources of a backend (stagers, checkpoint processes)."""

    # ---- restore ------------------------------------------------------------------------------------
    def restore(self, target: Target) -> int | None:
        self._state_dict_info(target)  # per-run analysis for saves, done during setup rather than at the first save
        spec = self.load_spec
        if spec in (None, "none", False):
            return None
        choice: Any = None
        if self.rank == 0:  # rank 0 decides (and reports a bad spec) for everyone
            try:
                choice = layout.candidates(self.root, spec)
                if spec == "auto" and self.local is not None:  # the newest complete one of either tier
                    both = [(layout.step_of(p), 0, p) for p in layout.candidates(self.local.root, "auto")]
                    both += [(layout.step_of(p), 1, p) for p in choice]
                    choice = [p for _, _, p in sorted(both, key=lambda x: (-x[0], x[1]))]  # a tie: local (faster)
            except CheckpointError as e:
                choice = str(e)
        choice = self.strategy.broadcast_object(choice)
        if isinstance(choice, str):
            raise CheckpointError(choice)
        explicit = spec != "auto"
        for i, path in enumerate(choice):
            t0 = time.perf_counter()
            error: BaseException | None = None
            try:
                self._load(path, target)
            except FingerprintMismatch:
                raise
            except ERRORS as e:  # corrupt/truncated: fall back to an older one
                error = e
            if self.strategy.any(error is not None):  # every rank takes the same checkpoint, or none
                reason = one_line(error) if error is not None else "failed to load on another rank"
                if explicit:
                    raise CheckpointError(f"cannot load checkpoint {path}: {reason}") from error
                older = choice[i + 1] if i + 1 < len(choice) else None
                log.warning(
                    "checkpoint %s failed to load (%s); %s",
                    path,
                    reason,
                    f"falling back to {os.path.basename(older)}" if older else "no older complete checkpoint",
                )
                if older is None:
                    raise CheckpointError(
                        f"no loadable checkpoint in {self.root} (newest failed: {reason}); "
                        f"fix or move the directory, or set ckpt.load=none to start over"
                    ) from error
                continue
            tier = "local" if self.local is not None and path.startswith(self.local.root + os.sep) else "durable"
            log.info(
                "restored %s (step %d, %s tier) in %.2f s", path, target.state.step, tier, time.perf_counter() - t0
            )
            return target.state.step
        return None

    def _load(self, path: str, target: Target) -> None:
        model_sd, optim_sd, trains = self._read(path, target)
        # This rank's own state; a rank that did not exist when it was saved starts from rank 0's.
        train = trains.get(f"train.rank{self.rank}", trains.get("train.rank0"))
        saved_fp = train["fingerprint"] if train is not None else None
        if saved_fp is not None and not self.load_model_only:
            _check_fingerprint(path, saved_fp, target.state.fingerprint())
        full = StateDictOptions(full_state_dict=layout.is_full_state(path))
        if self.load_model_only:
            set_model_state_dict(target.model, model_sd, options=full)
            log.info("loaded model weights only from %s (ckpt.load_model_only=true)", path)
            return
        if train is None:
            raise CheckpointError(f"{path} has no training state (step, data position, RNG)")
        set_state_dict(
            target.model, target.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=full
        )
        peers = [trains[k] for k in sorted(trains, key=lambda k: int(k[len("train.rank") :]))]
        if len(peers) != self.world_size:
            log.info("resharding: checkpoint written by %d rank(s), resuming on %d", len(peers), self.world_size)
        target.state.load_state_dict(train, peers=peers)

    def _read(self, path: str, target: Target) -> tuple[dict, dict, dict[str, dict]]:
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
        if self.rank == 0:
            layout.remove(record.path)  # a partial leftover of the same step (e.g. after a crash), if any
        self.strategy.barrier()
        try:
            pending = self._write(self._app_state(target), record)
        except ERRORS as e:  # handled per on_error
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
        ok = [
            r.total_seconds for r in self.records[-10:] if r.error is None and r.total_seconds and r.tier == tier.name
        ]
        write = sum(ok[-5:]) / len(ok[-5:]) if ok and self.is_async else 0.0
        moved = tier.schedule.measured(cost, write)
        if moved is not None:
            key = "ckpt_interval_seconds" if tier is self.durable else "ckpt_local_interval_seconds"
            self.report({key: moved}, step)

    def _app_state(self, target: Target) -> dict:
        self.strategy.sync_buffers(target.model)
        model_sd, optim_sd = self._state_dicts(target)
        return {"model": model_sd, "optim": optim_sd, f"train.rank{self.rank}": encode_json(target.state.state_dict())}

    def _state_dicts(self, target: Target) -> tuple[dict, dict]:
        """DCP's ``get_state_dict``, without redoing per save what is per run: it works out every parameter's
        fully qualified name and the wrapper kind again on each call (~20 ms of the ~30 for ResNet-50 +
        AdamW, all of it loop time).  That analysis is kept for the (model, optimizer) pair and its options;
        the state dicts themselves are made fresh each save.  Where this torch lacks the pieces, the public
        call is used."""
        try:
            from torch.distributed.checkpoint import state_dict as sd

            info = self._state_dict_info(target)
            with sd._gc_context():
                model_sd = sd._get_model_state_dict(target.model, info)
                optim_sd = sd._get_optim_state_dict(target.model, (target.optimizer,), info)
                sd._verify_state_dict(model_sd, optim_sd, info)
            return model_sd, optim_sd
        except (AttributeError, TypeError):
            self._sd_info = None
            opts = StateDictOptions(full_state_dict=self.full_state, cpu_offload=self.full_state)
            return get_state_dict(target.model, target.optimizer, options=opts)

    def _state_dict_info(self, target: Target) -> Any:
        """DCP's analysis of the (model, optimizer) pair for ``get_state_dict``, made once per pair (None where
        this torch lacks ``_verify_options``)."""
        key = (id(target.model), id(target.optimizer))
        if self._sd_info is None or self._sd_info[0] != key:
            from torch.distributed.checkpoint import state_dict as sd

            verify = getattr(sd, "_verify_options", None)
            if verify is None:
                return None
            opts = StateDictOptions(full_state_dict=self.full_state, cpu_offload=self.full_state)
            self._sd_info = (key, verify(target.model, (target.optimizer,), optim_only=False, options=opts))
        return self._sd_info[1]

    def wait_staging(self) -> float:
        p = self.pending
        if p is None or p.staging is None:
            return 0.0
        t0 = time.perf_counter()
        try:
            p.staging.result()
        except ERRORS as e:  # the upload future carries the same failure
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
        except ERRORS as e:  # handled per on_error
            self._failed(p.record, e)
        else:
            self._committed(p.record)
        return time.perf_counter() - t0

    def poll(self) -> None:
        if self.pending is not None and self.pending.upload.done():
            self.wait()

    def _committed(self, record: SaveRecord) -> None:
        """A save became durable: account for it and purge old checkpoints (rank 0, in the background)."""
        record.total_seconds = (record.finished or time.perf_counter()) - record.started
        if self.rank == 0:
            record.bytes = dir_bytes(record.path)
            if self._purger is not None:
                tier = self._tier(record)
                self._purger.submit(layout.purge, tier.root, tier.keep_last_k)
                if tier is self.durable and self.local is not None:  # local ones not newer are of no more use
                    self._purger.submit(layout.purge_up_to, self.local.root, record.step)
        with self._lock:
            self._done.append(record)

    def _failed(self, record: SaveRecord, error: BaseException) -> None:
        record.error = one_line(error)
        self.failures += 1
        local = record.tier == "local"
        log.error(
            "%scheckpoint at step %d failed: %s (it is not committed; older checkpoints are intact%s)",
            "local-tier " if local else "",
            record.step,
            record.error,
            "; the durable tier is unaffected" if local else "",
        )
        if not layout.is_complete(record.path) and (self.rank == 0 or local):
            layout.remove(record.path)  # (a local tier may be per node: every rank cleans)
        with self._lock:
            self._done.append(record)
        if self.on_error == "raise" and not local:  # a fast tier failing (a full tmpfs) never stops the run
            raise CheckpointError(f"checkpoint at step {record.step} failed: {record.error}") from error

    def _report_finished(self) -> None:
        with self._lock:
            done, self._done = self._done, []
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
            self._report_finished()
            if self._purger is not None:
                self._purger.shutdown(wait=True)
                self._purger = None
            self._shutdown()
        durable = [r for r in self.records if r.tier == "durable"]
        last = durable[-1] if durable else None
        if self.local is not None and last is not None and last.last and last.error is None and self.rank == 0:
            shutil.rmtree(self.local.root, ignore_errors=True)  # the run is complete: free the tmpfs
        if last is not None and last.error is not None and (self.on_error == "raise" or last.last):
            # The final save failed (or failures must fail the run): never report success.
            raise CheckpointError(f"the last checkpoint (step {last.step}) failed: {last.error}")

    def _shutdown(self) -> None:
        """Release per-run backend resources (also after a failure)."""

    def stats(self) -> dict:
        """The durable tier's figures (``local_*``: the local tier's, when it is on)."""
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731

        def figures(tier: str) -> dict:
            records = [r for r in self.records if r.tier == tier]
            ok = [r for r in records if r.error is None]
            return {
                "saves": len(ok),
                "failures": sum(1 for r in records if r.error is not None),
                "block_seconds_total": round(sum(r.block_seconds for r in records), 4),
                "block_seconds_mean": round(mean([r.block_seconds for r in ok]), 5),
                "total_seconds_mean": round(mean([r.total_seconds or 0.0 for r in ok]), 5),
                "bytes_last": ok[-1].bytes if ok else 0,
            }

        out = {"backend": self.name, **figures("durable")}
        if self.local is not None:
            out.update({f"local_{k}": v for k, v in figures("local").items()})
            out["local_dir"] = self.local.root
        return out

    # ---- backend hook ---------------------------------------------------------------------------------
    @abstractmethod
    def _write(self, app_state: dict, record: SaveRecord) -> Pending | None:
        """Write ``app_state`` to ``record.path``: return None once it is committed (a synchronous save), or
        the futures of a save that goes on in the background (the lifecycle here waits for and commits it)."""


def _check_fingerprint(path: str, saved: dict, now: dict) -> None:
    changed = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if changed:
        detail = "; ".join(
            f"{k}: {str(saved.get(k))[:60]!r} -> {str(now.get(k))[:60]!r}" if k != "model" else "model config changed"
            for k in changed
        )
        raise FingerprintMismatch(
            f"cannot resume from {path}: {', '.join(changed)} changed since it was saved ({detail}); "
            f"use a new run_dir, or ckpt.load_model_only=true to start from its model weights"
        )
