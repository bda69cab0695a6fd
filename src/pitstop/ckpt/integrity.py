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

Nothing a checkpoint names is believed before it is checked: every file the manifest lists is a plain name inside
its dir (no ``/``, no ``..``), opened without following a link and only if it is a regular file (a FIFO or a
device never hangs a restore), and every small file is read up to a bound.  CRC32C has no key: whoever can write a
checkpoint can reseal it.  With a key in ``PITSTOP_CKPT_KEY`` the manifest also holds each file's SHA-256 and is
sealed with an HMAC of that key, so an edited or resealed checkpoint is refused (:func:`signing_key`).

Each finding is a :class:`~pitstop.errors.CorruptCheckpoint` whose text says which file, what was expected and what
was found.  ``python -m pitstop.ckpt.verify PATH...`` runs the same checks without training.

Pure functions of the files (no torch, no process groups): the verify command starts in a fraction of a second.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import re
import stat
from typing import Any

import crc32c as _crc32c

from pitstop import fsurl, statefile
from pitstop.ckpt import throttle
from pitstop.errors import ConfigError, CorruptCheckpoint

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
KEY_ENV = "PITSTOP_CKPT_KEY"  # the checkpoints' signing key (never in the config: it is a secret)
KEY_MIN = 16  # characters: shorter keys are refused (a guessable key signs nothing)
SIGNATURE = "hmac-sha256"
STRONG = "sha256"  # each file's hash in a signed manifest (CRC32C can be forged to any value: a key needs a real hash)
MANIFEST_MAX = 64 << 20  # bytes: a manifest is a line per file (one per rank), far below this
MARKER_MAX = 1 << 16
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,255}")


def signing_key() -> bytes | None:
    """The key of ``PITSTOP_CKPT_KEY``, or None when it is unset.  Read from the environment (the one place below
    ``launch/`` besides the heal transport's secret): a secret must not travel in the config, and a checkpoint
    process inherits it as its trainer's."""
    key = os.environ.get(KEY_ENV)
    if not key:
        return None
    if len(key) < KEY_MIN:
        raise ConfigError(
            f"{KEY_ENV} is {len(key)} characters: use at least {KEY_MIN} random ones (e.g. `openssl rand -hex 32`), "
            f"or unset it to write unsigned checkpoints"
        )
    return key.encode()


def check_name(name: object, path: str, what: str = "a file") -> str:
    """``name`` if it is a plain file name (what pitstop's writers make: no separator, not ``.``/``..``); else
    CorruptCheckpoint naming checkpoint dir ``path``: a checkpoint never names anything outside itself."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        raise CorruptCheckpoint(
            f"checkpoint {path} is corrupt: it names {what} {str(name)[:80]!r}, which is not a plain name inside its "
            f"dir (a crafted or damaged checkpoint: nothing outside it is read)"
        )
    return name


def check_dir(path: str) -> None:
    """CorruptCheckpoint unless local checkpoint dir ``path`` is a directory itself, not a link to one elsewhere
    (an object store has no links)."""
    if fsurl.is_url(path):
        return
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"checkpoint {path} is missing") from None
    if stat.S_ISLNK(st.st_mode):
        raise CorruptCheckpoint(
            f"checkpoint {path} is a symbolic link (to {os.readlink(path)[:120]!r}), not a checkpoint of this run: "
            f"not loaded; copy the checkpoint here if it is meant to be"
        )


def crc(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC32C of ``data`` (any buffer) continued from ``value``; the GIL is released for large buffers."""
    return _crc32c.crc32c(data, value)


class Running:
    """A checksum and a length kept up to date as a file's bytes are written, in order."""

    __slots__ = ("value", "nbytes", "strong")

    def __init__(self, strong: bool | None = None) -> None:
        """``strong``: keep each file's SHA-256 too (a signed manifest needs it); by default when a key is set."""
        self.value, self.nbytes = 0, 0
        self.strong = hashlib.sha256() if (signing_key() is not None if strong is None else strong) else None

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        self.value = crc(view, self.value)
        self.nbytes += len(view)
        if self.strong is not None:
            self.strong.update(view)  # (releases the GIL for large buffers, like crc32c)

    def entry(self) -> dict:
        return entry(self.nbytes, self.value, self.strong.hexdigest() if self.strong is not None else None)


