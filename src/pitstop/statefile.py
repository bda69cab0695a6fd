"""State files a run reads back, each checked against the shape pitstop writes before a value of it is used.

A run dir is written by pitstop, but also torn by a full disk, edited by hand, copied from another version or
planted by whoever else can write it; valid JSON of another shape (``null``, ``[]``, a string where a number
belongs) used to end every later start in an ``AttributeError``. So each state file has a shape here
(:data:`GOODPUT`, :data:`FLOPS`, :data:`SUMMARY`, :data:`SAMPLE_RECORD`, :data:`INSTABILITY`, :data:`SUSPECTS`,
:data:`NODES`, :data:`HEALTH`, :data:`HANGWATCH`), and :func:`read_state` reads one:

- the process that owns the file at start (``GoodputLog``, the FLOPs cache) keeps a damaged one aside
  (``NAME.corrupt``, ``NAME.corrupt-2``, ...: never deleted) with a one-line warning naming it, and starts afresh;
- a read-only tool (report, time line, audit, the tracker) leaves the user's file as it is, says in one line that
  it is damaged, and goes on without it.

A shape is a function ``check(value, where)`` that raises :class:`Damaged` naming the first thing wrong; the
combinators below build them. Keys a shape does not name are allowed (a newer pitstop may add some); keys it names
must have their type when present, and the required ones must be present. This module sits in the lowest layer
(stdlib only), so every reader, the CLI tools included, may import it.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import stat
from typing import Any, Callable, Iterator

log = logging.getLogger("pitstop.state")

Shape = Callable[[Any, str], None]


class Damaged(ValueError):
    """A state file that is not the shape pitstop writes; the message names where and what."""


def _what(value: Any) -> str:
    text = json.dumps(value) if value is None or isinstance(value, (bool, int, float, str)) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _fail(where: str, belongs: str, value: Any) -> None:
    raise Damaged(f"{where or 'the document'}: {belongs} belongs there, found {_what(value)}")


def number(low: float | None = None) -> Shape:
    """A finite int or float (not a bool), at least ``low``: a duration or a clock is never NaN or negative."""

    def check(value: Any, where: str) -> None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or (low is not None and value < low):
            _fail(where, "a number" if low is None else f"a number >= {low:g}", value)

    return check


def real(value: Any, where: str) -> None:
    """An int or float, NaN and infinities included (an evaluation's metric of a diverged run)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        _fail(where, "a number", value)


def integer(low: int | None = None) -> Shape:
    def check(value: Any, where: str) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low):
            _fail(where, "an integer" if low is None else f"an integer >= {low}", value)

    return check


def string(value: Any, where: str) -> None:
    if not isinstance(value, str):
        _fail(where, "a string", value)


def boolean(value: Any, where: str) -> None:
    if not isinstance(value, bool):
        _fail(where, "true or false", value)


def anything(value: Any, where: str) -> None:
    pass


def optional(shape: Shape) -> Shape:
    """``shape`` or null."""

    def check(value: Any, where: str) -> None:
        if value is not None:
            shape(value, where)

    return check


def listof(item: Shape) -> Shape:
    def check(value: Any, where: str) -> None:
        if not isinstance(value, list):
            _fail(where, "a list", value)
        for i, v in enumerate(value):
            item(v, f"{where}[{i}]")

    return check


def mapping(value_shape: Shape) -> Shape:
    """An object whose every value has ``value_shape`` (its keys are names or digests, not fixed)."""

    def check(value: Any, where: str) -> None:
        if not isinstance(value, dict):
            _fail(where, "an object", value)
        for k, v in value.items():
            value_shape(v, f"{where}.{k}" if where else str(k))

    return check


def record(required: dict[str, Shape], optional_keys: dict[str, Shape] | None = None) -> Shape:
    """An object with the ``required`` keys, and the ``optional_keys`` of their shape when present."""

    def check(value: Any, where: str) -> None:
        if not isinstance(value, dict):
            _fail(where, "an object", value)
        for k, shape in required.items():
            if k not in value:
                raise Damaged(f"{where + '.' if where else ''}{k} is missing")
            shape(value[k], f"{where}.{k}" if where else k)
        for k, shape in (optional_keys or {}).items():
            if k in value:
                shape(value[k], f"{where}.{k}" if where else k)

    return check


