"""``ckpt=async_dcp`` / ``ckpt=async_dcp_pinned``: ``dcp.async_save`` — the loop pays only for staging.

- ``async_dcp``: staging (a host copy of the state) happens in the call; a thread writes it.
- ``async_dcp_pinned``: one reusable stager (pinned memory on CUDA, shared memory on CPU) staging in the
  background, written by a separate checkpoint process; the loop waits for staging only right before the
  optimizer changes the parameters, so the copy overlaps forward/backward.

At most one save is in flight: a new save first waits for the previous one.  A failed background write is
logged, counted (``ckpt_failed``) and handled per ``ckpt.on_error``; ``close()`` waits for the last save.
"""

from __future__ import annotations

import warnings

import logging
import os
import time
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from pitstop.ckpt.base import ERRORS, CheckpointManager, SaveRecord
from pitstop.ckpt.sync_dcp import dcp_writer

log = logging.getLogger("pitstop.ckpt")


# Single-process saves are intended: DCP's notice about it is noise.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class AsyncDCP(CheckpointManager):
    name = "async_dcp"
    is_async = True

    def __init__(self, pinned: bool = False, checkpointer: str = "auto", **kw: Any):
        super().__init__(**kw)
        self.pinned = bool(pinned)
        if checkpointer not in ("auto", "thread", "process"):
            raise ValueError(f"ckpt.checkpointer must be auto, thread or process, got {checkpointer!r}")
        self.checkpointer = checkpointer
        self.stager = None
        self.staging: Future | None = None
        self.upload: Future | None = None
        if self.pinned:
            self.name = "async_dcp_pinned"

    def bind(self, runner: Any) -> None:
        super().bind(runner)
        kind = self.checkpointer if self.checkpointer != "auto" else ("process" if self.pinned else "thread")
        self.kind = AsyncCheckpointerType.PROCESS if kind == "process" else AsyncCheckpointerType.THREAD
        if self.kind == AsyncCheckpointerType.PROCESS and not dist.is_initialized():
            self.strategy.init_local_group(os.path.join(runner.run_dir, ".pg-store"))
            self.group = self.strategy.ckpt_group()
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = self.strategy.device.type == "cuda"
        # One stager for the whole run: it keeps its host buffers (keyed by the source storages), so each
        # save is a copy into memory allocated once, and host memory stays flat across saves.
        opts = StagingOptions(use_pinned_memory=cuda, use_shared_memory=self.pinned, use_async_staging=self.pinned,
                              use_non_blocking_copy=cuda)
        self.stager = DefaultStager(opts)
        where = "pinned host memory, non-blocking copies" if cuda else (
            "reusable shared memory (no accelerator: pinned memory unavailable)" if self.pinned else "reusable host memory")
        log.info("%s: %s checkpointer, staging %s into %s", self.name, kind,
                 "in the background" if self.pinned else "in the loop", where)

    def _write(self, app_state: dict, record: SaveRecord) -> None:
        out = dcp.async_save(app_state, storage_writer=dcp_writer(record.path, self.throttle_mbps),
                             process_group=self.group, async_checkpointer_type=self.kind, async_stager=self.stager)
        if isinstance(out, Future):
            self.staging, self.upload = None, out
        else:  # AsyncSaveResponse: staging continues in the background
            self.staging, self.upload = out.staging_completion, out.upload_completion
        self.inflight = record
        self.upload.add_done_callback(lambda _: setattr(record, "finished", time.perf_counter()))

    def poll(self) -> None:
        if self.upload is not None and self.upload.done():
            self.wait()

    def wait_staging(self) -> float:
        if self.staging is None:
            return 0.0
        t0 = time.perf_counter()
        try:
            self.staging.result()
        except ERRORS as e:  # the upload future carries the same failure
            log.debug("staging failed: %s", e)
        self.staging = None
        waited = time.perf_counter() - t0
        if self.inflight is not None:
            self.inflight.block_seconds += waited
        return waited

    def wait(self) -> float:
        if self.upload is None:
            return 0.0
        t0 = time.perf_counter()
        self.wait_staging()
        record, upload = self.inflight, self.upload
        self.upload, self.inflight = None, None
        try:
            upload.result()
        except ERRORS as e:  # handled per on_error
            self._failed(record, e)
        else:
            self._committed(record)
        return time.perf_counter() - t0

    def _shutdown(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None
