"""No checkpoint ever holds a non-finite tensor: a save of model or optimizer state with a NaN or an infinity in it
is refused (:class:`NonFiniteState`, said in one line; the previous checkpoints are kept and the run goes on, or its
instability handling rolls it back). One read of the state per save, before it is staged or written."""

from __future__ import annotations

from typing import Any

import torch

from pitstop.errors import CheckpointError
from pitstop.parts.batch import local_shard


class NonFiniteState(CheckpointError):
    """The state to be saved holds a non-finite value: the save is refused, never written."""


def first_nonfinite(state: Any, where: str = "") -> str | None:
    """The path of the first floating tensor of ``state`` (nested dicts and lists) with a non-finite value, or None."""
    if isinstance(state, torch.Tensor):
        t = local_shard(state)
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            return where or "a tensor"
        return None
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        return None
    for k, v in items:
        found = first_nonfinite(v, f"{where}.{k}" if where else str(k))
        if found is not None:
            return found
    return None


def refuse_nonfinite(model_sd: Any, optim_sd: Any) -> None:
    for name, sd in (("model", model_sd), ("optimizer", optim_sd)):
        found = first_nonfinite(sd)
        if found is not None:
            raise NonFiniteState(f"refused: the {name} state holds a non-finite value ({found}); not saved")
