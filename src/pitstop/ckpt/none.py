"""``ckpt=none``: never saves, never resumes (each run starts from step 0) — a full :class:`Checkpointer`."""

from __future__ import annotations

from typing import Any, Callable

from pitstop.ckpt.contract import Checkpointer, SaveResult, Target


class NoCheckpoint(Checkpointer):
    name = "none"

    def __init__(
        self,
        *,
        dir: Any = None,
        interval_steps: Any = None,
        interval_seconds: Any = None,
        interval: Any = None,
        mtbf_seconds: Any = None,
        keep_last_k: Any = None,
        save_last: Any = None,
        load: Any = None,
        load_model_only: Any = None,
        on_error: Any = None,
        throttle_mbps: Any = None,
        storage_options: Any = None,
        local: Any = None,
    ):
        """The saving backends' keys are accepted and unused: ``conf/ckpt/none.yaml`` carries them so that a sweep
        over ``ckpt=none,async_dcp ckpt.interval=auto`` composes. Any other key is refused."""
        self.root, self.last_started = None, None

    def setup(self, strategy: Any, report: Callable[[dict, int], None], intervals: Any = None) -> None:
        pass

    def restore(self, target: Target) -> int | None:
        return None

    def maybe_save(self, target: Target, step: int, *, last: bool = False, force: bool = False) -> SaveResult:
        return SaveResult()

    def wait_staging(self) -> float:
        return 0.0

    def wait(self) -> float:
        return 0.0

    def poll(self) -> None:
        pass

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        return {"backend": self.name, "saves": 0, "failures": 0}
