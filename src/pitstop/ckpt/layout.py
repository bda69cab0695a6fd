"""The on-disk layout of checkpoints: where they live, when one is complete, which to load, which to purge.

``ckpt.dir/step_{:08d}/``, one dir per checkpoint.  A checkpoint is *complete* only when its commit marker
exists, and the marker is written last: DCP's ``.metadata`` (rank 0 writes it after every rank's data is
written and fsynced) or, for ``sync_save``, ``COMMITTED`` (after ``state.pt`` was written under a temporary
name, fsynced and renamed).  Anything else in ``ckpt.dir`` is partial and never loaded.

Pure functions of the directory (no process groups, no tensors): rank 0 calls them and shares the answer.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from pitstop.errors import CheckpointError
from pitstop.metrics import write_text_atomic

log = logging.getLogger("pitstop.ckpt")

DCP_MARKER = ".metadata"
SAVE_MARKER = "COMMITTED"
STEP_PREFIX = "step_"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"{STEP_PREFIX}{step:08d}")


def step_of(path: str) -> int:
    return int(os.path.basename(os.path.normpath(path))[len(STEP_PREFIX):])


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, DCP_MARKER)) or os.path.isfile(os.path.join(path, SAVE_MARKER))


def is_full_state(path: str) -> bool:
    """Written by ``sync_save`` (one unsharded ``state.pt``) rather than as DCP shards."""
    return os.path.isfile(os.path.join(path, SAVE_MARKER))


def list_checkpoints(root: str) -> list[tuple[int, str, bool]]:
    """``(step, path, complete)`` for every ``step_*`` dir, oldest first."""
    out = []
    if not os.path.isdir(root):
        return out
    for name in os.listdir(root):
        if name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX):].isdigit():
            path = os.path.join(root, name)
            out.append((int(name[len(STEP_PREFIX):]), path, is_complete(path)))
    return sorted(out)


def candidates(root: str, spec: Any) -> list[str]:
    """The checkpoints to try for ``ckpt.load=spec``, newest first.  ``auto``: every complete one (partial
    dirs are logged and removed); a step or a path: exactly that one, which must be complete."""
    if isinstance(spec, int) or (isinstance(spec, str) and spec.isdigit()):
        path = step_dir(root, int(spec))
        if not is_complete(path):
            raise CheckpointError(f"ckpt.load={spec}: {path} is not a complete checkpoint")
        return [path]
    if spec != "auto":
        path = os.path.abspath(str(spec))
        if not is_complete(path):
            raise CheckpointError(f"ckpt.load={spec}: no complete checkpoint there (missing {DCP_MARKER} or {SAVE_MARKER})")
        return [path]
    found = list_checkpoints(root)
    for _, path, complete in found:
        if not complete:
            log.warning("skipping partial checkpoint %s (no commit marker); removing it", path)
            shutil.rmtree(path, ignore_errors=True)
    return [path for _, path, complete in reversed(found) if complete]


def purge(root: str, keep_last_k: int) -> None:
    """Remove all but the newest ``keep_last_k`` complete checkpoints (0 keeps all).  An in-flight save is
    not complete yet, so it never counts and is never removed."""
    if not keep_last_k:
        return
    complete = [(s, p) for s, p, ok in list_checkpoints(root) if ok]
    for _, path in complete[:-keep_last_k]:
        shutil.rmtree(path, ignore_errors=True)
        log.debug("purged %s", path)


def run_id(root: str) -> str:
    """This run's id, kept in ``root/.run_id`` (made on first use): it names the run's local-tier dir."""
    import uuid

    path = os.path.join(root, ".run_id")
    try:
        with open(path) as f:
            rid = f.read().strip()
        if rid:
            return rid
    except FileNotFoundError:
        pass
    rid = uuid.uuid4().hex[:16]
    write_text_atomic(path, rid)
    return rid


def purge_up_to(root: str, step: int) -> None:
    """Remove every checkpoint of ``step`` or older (the local tier, once a durable save of ``step`` is committed)."""
    for s, path, _ in list_checkpoints(root):
        if s <= step:
            shutil.rmtree(path, ignore_errors=True)


def check_writable(root: str, key: str = "ckpt.dir") -> None:
    probe = os.path.join(root, f".write-probe-{os.getpid()}")
    try:
        os.makedirs(root, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"{key} {root} is not writable ({e.strerror or e}); "
                              f"point {key} at a writable directory") from None
