"""``ckpt=async_dcp`` / ``ckpt=async_dcp_pinned``: ``dcp.async_save`` — the loop pays only for staging.

- ``async_dcp``: staging (a host copy of the state) happens in the call; a thread writes it.
- ``async_dcp_pinned``: one reusable stager (pinned memory on CUDA, shared memory on CPU) staging in the
  background, written by a separate checkpoint process; the loop waits for staging only right before the
  optimizer changes the parameters, so the copy overlaps forward/backward.

The lifecycle (one save in flight, waiting for staging before the state changes, commit, failure handling
per ``ckpt.on_error``, waiting for the last save at close) is :class:`~pitstop.ckpt.base.CheckpointManager`'s;
this module only starts the write and says where staging happens.
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from pitstop.ckpt.base import CheckpointManager, Pending, SaveRecord
from pitstop.errors import ConfigError
from pitstop.ckpt.sync_dcp import dcp_writer

log = logging.getLogger("pitstop.ckpt")


# Single-process saves are intended: DCP's notice about it is noise.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class AsyncDCP(CheckpointManager):
    name = "async_dcp"
    is_async = True

    def __init__(self, pinned: bool = False, checkpointer: str = "auto", **kw: Any):
        if checkpointer not in ("auto", "thread", "process"):
            raise ConfigError(f"ckpt.checkpointer={checkpointer!r}: use auto, thread or process")
        super().__init__(**kw)
        self.pinned, self.checkpointer = bool(pinned), checkpointer
        self.stager = None
        if self.pinned:
            self.name = "async_dcp_pinned"

    def _setup_backend(self) -> None:
        kind = self.checkpointer if self.checkpointer != "auto" else ("process" if self.pinned else "thread")
        self.kind = AsyncCheckpointerType.PROCESS if kind == "process" else AsyncCheckpointerType.THREAD
        if self.kind == AsyncCheckpointerType.PROCESS and not dist.is_initialized():
            # A one-rank group for the checkpoint process; its file store is private to this process.
            self.strategy.init_local_group(os.path.join(tempfile.gettempdir(), f"pitstop-pg-{os.getpid()}-{id(self)}"))
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

    def _write(self, app_state: dict, record: SaveRecord) -> Pending | None:
        out = dcp.async_save(app_state, storage_writer=dcp_writer(record.path, record.throttle_mbps),
                             process_group=self.group, async_checkpointer_type=self.kind, async_stager=self.stager)
        if isinstance(out, Future):
            return Pending(record, upload=out)
        # AsyncSaveResponse: staging continues in the background
        return Pending(record, upload=out.upload_completion, staging=out.staging_completion)

    def _shutdown(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None
