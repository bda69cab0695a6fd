"""``ckpt=none``: never saves, never resumes (each run starts from step 0)."""

from __future__ import annotations

from typing import Any


class NoCheckpoint:
    name = "none"

    def __init__(self, **_: Any):
        pass

    def bind(self, runner: Any) -> None:
        pass

    def wait_staging(self) -> float:
        return 0.0

    def restore(self, state: Any) -> int | None:
        """Load the newest complete checkpoint into ``state``; return its step, or None to start fresh."""
        return None

    def maybe_save(self, state: Any, step: int, *, last: bool = False) -> float:
        """Save if due; return the seconds the training loop was blocked."""
        return 0.0

    def close(self) -> None:
        """Wait for in-flight saves; raise if one failed."""

    def stats(self) -> dict:
        return {}
