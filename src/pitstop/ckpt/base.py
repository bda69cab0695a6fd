"""What every checkpoint backend shares: when to save, the commit protocol, auto-resume, retention.

Layout: ``ckpt.dir/step_{:08d}/``, one dir per checkpoint.  A checkpoint is *complete* only when its
commit marker exists, and the marker is written last: DCP's ``.metadata`` (rank 0 writes it after every
rank's data is written and fsynced) or, for ``sync_save``, ``COMMITTED`` (after ``state.pt`` was written
under a temporary name, fsynced and renamed).  Anything else in ``ckpt.dir`` is partial and never loaded.

The saved state (the same for every backend, so checkpoints are interchangeable):
- ``model`` and ``optim``: from DCP's ``get_state_dict`` (the same keys for plain, DDP and FSDP models);
- ``train.rank{R}``: the rest of each rank's state — step and sample counters, LR schedule, data-loader
  position, every RNG state and the config fingerprint — as JSON bytes in a uint8 tensor, so nothing is
  ever unpickled: ``torch.load`` always runs with ``weights_only=True``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from torch.distributed.checkpoint.api import CheckpointException

from omegaconf import OmegaConf

from pitstop.ckpt.storage import dir_bytes
from pitstop.errors import ConfigError, PitstopError

log = logging.getLogger("pitstop.ckpt")

DCP_MARKER = ".metadata"
SAVE_MARKER = "COMMITTED"
STEP_PREFIX = "step_"
# DCP reports failures as CheckpointException, which derives from BaseException, not Exception.
ERRORS = (Exception, CheckpointException)


class CheckpointError(PitstopError):
    """A checkpoint could not be written or read, or does not match this run."""


class FingerprintMismatch(CheckpointError):
    pass


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"{STEP_PREFIX}{step:08d}")


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, DCP_MARKER)) or os.path.isfile(os.path.join(path, SAVE_MARKER))


def list_checkpoints(root: str) -> list[tuple[int, str, bool]]:
    """``(step, path, complete)`` for every ``step_*`` dir, oldest first."""
    out = []
    if not os.path.isdir(root):
        return out
    for name in os.listdir(root):
        if name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX):].isdigit():
            path = os.path.join(root, name)
            out.append((int(name[len(STEP_PREFIX):]), path, is_complete(path)))
    return sorted(out)


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


def encode_json(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj, separators=(",", ":")).encode()), dtype=torch.uint8)


def decode_json(t: torch.Tensor) -> Any:
    return json.loads(bytes(t.cpu().numpy().tobytes()).decode())


@dataclass
class SaveRecord:
    step: int
    path: str
    started: float = field(default_factory=time.perf_counter)
    block_seconds: float = 0.0
    total_seconds: float | None = None
    finished: float | None = None  # when the write became durable (set from the writer's thread)
    bytes: int = 0
    error: str | None = None


class CheckpointManager:
    """Base class of the saving backends; subclasses implement :meth:`_write` and :meth:`_read`."""

    name = "base"
    is_async = False
    full_state = False  # gather the full (unsharded) state on rank 0 instead of per-rank shards

    def __init__(self, dir: str, interval_steps: int | None = None, interval_seconds: float | None = None,
                 keep_last_k: int = 3, save_last: bool = True, load: Any = "auto", on_error: str = "raise",
                 load_model_only: bool = False, throttle_mbps: float | None = None, interval: Any = None,
                 mtbf_seconds: float | None = None, **_: Any):
        if on_error not in ("raise", "warn"):
            raise ConfigError(f"ckpt.on_error must be 'raise' or 'warn', got {on_error!r}")
        for key, v in (("ckpt.interval_steps", interval_steps), ("ckpt.interval_seconds", interval_seconds)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
                raise ConfigError(f"{key} must be a positive number or null, got {v!r}")
        if isinstance(keep_last_k, bool) or not isinstance(keep_last_k, int) or keep_last_k < 0:
            raise ConfigError(f"ckpt.keep_last_k must be an integer >= 0 (0 keeps all), got {keep_last_k!r}")
        if self.is_async and keep_last_k == 1:
            raise ConfigError("ckpt.keep_last_k=1 is unsafe with async saves (the newest may still be in flight); "
                              "use 2 or more, or 0 to keep all")
        if interval not in (None, "auto"):
            raise ConfigError(f"ckpt.interval={interval!r}: use auto (Young–Daly from measured save cost and MTBF) "
                              f"or null with ckpt.interval_steps / ckpt.interval_seconds")
        if mtbf_seconds is not None and (isinstance(mtbf_seconds, bool) or not isinstance(mtbf_seconds, (int, float))
                                         or mtbf_seconds <= 0):
            raise ConfigError(f"ckpt.mtbf_seconds must be a positive number of seconds or null, got {mtbf_seconds!r}")
        self.root = str(dir)
        self.auto, self.mtbf_seconds = interval == "auto", mtbf_seconds
        if self.auto:  # the measured interval replaces the fixed ones
            interval_steps = interval_seconds = None
        self.interval_steps, self.interval_seconds = interval_steps, interval_seconds
        self.keep_last_k, self.save_last, self.load_spec, self.on_error = keep_last_k, save_last, load, on_error
        self.load_model_only, self.throttle_mbps = bool(load_model_only), throttle_mbps
        self.records: list[SaveRecord] = []
        self.inflight: SaveRecord | None = None
        self.failures = 0
        self._done: list[SaveRecord] = []  # finished in the background, not yet reported
        self._lock = threading.Lock()
        self._purger: ThreadPoolExecutor | None = None
        self.saved_step: int | None = None  # the step of the latest save started

    # ---- wiring -------------------------------------------------------------------------------------
    def bind(self, runner: Any) -> None:
        self.runner, self.strategy = runner, runner.strategy
        self.rank, self.world_size = self.strategy.rank, self.strategy.world_size
        self.group = self.strategy.ckpt_group()
        if self.rank == 0:
            self._check_writable()
            self._purger = ThreadPoolExecutor(1, thread_name_prefix="pitstop-ckpt-purge")
        self.strategy.barrier()
        self.last_save_time = time.monotonic()
        self.started_saves = 0
        if self.auto:
            from pitstop.goodput import AutoInterval

            fault_mtbf = OmegaConf.select(runner.cfg, "fault.mtbf_seconds", default=None)
            mtbf, source = ((self.mtbf_seconds, "ckpt.mtbf_seconds") if self.mtbf_seconds else
                            (fault_mtbf, "fault.mtbf_seconds") if fault_mtbf else (None, ""))
            self.auto_interval = AutoInterval(mtbf, source, runner.goodput.failures(), runner.goodput.job_seconds())

    def _check_writable(self) -> None:
        probe = os.path.join(self.root, f".write-probe-{os.getpid()}")
        try:
            os.makedirs(self.root, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"ok")
                f.flush()
                os.fsync(f.fileno())
            os.remove(probe)
        except OSError as e:
            raise CheckpointError(f"ckpt.dir {self.root} is not writable ({e.strerror or e}); "
                                  f"point ckpt.dir at a writable directory") from None

    # ---- restore ------------------------------------------------------------------------------------
    def restore(self, runner: Any) -> int | None:
        spec = self.load_spec
        if spec in (None, "none", False):
            return None
        choice: Any = None
        if self.rank == 0:  # rank 0 decides (and reports a bad spec) for everyone
            try:
                choice = self._candidates(spec)
            except CheckpointError as e:
                choice = str(e)
        choice = self.strategy.broadcast_object(choice)
        if isinstance(choice, str):
            raise CheckpointError(choice)
        candidates = choice
        explicit = spec != "auto"
        for i, path in enumerate(candidates):
            t0 = time.perf_counter()
            error: BaseException | None = None
            try:
                self._load(path, runner)
            except FingerprintMismatch:
                raise
            except ERRORS as e:  # corrupt/truncated: fall back to an older one
                error = e
            if self.strategy.any(error is not None):  # every rank takes the same checkpoint, or none
                reason = one_line(error) if error is not None else "failed to load on another rank"
                if explicit:
                    raise CheckpointError(f"cannot load checkpoint {path}: {reason}") from error
                older = candidates[i + 1] if i + 1 < len(candidates) else None
                log.warning("checkpoint %s failed to load (%s); %s", path, reason,
                            f"falling back to {os.path.basename(older)}" if older else "no older complete checkpoint")
                if older is None:
                    raise CheckpointError(f"no loadable checkpoint in {self.root} (newest failed: {reason}); "
                                          f"fix or move the directory, or set ckpt.load=none to start over") from error
                continue
            step = runner.step
            log.info("restored %s (step %d) in %.2f s", path, step, time.perf_counter() - t0)
            return step
        return None

    def _candidates(self, spec: Any) -> list[str]:
        """Rank 0: the checkpoints to try, newest first; partial dirs are reported (and cleaned up)."""
        if isinstance(spec, int) or (isinstance(spec, str) and spec.isdigit()):
            path = step_dir(self.root, int(spec))
            if not is_complete(path):
                raise CheckpointError(f"ckpt.load={spec}: {path} is not a complete checkpoint")
            return [path]
        if spec != "auto":
            path = os.path.abspath(str(spec))
            if not is_complete(path):
                raise CheckpointError(f"ckpt.load={spec}: no complete checkpoint there (missing {DCP_MARKER} or {SAVE_MARKER})")
            return [path]
        found = list_checkpoints(self.root)
        for step, path, complete in found:
            if not complete:
                log.warning("skipping partial checkpoint %s (no commit marker); removing it", path)
                shutil.rmtree(path, ignore_errors=True)
        return [path for _, path, complete in reversed(found) if complete]

    def _load(self, path: str, runner: Any) -> None:
        model, optim = runner.model, runner.optimizer
        model_sd, optim_sd, trains = self._read(path, runner)
        # This rank's own state; a rank that did not exist when it was saved starts from rank 0's.
        train = trains.get(f"train.rank{self.rank}", trains.get("train.rank0"))
        saved_fp = train["fingerprint"] if train is not None else None
        if saved_fp is not None and not self.load_model_only:
            self._check_fingerprint(path, saved_fp, runner.fingerprint())
        full = StateDictOptions(full_state_dict=self._read_full(path))
        if self.load_model_only:
            set_model_state_dict(model, model_sd, options=full)
            log.info("loaded model weights only from %s (ckpt.load_model_only=true)", path)
            return
        if train is None:
            raise CheckpointError(f"{path} has no training state (step, data position, RNG)")
        set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd, options=full)
        peers = [trains[k] for k in sorted(trains, key=lambda k: int(k[len("train.rank"):]))]
        if len(peers) != self.world_size:
            log.info("resharding: checkpoint written by %d rank(s), resuming on %d", len(peers), self.world_size)
        runner.state.load_state_dict(train, peers=peers)

    @staticmethod
    def _check_fingerprint(path: str, saved: dict, now: dict) -> None:
        changed = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
        if changed:
            detail = "; ".join(
                f"{k}: {str(saved.get(k))[:60]!r} -> {str(now.get(k))[:60]!r}" if k != "model" else "model config changed"
                for k in changed)
            raise FingerprintMismatch(
                f"cannot resume from {path}: {', '.join(changed)} changed since it was saved ({detail}); "
                f"use a new run_dir, or ckpt.load_model_only=true to start from its model weights")

    # ---- save ---------------------------------------------------------------------------------------
    def due(self, step: int, last: bool) -> bool:
        if last:
            return bool(self.save_last)
        if self.auto and self.started_saves == 0:
            return True  # the first save measures what a save costs
        if self.interval_steps and step % int(self.interval_steps) == 0:
            return True
        seconds = self._auto_seconds(step) if self.auto else self.interval_seconds
        if seconds:
            flag = time.monotonic() - self.last_save_time >= float(seconds)
            return self.strategy.any(flag)  # every rank must agree, or collectives would hang
        return False

    def _auto_seconds(self, step: int) -> float:
        """Young–Daly from this attempt's measured blocking cost per save (the loop's checkpoint time,
        staging waits included) and, for async saves, never before the last one became durable."""
        cost = self.runner.ledger.seconds["checkpoint"] / max(self.started_saves, 1)
        ok = [r.total_seconds for r in self.records[-5:] if r.error is None and r.total_seconds]
        write = sum(ok) / len(ok) if ok and self.is_async else 0.0
        before = self.auto_interval.seconds
        seconds = self.auto_interval.update(cost, write)
        if seconds != before:  # update() keeps the old value unless it moves by more than 10%
            self.runner.report({"ckpt_interval_seconds": seconds}, step)
        return seconds

    def maybe_save(self, state: Any, step: int, *, last: bool = False) -> float:
        """Save if due; return the seconds the training loop was blocked."""
        self.poll()
        self._report_finished()
        if not self.due(step, last):
            return 0.0
        t0 = time.perf_counter()
        self.wait()  # at most one save in flight
        self.saved_step = step
        self.started_saves += 1
        record = SaveRecord(step=step, path=step_dir(self.root, step))
        if self.rank == 0 and os.path.exists(record.path):
            shutil.rmtree(record.path)  # a partial leftover of the same step (e.g. after a crash)
        self.strategy.barrier()
        try:
            self._write(self.app_state(), record)
        except ERRORS as e:  # handled per on_error
            self._failed(record, e)
        block = time.perf_counter() - t0
        record.block_seconds += block
        self.last_save_time = time.monotonic()
        return block

    def app_state(self) -> dict:
        r = self.runner
        self.strategy.sync_buffers(r.model)
        opts = StateDictOptions(full_state_dict=self.full_state, cpu_offload=self.full_state)
        model_sd, optim_sd = get_state_dict(r.model, r.optimizer, options=opts)
        return {"model": model_sd, "optim": optim_sd, f"train.rank{self.rank}": encode_json(r.state.state_dict())}

    def wait_staging(self) -> float:
        """Called before the model state changes (the next forward if it updates buffers, else before
        ``optimizer.step()``); a background stager finishes here. Returns the seconds waited."""
        return 0.0

    def wait(self) -> float:
        """Wait for the save in flight (if any); return the seconds waited."""
        return 0.0

    def poll(self) -> None:
        """Settle a background save that has finished (commit it, or report its failure) without waiting."""

    def _committed(self, record: SaveRecord) -> None:
        """A save became durable: account for it and purge old checkpoints (rank 0, in the background)."""
        record.total_seconds = (record.finished or time.perf_counter()) - record.started
        if self.rank == 0:
            record.bytes = dir_bytes(record.path)
            if self._purger is not None:
                self._purger.submit(self._purge)
        with self._lock:
            self._done.append(record)

    def _failed(self, record: SaveRecord, error: BaseException) -> None:
        record.error = one_line(error)
        self.failures += 1
        log.error("checkpoint at step %d failed: %s (it is not committed; older checkpoints are intact)",
                  record.step, record.error)
        if self.rank == 0 and not is_complete(record.path):
            shutil.rmtree(record.path, ignore_errors=True)
        with self._lock:
            self._done.append(record)
        if self.on_error == "raise":
            raise CheckpointError(f"checkpoint at step {record.step} failed: {record.error}") from error

    def _purge(self) -> None:
        if not self.keep_last_k:
            return
        complete = [(s, p) for s, p, ok in list_checkpoints(self.root) if ok]
        for step, path in complete[:-self.keep_last_k]:  # never the in-flight one: it is not complete yet
            shutil.rmtree(path, ignore_errors=True)
            log.debug("purged %s", path)

    def _report_finished(self) -> None:
        with self._lock:
            done, self._done = self._done, []
        for rec in done:
            self.records.append(rec)
            metrics = {"ckpt_block_seconds": rec.block_seconds, "ckpt_failed": float(rec.error is not None)}
            if rec.error is None:
                metrics.update(ckpt_total_seconds=rec.total_seconds, ckpt_bytes=float(rec.bytes))
            self.runner.report(metrics, rec.step)

    def close(self) -> None:
        """Wait for the last save; never let the run end successfully with a save in flight or failed."""
        try:
            self.wait()
        finally:
            self._report_finished()
            if self._purger is not None:
                self._purger.shutdown(wait=True)
                self._purger = None
            self._shutdown()
        last = self.records[-1] if self.records else None
        final_step = getattr(self.runner, "total_steps", None)
        if last is not None and last.error is not None and (self.on_error == "raise" or last.step == final_step):
            # The final save failed (or failures must fail the run): never report success.
            raise CheckpointError(f"the last checkpoint (step {last.step}) failed: {last.error}")

    def _shutdown(self) -> None:
        pass

    def stats(self) -> dict:
        ok = [r for r in self.records if r.error is None]
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        return {"backend": self.name, "saves": len(ok), "failures": self.failures,
                "block_seconds_total": round(sum(r.block_seconds for r in self.records), 4),
                "block_seconds_mean": round(mean([r.block_seconds for r in ok]), 5),
                "total_seconds_mean": round(mean([r.total_seconds or 0.0 for r in ok]), 5),
                "bytes_last": ok[-1].bytes if ok else 0}

    # ---- backend hooks --------------------------------------------------------------------------------
    def _write(self, app_state: dict, record: SaveRecord) -> None:
        raise NotImplementedError

    def _read(self, path: str, runner: Any) -> tuple[dict, dict, dict[str, dict]]:
        from pitstop.ckpt.formats import read_checkpoint

        return read_checkpoint(path, runner, self.group)

    def _read_full(self, path: str) -> bool:
        return os.path.isfile(os.path.join(path, SAVE_MARKER))
