"""The two on-disk formats: DCP directories (``.metadata`` + ``__R_N.distcp``) and one ``state.pt``."""

from __future__ import annotations

import io
import json
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from pitstop import fsurl
from pitstop.ckpt.layout import DCP_MARKER, SAVE_MARKER, is_file
from pitstop.ckpt.rawdcp import RawFileSystemReader, RawFsspecReader
from pitstop.ckpt.storage import fsync_dir, open_write

STATE_FILE = "state.pt"
TRAIN_PREFIX = "train.rank"


def encode_json(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj, separators=(",", ":")).encode()), dtype=torch.uint8)


def decode_json(t: torch.Tensor) -> Any:
    return json.loads(bytes(t.cpu().numpy().tobytes()).decode())


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values (e.g. optimizer hyper-parameters) are read with
    ``torch.load(..., weights_only=True)``: a checkpoint can never run code when it is loaded."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_checkpoint(path: str, model: Any, optimizer: Any, group: Any) -> tuple[dict, dict, dict[str, dict]]:
    """Read any pitstop checkpoint into ``(model_sd, optim_sd, {"train.rankR": train state} of every saved rank)``."""
    if is_file(fsurl.join(path, DCP_MARKER)):
        return _read_dcp(path, model, optimizer, group)
    if is_file(fsurl.join(path, SAVE_MARKER)):
        if fsurl.is_url(path):
            fs, p = fsurl.filesystem(fsurl.join(path, STATE_FILE))
            sd = torch.load(io.BytesIO(fs.cat_file(p)), map_location="cpu", weights_only=True)
        else:
            sd = torch.load(os.path.join(path, STATE_FILE), map_location="cpu", weights_only=True, mmap=True)
        return sd["model"], sd["optim"], {k: decode_json(v) for k, v in sd.items() if k.startswith(TRAIN_PREFIX)}
    raise FileNotFoundError(f"{path} has no commit marker")


def dcp_reader(path: str) -> FileSystemReader:
    """A reader for any DCP checkpoint: raw tensor items (pitstop's default) and torch.save items alike."""
    if fsurl.is_url(path):
        return RawFsspecReader(path, **fsurl.options_for(path))
    return RawFileSystemReader(path)


def to_torch_save(path: str, out: str) -> None:
    """The whole of a DCP checkpoint (either format) as one ``torch.save`` file, as torch's
    ``format_utils.dcp_to_torch_save`` does for its own format."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict = {}
    _load_state_dict(sd, storage_reader=dcp_reader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    torch.save(sd, out)


def _read_dcp(path: str, model: Any, optimizer: Any, group: Any) -> tuple[dict, dict, dict[str, dict]]:
    reader = dcp_reader(path)
    meta = reader.read_metadata().state_dict_metadata
    # Load in place into tensors shaped like this run's (sharded) state: DCP reshards N -> M ranks.
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions())
    sd: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    trains = [k for k in meta if k.startswith(TRAIN_PREFIX)]  # small: every rank reads every rank's
    sd.update({k: torch.empty(meta[k].size, dtype=torch.uint8) for k in trains})
    dcp.load(sd, storage_reader=reader, planner=SafeLoadPlanner(), process_group=group)
    return sd["model"], sd["optim"], {k: decode_json(sd[k]) for k in trains}


def write_torch_save(
    app_state: dict, path: str, rank: int, world_size: int, group: Any, step: int, throttle_mbps: float | None
) -> None:
    """Rank 0 writes the full state as one file: temp name, fsync, rename, then the COMMITTED marker."""
    train_keys = [k for k in app_state if k.startswith("train.rank")]
    if world_size > 1:  # every rank's train state goes into the one file
        gathered: list = [None] * world_size if rank == 0 else None
        dist.gather_object({k: app_state[k] for k in train_keys}, gathered, dst=0, group=group)
        if rank == 0:
            for part in gathered:
                app_state.update(part)
    if rank != 0:
        return
    if fsurl.is_url(path):
        return _upload_torch_save(app_state, path, world_size, step)
    os.makedirs(path, exist_ok=True)
    tmp, final = os.path.join(path, STATE_FILE + ".tmp"), os.path.join(path, STATE_FILE)
    with open_write(tmp, throttle_mbps) as f:
        torch.save(app_state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(path)
    marker_tmp = os.path.join(path, SAVE_MARKER + ".tmp")
    with open(marker_tmp, "w") as f:
        json.dump({"step": step, "format": "torch.save", "world_size": world_size}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(marker_tmp, os.path.join(path, SAVE_MARKER))
    fsync_dir(path)


def _upload_torch_save(app_state: dict, path: str, world_size: int, step: int) -> None:
    """To an object store: ``state.pt`` is one upload (whole or absent), then the marker; no rename needed."""
    fs, p = fsurl.filesystem(path)
    with fs.open(f"{p}/{STATE_FILE}", "wb") as f:
        torch.save(app_state, f)
    fs.pipe_file(
        f"{p}/{SAVE_MARKER}", json.dumps({"step": step, "format": "torch.save", "world_size": world_size}).encode()
    )
