"""Restore with fallback: which checkpoint to load (``ckpt.load``), and what to do when it does not load.

Rank 0 lists the candidates (newest complete first; with the local tier on, the newest of either tier, a tie
going to the local one) and every rank gets the same list.  Every rank takes the same checkpoint, or none:
one whose bytes are damaged on any rank (a checksum, a truncated or missing file, a refused pickle) is skipped
for the next older one, unless it was asked for by name; a transient read error is retried and then fails the
attempt (never a silent fallback that redoes work); any other error is raised as the bug it is.  A changed
config (the fingerprint) is never skipped: it stops the run.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from typing import Any, Callable

from pitstop.ckpt import dcp, integrity, layout, peer
from pitstop.ckpt.contract import StrategyLike, Target, interrupt_in, one_line
from pitstop.errors import CheckpointError, CorruptCheckpoint, FingerprintMismatch

log = logging.getLogger("pitstop.ckpt")


def candidates(
    strategy: StrategyLike, root: str, local_root: str | None, spec: int | str, at_most: int | None = None
) -> list[str]:
    """The checkpoints ``spec`` names, newest first, the same on every rank (rank 0 decides and reports a bad
    ``spec`` for everyone); ``at_most``: only those of a step at most that (a rollback)."""
    choice: Any = None
    if strategy.rank == 0:
        try:
            choice = layout.candidates(root, spec)
            if spec == "auto" and local_root is not None:  # the newest complete one of either tier
                both = [(layout.step_of(p), 0, p) for p in layout.candidates(local_root, "auto")]
                both += [(layout.step_of(p), 1, p) for p in choice]
                choice = [p for _, _, p in sorted(both, key=lambda x: (-x[0], x[1]))]  # a tie: local (faster)
            if at_most is not None:
                choice = [p for p in choice if layout.is_step_dir(p) and layout.step_of(p) <= at_most]
        except CheckpointError as e:
            choice = str(e)
    choice = strategy.broadcast_object(choice)
    if isinstance(choice, str):
        raise CheckpointError(choice)
    return choice


def discard_after(strategy: StrategyLike, root: str, local_root: str | None, step: int) -> None:
    """Remove the complete checkpoints newer than ``step`` (a rollback abandoned their steps): rank 0 those of
    ``root``, every rank those of the local tier (it may be per node). One that cannot be removed is said in one
    line: it stays, and a restart would resume from it."""
    roots = ([root] if strategy.rank == 0 else []) + ([local_root] if local_root is not None else [])
    for where in roots:
        for s, path, complete in layout.list_checkpoints(where):
            if s > step and complete:
                try:
                    layout.remove(path)
                    log.info("removed checkpoint %s: its steps were rolled back to step %d", path, step)
                except OSError as e:
                    log.error("checkpoint %s of rolled-back steps could not be removed: %s", path, e)
    strategy.barrier()


def verify(strategy: StrategyLike, path: str) -> None:
    """Every rank checks its share of ``path``'s files against the checkpoint's checksum manifest (the small ones,
    ``.metadata`` included, each rank itself) before anything is read; every rank then takes the same decision,
    and the first finding is the one every rank reports."""
    rank, world_size = strategy.rank, strategy.world_size
    problem: str | None = None
    try:
        integrity.verify(path, share=(rank, world_size))
    except CorruptCheckpoint as e:
        problem = str(e)
    if not strategy.any(problem is not None):
        return
    for src in range(world_size if world_size > 1 else 0):
        found = strategy.broadcast_object(problem if rank == src else None, src=src)
        if found:
            problem = found
            break
    raise CorruptCheckpoint(problem or f"checkpoint {path} is corrupt")


RETRIES = 3  # tries of a checkpoint whose read failed for a transient reason (a reset, a timeout, a 5xx)
BACKOFF = 1.0  # seconds before the second try; doubles each time


def classify(error: BaseException) -> str:
    """Why a checkpoint did not load: ``integrity`` (its bytes are not what was written: a checksum, a missing or
    truncated file, a refused pickle; another checkpoint may load), ``transient`` (the store did not answer or
    broke off: the same checkpoint may load in a moment), or ``bug`` (anything else: no fallback may hide it).
    DCP wraps each rank's exception: the worst of them decides."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        causes = [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        kinds = {classify(c) if isinstance(c, BaseException) else "bug" for c in causes}
        return next(k for k in ("bug", "transient", "integrity") if k in kinds)
    if isinstance(error, (CorruptCheckpoint, FileNotFoundError)):
        return "integrity"
    if isinstance(error, (ConnectionError, TimeoutError)):
        return "transient"
    if isinstance(error, OSError) and error.errno in TRANSIENT_ERRNOS:
        return "transient"
    module = type(error).__module__.split(".")[0]
    if module in ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "s3fs", "fsspec"):
        name = type(error).__name__
        if any(w in name for w in ("Connect", "Timeout", "Endpoint", "Disconnect", "Payload", "Throttl", "Read")):
            return "transient"
    if isinstance(error, OSError) and not isinstance(error, PermissionError) and error.errno is None:
        return "transient"  # (fsspec's stores report a failed request as a bare OSError)
    return "bug"


