"""DCP checkpoints whose tensors are stored as their raw bytes (``ckpt.format=raw``, the default).

``torch.distributed.checkpoint``'s file writer stores every tensor as its own ``torch.save`` archive: a
pickler and a zip writer per tensor, ~1.2 ms of Python each and ~40 small writes, and a clone of any tensor
that is a view into a larger buffer (every tensor :class:`~pitstop.ckpt.staging.HostStager` stages).  For
ResNet-50 + AdamW that is 815 archives and ~2 s of writer CPU per save, twice one ``torch.save`` of the same
state, and it is what limits a run that saves often (``bench/ckpt.py``).

Here each tensor's bytes go to the rank's file in one write (the GIL is released while the OS copies them),
and the metadata records where.  Everything else is DCP's: the plan, the ``.metadata`` file, the chunk
layout, and so resharding N -> M ranks on load.  The tensor's dtype and chunk shape are already in the
metadata, so a reader needs nothing else.  Each raw item carries the descriptor ``pitstop.raw/1``:
torch's own ``FileSystemReader`` refuses such a checkpoint with ``Unknown extension name='pitstop.raw'``
rather than misreading it; :class:`RawFileSystemReader` reads both raw items and ``torch.save`` items (older
pitstop checkpoints, ``ckpt.format=torch_save``, or any other DCP checkpoint).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import os
import pickle
from typing import Generator

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, DEFAULT_SUFFIX, FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from pitstop import fsurl
from pitstop.ckpt import integrity
from pitstop.ckpt.dcpmeta import METADATA, RAW, check_metadata
from pitstop.ckpt.staging import PAGE  # (O_DIRECT alignment of memory, file offsets and lengths)
from pitstop.ckpt.unpickle import load_metadata
from pitstop.errors import CorruptCheckpoint

DIRECT_CHUNK = 256 << 20  # bytes per O_DIRECT write call
FORMATS = ("raw", "torch_save")
CHECKSUM_FQN = "pitstop.checksum/"  # a write result that carries a file's checksum to the coordinator, not an item


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes, without a copy when it is contiguous (a view into a staged flat buffer is)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class _RawWrites:
    """``write_data`` for DCP's file writers: one file per rank, non-tensor items as DCP serialises them,
    tensors as raw bytes.  Mixed into :class:`FileSystemWriter` (local, fsync) and :class:`FsspecWriter`.

    On a local file system, tensors that are views of one page-aligned host buffer (what
    :class:`~pitstop.ckpt.staging.HostStager` stages into: one flat buffer per dtype) are written as that
    buffer's span in one ``O_DIRECT`` write: the bytes go from the buffer to the device without a copy into
    the page cache, which on a small CPU box cost the training loop as much CPU as the rest of the save
    (writing 283 MB through the page cache: ~0.1-0.5 s of kernel time plus the flusher's).  Everything else,
    and file systems that refuse ``O_DIRECT`` (tmpfs before Linux 6.6), go through an ordinary buffered write."""

    def write_data(self, plan, planner) -> Future:
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        path = self.fs.concat_path(self.path, name)
        items = [(item, planner.resolve_data(item)) for item in plan.items]
        results: list[WriteResult] = []
        on = getattr(self, "checksums", True)
        strong = writer_key(self) is not None
        running = integrity.Running(strong) if on else None  # the file's checksum, as its bytes go out (in order)
        offset = 0
        if type(self.fs) is FileSystem:  # local and unthrottled
            regions, rest = page_regions(items)
            if regions:
                offset = write_direct(str(path), name, regions, results, running)
                if offset is None:  # O_DIRECT refused here: all of it buffered
                    offset, rest, results, running = 0, items, [], integrity.Running(strong) if on else None
        else:
            rest = items
        with self.fs.create_stream(path, "r+b" if offset else "wb") as stream:
            if offset:
                stream.seek(offset)
            for item, data in rest:
                if item.type == WriteItemType.BYTE_IO:
                    view, descriptors = data.getbuffer(), None
                else:
                    view, descriptors = tensor_bytes(data), [RAW]
                if len(view):
                    stream.write(view)
                    if running is not None:
                        running.update(view)
                results.append(_result(item, name, offset, len(view), descriptors))
                offset += len(view)
            if self.sync_files:
                stream.flush()
                os.fsync(stream.fileno())
        if getattr(self, "checksums", True):
            results.append(checksum_result(name, running.entry()))
        fut: Future = Future()
        fut.set_result(results)
        return fut


def _result(item, name: str, offset: int, length: int, descriptors: list | None) -> WriteResult:
    return WriteResult(
        index=item.index,
        size_in_bytes=length,
        storage_data=_StorageInfo(name, offset, length, transform_descriptors=descriptors),
    )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def page_regions(items: list) -> tuple[list, list]:
    """Split ``(item, data)`` pairs into page-aligned spans of shared host buffers, each
    ``(storage, start, end, [(item, tensor), ...])`` with byte offsets into the storage, and the rest."""
    groups: dict[int, list] = {}
    rest = []
    for item, data in items:
        if (
            item.type != WriteItemType.BYTE_IO
            and isinstance(data, torch.Tensor)
            and data.device.type == "cpu"
            and data.numel()
            and data.is_contiguous()
        ):
            groups.setdefault(data.untyped_storage().data_ptr(), []).append((item, data))
        else:
            rest.append((item, data))
    regions = []
    for base, members in groups.items():
        storage = members[0][1].untyped_storage()
        lo = min(t.data_ptr() for _, t in members)
        hi = max(t.data_ptr() + _nbytes(t) for _, t in members)
        start, end = lo - lo % PAGE - base, hi + (-hi % PAGE) - base
        used = sum(_nbytes(t) for _, t in members)
        # the span must lie in the storage and hold little besides these tensors (views pad to 64 bytes)
        if start >= 0 and end <= storage.nbytes() and end - start <= used * 1.05 + 2 * PAGE:
            regions.append((storage, start, end, members))
        else:
            rest.extend(members)
    return regions, rest


def write_direct(path: str, name: str, regions: list, results: list, running: integrity.Running | None) -> int | None:
    """Write each region's span with ``O_DIRECT`` back to back from offset 0, append the tensors' results, add
    the bytes to the ``running`` checksum, and return the end offset; None where the file system refuses
    ``O_DIRECT`` (nothing written)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return None
        raise
    try:
        offset = 0
        for storage, start, end, members in regions:
            whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
            view = memoryview(whole[start:end].numpy())
            done = 0
            while done < len(view):
                try:
                    done += os.pwrite(fd, view[done : done + DIRECT_CHUNK], offset + done)
                except OSError as e:
                    if e.errno == errno.EINVAL and offset + done == 0:
                        return None
                    raise
            if running is not None:
                running.update(view)
            first = storage.data_ptr() + start
            for item, t in members:
                results.append(_result(item, name, offset + t.data_ptr() - first, _nbytes(t), [RAW]))
            offset += end - start
        return offset
    finally:
        os.close(fd)


def writer_key(writer: object) -> bytes | None:
    """The key a writer signs with: the one the trainer read when it made the writer (``sync_dcp.dcp_writer``),
    else the environment's where it runs."""
    key = getattr(writer, "signing_key", integrity.FROM_ENV)
    return integrity.signing_key() if key is integrity.FROM_ENV else key


def checksum_result(name: str, entry: dict) -> WriteResult:
    """The checksum of file ``name``, as a write result: DCP gathers every rank's results to the coordinator, whose
    ``finish`` takes these out into the manifest (:mod:`pitstop.ckpt.integrity`) before writing ``.metadata``."""
    return WriteResult(
        index=MetadataIndex(fqn=CHECKSUM_FQN + name), size_in_bytes=0, storage_data={"file": name, **entry}
    )


class _Manifest:
    """``finish`` for every pitstop DCP writer: the checksum manifest (every rank's files and the metadata's own
    bytes) is made durable first, then ``.metadata``, the commit marker, as DCP's own ``finish`` writes it (temp
    name, fsync, rename)."""

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if not getattr(self, "checksums", True):  # (bench/ckpt.py's rows without checksums: DCP's own finish)
            return super().finish(metadata, results)
        files: dict[str, dict] = {}
        storage: dict = {}
        for wr_list in results:
            for wr in wr_list:
                if wr.index.fqn.startswith(CHECKSUM_FQN):
                    files[wr.storage_data["file"]] = {k: v for k, v in wr.storage_data.items() if k != "file"}
                else:
                    storage[wr.index] = wr.storage_data
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        blob = pickle.dumps(metadata)
        key = writer_key(self)
        running = integrity.Running(key is not None)
        running.update(blob)
        files[METADATA] = running.entry()
        self._put(integrity.MANIFEST, integrity.manifest_bytes(files, integrity.dir_name(str(self.path)), key))
        self._put(METADATA, blob)

    def _put(self, name: str, data: bytes) -> None:
        tmp = self.fs.concat_path(self.path, name + ".tmp")
        with self.fs.create_stream(tmp, "wb") as f:
            f.write(data)
            if self.sync_files:
                f.flush()
                os.fsync(f.fileno())
        final = self.fs.concat_path(self.path, name)
        if self.fs.exists(final):
            self.fs.rm_file(final)
        self.fs.rename(tmp, final)
        if self.sync_files and isinstance(self.fs, FileSystem):
            from pitstop.ckpt.storage import fsync_dir

            fsync_dir(str(self.path))


class _ReadBackChecksums:
    """``write_data`` for DCP's own (torch.save-item) writers: their files are checksummed once written, by reading
    them back in the writer's thread or process (page-cache hot on a local disk)."""

    def write_data(self, plan, planner) -> Future:
        results = list(super().write_data(plan, planner).wait())
        for name in (
            [] if not getattr(self, "checksums", True) else sorted({r.storage_data.relative_path for r in results})
        ):
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                entry = integrity.stream_checksum(stream, writer_key(self) is not None).entry()
            results.append(checksum_result(name, entry))
        fut: Future = Future()
        fut.set_result(results)
        return fut


class RawFileSystemWriter(_Manifest, _RawWrites, FileSystemWriter):
    pass


class RawFsspecWriter(_Manifest, _RawWrites, FsspecWriter):
    pass


class TorchSaveFileSystemWriter(_Manifest, _ReadBackChecksums, FileSystemWriter):
    pass


class TorchSaveFsspecWriter(_Manifest, _ReadBackChecksums, FsspecWriter):
    pass


class _RawReads:
    """``read_data`` that reads raw items itself (one read per item, straight into a tensor of the stored
    chunk's dtype and shape) and hands every other item to DCP's reader."""

    checkpoint_dir: str | None = None  # the dir as pitstop names it (a URL for a store): set by formats.dcp_reader

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        """DCP's ``read_metadata``, through the restricted unpickler (:mod:`pitstop.ckpt.unpickle`), then checked
        against the checkpoint's manifest (:func:`check_metadata`) before DCP uses any path or size in it."""
        where = self.checkpoint_dir or str(self.path)
        files = integrity.read_manifest(where)
        path = fsurl.join(where, METADATA)
        if METADATA not in files:
            raise CorruptCheckpoint(f"checkpoint {where} is corrupt: its {integrity.MANIFEST} does not list {METADATA}")
        want = files[METADATA]
        with integrity.open_file(path) as f:
            blob = f.read(want["bytes"] + 1)
        if len(blob) != want["bytes"] or f"{integrity.crc(blob):08x}" != want[integrity.ALGORITHM]:
            raise CorruptCheckpoint(f"checkpoint {where} is corrupt: {METADATA} is not the file its manifest lists")
        metadata = load_metadata(io.BytesIO(blob), path)
        check_metadata(metadata, files, where)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: object, **kwargs: object) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.tensor_metadata = metadata.state_dict_metadata

    def read_data(self, plan, planner) -> Future:
        raw: dict[str, list] = {}
        other = []
        for req in plan.items:
            info: _StorageInfo = self.storage_data[req.storage_index]
            if req.type != LoadItemType.BYTE_IO and RAW in (info.transform_descriptors or ()):
                raw.setdefault(info.relative_path, []).append((info, req))
            else:
                other.append(req)
        if other:
            super().read_data(dataclasses.replace(plan, items=other), planner).wait()
        for relative_path, reqs in raw.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                for info, req in sorted(reqs, key=lambda r: r[0].offset):
                    stored = self._stored_chunk(req.storage_index, stream, info)
                    tensor = narrow_tensor_by_index(stored, req.storage_offsets, req.lengths)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != tensor.size():
                        raise AssertionError(
                            f"{req.storage_index.fqn}: stored {tuple(tensor.size())}, expected {tuple(target.size())}"
                        )
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _stored_chunk(self, index: MetadataIndex, stream: io.IOBase, info: _StorageInfo) -> torch.Tensor:
        md = self.tensor_metadata[index.fqn]
        chunks = md.chunks
        chunk = chunks[index.index] if index.index is not None and index.index < len(chunks) else None
        if chunk is None or (index.offset is not None and chunk.offsets != index.offset):
            chunk = next(c for c in chunks if index.offset is None or c.offsets == index.offset)
        dtype = md.properties.dtype
        if info.length == 0:
            return torch.empty(chunk.sizes, dtype=dtype)
        buf = bytearray(info.length)
        stream.seek(info.offset)
        got = stream.readinto(buf)
        if got != info.length:
            raise CorruptCheckpoint(
                f"{index.fqn}: the checkpoint file {info.relative_path} ends after {got} of "
                f"{info.length} bytes at offset {info.offset}: it is truncated"
            )
        return torch.frombuffer(buf, dtype=dtype).view(chunk.sizes)


class _NoLinks(FileSystem):
    """DCP's local file system, but a read opens only a regular file reached without a link (what ``verify``
    checked: a link swapped in after it would otherwise be read through)."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "r" not in mode or "+" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with integrity.open_regular(str(path)) as raw, io.BufferedReader(raw) as stream:
            yield stream


class RawFileSystemReader(_RawReads, FileSystemReader):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.fs = _NoLinks()


class RawFsspecReader(_RawReads, FsspecReader):
    pass
