"""The two on-disk formats: DCP directories (``.metadata`` + ``__R_N.distcp``) and one ``state.pt``."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from typing import IO, Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from pitstop import fsurl
from pitstop.ckpt import integrity
from pitstop.ckpt.layout import DCP_MARKER, SAVE_MARKER, is_file
from pitstop.ckpt.rawdcp import RawFileSystemReader, RawFsspecReader
from pitstop.ckpt.storage import fsync_dir, open_write
from pitstop.errors import CorruptCheckpoint

STATE_FILE = "state.pt"
TRAIN_PREFIX = "train.rank"


def encode_json(obj: object) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj, separators=(",", ":")).encode()), dtype=torch.uint8)


def decode_json(t: object, key: str = "train state") -> Any:
    """What :func:`encode_json` wrote; CorruptCheckpoint for anything else (another kind of tensor, a value that is
    no tensor, bytes that are not JSON, JSON nested too deep to parse)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        kind = f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise CorruptCheckpoint(f"{key} is a {kind}, not the bytes of the JSON pitstop wrote")
    try:
        return json.loads(bytes(t.cpu().numpy().tobytes()).decode())
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptCheckpoint(f"{key} is not the JSON pitstop wrote ({type(e).__name__})") from None


def safe_torch_load(source: str | os.PathLike[str] | IO[bytes], what: str, **kw: Any) -> Any:
    """``torch.load(weights_only=True)``: torch's restricted unpickler; what it refuses is named as a refused file."""
    try:
        return torch.load(source, weights_only=True, **kw)
    except pickle.UnpicklingError as e:
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise CorruptCheckpoint(f"refused {what}: {first} (nothing in it was run)") from None
    except UNREADABLE as e:  # (its bytes passed their checksums: what they declare does not hold together)
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise CorruptCheckpoint(f"{what} is unreadable ({type(e).__name__}: {first})") from None


# What reading a checkpoint's bytes raises when what they declare is inconsistent (a storage smaller than a tensor's
# shape, a truncated archive, a record of the wrong type): corruption, never a bug to restart on.
UNREADABLE = (RuntimeError, ValueError, EOFError, KeyError, TypeError, IndexError, OverflowError, MemoryError)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values (e.g. optimizer hyper-parameters) are read with
    ``torch.load(..., weights_only=True)``: a checkpoint can never run code when it is loaded."""

    def load_bytes(self, read_item, value) -> None:
        obj = safe_torch_load(value, f"the checkpoint item {read_item.dest_index.fqn}")
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class Summed:
    """A writable file that checksums what passes through it: ``torch.save`` writes its archive in order, so the
    manifest gets the file's checksum without reading it back."""

    def __init__(self, raw: IO[bytes]):
        self.raw, self.running = raw, integrity.Running()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        self.raw.write(view)
        self.running.update(view)
        return len(view)

    def flush(self) -> None:
        self.raw.flush()


def read_checkpoint(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer, group: dist.ProcessGroup | None
) -> tuple[dict[str, dict], Callable[[], tuple]]:
    """Read any pitstop checkpoint: ``({"train.rankR": train state} of every saved rank, tensors)``, where
    ``tensors()`` reads ``(model_sd, optim_sd)``; the train states come first, so a changed config (the fingerprint
    they hold) is told before tensors of another shape fail to load."""
    if is_file(fsurl.join(path, DCP_MARKER)):
        return _read_dcp(path, model, optimizer, group)
    if is_file(fsurl.join(path, SAVE_MARKER)):
        if fsurl.is_url(path):
            fs, p = fsurl.filesystem(fsurl.join(path, STATE_FILE))
            sd = safe_torch_load(io.BytesIO(fs.cat_file(p)), fsurl.join(path, STATE_FILE), map_location="cpu")
        else:
            where = os.path.join(path, STATE_FILE)
            with integrity.open_regular(where) as f:  # (the file verify checked: never a link swapped in since)
                fd_path = f"/proc/self/fd/{f.fileno()}"
                sd = safe_torch_load(
                    fd_path if os.path.exists(fd_path) else where, where, map_location="cpu", mmap=True
                )
        if not isinstance(sd, dict) or not isinstance(sd.get("model"), dict) or not isinstance(sd.get("optim"), dict):
            raise CorruptCheckpoint(f"{path}/{STATE_FILE} holds no model and optimizer state")
        trains = {k: decode_json(v, k) for k, v in sd.items() if train_key(path, k)}
        return trains, lambda: (sd["model"], sd["optim"])
    raise FileNotFoundError(f"{path} has no commit marker")


