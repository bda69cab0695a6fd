"""The one pickle pitstop reads from a checkpoint, DCP's ``.metadata``, read without running code.

torch's ``FileSystemReader.read_metadata`` calls ``pickle.load`` on the file as is: a crafted ``.metadata`` (in a
shared bucket, a downloaded checkpoint, a run dir someone else can write) runs whatever it names.  Here the
unpickler admits only what DCP's metadata is made of: its own record classes, ``torch.Size``, dtypes, layouts and
the path in its storage record; any other global is refused before it is looked up, so nothing outside that list
is ever called.  Every other non-tensor item pitstop reads goes through ``torch.load(weights_only=True)``, torch's
own restricted unpickler (:class:`pitstop.ckpt.formats.SafeLoadPlanner`, ``sync_save``'s ``state.pt``).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from pitstop.errors import CorruptCheckpoint

_DCP = "torch.distributed.checkpoint.metadata"
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP, "Metadata"),
        (_DCP, "MetadataIndex"),
        (_DCP, "StorageMeta"),
        (_DCP, "TensorProperties"),
        (_DCP, "TensorStorageMetadata"),
        (_DCP, "BytesStorageMetadata"),
        (_DCP, "ChunkStorageMetadata"),
        (_DCP, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a layout by its name (torch.strided)
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
        ("pathlib", "PurePosixPath"),
    }
)


class _Refused(Exception):
    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` admits :data:`ALLOWED` and torch's dtypes, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")


def load_metadata(stream: io.IOBase, name: str) -> Any:
    """Unpickle DCP metadata from ``stream`` (``name``: the file, for the message); CorruptCheckpoint if it names
    anything outside the allowed classes, or is not a pickle at all."""
    try:
        return MetadataUnpickler(stream).load()
    except _Refused as e:
        raise CorruptCheckpoint(
            f"refused {name}: it would construct {e.what}, which checkpoint metadata never holds (a crafted or "
            f"foreign file); nothing in it was run"
        ) from None
    except (
        pickle.UnpicklingError,
        EOFError,
        AttributeError,
        ImportError,
        IndexError,
        KeyError,
        TypeError,
        ValueError,
        OverflowError,
        RecursionError,
        MemoryError,
    ) as e:
        raise CorruptCheckpoint(f"{name} is unreadable ({type(e).__name__}: {str(e)[:120]})") from None


def loads_metadata(data: bytes, name: str) -> Any:
    return load_metadata(io.BytesIO(data), name)