# ---- the shapes pitstop writes --------------------------------------------------------------------------------
SECONDS = number(0)
_HEAL = record({}, {"step": integer(0), "from_step": integer(0), "seconds": SECONDS})
_ROLLBACK = record({"to": integer(0), "from": integer(0)}, {"bucket": string, "seconds": SECONDS, "why": string})
ATTEMPT = record(
    # (what every pitstop that wrote goodput.json wrote; the rest came later and is read with defaults)
    {"start": SECONDS, "end": optional(SECONDS), "status": string, "step": integer(0), "buckets": mapping(SECONDS)},
    {
        "attempt": integer(1),
        "pid": integer(0),
        "auto_restart": boolean,
        "restored": boolean,
        "resumed_from": optional(integer(0)),
        "restored_from": optional(string),  # local | peer | durable | heal (others: not booked by tier)
        "start_method": optional(string),
        "saves": integer(0),
        "marks": mapping(mapping(SECONDS)),  # {step: the work done up to that checkpoint, per bucket}
        "ft": optional(record({}, {"heals": listof(_HEAL), "discarded_steps": anything})),
        "rollbacks": listof(_ROLLBACK),
    },
)
GOODPUT = record({"attempts": listof(ATTEMPT)})  # RUN_DIR/goodput.json (its totals are derived: not read back)
FLOPS = mapping(integer(0))  # RUN_DIR/flops.json: {digest of the model and batch: FLOPs of one micro-batch}
SUMMARY = record(  # RUN_DIR/summary.json, the keys that are read back (the sweep report, recipe.goodput --from)
    {
        "samples_seen": integer(0),
        "goodput": record(
            {"goodput": number(0), "totals": mapping(SECONDS), "restarts": integer(0), "failures": integer(0)},
            {"restart_seconds": optional(SECONDS)},
        ),
    },
    {
        "final_step": integer(0),
        "wall_clock": mapping(SECONDS),
        "metrics": mapping(real),
        "throughput": record(
            {},
            {
                "samples_per_s_per_device": optional(number(0)),
                "step_seconds_p50": optional(SECONDS),
                "mfu": optional(number(0)),
            },
        ),
        "checkpoint": record(
            {}, {"saves": integer(0), "block_seconds_mean": optional(SECONDS), "total_seconds_mean": optional(SECONDS)}
        ),
    },
)
# RUN_DIR/instability.json (train/rollback.py): the data a rollback skipped, as every rank's loader position at that
# moment, keyed by the step of the checkpoint it was rolled back to (applied whenever that checkpoint is restored);
# the sample keys quarantined; the rollbacks so far
SKIP = record({"world_size": integer(1), "loaders": listof(record({}))}, {"from": integer(0), "why": string})
INSTABILITY = record({}, {"skips": mapping(SKIP), "quarantined": listof(string), "rollbacks": integer(0)})
# RUN_DIR/suspects.json (train/sdc.py): the ranks whose state was found corrupted, each time one was (strategy=ft:
# the replica group, ``replica``, in each group's run dir); node health reads it
SUSPECT = record(
    {"rank": integer(0), "step": integer(0), "how": string},
    {"host": string, "time": SECONDS, "tensors": listof(string), "world_size": integer(1), "replica": integer(0)},
)
SUSPECTS = record({"suspects": listof(SUSPECT)})
# RUN_DIR/nodes.json (resilience/node_book.py): each node's failed attempts and whether it is excluded from the job
_NODE_FAILURE = record({"time": SECONDS, "why": string}, {"step": integer(0)})
_EXCLUSION = record({"why": string, "by": string}, {"time": SECONDS})
NODES = record({"nodes": mapping(record({}, {"failures": listof(_NODE_FAILURE), "excluded": _EXCLUSION}))})
# RUN_DIR/health.json (launch/health.py): each node's recent matmul timings, the reference of the others' health checks
HEALTH = record({"nodes": mapping(record({}, {"matmul": listof(SECONDS), "time": SECONDS}))})
# RUN_DIR/hangwatch.rank{R}.json (resilience/hang_peers.py): where a rank's loop is, for the hang report of its peers
HANGWATCH = record(
    {"rank": integer(0), "step": integer(0), "collectives": integer(0)},
    {"inside": optional(string), "phase": optional(string), "since": SECONDS},
)
# samples.rank{R}.jsonl (train/sample_log.py): an attempt's header, a step's (or micro-batch's) keys, or (ft) a
# step's outcome
SAMPLE_HEADER = record(
    {
        "attempt": number(),
        "resumed_from": integer(0),
        "rank": integer(0),
        "world_size": integer(1),
        "epoch_samples": integer(0),
        "epochs": optional(integer(0)),
    },
    {"t": number(), "healed": boolean},
)
SAMPLE_STEP = record(
    {"step": integer(0), "keys": listof(string)},
    {"micro": integer(0), "epoch": optional(integer(0)), "quorum": integer()},
)
SAMPLE_COMMIT = record({"commit": integer(0), "ok": boolean, "quorum": integer()}, {"t": number()})
# the keys written last for the step were skipped, not consumed (a non-finite or spiking loss): their epoch
SAMPLE_SKIP = record({"skip": integer(0)}, {"epoch": integer(0), "why": string, "t": number()})
# steps (to, from] were rolled back in this attempt: their keys were skipped (keep_data) or are redone; "epochs":
# {step: its epoch} of those steps
SAMPLE_ROLLBACK = record(
    {"rollback": integer(0), "from": integer(0), "keep_data": boolean},
    {"epochs": mapping(integer(0)), "why": string, "t": number()},
)


def SAMPLE_RECORD(value: Any, where: str) -> None:  # noqa: N802 - a shape, named like the others
    if isinstance(value, dict) and "attempt" in value:
        SAMPLE_HEADER(value, where)
    elif isinstance(value, dict) and "commit" in value:
        SAMPLE_COMMIT(value, where)
    elif isinstance(value, dict) and "skip" in value:
        SAMPLE_SKIP(value, where)
    elif isinstance(value, dict) and "rollback" in value:
        SAMPLE_ROLLBACK(value, where)
    else:
        SAMPLE_STEP(value, where)


