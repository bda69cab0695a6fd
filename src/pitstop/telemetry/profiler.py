"""``trainer.profile``: a torch.profiler trace of a window of steps, written to ``RUN_DIR/profile/``.

    python -m recipe.train trainer.profile.steps=[20,25]            # -> profile/trace.rank0.steps20-25.json
    python -m recipe.train trainer.profile.steps=[20,25] trainer.profile.memory=true

The trace is Chrome/Perfetto JSON (open it at ui.perfetto.dev or chrome://tracing). ``memory=true`` adds
allocations to the trace and, on CUDA, writes a memory snapshot (``memory.rank{R}.pickle``, for
pytorch.org/memory_viz).  Off by default: then nothing here runs in the loop beyond two integer compares.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pitstop.errors import ConfigError

if TYPE_CHECKING:
    from torch.profiler import profile

log = logging.getLogger("pitstop.profile")


class StepProfiler:
    def __init__(
        self, steps: Sequence[int] | None, memory: bool, run_dir: str, rank: int, device: torch.device, total_steps: int
    ):
        self.window: tuple[int, int] | None = None
        self.memory, self.rank, self.device = bool(memory), rank, device
        self.dir = os.path.join(run_dir, "profile")
        self._prof: profile | None = None
        if steps is None:
            return
        if (
            isinstance(steps, (str, bytes))
            or not hasattr(steps, "__len__")
            or len(steps) != 2
            or any(isinstance(s, bool) or not isinstance(s, int) for s in steps)
        ):
            shown = list(steps) if hasattr(steps, "__iter__") and not isinstance(steps, str) else steps
            raise ConfigError(f"trainer.profile.steps must be [start, end] (two step numbers), got {shown!r}")
        start, end = int(steps[0]), int(steps[1])
        if not 1 <= start <= end:
            raise ConfigError(f"trainer.profile.steps=[{start}, {end}]: need 1 <= start <= end")
        if end > total_steps:
            raise ConfigError(
                f"trainer.profile.steps=[{start}, {end}] ends past the last step ({total_steps}); "
                f"choose a window within 1..{total_steps}"
            )
        self.window = (start, end)

    def before_step(self, step: int) -> None:
        """``step``: the step about to run."""
        if self.window is None or step < self.window[0]:
            return
        if step > self.window[0]:  # resumed past the window's start: nothing to profile in this attempt
            if step <= self.window[1] and self._prof is None and not getattr(self, "_told", False):
                log.warning(
                    "trainer.profile.steps=[%d, %d]: this attempt starts at step %d, inside the window; "
                    "no trace (profile a later window)",
                    *self.window,
                    step,
                )
                self._told = True
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        if self.memory and self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        self._prof = profile(activities=activities, record_shapes=True, profile_memory=self.memory, with_stack=False)
        self._prof.__enter__()
        log.info("profiling steps %d-%d", *self.window)

    def after_step(self, step: int) -> None:
        if self._prof is not None and step >= self.window[1]:
            self._stop()

    def _stop(self) -> None:
        prof, self._prof = self._prof, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        prof.__exit__(None, None, None)
        os.makedirs(self.dir, exist_ok=True)
        start, end = self.window
        path = os.path.join(self.dir, f"trace.rank{self.rank}.steps{start}-{end}.json")
        prof.export_chrome_trace(path)
        log.info("profiler trace: %s", path)
        if self.memory and self.device.type == "cuda":
            snap = os.path.join(self.dir, f"memory.rank{self.rank}.pickle")
            torch.cuda.memory._dump_snapshot(snap)
            torch.cuda.memory._record_memory_history(enabled=None)
            log.info("CUDA memory snapshot: %s", snap)

    def close(self) -> None:
        """The run ended inside the window (a failure): keep what was recorded."""
        if self._prof is not None:
            self._stop()
