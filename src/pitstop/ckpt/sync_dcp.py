"""``ckpt=sync_dcp``: ``torch.distributed.checkpoint.save`` — every rank writes its shard, rank 0 ``.metadata``."""

from __future__ import annotations

import warnings

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from pitstop import fsurl
from pitstop.ckpt import integrity
from pitstop.ckpt.contract import Pending, SaveRecord
from pitstop.ckpt.manager import CheckpointManager
from pitstop.ckpt.rawdcp import (
    FORMATS,
    RawFileSystemWriter,
    RawFsspecWriter,
    TorchSaveFileSystemWriter,
    TorchSaveFsspecWriter,
)
from pitstop.ckpt.storage import ThrottledFileSystem
from pitstop.errors import ConfigError


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ConfigError(
            f"ckpt.format={fmt!r}: use raw (tensor bytes, fastest) or torch_save (what torch's own "
            f"FileSystemReader reads)"
        )
    return fmt


def dcp_writer(path: str, throttle_mbps: float | None, fmt: str = "raw") -> dcp.FileSystemWriter:
    """A DCP writer for ``path``: one file per rank; ``fmt`` raw (see :mod:`pitstop.ckpt.rawdcp`) or torch_save;
    either way a checksum manifest goes before the commit marker (:mod:`pitstop.ckpt.integrity`)."""
    if fsurl.is_url(path):  # an object store: each file is one upload, whole or absent (nothing to fsync)
        writer = (RawFsspecWriter if fmt == "raw" else TorchSaveFsspecWriter)(
            path, single_file_per_rank=True, sync_files=False, thread_count=1, overwrite=True, **fsurl.options_for(path)
        )
    else:
        writer = (RawFileSystemWriter if fmt == "raw" else TorchSaveFileSystemWriter)(
            path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True
        )
        if throttle_mbps:
            writer.fs = ThrottledFileSystem(throttle_mbps)
    writer.checksums = integrity.ENABLED
    # (the key as the trainer has it, carried with the writer into a checkpoint process, which may have started
    # before: what signs a save is what its restore will check)
    writer.signing_key = integrity.signing_key()
    return writer


def planner() -> DefaultSavePlanner:
    """DCP's default planner with plan caching: the save plan of a run's state is the same every save, so
    ranks exchange it once (later saves send only what changed)."""
    return DefaultSavePlanner(enable_plan_caching=True)


# Single-process saves are intended: DCP's notice about it is noise.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class SyncDCP(CheckpointManager):
    name = "sync_dcp"

    def __init__(self, format: str = "raw", **kw):
        self.format = check_format(format)
        super().__init__(**kw)

    def _write(self, app_state: dict, record: SaveRecord) -> Pending | None:
        dcp.save(
            app_state,
            storage_writer=dcp_writer(record.path, record.throttle_mbps, self.format),
            planner=planner(),
            process_group=self.group,
        )
        return None