# ---- reading --------------------------------------------------------------------------------------------------
MAX_BYTES = 256 << 20  # a state file is KBs to a few MBs; one larger than this is not one pitstop wrote
_said: set[tuple[str, str]] = set()  # (path, why) already warned about in this process (a poller reads often)


class NotPlain(Damaged):
    """What is at a path is not a plain file of its own: ``kind`` says what (``symbolic link``, ``FIFO``,
    ``directory``, ``device or special file``), ``target`` where a link points."""

    def __init__(self, what: str, kind: str, target: str | None = None):
        super().__init__(what)
        self.kind, self.target = kind, target


def open_fd(path: str) -> int:
    """A file descriptor of ``path`` opened for reading if it is a regular file reached without a link (a FIFO
    planted in its place must not hang the reader, a link must not read another run's file: ``O_NOFOLLOW``,
    ``O_NONBLOCK``); :class:`NotPlain` otherwise. The one such open: state files and checkpoints use it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(path):
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            raise NotPlain("a symbolic link, not a file of this run", "symbolic link", target) from None
        raise e
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "directory" if stat.S_ISDIR(mode) else "FIFO" if stat.S_ISFIFO(mode) else "device or special file"
        raise NotPlain("not a regular file", kind)
    return fd


def open_regular(path: str) -> Any:
    """``path`` opened for reading (buffered) if it is a regular file of its own (:func:`open_fd`)."""
    return os.fdopen(open_fd(path), "rb")


def parse(path: str, shape: Shape) -> Any:
    """``path``'s document if it has ``shape``. Raises FileNotFoundError (no file), :class:`Damaged` (not JSON, or
    another shape, or not a regular file) or another OSError (unreadable)."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_BYTES:
            raise Damaged(f"{size} bytes, more than pitstop writes")
        data = f.read(MAX_BYTES + 1)
    return loads(data, shape)


def loads(data: bytes, shape: Shape) -> Any:
    """One JSON document of ``shape``; :class:`Damaged` naming what is wrong (nested too deep for the parser
    included: a crafted file must not crash the reader)."""
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as e:  # (UnicodeDecodeError included)
        raise Damaged(f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}") from None
    try:
        shape(value, "")
    except RecursionError:
        raise Damaged("nested too deep") from None
    return value


def read_state(
    path: str, shape: Shape, *, keep_aside: bool, then: str = "", logger: logging.Logger | None = log
) -> Any:
    """``path``'s document if it has ``shape``; None if there is none or it is damaged (said in one warning that
    names it; with ``keep_aside``, by the process that owns the file, moved aside first). ``then``: what the
    caller does without it, for the warning; ``logger`` None: say nothing (another process says it)."""
    try:
        return parse(path, shape)
    except FileNotFoundError:
        return None
    except (OSError, Damaged) as e:
        why = str(e) if isinstance(e, Damaged) else f"{type(e).__name__}: {e.strerror or e}"
        aside = keep_aside_copy(path) if keep_aside else None  # (unreadable too: rewriting it would lose it)
        if logger is None:
            pass
        elif aside is not None:
            logger.warning("%s is unreadable (%s): kept aside as %s%s", path, why, aside, f"; {then}" if then else "")
        elif (path, why) not in _said:
            _said.add((path, why))
            logger.warning("%s is unreadable (%s): %s", path, why, then or "ignored")
        return None


def keep_aside_copy(path: str) -> str | None:
    """Move ``path`` to the first free ``PATH.corrupt``, ``PATH.corrupt-2``, ...; never over another file (an
    earlier one kept aside stays too). Returns the new name, or None if it could not be moved."""
    for n in range(1, 10_000):
        aside = f"{path}.corrupt" if n == 1 else f"{path}.corrupt-{n}"
        try:
            os.link(path, aside, follow_symlinks=False)  # (fails if the name is taken: never over an earlier one)
        except FileExistsError:
            continue
        except OSError:  # (a file system without hard links)
            if os.path.lexists(aside):
                continue
            try:
                os.rename(path, aside)
                return aside
            except OSError:
                return None
        try:
            os.unlink(path)
        except OSError:
            pass
        return aside
    return None


def read_records(path: str, shape: Shape, *, then: str = "skipped", logger: logging.Logger = log) -> Iterator[dict]:
    """The lines of a JSON-lines file that have ``shape``, in order (read-only: the file is left as it is). Lines
    that do not (a line cut by a kill, a hand edit) are skipped and said in one warning naming the file, the count
    and the first one."""
    bad, first = 0, ""
    try:
        f = open_regular(path)
    except Damaged as e:
        logger.warning("%s is unreadable (%s): %s", path, e, then)
        return
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = loads(line, shape)
            except (ValueError, Damaged) as e:  # (Damaged is a ValueError: kept for the reader)
                bad += 1
                if not first:
                    first = f"line {n}: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__}"
                continue
            yield value
    if bad:
        logger.warning("%s has %d damaged line(s) (first: %s): %s", path, bad, first, then)