TRANSIENT_ERRNOS = {
    errno.EAGAIN,
    errno.EINTR,
    errno.EIO,
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ENETDOWN,
    errno.EPIPE,
}


def first_loadable(
    strategy: StrategyLike,
    choice: list[str],
    explicit: bool,
    load: Callable[[str], None],
    root: str,
    local_root: str | None,
    step: Callable[[], int],
    tiers: dict[str, str] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int | None:
    """Load the first of ``choice`` that loads on every rank; its step, or None when there was none.

    Every rank takes the same decision: a checkpoint whose bytes are damaged on any rank is skipped for the next
    older one (named in one line; unless it was asked for by name); one whose read failed for a transient reason
    is read again (:data:`RETRIES` tries, with backoff), and then the attempt fails in one line, for the launcher's
    restart to try again; any other error is raised as it is."""
    for i, path in enumerate(choice):
        t0 = time.perf_counter()
        for attempt in range(1, RETRIES + 1):
            error: BaseException | None = None
            try:
                load(path)
            except FingerprintMismatch:
                raise
            except dcp.ERRORS as e:
                interrupt = interrupt_in(e)
                if interrupt is not None:  # (a hang in the restore is the hang)
                    raise interrupt from None
                error = e
            kind = classify(error) if error is not None else None
            if strategy.any(kind == "bug"):
                if error is not None and kind == "bug":
                    raise error
                raise CheckpointError(f"checkpoint {path} failed to load on another rank (its log says why)")
            if not strategy.any(kind == "transient"):
                break
            reason = one_line(error) if kind == "transient" else "a transient read error on another rank"
            if attempt == RETRIES:
                raise CheckpointError(
                    f"cannot read checkpoint {path}: {reason} (a transient I/O error, {RETRIES} tries); the "
                    f"checkpoint is intact as far as pitstop knows: the next attempt (the launcher's restart, or the "
                    f"same command) reads it again"
                ) from error
            delay = BACKOFF * 2 ** (attempt - 1)
            log.warning("checkpoint %s: read failed (%s); trying again in %.0f s", path, reason, delay)
            sleep(delay)
        if strategy.any(error is not None):  # (integrity, on some rank)
            reason = one_line(error) if error is not None else "corrupt on another rank"
            if explicit:
                raise CheckpointError(f"cannot load checkpoint {path}: {reason}") from error
            older = choice[i + 1] if i + 1 < len(choice) else None
            log.warning(
                "checkpoint %s is corrupt, not loaded (%s); %s",
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
        tier = tier_of(path, local_root, tiers)
        log.info("restored %s (step %d, %s tier) in %.2f s", path, step(), tier, time.perf_counter() - t0)
        return step()
    return None


def tier_of(path: str, local_root: str | None, tiers: dict[str, str] | None = None) -> str:
    """The tier checkpoint ``path`` is read from: as ``tiers`` names it (:func:`with_peers`: ``local`` or ``peer``),
    else ``local`` under the local tier's root, else ``durable``."""
    if tiers and path in tiers:
        return tiers[path]
    return "local" if local_root is not None and path.startswith(local_root + os.sep) else "durable"


def with_peers(replicator: Any, durable: list[str]) -> tuple[list[str], dict[str, str]]:
    """The candidates with the local tier replicated to peer nodes (:mod:`.peer`): the newest step every rank can get
    from its node's dir, a peer's copy or the durable tier.  When the nodes and their copies hold a step at least as
    new as the durable tier's newest, every node makes it whole in its own dir (this rank's path first, then the
    durable ones); ``tiers``: that path's tier (``local``, or ``peer`` when a lost node's files came from a copy)."""
    found = replicator.newest()
    newest = layout.step_of(durable[0]) if durable and layout.is_step_dir(durable[0]) else -1
    gone = peer.lost(replicator.held_by, max(newest, found[0] if found else -1))
    if gone is not None and replicator.rank == 0:
        nodes = ", ".join(str(n) for n in gone[1])
        log.warning(
            "the local checkpoint of step %d is lost: no node holds the files of the saving job's node(s) %s (the node "
            "and its partner, both gone, or the node alone when the save was made with copies off); restoring from %s",
            gone[0],
            nodes,
            f"step {found[0]}, held by the nodes" if found and found[0] >= newest else "the durable tier",
        )
    if found is None or found[0] < newest:
        return durable, {}
    step, held_by = found
    tier = replicator.assemble(step, held_by)
    if tier is None:
        return durable, {}
    path = layout.step_dir(replicator.root, step)
    return [path, *durable], {path: tier}


def state_bytes(strategy: StrategyLike, root: str, target: Target) -> int:
    """What one checkpoint of this job takes: the newest durable one's size, else the model's tensors three times
    (parameters and two optimizer moments, as Adam keeps), summed over the ranks unless every rank holds the whole."""
    from pitstop.ckpt.storage import dir_bytes

    size = 0
    if strategy.rank == 0:
        found = [p for _, p, ok in layout.list_checkpoints(root) if ok]
        size = dir_bytes(found[-1]) if found else 0
    size = int(strategy.broadcast_object(size))
    if size:
        return size
    tensors = [getattr(t, "_local_tensor", t) for t in target.model.state_dict().values()]
    mine = 3 * sum(t.nbytes for t in tensors if hasattr(t, "nbytes"))
    return mine if strategy.replicated else int(sum(strategy.all_gather_object(mine)))


def load_into(
    path: str,
    target: Target,
    read: tuple[dict[str, dict], Callable[[], tuple]],
    rank: int,
    world_size: int,
    model_only: bool,
) -> None:
    """``read``: every rank's train state read from ``path``, and what reads its model and optimizer state dicts
    (once the fingerprint is checked)."""
    trains, tensors = read
    # This rank's own state; a rank that did not exist when it was saved starts from rank 0's.
    train = trains.get(f"train.rank{rank}", trains.get("train.rank0"))
    for key in sorted(trains):
        check_train(path, key, trains[key])
    saved_fp = train["fingerprint"] if train is not None else None
    if saved_fp is not None and not model_only:
        check_fingerprint(path, saved_fp, target.state.fingerprint())
    full = layout.is_full_state(path)
    model_sd, optim_sd = tensors()
    if model_only:
        dcp.load(target, model_sd, optim_sd, full, model_only=True)
        log.info("loaded model weights only from %s (ckpt.load_model_only=true)", path)
        return
    if train is None:
        raise CheckpointError(f"{path} has no training state (step, data position, RNG)")
    peers = [trains[k] for k in sorted(trains, key=lambda k: int(k[len("train.rank") :]))]
    if len({p["step"] for p in peers}) > 1:
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: its ranks' train states hold different steps")
    named = layout.step_of(path) if layout.is_step_dir(path) else None
    if named is not None and train["step"] != named:
        raise CorruptCheckpoint(
            f"checkpoint {path} is corrupt: its name says step {named}, its train state step {train['step']} (a "
            f"checkpoint moved under another step's name: not loaded)"
        )
    try:
        dcp.load(target, model_sd, optim_sd, full)
    except UNFIT as e:  # (a full state dict read from a verified file: its tensors do not fit this model)
        if not full:
            raise
        raise CorruptCheckpoint(
            f"checkpoint {path} is corrupt: its model or optimizer state does not fit this run ({type(e).__name__}: "
            f"{one_line(e)})"
        ) from None
    if len(peers) != world_size:
        log.info("resharding: checkpoint written by %d rank(s), resuming on %d", len(peers), world_size)
    try:
        target.state.load_state_dict(train, peers=peers)
    except UNFIT as e:  # (its bytes passed their checksums: what they hold does not fit together)
        raise CorruptCheckpoint(
            f"checkpoint {path} is corrupt: its train state does not fit this run ({type(e).__name__}: {one_line(e)})"
        ) from None


# What loading a train state, an RNG state or a full state dict read from a checkpoint raises when its values do
# not fit this run (a generator state of the wrong size, a count too large for numpy, a tensor of another shape).
UNFIT = (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError, OverflowError, RecursionError)


TRAIN_SHAPE = {"step": int, "samples_seen": int, "loader": dict, "scheduler": dict, "fingerprint": dict}


def check_train(path: str, key: str, train: object) -> None:
    """CorruptCheckpoint unless ``train`` (one rank's train state, read from ``path``) has the shape pitstop writes:
    what a restore reads next would otherwise fail as a bug, and every restart would repeat it."""
    problem = None
    if not isinstance(train, dict):
        problem = f"is a {type(train).__name__}"
    else:
        for name, kind in TRAIN_SHAPE.items():
            value = train.get(name)
            if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
                problem = f"has {name}={str(value)[:40]!r}, not a {'count' if kind is int else kind.__name__}"
                break
        else:
            if "rng" not in train:
                problem = "has no rng"
    if problem:
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: {key} {problem}")


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
