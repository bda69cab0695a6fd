"""The on-disk layout of checkpoints: where they live, when one is complete, which to load, which to purge.

``ckpt.dir/step_{:08d}/``, one dir per checkpoint.  A checkpoint is *complete* only when its commit marker
exists, and the marker is written last: DCP's ``.metadata`` (rank 0 writes it after every rank's data is
written and fsynced) or, for ``sync_save``, ``COMMITTED`` (after ``state.pt`` was written under a temporary
name, fsynced and renamed).  Anything else in ``ckpt.dir`` is partial and never loaded.

``ckpt.dir`` may also be an fsspec URL (``s3://bucket/run/checkpoints``): the same functions then list, read
and remove through fsspec with the options registered for it (:func:`pitstop.fsurl.use_options`).  An object
store has no rename and no fsync, but an object appears whole or not at all when its upload completes, so
the same rule holds: the marker is uploaded last, and a step dir without it is partial.

Pure functions of the directory (no process groups, no tensors): rank 0 calls them and shares the answer.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import time

from pitstop import fsurl
from pitstop.errors import CheckpointError
from pitstop.telemetry.metrics import write_text_atomic

log = logging.getLogger("pitstop.ckpt")

DCP_MARKER = ".metadata"
SAVE_MARKER = "COMMITTED"
STEP_PREFIX = "step_"


def step_dir(root: str, step: int) -> str:
    return fsurl.join(root, f"{STEP_PREFIX}{step:08d}")


def step_of(path: str) -> int:
    return int(str(path).rstrip("/").rsplit("/", 1)[-1][len(STEP_PREFIX) :])


def is_step_dir(path: str) -> bool:
    """``path`` is named like a checkpoint dir (``step_00000500``)."""
    name = str(path).rstrip("/").rsplit("/", 1)[-1]
    return name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX) :].isdigit()


def is_file(path: str) -> bool:
    """``path`` is a regular file; locally, itself (a link to a file is not one: a checkpoint holds its own files)."""
    if fsurl.is_url(path):
        fs, p = fsurl.filesystem(path)
        fs.invalidate_cache(p)  # (a listing cached earlier would not show a marker written since)
        return fs.isfile(p)
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def is_link(path: str) -> bool:
    return not fsurl.is_url(path) and os.path.islink(path)


def is_complete(path: str) -> bool:
    return is_file(fsurl.join(path, DCP_MARKER)) or is_file(fsurl.join(path, SAVE_MARKER))


def is_full_state(path: str) -> bool:
    """Written by ``sync_save`` (one unsharded ``state.pt``) rather than as DCP shards."""
    return is_file(fsurl.join(path, SAVE_MARKER))


def _names(root: str) -> list[str]:
    """The entries of ``root`` (none if it does not exist)."""
    if not fsurl.is_url(root):
        return os.listdir(root) if os.path.isdir(root) else []
    fs, p = fsurl.filesystem(root)
    try:
        fs.invalidate_cache(p)  # (s3fs caches listings: another process may have written since)
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(p, detail=False)]
    except FileNotFoundError:
        return []


def free_dir(root: str, what: str = "the local tier") -> None:
    """Remove the whole dir ``root`` (a run's local tier, freed or cleared): one warning per path that stays (a
    permission, a busy mount), none for one already gone (another process of the node removed it first)."""

    def left(_func: object, path: str, exc: tuple) -> None:
        if not issubclass(exc[0], FileNotFoundError):
            log.warning("%s could not be freed: %s stays (%s)", what, path, exc[1])

    shutil.rmtree(root, onerror=left)


def remove(path: str) -> None:
    """Remove a checkpoint dir (or what is left of one); nothing if it is not there.  The commit markers go first, so
    a removal cut short leaves a partial dir that no restore loads; OSError naming what is left if any of it stays
    (a read-only mount, a permission, a store that refused a delete)."""
    if is_link(path):  # never through a link: it names another place (another run's checkpoint), not ours to delete
        os.unlink(path)
        return
    for marker in (DCP_MARKER, SAVE_MARKER):
        _remove_file(fsurl.join(path, marker))
    if not fsurl.is_url(path):
        failed: list[str] = []
        shutil.rmtree(path, onerror=lambda _f, p, e: None if issubclass(e[0], FileNotFoundError) else failed.append(p))
        if failed or os.path.exists(path):
            raise OSError(
                f"could not remove {path}: {len(failed) or 'some'} entr{'y' if len(failed) == 1 else 'ies'} left"
            )
        return
    fs, p = fsurl.filesystem(path)
    try:
        fs.rm(p, recursive=True)
    except FileNotFoundError:
        pass
    fs.invalidate_cache(p)
    try:
        left = fs.find(p)  # (s3fs's bulk delete reports objects it could not delete without raising)
    except FileNotFoundError:
        left = []
    if left:
        raise OSError(f"could not remove {path}: {len(left)} object(s) left")


def _remove_file(path: str) -> None:
    try:
        if fsurl.is_url(path):
            fs, p = fsurl.filesystem(path)
            fs.rm_file(p)
            fs.invalidate_cache(p)
        else:
            os.remove(path)
    except FileNotFoundError:
        pass


def list_checkpoints(root: str) -> list[tuple[int, str, bool]]:
    """``(step, path, complete)`` for every ``step_*`` dir, oldest first.  A ``step_*`` that is a symbolic link is
    not one of them: it is never loaded, and retention never deletes through it (said once per listing)."""
    out = []
    for name in _names(root):
        if name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX) :].isdigit():
            path = fsurl.join(root, name)
            if is_link(path):
                log.warning(
                    "%s is a symbolic link, not a checkpoint of this run: never loaded, never deleted (remove it, or "
                    "copy the checkpoint it points at here)",
                    path,
                )
                continue
            out.append((int(name[len(STEP_PREFIX) :]), path, is_complete(path)))
    return sorted(out)


def candidates(root: str, spec: int | str) -> list[str]:
    """The checkpoints to try for ``ckpt.load=spec``, newest first.  ``auto``: every complete one (partial
    dirs are logged and removed); a step or a path: exactly that one, which must be complete."""
    if isinstance(spec, int) or (isinstance(spec, str) and spec.isdigit()):
        path = step_dir(root, int(spec))
        if not is_complete(path):
            raise CheckpointError(f"ckpt.load={spec}: {path} is not a complete checkpoint")
        return [path]
    if spec != "auto":
        path = str(spec) if fsurl.is_url(spec) else os.path.abspath(str(spec))
        if not is_complete(path):
            raise CheckpointError(
                f"ckpt.load={spec}: no complete checkpoint there (missing {DCP_MARKER} or {SAVE_MARKER})"
            )
        return [path]
    found = list_checkpoints(root)
    for _, path, complete in found:
        if not complete:
            log.warning("skipping partial checkpoint %s (no commit marker); removing it", path)
            try:
                remove(path)
            except OSError as e:
                log.warning("the partial checkpoint stays (never loaded): %s", e)
    return [path for _, path, complete in reversed(found) if complete]


def purge(root: str, keep_last_k: int, pinned: int | None = None) -> None:
    """Remove all but the newest ``keep_last_k`` complete checkpoints (0 keeps all).  An in-flight save is
    not complete yet, so it never counts and is never removed. ``pinned``: the newest checkpoint at or before that
    step is kept too (what a rollback may go back to: ``trainer.instability``)."""
    if not keep_last_k:
        return
    complete = [(s, p) for s, p, ok in list_checkpoints(root) if ok]
    held = max((s for s, _ in complete if pinned is not None and s <= pinned), default=None)
    for s, path in complete[:-keep_last_k]:
        if s != held:
            remove(path)
            log.debug("purged %s", path)


RUN_ID = re.compile(r"[0-9a-f]{16}")


def run_id(root: str) -> str:
    """This run's id, kept in ``root/.run_id`` (made on first use): it names the run's local-tier dir, so it must be
    what pitstop made (16 hex digits): anything else (``../somewhere``, an absolute path, a link) would make the
    local tier's saves, retention and final clean-up act on another dir.  Such a file is kept aside under a new
    name, with a warning, and a new id is made (the old local checkpoints are then not used: the durable tier is)."""
    import uuid

    path = fsurl.join(root, ".run_id")
    remote = fsurl.is_url(root)
    fs, p = fsurl.filesystem(path) if remote else (None, path)
    rid = None
    try:
        if remote:
            rid = fs.cat_file(p)[:64].decode(errors="replace").strip()
        elif is_link(path):
            rid = f"a symbolic link to {os.readlink(path)[:80]}"
        else:
            with open(path, "rb") as f:
                rid = f.read(64).decode(errors="replace").strip()
    except FileNotFoundError:
        pass
    if rid and RUN_ID.fullmatch(rid):
        return rid
    if rid:
        aside = f"{path}.damaged-{int(time.time())}"
        log.warning(
            "%s holds %r, not a run id pitstop made: kept aside as %s; this run's local tier starts afresh",
            path,
            rid[:80],
            aside.rsplit("/", 1)[-1],
        )
        if remote:
            fs.mv(p, fsurl.filesystem(aside)[1])
        else:
            os.replace(path, aside)
    rid = uuid.uuid4().hex[:16]
    if remote:
        fs.pipe_file(p, rid.encode())
    else:
        write_text_atomic(path, rid)
    return rid


def purge_up_to(root: str, step: int) -> None:
    """Remove every checkpoint of ``step`` or older (the local tier, once a durable save of ``step`` is committed)."""
    for s, path, _ in list_checkpoints(root):
        if s <= step:
            remove(path)


def write_probe(path: str) -> None:
    """Write ``path`` (a probe file), sync it and remove it: OSError if the file system will not (read-only, full, not
    permitted). Node health's check and the checkpointer's own use it."""
    with open(path, "wb") as f:
        f.write(b"ok")
        f.flush()
        os.fsync(f.fileno())
    os.remove(path)


def check_writable(root: str, key: str = "ckpt.dir", private: bool = False) -> None:
    """CheckpointError in one line unless ``root`` can be written (made if missing).  ``private``: a dir in a place
    others may write (the local tier's tmpfs): it and its parent must be real dirs of this user's, ``root`` made
    ``0700``, so nobody else can plant a checkpoint the restore would prefer, or a link that saves would follow."""
    if fsurl.is_url(root):
        return _check_writable_url(root, key)
    probe = os.path.join(root, f".write-probe-{os.getpid()}")
    try:
        if private:
            os.makedirs(os.path.dirname(root), mode=0o700, exist_ok=True)
            os.makedirs(root, mode=0o700, exist_ok=True)
            wrong = not_ours(root)  # (its parent may be shared, as /dev/shm is: its sticky bit keeps ours ours)
            if wrong:
                raise CheckpointError(f"{key}: {root} {wrong}, not a dir of this user's alone")
        os.makedirs(root, exist_ok=True)
        write_probe(probe)
    except OSError as e:
        raise CheckpointError(
            f"{key} {root} is not writable ({e.strerror or e}); point {key} at a writable directory"
        ) from None


def not_ours(path: str, mask: int = 0o022) -> str | None:
    """What is wrong with ``path`` as a real dir of this user's that nobody else may write (``mask`` 0o022) or enter
    (0o077); None if nothing."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"is a symbolic link (to {os.readlink(path)[:80]})"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not by this user ({os.getuid()})"
    if st.st_mode & mask:
        may = "enter" if mask & 0o011 else "write"
        return f"has mode {stat.S_IMODE(st.st_mode):04o} (group or others may {may} it)"
    return None


def _check_writable_url(root: str, key: str) -> None:
    """Upload and remove a probe object: a bucket that does not exist, wrong credentials or a missing write
    permission stop the run here, in one line, not at its first save."""
    probe = fsurl.join(root, f".write-probe-{os.getpid()}")
    try:
        fs, p = fsurl.filesystem(probe)
        fs.pipe_file(p, b"ok")
        fs.rm(p)
    except Exception as e:  # noqa: BLE001 - any transport error, said with what to do about it
        text = f"{type(e).__name__} {e}".lower()
        if fsurl.is_permission_error(e):
            hint = (
                f"the credentials in the environment ({fsurl.credential_vars(root)}) are wrong or may not write "
                f"there: fix them (never in the config), or point {key} at a place they may write"
            )
        elif "nosuchbucket" in text or "bucket does not exist" in text or isinstance(e, FileNotFoundError):
            hint = f"the bucket does not exist: create it, or point {key} at one that does"
        else:
            hint = f"check {key} and the {fsurl.scheme(root)} endpoint ({key.rsplit('.', 1)[0]}.storage_options)"
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"{key} {root} is not writable ({type(e).__name__}: {first}); {hint}") from None