def entry(nbytes: int, value: int, strong: str | None = None) -> dict:
    out: dict[str, Any] = {"bytes": int(nbytes), ALGORITHM: f"{value:08x}"}
    if strong is not None:
        out[STRONG] = strong
    return out


FROM_ENV: Any = object()  # (a writer's key: the environment's, read where the writer runs)


def seal(body: dict, key: bytes | None = FROM_ENV) -> bytes:
    """``body`` as one line of JSON, then a line with the checksum of that line's bytes: any changed byte (a space
    included) is found when it is read back.  With a ``key`` (by default :func:`signing_key`'s; None: unsigned), a
    third line holds an HMAC-SHA256 of the first: without the key, nobody can make one that matches."""
    key = signing_key() if key is FROM_ENV else key
    line = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    out = line + f"\n{ALGORITHM} {crc(line):08x}\n".encode()
    if key:
        out += f"{SIGNATURE} {hmac.new(key, line, hashlib.sha256).hexdigest()}\n".encode()
    return out


def is_signed(data: bytes) -> bool:
    return f"\n{SIGNATURE} ".encode() in data


def unseal(data: bytes, path: str, name: str) -> dict:
    """What :func:`seal` wrote; CorruptCheckpoint (naming file ``name`` of checkpoint dir ``path``) if it is not.
    With a key set, the file must carry a matching HMAC (an unsigned, edited or resealed file is refused)."""
    line, _, tail = data.partition(b"\n")
    expected = tail.decode(errors="replace").strip()
    found = f"{ALGORITHM} {crc(line):08x}"
    tail, sep, signature = tail.partition(b"\n")
    tail += sep
    if tail != f"{found}\n".encode() or (signature and not re.fullmatch(rb"hmac-sha256 [0-9a-f]{64}\n", signature)):
        raise CorruptCheckpoint(
            f"checkpoint {path} is corrupt: {name} does not match its own checksum (expected {expected[:40]!r}, "
            f"found {found!r})"
        )
    key = signing_key()
    if key is not None:
        if not signature:
            raise CorruptCheckpoint(
                f"checkpoint {path} is not signed ({name} has no {SIGNATURE}) but {KEY_ENV} is set: it was written "
                f"without the key, or its signature was removed; unset {KEY_ENV} to load unsigned checkpoints"
            )
        want = f"{SIGNATURE} {hmac.new(key, line, hashlib.sha256).hexdigest()}\n".encode()
        if not hmac.compare_digest(signature, want):
            raise CorruptCheckpoint(
                f"checkpoint {path} is corrupt: {name}'s signature does not match {KEY_ENV}'s key (edited or "
                f"resealed after it was written, or signed with another key)"
            )
    try:
        doc = json.loads(line.decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: {name} is unreadable ({type(e).__name__})") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: {name} holds no record")
    return doc


def manifest_bytes(files: dict[str, dict], dir_name: str | None = None, key: bytes | None = FROM_ENV) -> bytes:
    """The manifest for ``files`` (name -> entry) of the checkpoint dir named ``dir_name`` (kept in it: a step dir
    moved or renamed under another step's name is told; signed with the rest when a ``key`` is set)."""
    body: dict[str, Any] = {"format": FORMAT, "algorithm": ALGORITHM, "files": dict(sorted(files.items()))}
    if dir_name is not None:
        body["dir"] = dir_name
    return seal(body, key)


def dir_name(path: str) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def write_manifest(path: str, files: dict[str, dict]) -> None:
    """Make the manifest durable in checkpoint dir ``path`` (temp name, fsync, rename; one upload on a store). Its
    directory entry is made durable with the commit marker's: the marker is renamed after it, and the file system
    journals the two renames in that order."""
    write_durable(path, MANIFEST, manifest_bytes(files, dir_name(path)), sync_dir=False)


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
    if os.path.lexists(tmp):  # (a write that died before its rename; a link or FIFO put there: never written through)
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    with open(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, name))
    if sync_dir:
        fsync_dir(path)


