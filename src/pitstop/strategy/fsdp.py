"""``strategy=fsdp``: FSDP2 (``fully_shard``) — parameters, gradients and optimizer state sharded across ranks.

Each module named in ``shard`` (or, with ``shard: auto``, each direct child that has parameters) becomes
its own FSDP unit, then the root; ``reshard_after_forward`` trades memory for a re-gather in backward;
``mixed_precision`` (null | bfloat16 | float16) sets the parameter dtype for compute (reductions in fp32);
BatchNorm layers stay in fp32 (their own units), as their running statistics are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pitstop.strategy.ddp import DDP


class FSDP(DDP):
    name = "fsdp"

    def __init__(self, shard: Any = "auto", reshard_after_forward: bool = True, mixed_precision: str | None = None,
                 **kw: Any):
        super().__init__(**kw)
        self.shard, self.reshard_after_forward, self.mixed_precision = shard, bool(reshard_after_forward), mixed_precision

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = model.to(self.device)
        kw: dict[str, Any] = {"reshard_after_forward": self.reshard_after_forward}
        if self.mixed_precision:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, self.mixed_precision),
                                                   reduce_dtype=torch.float32)
            # BatchNorm keeps fp32 parameters next to its fp32 running statistics (kernels refuse bf16 weights with
            # fp32 stats): each norm layer is its own unit that computes in fp32 and hands back mp-dtype outputs.
            norm = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                        output_dtype=getattr(torch, self.mixed_precision))
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
