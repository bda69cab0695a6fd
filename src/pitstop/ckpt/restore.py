"""Restore with fallback: which checkpoint to load (``ckpt.load``), and what to do when it does not load.

Rank 0 lists the candidates (newest complete first; with the local tier on, the newest of either tier, a tie
going to the local one) and every rank gets the same list.  Every rank takes the same checkpoint, or none:
one that fails to load on any rank (corrupt, truncated) is skipped for the next older one, unless it was
asked for by name.  A changed config (the fingerprint) is never skipped: it stops the run.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

from pitstop.ckpt import dcp, layout
from pitstop.ckpt.contract import Target, one_line
from pitstop.errors import CheckpointError, FingerprintMismatch

log = logging.getLogger("pitstop.ckpt")


def candidates(strategy: Any, root: str, local_root: str | None, spec: Any) -> list[str]:
    """The checkpoints ``spec`` names, newest first, the same on every rank (rank 0 decides and reports a bad
    ``spec`` for everyone)."""
    choice: Any = None
    if strategy.rank == 0:
        try:
            choice = layout.candidates(root, spec)
            if spec == "auto" and local_root is not None:  # the newest complete one of either tier
                both = [(layout.step_of(p), 0, p) for p in layout.candidates(local_root, "auto")]
                both += [(layout.step_of(p), 1, p) for p in choice]
                choice = [p for _, _, p in sorted(both, key=lambda x: (-x[0], x[1]))]  # a tie: local (faster)
        except CheckpointError as e:
            choice = str(e)
    choice = strategy.broadcast_object(choice)
    if isinstance(choice, str):
        raise CheckpointError(choice)
    return choice


def first_loadable(
    strategy: Any,
    choice: list[str],
    explicit: bool,
    load: Callable[[str], None],
    root: str,
    local_root: str | None,
    step: Callable[[], int],
) -> int | None:
    """Load the first of ``choice`` that loads on every rank; its step, or None when there was none."""
    for i, path in enumerate(choice):
        t0 = time.perf_counter()
        error: BaseException | None = None
        try:
            load(path)
        except FingerprintMismatch:
            raise
        except dcp.ERRORS as e:  # corrupt/truncated: fall back to an older one
            error = e
        if strategy.any(error is not None):  # every rank takes the same checkpoint, or none
            reason = one_line(error) if error is not None else "failed to load on another rank"
            if explicit:
                raise CheckpointError(f"cannot load checkpoint {path}: {reason}") from error
            older = choice[i + 1] if i + 1 < len(choice) else None
            log.warning(
                "checkpoint %s failed to load (%s); %s",
                path,
                reason,
                f"falling back to {os.path.basename(older)}" if older else "no older complete checkpoint",
            )
            if older is None:
                raise CheckpointError(
                    f"no loadable checkpoint in {root} (newest failed: {reason}); "
                    f"fix or move the directory, or set ckpt.load=none to start over"
                ) from error
            continue
        tier = "local" if local_root is not None and path.startswith(local_root + os.sep) else "durable"
        log.info("restored %s (step %d, %s tier) in %.2f s", path, step(), tier, time.perf_counter() - t0)
        return step()
    return None


def load_into(
    path: str,
    target: Target,
    read: tuple[dict, dict, dict[str, dict]],
    rank: int,
    world_size: int,
    model_only: bool,
) -> None:
    """``read``: the model and optimizer state dicts and every rank's train state read from ``path``."""
    model_sd, optim_sd, trains = read
    # This rank's own state; a rank that did not exist when it was saved starts from rank 0's.
    train = trains.get(f"train.rank{rank}", trains.get("train.rank0"))
    saved_fp = train["fingerprint"] if train is not None else None
    if saved_fp is not None and not model_only:
        check_fingerprint(path, saved_fp, target.state.fingerprint())
    full = layout.is_full_state(path)
    if model_only:
        dcp.load(target, model_sd, optim_sd, full, model_only=True)
        log.info("loaded model weights only from %s (ckpt.load_model_only=true)", path)
        return
    if train is None:
        raise CheckpointError(f"{path} has no training state (step, data position, RNG)")
    dcp.load(target, model_sd, optim_sd, full)
    peers = [trains[k] for k in sorted(trains, key=lambda k: int(k[len("train.rank") :]))]
    if len(peers) != world_size:
        log.info("resharding: checkpoint written by %d rank(s), resuming on %d", len(peers), world_size)
    target.state.load_state_dict(train, peers=peers)


def check_fingerprint(path: str, saved: dict, now: dict) -> None:
    changed = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if changed:
        detail = "; ".join(
            f"{k}: {str(saved.get(k))[:60]!r} -> {str(now.get(k))[:60]!r}" if k != "model" else "model config changed"
            for k in changed
        )
        raise FingerprintMismatch(
            f"cannot resume from {path}: {', '.join(changed)} changed since it was saved ({detail}); "
            f"use a new run_dir, or ckpt.load_model_only=true to start from its model weights"
        )
