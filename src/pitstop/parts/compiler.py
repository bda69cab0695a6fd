"""``trainer.compile=true``: ``torch.compile`` of the model, in place, after the strategy wrapped it.

- In place (``nn.Module.compile``): the module keeps its parameter names (no ``_orig_mod.`` prefix), so a
  checkpoint of a compiled run resumes an eager one and back, with any checkpoint backend.
- After wrapping, as torch documents it: a DDP module is compiled as a whole, so that dynamo splits the graph
  at DDP's gradient buckets (``DDPOptimizer``: all-reduces still overlap backward); under FSDP2 the
  ``fully_shard`` hooks stay outside the compiled regions (each sharded unit's forward is compiled).
- Compilation happens at the first forward of each shape/mode (training, then evaluation), inside the loop:
  :class:`CompileClock` reads how long dynamo spent compiling so that the runner moves it out of
  ``compute``/``eval`` into its own ledger bucket, ``compile`` (a start-up cost every restart pays again).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from pitstop.errors import ConfigError

log = logging.getLogger("pitstop.compile")

# dynamo's own timers (seconds per call), the two that cover a training step's compilation: tracing + the
# backend for the forward (AOT autograd traces the backward there too) and inductor's lazy backward compile.
_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


def check(backend: str, mode: str | None) -> None:
    """Refuse an unknown backend or mode before anything is built (one line, naming what there is)."""
    import torch._dynamo

    backends = torch._dynamo.list_backends(exclude_tags=())
    if backend not in backends:
        raise ConfigError(
            f"trainer.compile_backend={backend!r} is not a torch.compile backend here; "
            f"use one of {', '.join(b for b in backends if 'TESTING' not in b)}"
        )
    modes = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
    if mode is not None and mode not in modes:
        raise ConfigError(
            f"trainer.compile_mode={mode!r} is not a torch.compile mode; use null or one of {', '.join(modes)}"
        )
    if mode is not None and backend != "inductor":
        raise ConfigError(
            f"trainer.compile_mode={mode!r} is an inductor option; set trainer.compile_backend=inductor "
            f"or trainer.compile_mode=null"
        )


def compile_model(model: nn.Module, backend: str, mode: str | None) -> nn.Module:
    kw: dict[str, Any] = {"backend": backend}
    if mode is not None:
        kw["mode"] = mode
    model.compile(**kw)
    log.info(
        "model compiled in place (backend %s%s): compilation runs at the first steps",
        backend,
        f", mode {mode}" if mode else "",
    )
    return model


class CompileClock:
    """Seconds dynamo spent compiling since the last :meth:`take` (0 when nothing was compiled).

    Reads ``torch._dynamo.utils.compilation_time_metrics`` (dynamo's per-phase timers; a private table: if it
    ever disappears, compilation stays inside ``compute`` and this returns 0)."""

    def __init__(self) -> None:
        self._seen = self._total()

    @staticmethod
    def _total() -> float:
        try:
            from torch._dynamo.utils import compilation_time_metrics as metrics
        except ImportError:  # pragma: no cover - a torch without the table
            return 0.0
        return float(sum(sum(metrics.get(k, ())) for k in _TIMERS))

    def take(self) -> float:
        now = self._total()
        took, self._seen = max(0.0, now - self._seen), now
        return took
