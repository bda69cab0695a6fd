"""Check checkpoints without training: every file against its checksum, and DCP's metadata through the same
restricted unpickler a restore uses.

    python -m pitstop.ckpt.verify outputs/runs/mine                     # every checkpoint of a run
    python -m pitstop.ckpt.verify ckpts/step_00000500 s3://bucket/run/checkpoints

A PATH is a checkpoint dir (``step_*``), a checkpoints dir, or a run dir (its ``checkpoints/``); a URL too.  One line
per checkpoint: ``ok`` (with its files, bytes and the time taken), ``CORRUPT`` (which file, what was expected, what
was found) or ``partial`` (no commit marker: a save that never completed, which no restore loads).  Exit status 1
if any checkpoint is corrupt, 2 if a PATH holds none.  With ``PITSTOP_CKPT_KEY`` set, each checkpoint's signature is
checked too (an unsigned, edited or resealed one is CORRUPT).
"""

from __future__ import annotations

import argparse
import sys
import time

from pitstop import fsurl
from pitstop.ckpt import integrity, layout
from pitstop.errors import ConfigError, CorruptCheckpoint


def checkpoints(path: str) -> list[tuple[str, bool]]:
    """``(checkpoint dir, complete)`` for what ``path`` names, oldest first."""
    path = path.rstrip("/") if fsurl.is_url(path) else path
    if layout.is_step_dir(path):
        return [(path, layout.is_complete(path))]
    for root in (fsurl.join(path, "checkpoints"), path):
        found = layout.list_checkpoints(root)
        if found:
            return [(p, ok) for _, p, ok in found]
    return []


def check(path: str) -> tuple[int, int]:
    """Verify one complete checkpoint; ``(files, bytes)`` checked, or CorruptCheckpoint."""
    files = integrity.read_manifest(path)
    checked = integrity.verify(path, files=files)
    if layout.DCP_MARKER in files:  # what a restore would read: the same restricted unpickler and the same checks
        from pitstop.ckpt.formats import dcp_reader  # (torch: imported once, before the first is timed)

        dcp_reader(path).read_metadata()
    return len(files), checked


def signed(path: str) -> str:
    """What the verdict says of the checkpoint's signature (:func:`pitstop.ckpt.integrity.signing_key`)."""
    if integrity.signing_key() is not None:
        return f", signature checked ({integrity.KEY_ENV})"
    data = integrity.read_file(fsurl.join(path, integrity.MANIFEST), integrity.MANIFEST_MAX)
    return f", signed: set {integrity.KEY_ENV} to check the signature" if integrity.is_signed(data) else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pitstop.ckpt.verify", description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", metavar="PATH")
    a = p.parse_args(argv)
    corrupt = empty = 0
    try:
        integrity.signing_key()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import pitstop.ckpt.formats  # noqa: F401 - torch's import, before any checkpoint is timed

    for given in a.paths:
        found = checkpoints(given)
        if not found:
            print(f"error: no checkpoint at or under {given} (looked for step_* dirs)", file=sys.stderr)
            empty += 1
            continue
        for path, complete in found:
            if not complete:
                print(f"partial  {path} (no commit marker: a save that never completed; no restore loads it)")
                continue
            t0 = time.perf_counter()
            try:
                n, nbytes = check(path)
            except CorruptCheckpoint as e:
                corrupt += 1
                print(f"CORRUPT  {e}")
                continue
            print(f"ok       {path} ({n} files, {nbytes / 1e6:.1f} MB, {time.perf_counter() - t0:.2f} s{signed(path)})")
    return 1 if corrupt else 2 if empty else 0


if __name__ == "__main__":
    sys.exit(main())
