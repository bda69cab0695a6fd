"""``strategy=fsdp``: FSDP2 (``fully_shard``) — parameters, gradients and optimizer state sharded across ranks.

Each module named in ``shard`` (or, with ``shard: auto``, each direct child that has parameters) becomes
its own FSDP unit, then the root; ``reshard_after_forward`` trades memory for a re-gather in backward;
``mixed_precision`` sets the parameter dtype for compute (reductions in fp32); it follows ``trainer.precision``
(``fp32`` | ``bf16`` | ``fp16``), so one key sets the precision under every strategy (pitstop/parts/precision.py: no
autocast on top of FSDP's policy); set explicitly to another dtype than ``trainer.precision`` it is refused.
BatchNorm layers stay in fp32 (their own units), as their running statistics are.
Gradient accumulation: ``no_sync`` turns FSDP's reduce-scatter off for the micro-batches before the last.
"""

from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Sequence
from typing import Any, Callable, Iterator

import torch
from torch import nn

from pitstop.errors import ConfigError
from pitstop.parts.precision import DTYPES
from pitstop.strategy.ddp import DDP

# trainer.precision's names, and torch's (the key's older spellings)
_DTYPES = {**DTYPES, None: None, "float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FSDP(DDP):
    name = "fsdp"
    # fully_shard refuses non-contiguous parameters: with trainer.channels_last only the inputs are NHWC, which
    # is enough for cuDNN/oneDNN to run the convolutions (and their outputs) channels_last.
    channels_last_params = False
    replicated = False  # each rank holds its shard alone: nothing for trainer.sdc to compare

    def __init__(
        self,
        shard: str | Sequence[str] | None = "auto",
        reshard_after_forward: bool = True,
        mixed_precision: str | None = None,
        **kw: Any,
    ):
        super().__init__(**kw)
        if mixed_precision not in _DTYPES:
            raise ConfigError(
                f"strategy.mixed_precision={mixed_precision!r} is not a precision; set trainer.precision "
                f"(fp32 | bf16 | fp16), which this key follows"
            )
        self.shard, self.reshard_after_forward = shard, bool(reshard_after_forward)
        self.compute_dtype = _DTYPES[mixed_precision]

    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def watch_gradients(self, model: nn.Module, ready: Callable[[], None]) -> bool:
        return False  # (its reduce-scatters run inside backward: no point where its own work alone has ended)

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = model.to(self.device)
        kw: dict[str, Any] = {"reshard_after_forward": self.reshard_after_forward}
        if self.compute_dtype is not None:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
            # BatchNorm keeps fp32 parameters next to its fp32 running statistics (kernels refuse bf16 weights with
            # fp32 stats): each norm layer is its own unit that computes in fp32 and hands back mp-dtype outputs.
            norm = MixedPrecisionPolicy(
                param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=self.compute_dtype
            )
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    fully_shard(m, reshard_after_forward=self.reshard_after_forward, mp_policy=norm)
        if self.shard == "auto":
            units = [m for m in model.children() if any(True for _ in m.parameters())]
        else:
            names = list(self.shard or [])
            units = [model.get_submodule(n) for n in names]
        for unit in units:
            fully_shard(unit, **kw)
        fully_shard(model, **kw)
        return model
