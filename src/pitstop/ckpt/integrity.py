"""What a checkpoint's bytes should be: a checksum manifest, written before the commit marker, checked on restore.

Every checkpoint dir (``sync_save``, the DCP backends, either tier, local or an object store) holds
``CHECKSUMS``: for each file it wrote, the length and CRC32C of its bytes (one line of JSON), then a CRC32C of
that line.  The writer computes each file's checksum as the bytes go out (in the writer thread or the checkpoint
process, never in the training loop; CRC32C runs at ~14 GB/s on one core here and releases the GIL), and the
manifest is made durable before the commit marker (``.metadata`` or ``COMMITTED``), whose own checksum it
holds.  So a complete checkpoint always has its manifest, and a restore reads nothing it has not checked:

- a flipped byte anywhere in a file, a truncated or extended file: its checksum or length differs;
- a deleted file, or a deleted or garbled manifest: named as missing or unreadable;
- a garbled ``.metadata``: its checksum differs, before anything unpickles it.

Each finding is a :class:`~pitstop.errors.CorruptCheckpoint` whose text says which file, what was expected and what
was found.  ``python -m pitstop.ckpt.verify PATH...`` runs the same checks without training.

Pure functions of the files (no torch, no process groups): the verify command starts in a fraction of a second.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

import crc32c as _crc32c

from pitstop import fsurl
from pitstop.errors import CorruptCheckpoint

MANIFEST = "CHECKSUMS"
SAVE_MARKER = "COMMITTED"  # (pitstop.ckpt.layout's; sync_save's commit marker, after its one file)
STATE_FILE = "state.pt"  # (pitstop.ckpt.formats')
FORMAT = "pitstop.checksums/1"
ALGORITHM = "crc32c"
READ_CHUNK = 8 << 20  # bytes read per call while verifying
# Writers record checksums while this is True (read when a save's writer is made, and carried with it into a
# checkpoint process).  Only bench/ckpt.py turns it off, to measure what checksums cost side by side: a checkpoint
# written without them has no manifest, and a restore refuses it as corrupt.
ENABLED = True


def crc(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC32C of ``data`` (any buffer) continued from ``value``; the GIL is released for large buffers."""
    return _crc32c.crc32c(data, value)


class Running:
    """A checksum and a length kept up to date as a file's bytes are written, in order."""

    __slots__ = ("value", "nbytes")

    def __init__(self) -> None:
        self.value, self.nbytes = 0, 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        self.value = crc(view, self.value)
        self.nbytes += len(view)

    def entry(self) -> dict:
        return entry(self.nbytes, self.value)


def entry(nbytes: int, value: int) -> dict:
    return {"bytes": int(nbytes), ALGORITHM: f"{value:08x}"}


def seal(body: dict) -> bytes:
    """``body`` as one line of JSON, then a line with the checksum of that line's bytes: any changed byte (a space
    included) is found when it is read back."""
    line = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return line + f"\n{ALGORITHM} {crc(line):08x}\n".encode()


def unseal(data: bytes, path: str, name: str) -> dict:
    """What :func:`seal` wrote; CorruptCheckpoint (naming file ``name`` of checkpoint dir ``path``) if it is not."""
    line, _, tail = data.partition(b"\n")
    expected = tail.decode(errors="replace").strip()
    found = f"{ALGORITHM} {crc(line):08x}"
    if tail != f"{found}\n".encode():
        raise CorruptCheckpoint(
            f"checkpoint {path} is corrupt: {name} does not match its own checksum (expected {expected[:40]!r}, "
            f"found {found!r})"
        )
    try:
        doc = json.loads(line.decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: {name} is unreadable ({type(e).__name__})") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: {name} holds no record")
    return doc


def manifest_bytes(files: dict[str, dict]) -> bytes:
    """The manifest for ``files`` (name -> entry)."""
    return seal({"format": FORMAT, "algorithm": ALGORITHM, "files": dict(sorted(files.items()))})


def write_manifest(path: str, files: dict[str, dict]) -> None:
    """Make the manifest durable in checkpoint dir ``path`` (temp name, fsync, rename; one upload on a store). Its
    directory entry is made durable with the commit marker's: the marker is renamed after it, and the file system
    journals the two renames in that order."""
    write_durable(path, MANIFEST, manifest_bytes(files), sync_dir=False)


def write_durable(path: str, name: str, data: bytes, sync_dir: bool = True) -> None:
    """File ``name`` of checkpoint dir ``path``, whole or absent: temp name, fsync, rename, fsync of the dir (one
    upload on an object store, where an object appears whole when its upload completes).  An OSError names the
    file (a save that failed at its commit marker says so)."""
    try:
        _write_durable(path, name, data, sync_dir)
    except OSError as e:
        where = fsurl.join(path, name)
        if e.errno is None:
            raise OSError(f"writing {where}: {e}") from e
        raise OSError(e.errno, f"writing {where}: {e.strerror or e}") from e


