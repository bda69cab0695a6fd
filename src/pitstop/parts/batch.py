"""``map_tensors``: one walk over a batch's nested lists, tuples and dicts, applying a function to each tensor."""

from __future__ import annotations

from typing import Any, Callable

import torch


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """``batch`` with every tensor ``t`` replaced by ``fn(t)`` (same containers; other leaves unchanged)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(fn, b) for b in batch)
    if isinstance(batch, dict):
        return {k: map_tensors(fn, v) for k, v in batch.items()}
    return batch


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2: the same storage), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def without(batch: Any, keys: list[str], drop: frozenset[str] | set[str]) -> tuple[Any, list[str]]:
    """``batch`` (whose tensors hold one row per key of ``keys``) without the rows of the keys in ``drop``, and the
    keys kept (a quarantined sample is never fed again)."""
    keep = [i for i, k in enumerate(keys) if k not in drop]
    n, index = len(keys), torch.tensor(keep, dtype=torch.long)
    rows = lambda t: t.index_select(0, index.to(t.device)) if t.dim() > 0 and t.shape[0] == n else t  # noqa: E731
    return map_tensors(rows, batch), [keys[i] for i in keep]
