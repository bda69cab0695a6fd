"""``ckpt=async_dcp`` / ``ckpt=async_dcp_pinned``: ``dcp.async_save`` — the loop pays only for a snapshot.

Both stage with :class:`~pitstop.ckpt.staging.HostStager`: buffers that forward changes (BatchNorm
statistics) are copied in the call; parameters and optimizer state are copied in the background into host
buffers allocated once, and the loop waits for that copy only right before ``optimizer.step()``, so it
overlaps the next step's forward and backward.  Then a writer (``ckpt.checkpointer``: a thread of this
process, or a checkpoint process reading the host buffers from shared memory) writes the checkpoint.

- ``async_dcp``: plain host memory (pinned on CUDA).
- ``async_dcp_pinned``: pinned and shared host memory for a checkpoint process (shared memory on CPU).

The lifecycle (one save in flight, waiting for staging before the state changes, commit, failure handling
per ``ckpt.on_error``, waiting for the last save at close) is :class:`~pitstop.ckpt.manager.CheckpointManager`'s;
this module only starts the write and says where staging happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import shutil
import tempfile
import warnings
from concurrent.futures import Future
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from pitstop.ckpt import orphans
from pitstop.ckpt.contract import Pending, SaveRecord, SaveResult, Target, one_line
from pitstop.ckpt.dcp import ERRORS
from pitstop.ckpt.manager import CheckpointManager
from pitstop.ckpt.staging import HostStager, Layout, layout_bytes, staged_leaves
from pitstop.ckpt.sync_dcp import check_format, dcp_writer, planner
from pitstop.errors import CheckpointError, ConfigError
from pitstop.notices import notices_blocked

log = logging.getLogger("pitstop.ckpt")


# Single-process saves are intended: DCP's notice about it is noise.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class AsyncDCP(CheckpointManager):
    name = "async_dcp"
    is_async = True

    def __init__(self, pinned: bool = False, checkpointer: str = "auto", format: str = "raw", **kw: Any):
        self.format = check_format(format)
        if checkpointer not in ("auto", "thread", "process"):
            raise ConfigError(f"ckpt.checkpointer={checkpointer!r}: use auto, thread or process")
        super().__init__(**kw)
        self.pinned, self.checkpointer = bool(pinned), checkpointer
        self.stager = None
        self._recorded: int | None = None  # the checkpoint process's pid, once recorded (pitstop.ckpt.orphans)
        if self.pinned:
            self.name = "async_dcp_pinned"

    def _setup_backend(self) -> None:
        kind = self.checkpointer if self.checkpointer != "auto" else ("process" if self.pinned else "thread")
        self.kind = AsyncCheckpointerType.PROCESS if kind == "process" else AsyncCheckpointerType.THREAD
        if self.kind == AsyncCheckpointerType.PROCESS and not dist.is_initialized():
            # A one-rank group for the checkpoint process; its file store is private to this process.
            self.strategy.init_local_group(os.path.join(tempfile.gettempdir(), f"pitstop-pg-{os.getpid()}-{id(self)}"))
            self.group = self.strategy.ckpt_group()
        # One stager for the whole run: its host buffers are allocated on the first save and reused.
        self.stager = HostStager(
            self.strategy.device, shared=self.kind == AsyncCheckpointerType.PROCESS, pinned=self.pinned
        )
        log.info("%s: %s checkpointer; staging: %s", self.name, kind, self.stager.describe())
        self._warmup: tuple[Future, str] | None = None
        self._shm_checked = False
        self._prepared = False
        if self.kind == AsyncCheckpointerType.PROCESS:
            self._start_checkpoint_process()

    def _start_checkpoint_process(self) -> None:
        """Start the checkpoint process now, while the rest of setup runs, not at the first save: a tiny save
        into a scratch dir spawns it (an interpreter importing torch and joining a process group: seconds).
        The first real save waits for it only if it is still starting."""
        scratch = tempfile.mkdtemp(prefix="pitstop-ckpt-warmup-")
        try:
            with notices_blocked():  # (DCP's thread, and the process it spawns, inherit the blocked notices)
                out = dcp.async_save(
                    {"warmup": torch.zeros(1)},
                    storage_writer=dcp_writer(scratch, None, self.format),
                    process_group=self.group,
                    async_checkpointer_type=self.kind,
                )
        except ERRORS as e:  # the first real save will report what is wrong
            log.warning("could not start the checkpoint process ahead of the first save: %s", one_line(e))
            shutil.rmtree(scratch, ignore_errors=True)
            return
        self._warmup = (out if isinstance(out, Future) else out.upload_completion, scratch)

    def _wait_warmup(self) -> None:
        if self._warmup is None:
            return
        (future, scratch), self._warmup = self._warmup, None
        try:
            future.result()
        except ERRORS as e:
            log.warning("checkpoint process warm-up save failed: %s", one_line(e))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        self._writer_started()

    def maybe_save(self, target: Target, step: int, *, last: bool = False, force: bool = False) -> SaveResult:
        result = super().maybe_save(target, step, last=last, force=force)
        if self.kind == AsyncCheckpointerType.PROCESS:  # (DCP starts a new one inside a save's thread: seen here)
            self._writer_started()
        if (
            result.started is None
            and self.stager is not None
            and self.stager.layout is None
            and not self._prepared
            and getattr(target.optimizer, "state", None)
        ):
            # The optimizer has state now (a step ran), so the state's layout is final: allocate the host buffers
            # in the background while training goes on, not in the first save (which then took 2-6x a later one)
            self._prepared = True
            state = dict(zip(("model", "optim"), self._sd.get(target)))
            self._check_shared_memory(state)
            self.stager.prepare(state)
        return result

    def _app_state(self, target: Target) -> dict:
        state = super()._app_state(target)
        self.stager.snapshot_in_call(target.model.buffers())
        return state

    def _write(self, app_state: dict, record: SaveRecord) -> Pending | None:
        kind = self.kind
        if (
            kind == AsyncCheckpointerType.PROCESS
            and self._warmup is not None
            and self.strategy.any(not self._warmup[0].done())
        ):
            # The checkpoint process is still starting (seconds after setup): rather than wait for it, this
            # save is written by a thread, from the same host buffers; the process takes the next one.
            kind = AsyncCheckpointerType.THREAD
            log.info("checkpoint process still starting: the save at step %d is written from a thread", record.step)
        else:
            self._wait_warmup()  # (DCP keeps one checkpoint process per trainer: never start a second one)
        if kind == AsyncCheckpointerType.PROCESS:
            self._replace_dead_checkpoint_process()
        self._check_shared_memory(app_state)
        if self.kind == AsyncCheckpointerType.THREAD:  # (shared memory too small: a thread writes from now on)
            kind = AsyncCheckpointerType.THREAD
        # A scheduler's notice goes to every process of the job step: not to DCP's checkpoint process, which is
        # spawned (fork + exec) from the thread this call starts, or the notice would end the save it asks for.
        with notices_blocked():
            out = dcp.async_save(
                app_state,
                storage_writer=dcp_writer(record.path, record.throttle_mbps, self.format),
                planner=planner(),
                process_group=self.group,
                async_checkpointer_type=kind,
                async_stager=self.stager,
            )
        upload = out if isinstance(out, Future) else out.upload_completion
        if kind == AsyncCheckpointerType.THREAD:
            upload.add_done_callback(_release_freed_memory)
        if isinstance(out, Future):
            return Pending(record, upload=out)
        # AsyncSaveResponse: staging continues in the background
        return Pending(record, upload=out.upload_completion, staging=out.staging_completion)

    def _check_shared_memory(self, state: dict) -> None:
        """Before host buffers are allocated in shared memory: is there room for them?  Every rank decides the
        same (one collective, once per run)."""
        if not self.stager.shared or self._shm_checked:
            return
        problem = _shared_memory_problem(state, self.stager)
        if self.strategy.any(problem is not None):
            problem = problem or "ckpt.checkpointer=process: shared memory is too small on another rank"
            if self.checkpointer != "auto":
                raise CheckpointError(
                    f"{problem}: enlarge it (docker run --shm-size, a Kubernetes emptyDir "
                    f"with medium: Memory) or use ckpt.checkpointer=thread"
                )
            log.warning("%s; writing from a thread of this process instead", problem)
            snapshot, self.stager = self.stager, HostStager(self.strategy.device, shared=False, pinned=self.pinned)
            self.stager._in_call = snapshot._in_call  # (set for this save by _app_state, if it is one)
            snapshot.close()
            self.kind = AsyncCheckpointerType.THREAD
        self._shm_checked = True

    def _replace_dead_checkpoint_process(self) -> None:
        """A checkpoint process that died (killed, out of memory) fails the save it was writing; DCP would then
        send every later save to the dead process.  Every rank drops its checkpoint process when any rank's
        died (they form one process group), and the next save starts new ones."""
        from torch.distributed.checkpoint import _async_process_executor as executor

        current = getattr(executor, "_CHECKPOINT_PROCESS", None)
        proc = getattr(current, "_save_process", None)
        dead = proc is not None and not proc.is_alive()
        if not self.strategy.any(dead):
            return
        if dead:
            log.warning(
                "the checkpoint process (pid %s) died (exit code %s); starting a new one for this save",
                proc.pid,
                proc.exitcode,
            )
        elif proc is not None:  # alive, but its peers on other ranks are gone: stop it
            proc.terminate()
            proc.join(timeout=10)
        executor._CHECKPOINT_PROCESS = None

    def _writer_started(self) -> None:
        """The checkpoint process (if one runs): its priority lowered, and recorded on this machine for the next
        attempt, which it may outlive (:mod:`pitstop.ckpt.orphans`)."""
        from torch.distributed.checkpoint import _async_process_executor as executor

        proc = getattr(getattr(executor, "_CHECKPOINT_PROCESS", None), "_save_process", None)
        if proc is None or proc.pid is None or proc.pid == self._recorded or not proc.is_alive():
            return
        _lower_priority(proc.pid)
        orphans.record(self.root, proc.pid)
        self._recorded = proc.pid

    def _shutdown(self) -> None:
        self._wait_warmup()
        if self._recorded is not None:
            orphans.forget(self.root)
        if self.stager is not None:
            self.stager.close()
            self.stager = None


SHM = "/dev/shm"


def _release_freed_memory(_: Future | None = None) -> None:
    """DCP writes each save from a new thread, and glibc gives new threads their own malloc arenas; memory a
    write frees stays in them, so a thread-written run's RSS grew by ~350 MB over 50 ResNet-50 saves
    (bench/ckpt.py).  Handing freed arena memory back after each write (on the writer's own thread, off the
    loop) keeps it flat.  A no-op where the C library has no ``malloc_trim``."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Callable[[int], object] | bool | None = None
WRITER_NICE = 10


def _lower_priority(pid: int) -> None:
    """The checkpoint process only has to finish before the next save; the training loop is what the job pays
    for.  With fewer free cores than busy threads (a CPU-only box, or a data loader using every core), the
    writer at nice 10 takes the cores the loop leaves idle instead of slowing its steps."""
    try:
        if os.getpriority(os.PRIO_PROCESS, pid) < WRITER_NICE:
            os.setpriority(os.PRIO_PROCESS, pid, WRITER_NICE)
    except OSError:
        pass


def _shared_memory_problem(app_state: dict, stager: HostStager) -> str | None:
    """A checkpoint process reads the host buffers from shared memory; where it is too small, a write to them
    would kill the trainer with SIGBUS.  Say so before allocating, with the size needed."""
    leaves = staged_leaves(app_state)
    if stager.layout is not None and stager.layout.key == Layout.key_of(leaves):
        return None
    need = layout_bytes([t for _, t in leaves])
    try:
        st = os.statvfs(SHM)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if free >= need:
        return None
    return (
        f"ckpt.checkpointer=process needs {need / 2**20:.0f} MiB of shared memory for its host buffers, but "
        f"{SHM} has {free / 2**20:.0f} MiB free"
    )
