"""``strategy=single``: one process, one device (CUDA when present, else CPU)."""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, ContextManager, TypeVar

import torch
from torch import nn

from pitstop.config.checks import is_integer
from pitstop.errors import ConfigError
from pitstop.parts.batch import map_tensors
from pitstop.strategy.base import Strategy

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

T = TypeVar("T")
log = logging.getLogger("pitstop.strategy")
# What OMP_NUM_THREADS (or torch's own default) allows, read once before any run sets a count: the cap of
# cpu_threads=auto (torch.get_num_threads() later is what the previous run in this process chose).
_THREADS_ALLOWED = torch.get_num_threads()


class Single(Strategy):
    name = "single"

    def __init__(self, device: str = "auto", cpu_threads: int | str | None = "auto"):
        self.requested = device
        self.cpu_threads = cpu_threads_key(cpu_threads)
        self.loader_workers = 0
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
        else:
            self.set_cpu_threads()

    def share_cores(self, loader_workers: int) -> None:
        self.loader_workers = int(loader_workers)

    def set_cpu_threads(self) -> None:
        """The CPU budget: the loop's intra-op threads and the loader's workers share the cores, so that adding a
        worker never slows the step (``strategy.cpu_threads``: auto = the cores the workers leave, at least 1,
        at most what OMP_NUM_THREADS allows; or pinned)."""
        cores = os.cpu_count() or 1
        if self.cpu_threads is not None:
            threads = self.cpu_threads
        else:
            if self.loader_workers > cores:
                log.warning(
                    "loader.num_workers=%d is more than this machine's %d cores: the loop keeps 1 intra-op thread "
                    "and the workers share the cores (fewer workers, or strategy.cpu_threads, to choose)",
                    self.loader_workers,
                    cores,
                )
            threads = min(_THREADS_ALLOWED, max(1, cores - self.loader_workers))
        torch.set_num_threads(threads)
        log.info(
            "CPU budget: %d intra-op thread(s) for the loop, %d loader worker(s), %d cores%s",
            threads,
            self.loader_workers,
            cores,
            "" if self.cpu_threads is None else " (strategy.cpu_threads)",
        )

    def wrap(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)

    def sync_buffers(self, model: nn.Module) -> None:
        pass

    def no_sync(self, model: nn.Module) -> ContextManager:
        return nullcontext()  # nothing to reduce

    def to_device(self, batch: object) -> Any:
        return map_tensors(lambda t: t.to(self.device, non_blocking=self.pin_memory), batch)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    # ---- checkpoint coordination (a dedicated gloo group when there are several ranks) -------------
    def ckpt_group(self) -> ProcessGroup | None:
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

    def broadcast_object(self, obj: T, src: int = 0) -> T:
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


def cpu_threads_key(value: int | str | None) -> int | None:
    """``strategy.cpu_threads``: auto (None: the strategy's share of the cores) or a positive integer."""
    if value in (None, "auto"):
        return None
    if not is_integer(value) or value < 1:
        raise ConfigError(f"strategy.cpu_threads must be auto or a positive integer, got {value!r}")
    return int(value)
