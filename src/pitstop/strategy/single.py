"""``strategy=single``: one process, one device (CUDA when present, else CPU)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager

import torch
from torch import nn

from pitstop.train.batch import map_tensors
from pitstop.strategy.base import Strategy


class Single(Strategy):
    name = "single"

    def __init__(self, device: str = "auto"):
        self.requested = device
        self.rank, self.local_rank, self.world_size = 0, 0, 1
        self.device = torch.device("cpu")
        self._owns_group = False  # this strategy created the process group (and must destroy it)
        self._store_path: str | None = None

    def setup(self) -> None:
        if self.requested == "auto":
            self.device = torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")
        else:
            self.device = torch.device(self.requested)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def wrap(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)

    def sync_buffers(self, model: nn.Module) -> None:
        pass

    def no_sync(self, model: nn.Module) -> ContextManager:
        return nullcontext()  # nothing to reduce

    def to_device(self, batch: Any) -> Any:
        return map_tensors(lambda t: t.to(self.device, non_blocking=self.pin_memory), batch)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    # ---- checkpoint coordination (a dedicated gloo group when there are several ranks) -------------
    def ckpt_group(self) -> Any:
        import torch.distributed as dist

        return dist.group.WORLD if dist.is_initialized() else None

    def init_local_group(self, store_path: str) -> None:
        """A one-rank gloo group (file store, no port) for savers that need one (process-based DCP)."""
        import os

        import torch.distributed as dist

        if dist.is_initialized():
            return
        if os.path.exists(store_path):
            os.remove(store_path)
        os.makedirs(os.path.dirname(store_path), exist_ok=True)
        dist.init_process_group("gloo", store=dist.FileStore(store_path, 1), rank=0, world_size=1)
        self._owns_group, self._store_path = True, store_path

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def any(self, flag: bool) -> bool:
        return bool(flag)

    def barrier(self) -> None:
        pass

    def teardown(self) -> None:
        if self._owns_group:
            import os

            import torch.distributed as dist

            dist.destroy_process_group()
            self._owns_group = False
            if self._store_path and os.path.exists(self._store_path):
                os.remove(self._store_path)
