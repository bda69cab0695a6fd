"""What DCP's ``.metadata`` may hold, checked before DCP uses any path or size in it (:func:`check_metadata`).

The restricted unpickler (:mod:`pitstop.ckpt.unpickle`) makes sure reading ``.metadata`` runs no code; this makes
sure what it says is believable: the records DCP writes, files of the checkpoint's own manifest, offsets inside
them, tensors no larger than the bytes that hold them, dtypes a checkpoint holds.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from pitstop.ckpt import integrity
from pitstop.errors import CorruptCheckpoint

RAW = "pitstop.raw/1"  # the descriptor of a tensor stored as its raw bytes (pitstop.ckpt.rawdcp)
METADATA = ".metadata"  # DCP's metadata file: the commit marker


# The dtypes a tensor in a checkpoint may have: what models, optimizers and pitstop's own records use. A quantized
# or sub-byte dtype declared for raw bytes would make torch read past them (a crash, not an error).
DTYPES = frozenset(
    getattr(torch, name)
    for name in (
        "float64 float32 float16 bfloat16 complex128 complex64 int64 int32 int16 int8 uint8 uint16 uint32 uint64 bool "
        "float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz"
    ).split()
    if isinstance(getattr(torch, name, None), torch.dtype)
)
MAX_DIM = 1 << 40  # elements along one dimension: far beyond any tensor, far below what overflows an allocation


def check_metadata(metadata: object, files: dict[str, dict], path: str) -> None:
    """CorruptCheckpoint unless DCP ``metadata`` (of checkpoint dir ``path``, whose manifest lists ``files``) is made
    of the records DCP writes, names only files of its manifest, at offsets inside them, and declares no tensor
    larger than the bytes that hold it nor of a dtype checkpoints do not hold.  So nothing outside the checkpoint is
    opened and nothing is allocated for sizes the files do not have: a checkpoint of 1 MB that declares 2 GiB (or
    2^60 bytes) is refused before a byte is allocated."""

    def bad(what: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"checkpoint {path} is corrupt: its {METADATA} {what}")

    try:
        _check_metadata(metadata, files, path, bad)
    except (AttributeError, TypeError, ValueError, OverflowError, RecursionError) as e:
        raise bad(f"is malformed ({type(e).__name__}: {str(e)[:100]})") from None


def _check_metadata(
    metadata: object, files: dict[str, dict], path: str, bad: Callable[[str], CorruptCheckpoint]
) -> None:
    if not isinstance(metadata, Metadata):
        raise bad(f"holds a {type(metadata).__name__}, not DCP metadata")
    storage, tensors = metadata.storage_data, metadata.state_dict_metadata
    if not isinstance(storage, dict) or not isinstance(tensors, dict):
        raise bad("has no storage records")
    spans: dict[tuple, _StorageInfo] = {}
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo) or not isinstance(index.fqn, str):
            raise bad(f"holds a storage record of type {type(info).__name__}")
        name = integrity.check_name(info.relative_path, path, f"a file in its {METADATA}")
        if name not in files or name == METADATA:
            raise bad(f"stores {index.fqn[:80]} in {name}, a file its {integrity.MANIFEST} does not list")
        if not all(_count(v) for v in (info.offset, info.length)) or info.offset + info.length > files[name]["bytes"]:
            raise bad(
                f"stores {index.fqn[:80]} at bytes {info.offset}+{info.length} of {name}, which has "
                f"{files[name]['bytes']} (a declared size the file does not have)"
            )
        offset = None if index.offset is None else _dims(index.offset, bad, index.fqn)
        spans[(index.fqn, offset)] = info
    for fqn, md in tensors.items():
        if not isinstance(fqn, str):
            raise bad(f"names an item {str(fqn)[:40]!r}, not a string")
        if isinstance(md, BytesStorageMetadata) and not fqn.startswith("train.rank"):
            continue
        if not isinstance(md, TensorStorageMetadata) or not isinstance(md.properties, TensorProperties):
            raise bad(f"describes {fqn[:80]} as a {type(md).__name__}")
        if md.properties.dtype not in DTYPES:
            raise bad(f"gives {fqn[:80]} the dtype {md.properties.dtype}, which no checkpoint holds")
        if fqn.startswith("train.rank") and (md.properties.dtype != torch.uint8 or len(_dims(md.size, bad, fqn)) != 1):
            raise bad(f"describes the train state {fqn[:40]} as {md.properties.dtype} of shape {tuple(md.size)}")
        _check_tensor(fqn, md, spans, bad)


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _dims(v: object, bad: Callable[[str], CorruptCheckpoint], fqn: str) -> tuple[int, ...]:
    """A shape or an offset: a sequence of counts, each below :data:`MAX_DIM`."""
    if not isinstance(v, (tuple, list)) or not all(_count(d) and d < MAX_DIM for d in v):
        raise bad(f"gives {fqn[:80]} the shape or offset {str(v)[:60]}")
    return tuple(v)


def _check_tensor(fqn: str, md: TensorStorageMetadata, spans: dict, bad: Callable[[str], Exception]) -> None:
    size = _dims(md.size, bad, fqn)
    itemsize = md.properties.dtype.itemsize
    if not isinstance(md.chunks, list):
        raise bad(f"gives {fqn[:80]} no list of chunks")
    held = 0
    for chunk in md.chunks:
        if not isinstance(chunk, ChunkStorageMetadata):
            raise bad(f"gives {fqn[:80]} a chunk of type {type(chunk).__name__}")
        offsets, sizes = _dims(chunk.offsets, bad, fqn), _dims(chunk.sizes, bad, fqn)
        if (
            len(offsets) != len(size)
            or len(sizes) != len(size)
            or any(o + n > d for o, n, d in zip(offsets, sizes, size))
        ):
            raise bad(f"gives {fqn[:80]} a chunk {sizes} at {offsets} outside its shape {size}")
        nbytes = math.prod(sizes) * itemsize
        info = spans.get((fqn, offsets))
        if info is None:
            raise bad(f"has no stored bytes for {fqn[:80]}'s chunk at {offsets}")
        raw = RAW in (info.transform_descriptors or ())
        if info.length != nbytes if raw else info.length < nbytes:  # (a torch.save item holds the bytes and more)
            raise bad(f"declares {nbytes} bytes for {fqn[:80]}'s chunk at {offsets}, stored in {info.length}")
        held += nbytes
    if math.prod(size) * itemsize > held:
        raise bad(f"declares {math.prod(size) * itemsize} bytes for {fqn[:80]}, its chunks hold {held}")
