"""``strategy=fsdp``: FSDP2 (``fully_shard``) — parameters, gradients and optimizer state sharded across ranks.

Each module named in ``shard`` (or, with ``shard: auto``, each direct child that has parameters) becomes
its own FSDP unit, then the root; ``reshard_after_forward`` trades memory for a re-gather in backward;
``mixed_precision`` (null | bfloat16 | float16) sets the parameter dtype for compute (reductions in fp32).
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
        if self.shard == "auto":
            units = [m for m in model.children() if any(True for _ in m.parameters())]
        else:
            names = list(self.shard or [])
            units = [model.get_submodule(n) for n in names]
        for unit in units:
            fully_shard(unit, **kw)
        fully_shard(model, **kw)
        return model