def train_key(path: str, key: object) -> bool:
    """``key`` is a rank's train state (``train.rank3``); CorruptCheckpoint for a ``train.rank`` key of another
    form (a rank is a number)."""
    if not isinstance(key, str) or not key.startswith(TRAIN_PREFIX):
        return False
    if not re.fullmatch(r"train\.rank[0-9]{1,9}", key):  # (ASCII digits: str.isdigit() takes '²' too)
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: it holds {key[:60]!r}, not a rank's train state")
    return True


def dcp_reader(path: str) -> FileSystemReader:
    """A reader for any DCP checkpoint: raw tensor items (pitstop's default) and torch.save items alike."""
    reader = RawFsspecReader(path, **fsurl.options_for(path)) if fsurl.is_url(path) else RawFileSystemReader(path)
    reader.checkpoint_dir = path
    return reader


def to_torch_save(path: str, out: str) -> None:
    """The whole of a DCP checkpoint (either format) as one ``torch.save`` file, as torch's
    ``format_utils.dcp_to_torch_save`` does for its own format; verified against its checksums first, and read
    without running code (its non-tensor items as :class:`SafeLoadPlanner` reads them)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    class SafeEmptyPlanner(SafeLoadPlanner, _EmptyStateDictLoadPlanner):
        pass

    integrity.verify(path)
    dcp_reader(path).read_metadata()  # (its checks, raised as they are: DCP's load would wrap them)
    sd: dict = {}
    _load_state_dict(sd, storage_reader=dcp_reader(path), planner=SafeEmptyPlanner(), no_dist=True)
    torch.save(sd, out)


def _read_dcp(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer, group: dist.ProcessGroup | None
) -> tuple[dict[str, dict], Callable[[], tuple]]:
    meta = dcp_reader(path).read_metadata().state_dict_metadata
    keys = [k for k in meta if train_key(path, k)]  # small: every rank reads every rank's
    small: dict[str, Any] = {k: torch.empty(meta[k].size, dtype=torch.uint8) for k in keys}
    if small:
        dcp.load(small, storage_reader=dcp_reader(path), planner=SafeLoadPlanner(), process_group=group)

    def tensors() -> tuple[dict, dict]:
        # In place into tensors shaped like this run's (sharded) state: DCP reshards N -> M ranks.
        model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions())
        sd: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        dcp.load(sd, storage_reader=dcp_reader(path), planner=SafeLoadPlanner(), process_group=group)
        return sd["model"], sd["optim"]

    return {k: decode_json(small[k], k) for k in keys}, tensors


def write_torch_save(
    app_state: dict,
    path: str,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None,
    step: int,
    throttle_mbps: float | None,
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
        summed = Summed(f)
        torch.save(app_state, summed if integrity.ENABLED else f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(path)
    if integrity.ENABLED:
        integrity.write_manifest(path, {STATE_FILE: summed.running.entry()})  # (durable before the marker)
    integrity.write_durable(path, SAVE_MARKER, marker(step, world_size))


def _upload_torch_save(app_state: dict, path: str, world_size: int, step: int) -> None:
    """To an object store: ``state.pt`` is one upload (whole or absent), then the marker; no rename needed."""
    fs, p = fsurl.filesystem(path)
    with fs.open(f"{p}/{STATE_FILE}", "wb") as f:
        summed = Summed(f)
        torch.save(app_state, summed)
    integrity.write_manifest(path, {STATE_FILE: summed.running.entry()})
    integrity.write_durable(path, SAVE_MARKER, marker(step, world_size))


def marker(step: int, world_size: int) -> bytes:
    """The ``COMMITTED`` marker's contents, sealed (:func:`pitstop.ckpt.integrity.seal`)."""
    return integrity.seal({"step": step, "format": "torch.save", "world_size": world_size})