_HEX8, _HEX64 = re.compile(r"[0-9a-f]{8}"), re.compile(r"[0-9a-f]{64}")


def read_manifest(path: str) -> dict[str, dict]:
    """The files the manifest of checkpoint dir ``path`` lists (name -> entry); CorruptCheckpoint if it is missing,
    unreadable, does not match its own checksum (or, with a key, its signature), names anything but plain files of
    its dir, or was written for another dir (a step dir moved under another step's name)."""
    check_dir(path)
    try:
        data = read_file(fsurl.join(path, MANIFEST), MANIFEST_MAX)
    except FileNotFoundError:
        raise CorruptCheckpoint(
            f"checkpoint {path} is corrupt: {MANIFEST} is missing (every pitstop checkpoint writes it before its "
            f"commit marker: the file was deleted, or the checkpoint was not written by this pitstop)"
        ) from None
    doc = unseal(data, path, MANIFEST)
    if doc.get("format") != FORMAT or doc.get("algorithm") != ALGORITHM or not isinstance(doc.get("files"), dict):
        raise CorruptCheckpoint(
            f"checkpoint {path}: {MANIFEST} is of format {str(doc.get('format'))[:40]!r} / "
            f"{str(doc.get('algorithm'))[:40]!r}; this pitstop reads {FORMAT!r} / {ALGORITHM!r}"
        )
    here, named = dir_name(path), doc.get("dir")
    if named is not None and named != here and here.startswith("step_") and str(named).startswith("step_"):
        raise CorruptCheckpoint(
            f"checkpoint {path} is corrupt: its {MANIFEST} was written for {str(named)[:40]!r} (a checkpoint moved or "
            f"renamed under another step's name: not loaded)"
        )
    strong = signing_key() is not None
    for name, want in doc["files"].items():
        check_name(name, path, f"a file in its {MANIFEST}")
        nbytes = want.get("bytes") if isinstance(want, dict) else None
        ok = (
            isinstance(nbytes, int)
            and not isinstance(nbytes, bool)
            and nbytes >= 0
            and isinstance(want.get(ALGORITHM), str)
            and _HEX8.fullmatch(want[ALGORITHM])
            and (not strong or (isinstance(want.get(STRONG), str) and _HEX64.fullmatch(want[STRONG])))
        )
        if not ok:
            raise CorruptCheckpoint(
                f"checkpoint {path} is corrupt: {MANIFEST}'s entry for {name} is not a length and "
                f"{ALGORITHM}{' and ' + STRONG if strong else ''} ({str(want)[:80]!r})"
            )
    return doc["files"]


def read_sealed(path: str, name: str) -> dict:
    """A small sealed file of checkpoint dir ``path`` (the ``COMMITTED`` marker)."""
    try:
        data = read_file(fsurl.join(path, name), MARKER_MAX)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: {name} is missing") from None
    return unseal(data, path, name)


def read_file(url_or_path: str, limit: int | None = None) -> bytes:
    """A checkpoint file's bytes (a regular file, not followed through a link); CorruptCheckpoint if it holds more
    than ``limit`` bytes (a small file that is not small is not what pitstop wrote, and is not read whole)."""
    with open_file(url_or_path) as f:
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise CorruptCheckpoint(f"{url_or_path} is larger than {limit} bytes: not the file pitstop wrote")
    return data


def open_regular(path: str) -> io.RawIOBase:
    """A local file opened for reading only if it is a regular file reached without a link
    (:func:`pitstop.statefile.open_fd`): a FIFO or a device would hang or never end a read, a link reads what it
    points at; either is CorruptCheckpoint.  Under a dir that stands in for a network volume
    (:func:`pitstop.ckpt.throttle.slow_volume`) its reads go at that volume's speed."""
    try:
        fd = statefile.open_fd(path)
    except statefile.NotPlain as e:
        if e.target is not None:
            raise CorruptCheckpoint(
                f"{path} is a symbolic link (to {e.target[:120]!r}): a checkpoint holds its own files only"
            ) from None
        raise CorruptCheckpoint(
            f"{path} is a {e.kind}, not a regular file: a checkpoint holds regular files only"
        ) from None
    return throttle.reader(path, io.FileIO(fd, "rb", closefd=True))


