"""Numeric precision of a training step: ``trainer.precision = fp32 | bf16 | fp16``.

- ``bf16`` / ``fp16`` under ``strategy=single|ddp``: forward and loss run under ``torch.autocast`` (weights,
  gradients and optimizer state stay fp32).  Under ``strategy=fsdp`` the same key sets FSDP's
  ``MixedPrecisionPolicy`` instead (parameters gathered in the low dtype, gradients reduced in fp32), as
  torchtitan does: no autocast on top.
- ``fp16`` adds a ``GradScaler`` (loss scaling, skipped steps on overflow); its state (scale, growth
  tracker) is part of the train state, so a resumed run scales exactly as an uninterrupted one would have.
  Under FSDP the scaler all-reduces "found inf" over ranks (each rank sees only its gradient shards).
- ``fp16`` needs an accelerator (CPU autocast in fp16 is slow and unscaled there): refused on CPU; any other
  name (``fp8``...) is refused naming the ones there are.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager

import torch

from pitstop.errors import ConfigError

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    def __init__(self, name: str, device: torch.device, *, strategy_casts: bool = False):
        """``strategy_casts``: the strategy applies the dtype itself (FSDP's mixed-precision policy)."""
        if name not in DTYPES:
            hint = (
                " (fp8 training needs Transformer Engine/torchao float8 layers, which pitstop does not wire)"
                if str(name).lower().startswith("fp8")
                else ""
            )
            raise ConfigError(f"trainer.precision={name!r} is not supported{hint}; use one of {', '.join(DTYPES)}")
        if name == "fp16" and device.type == "cpu":
            raise ConfigError(
                "trainer.precision=fp16 needs a CUDA device (this run is on CPU); "
                "use trainer.precision=bf16 or fp32 on CPU"
            )
        if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError(f"trainer.precision=bf16: {torch.cuda.get_device_name(device)} has no bf16; use fp16")
        self.name, self.device, self.dtype = name, device, DTYPES[name]
        self.autocasts = self.dtype is not None and not strategy_casts
        self.scaler: torch.amp.GradScaler | None = None
        if name == "fp16":
            if strategy_casts:  # sharded gradients: "found inf" must be agreed over ranks
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self.scaler = ShardedGradScaler(device.type)
            else:
                self.scaler = torch.amp.GradScaler(device.type)

    def autocast(self) -> ContextManager:
        """Around forward and loss."""
        return torch.autocast(self.device.type, dtype=self.dtype) if self.autocasts else nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Before anything reads the gradients' values (clipping)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
        else:  # skipped when the gradients overflowed; the scale backs off or grows
            self.scaler.step(optimizer)
            self.scaler.update()

    def state_dict(self) -> dict:
        return dict(self.scaler.state_dict()) if self.scaler is not None else {}

    def load_state_dict(self, state: dict | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
