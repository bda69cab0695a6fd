"""``ckpt=none``: never saves, never resumes (each run starts from step 0) — a full :class:`Checkpointer`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from pitstop.ckpt.contract import Checkpointer, SaveResult, StrategyLike, Target

if TYPE_CHECKING:
    from pitstop.goodput.interval import IntervalPolicy


class NoCheckpoint(Checkpointer):
    name = "none"

    def __init__(
        self,
        *,
        dir: object = None,
        interval_steps: object = None,
        interval_seconds: object = None,
        interval: object = None,
        mtbf_seconds: object = None,
        keep_last_k: object = None,
        save_last: object = None,
        load: object = None,
        load_model_only: object = None,
        on_error: object = None,
        throttle_mbps: object = None,
        storage_options: object = None,
        local: object = None,
    ):
        """The saving backends' keys are accepted and unused: ``conf/ckpt/none.yaml`` carries them so that a sweep
        over ``ckpt=none,async_dcp ckpt.interval=auto`` composes. Any other key is refused."""
        self.root, self.last_started = None, None

    def setup(
        self,
        strategy: StrategyLike,
        report: Callable[[dict, int], None],
        intervals: IntervalPolicy | None = None,
        node: str | None = None,
    ) -> None:
        pass

    def restore(self, target: Target, at_most: int | None = None) -> int | None:
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