def open_file(url_or_path: str) -> Any:
    if fsurl.is_url(url_or_path):
        fs, p = fsurl.filesystem(url_or_path)
        return fs.open(p, "rb", block_size=READ_CHUNK)
    return open_regular(url_or_path)


def stream_checksum(stream: io.IOBase, strong: bool | None = None) -> Running:
    """The checksum (and, with ``strong``, the SHA-256) of what is left to read in a binary stream, read in chunks."""
    running = Running(strong)
    while True:
        chunk = stream.read(READ_CHUNK)
        if not chunk:
            return running
        running.update(chunk)


def file_checksum(url_or_path: str, strong: bool | None = None) -> Running:
    """The checksum of a file (see :func:`stream_checksum`)."""
    with open_file(url_or_path) as f:
        return stream_checksum(f, strong)


def check_file(path: str, name: str, want: dict) -> None:
    """CorruptCheckpoint unless file ``name`` of checkpoint dir ``path`` has the length and checksum ``want`` (and,
    with a key set, its SHA-256)."""
    check_name(name, path)
    where = fsurl.join(path, name)
    strong = signing_key() is not None
    try:
        running = file_checksum(where, strong)
    except FileNotFoundError:
        raise CorruptCheckpoint(
            f"checkpoint {path} is corrupt: {name} is missing (expected {want['bytes']} bytes)"
        ) from None
    nbytes, found, expected = running.nbytes, f"{running.value:08x}", want.get(ALGORITHM)
    if nbytes != want["bytes"]:
        raise CorruptCheckpoint(
            f"checkpoint {path} is corrupt: {name} is {'truncated' if nbytes < want['bytes'] else 'longer'}: "
            f"expected {want['bytes']} bytes, found {nbytes}"
        )
    if found != expected:
        raise CorruptCheckpoint(
            f"checkpoint {path} is corrupt: {name}: expected {ALGORITHM}={expected}, found {found} ({nbytes} bytes)"
        )
    if strong and running.strong is not None and not hmac.compare_digest(running.strong.hexdigest(), want[STRONG]):
        raise CorruptCheckpoint(
            f"checkpoint {path} is corrupt: {name}'s {STRONG} is not the signed one (its bytes were replaced)"
        )


def marker_step(path: str) -> int | None:
    """The step a checkpoint dir's name says (``step_00000500``: 500), or None for another name."""
    name = dir_name(path)
    digits = name[len("step_") :] if name.startswith("step_") else ""
    return int(digits) if digits.isdigit() else None


def verify(path: str, share: tuple[int, int] = (0, 1), files: dict[str, dict] | None = None) -> int:
    """Check checkpoint dir ``path`` against its manifest: the small files (the commit marker, ``.metadata``) on
    every caller, the others split among ``share = (rank, world_size)`` callers.  Returns the bytes checked here;
    raises CorruptCheckpoint at the first mismatch."""
    files = read_manifest(path) if files is None else files
    if STATE_FILE in files:  # sync_save's marker holds the step and world size: sealed too
        marker = read_sealed(path, SAVE_MARKER)
        named = marker_step(path)
        if named is not None and marker.get("step") != named:
            raise CorruptCheckpoint(
                f"checkpoint {path} is corrupt: its {SAVE_MARKER} says step {str(marker.get('step'))[:20]}, its name "
                f"step {named} (a checkpoint moved under another step's name: not loaded)"
            )
    rank, world = share
    checked = 0
    for i, name in enumerate(sorted(files)):
        want = files[name]
        small = name.startswith(".") or want["bytes"] <= 1 << 16
        if small or i % world == rank:
            check_file(path, name, want)
            checked += want["bytes"]
    return checked
