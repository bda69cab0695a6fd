"""An evaluation pass of a ``ShardLoader``: every rank in lockstep, kept in memory for later passes if it fits."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator

from pitstop.data.loader.reader import Failure, from_transport
from pitstop.data.loader.sizes import first_sample, nbytes
from pitstop.errors import DataError

if TYPE_CHECKING:
    from pitstop.data.loader.base import ShardLoader

log = logging.getLogger("pitstop.data.loader")


def one_pass(
    loader: ShardLoader, max_batches: int | None = None, share: Callable[[Any, int], Any] | None = None
) -> Iterator[tuple[Any, bool]]:
    """One pass over this rank's share (evaluation): no shuffling, no position kept.

    Yields ``(batch, counted)``, and every rank yields the same number of batches: a forward is a
    collective under DDP (buffer broadcast) and FSDP (parameter all-gather), so a rank that stopped
    early while a peer still runs forwards would deadlock the job.  A rank that ran out keeps stepping
    with a one-sample *padding* batch (``counted=False``: run it, do not score it).  A rank with no
    evaluation data at all gets its padding sample from a rank that has some, through
    ``share(obj, src)`` (a broadcast every rank calls, before any forward, only when such a rank exists).
    """
    counts = loader.eval_batches()
    steps = max(counts, default=0)
    if max_batches is not None:
        steps = min(steps, int(max_batches))
    if loader._kept is not None and loader._kept[0] == steps:
        yield from loader._kept[1]  # the same batches as the first pass, without starting a worker
        return
    mine = min(counts[loader.rank], steps)
    it = loader._reader(0) if mine else iter(())
    first = _checked(next(it)) if mine else None
    shared = bool(steps and min(counts) == 0 and loader.world_size > 1)
    if shared:
        if share is None:
            raise ValueError("a rank has no evaluation data: iterate_once needs share= to stay in lockstep")
        src = counts.index(max(counts))
        pad = share(first_sample(first) if loader.rank == src else None, src)
    else:
        pad = first_sample(first) if first is not None else None
    # Kept in memory for later passes if it fits loader.eval_in_memory (each rank decides alone: a kept
    # pass runs no collective, so it is never kept when its padding came from a peer by a broadcast).
    keep: list[tuple[Any, bool]] | None = [] if loader.eval_in_memory and not shared else None
    size = 0
    for i in range(mine):
        pair = (first if i == 0 else _checked(next(it))), True
        first = None
        if keep is not None:
            size += nbytes(pair[0])
            if size <= loader.eval_in_memory:
                keep.append(pair)
            else:
                keep = None
        yield pair
    del it  # stop this pass's workers now, not when the generator is collected
    for _ in range(steps - mine):
        if keep is not None:
            keep.append((pad, False))
        yield pad, False
    if keep is not None:
        loader._kept = (steps, keep)
        log.info(
            "%s split: this rank's %d evaluation batches (%s bytes) are kept in memory for later passes "
            "(loader.eval_in_memory=%s bytes)",
            loader.split,
            len(keep),
            f"{size:,}",
            f"{loader.eval_in_memory:,}",
        )


def _checked(item: dict | Failure) -> Any:
    if isinstance(item, Failure):
        raise DataError(item.message)
    return from_transport(item["data"])
