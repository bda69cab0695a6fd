"""Which rank's failure explains the others: torch's agent reports the first failure it noticed, which may be a
peer that only lost the rank that really died."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping

from pitstop.resilience.preempt import PREEMPTED_EXIT

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from pitstop.resilience.watchdog import HUNG_EXIT


def first_line_of(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[0][:200] if lines else "no message"


# A rank that failed only because a peer went away: what it says explains nothing.
_LOST_PEER = (
    "connection closed by peer",
    "connection reset by peer",
    "remote worker crashing",
    "broken pipe",
    "communicator was aborted",
)


def lost_peer(message: str) -> bool:
    return any(p in message.lower() for p in _LOST_PEER)


def root_failure(failures: Mapping[int, Any]) -> tuple[int, Any]:
    """The failure that explains the others: a preempted or hung rank, else one killed or failing on its own,
    before ranks that then lost their peer (the earliest of a kind; a killed rank's exit may be noticed after
    its peer's error, so the earliest failure alone can name the wrong rank)."""

    def rank_of(item: tuple[int, Any]) -> tuple[int, float]:
        failure = item[1]
        code = getattr(failure, "exitcode", None)
        kind = 0 if code in (PREEMPTED_EXIT, HUNG_EXIT) else 2 if lost_peer(first_line(failure)) else 1
        return kind, float(getattr(failure, "timestamp", 0) or 0)

    return min(failures.items(), key=rank_of)


def silent_ranks(log_dir: str, run_id: str, n: int, reported: int) -> list[int]:
    """The ranks of this launch's last attempt that left no error file (the agent's logs under ``log_dir``):
    ranks that did not raise but died, by a signal. The agent reports one failure, the first it noticed; a
    SIGKILLed rank's exit may be noticed after the error of the peer that lost it."""
    import glob

    attempts = glob.glob(os.path.join(glob.escape(log_dir), f"{glob.escape(run_id)}_*", "attempt_*"))
    if not attempts:
        return []
    last = max(attempts, key=lambda d: int(d.rsplit("_", 1)[1]) if d.rsplit("_", 1)[1].isdigit() else -1)
    return [r for r in range(n) if r != reported and not os.path.exists(os.path.join(last, str(r), "error.json"))]


def first_line(failure: ProcessFailure) -> str:
    msg = getattr(failure, "message", None) or ""
    if isinstance(msg, dict):
        msg = msg.get("message", "") or str(msg)
    lines = [ln for ln in str(msg).splitlines() if ln.strip()]
    code = getattr(failure, "exitcode", None)
    return (lines[-1][:300] if lines else "no message") + (f", exit code {code}" if code is not None else "")
