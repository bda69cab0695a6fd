"""DCP's state-dict calls, in one place: the public ``get_state_dict`` / ``set_state_dict`` and the private
pieces that make a save's state dicts without redoing the per-run analysis of the model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import _StateDictInfo

    from pitstop.ckpt.contract import Target

# DCP reports failures as CheckpointException, which derives from BaseException, not Exception.
ERRORS = (Exception, CheckpointException)


class StateDicts:
    """DCP's ``get_state_dict``, without redoing per save what is per run: it works out every parameter's
    fully qualified name and the wrapper kind again on each call (~20 ms of the ~30 for ResNet-50 + AdamW,
    all of it loop time).  That analysis is kept for the (model, optimizer) pair and its options; the state
    dicts themselves are made fresh each save.  Where this torch lacks the pieces, the public call is used.
    ``full_state``: the full (unsharded) state on rank 0, offloaded to the CPU, instead of per-rank shards."""

    def __init__(self, full_state: bool):
        self.full_state = full_state
        self._info: tuple | None = None

    def options(self) -> StateDictOptions:
        return StateDictOptions(full_state_dict=self.full_state, cpu_offload=self.full_state)

    def info(self, target: Target) -> _StateDictInfo | None:
        """DCP's analysis of the (model, optimizer) pair, made once per pair (None where this torch lacks
        ``_verify_options``)."""
        key = (id(target.model), id(target.optimizer))
        if self._info is None or self._info[0] != key:
            from torch.distributed.checkpoint import state_dict as sd

            verify = getattr(sd, "_verify_options", None)
            if verify is None:
                return None
            self._info = (key, verify(target.model, (target.optimizer,), optim_only=False, options=self.options()))
        return self._info[1]

    def get(self, target: Target) -> tuple[dict, dict]:
        try:
            from torch.distributed.checkpoint import state_dict as sd

            info = self.info(target)
            with sd._gc_context():
                model_sd = sd._get_model_state_dict(target.model, info)
                optim_sd = sd._get_optim_state_dict(target.model, (target.optimizer,), info)
                sd._verify_state_dict(model_sd, optim_sd, info)
            return model_sd, optim_sd
        except (AttributeError, TypeError):
            self._info = None
            return get_state_dict(target.model, target.optimizer, options=self.options())


def load(target: Target, model_sd: dict, optim_sd: dict, full: bool, model_only: bool = False) -> None:
    """Load state dicts read from a checkpoint into the (wrapped) model and its optimizer; ``full``: they are
    the full state (rank 0's gather), not this rank's shards."""
    options = StateDictOptions(full_state_dict=full)
    if model_only:
        set_model_state_dict(target.model, model_sd, options=options)
    else:
        set_state_dict(
            target.model, target.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options
        )