def _write_durable(path: str, name: str, data: bytes, sync_dir: bool) -> None:
    if fsurl.is_url(path):
        fs, p = fsurl.filesystem(fsurl.join(path, name))
        fs.pipe_file(p, data)
        return
    from pitstop.ckpt.storage import fsync_dir

    tmp = os.path.join(path, name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, name))
    if sync_dir:
        fsync_dir(path)


def read_manifest(path: str) -> dict[str, dict]:
    """The files the manifest of checkpoint dir ``path`` lists (name -> entry); CorruptCheckpoint if it is missing,
    unreadable or does not match its own checksum."""
    try:
        data = read_file(fsurl.join(path, MANIFEST))
    except FileNotFoundError:
        raise CorruptCheckpoint(
            f"checkpoint {path} is corrupt: {MANIFEST} is missing (every pitstop checkpoint writes it before its "
            f"commit marker: the file was deleted, or the checkpoint was not written by this pitstop)"
        ) from None
    doc = unseal(data, path, MANIFEST)
    if doc.get("format") != FORMAT or doc.get("algorithm") != ALGORITHM or not isinstance(doc.get("files"), dict):
        raise CorruptCheckpoint(
            f"checkpoint {path}: {MANIFEST} is of format {doc.get('format')!r} / {doc.get('algorithm')!r}; this "
            f"pitstop reads {FORMAT!r} / {ALGORITHM!r}"
        )
    return doc["files"]


def read_sealed(path: str, name: str) -> dict:
    """A small sealed file of checkpoint dir ``path`` (the ``COMMITTED`` marker)."""
    try:
        data = read_file(fsurl.join(path, name))
    except FileNotFoundError:
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: {name} is missing") from None
    return unseal(data, path, name)


def read_file(url_or_path: str) -> bytes:
    if fsurl.is_url(url_or_path):
        fs, p = fsurl.filesystem(url_or_path)
        return fs.cat_file(p)
    with open(url_or_path, "rb") as f:
        return f.read()


def _open(url_or_path: str) -> Any:
    if fsurl.is_url(url_or_path):
        fs, p = fsurl.filesystem(url_or_path)
        return fs.open(p, "rb", block_size=READ_CHUNK)
    return open(url_or_path, "rb", buffering=0)


def stream_checksum(stream: io.IOBase) -> tuple[int, int]:
    """``(length, crc)`` of what is left to read in a binary stream, read in chunks."""
    running = Running()
    while True:
        chunk = stream.read(READ_CHUNK)
        if not chunk:
            return running.nbytes, running.value
        running.update(chunk)


def file_checksum(url_or_path: str) -> tuple[int, int]:
    """``(length, crc)`` of a file."""
    with _open(url_or_path) as f:
        return stream_checksum(f)


def check_file(path: str, name: str, want: dict) -> None:
    """CorruptCheckpoint unless file ``name`` of checkpoint dir ``path`` has the length and checksum ``want``."""
    where = fsurl.join(path, name)
    try:
        nbytes, value = file_checksum(where)
    except FileNotFoundError:
        raise CorruptCheckpoint(
            f"checkpoint {path} is corrupt: {name} is missing (expected {want['bytes']} bytes)"
        ) from None
    found, expected = f"{value:08x}", want.get(ALGORITHM)
    if nbytes != want["bytes"]:
        raise CorruptCheckpoint(
            f"checkpoint {path} is corrupt: {name} is {'truncated' if nbytes < want['bytes'] else 'longer'}: "
            f"expected {want['bytes']} bytes, found {nbytes}"
        )
    if found != expected:
        raise CorruptCheckpoint(
            f"checkpoint {path} is corrupt: {name}: expected {ALGORITHM}={expected}, found {found} ({nbytes} bytes)"
        )


def verify(path: str, share: tuple[int, int] = (0, 1), files: dict[str, dict] | None = None) -> int:
    """Check checkpoint dir ``path`` against its manifest: the small files (the commit marker, ``.metadata``) on
    every caller, the others split among ``share = (rank, world_size)`` callers.  Returns the bytes checked here;
    raises CorruptCheckpoint at the first mismatch."""
    files = read_manifest(path) if files is None else files
    if STATE_FILE in files:  # sync_save's marker holds the step and world size: sealed too
        read_sealed(path, SAVE_MARKER)
    rank, world = share
    checked = 0
    for i, name in enumerate(sorted(files)):
        want = files[name]
        small = name.startswith(".") or want["bytes"] <= 1 << 16
        if small or i % world == rank:
            check_file(path, name, want)
            checked += want["bytes"]
    return checked
