"""Which rank is behind when a hang is declared, not only which rank noticed it.

In synchronous training a rank stuck outside a collective (a stalled read, a slow disk, a bug in its own code)
leaves the others waiting inside the next one, and it is usually one of *them* whose watchdog fires first. So each
rank's watchdog thread publishes where its loop is (:class:`Where`: the last step done, the collectives entered,
the one it is in, the watchdog's phase) in ``RUN_DIR/hangwatch.rank<R>.json``, written atomically, at most once a
cycle (a second) and only when it changed; the loop itself only counts (``Strategy.collectives``). The rank that
declares a hang reads the others' files (a file of the run dir is input: checked for its shape,
``statefile.HANGWATCH``) and names the rank(s) at an earlier (step, collectives entered) than the rest
(:func:`behind`). The step tells most cases apart; the count tells apart ranks at the same step (every rank enters
the same collectives in the same order: the gradient reduce, the strategy's small ones).

No collective is used: the peers are the ones that may be stuck in one. The run dir is shared by the job's nodes
(as for ``nodes.json``); a file another attempt left is removed when this rank's watchdog starts.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from typing import Sequence

from pitstop.statefile import HANGWATCH, Damaged, parse
from pitstop.telemetry.metrics import write_text_atomic

_LABEL = re.compile(r"[A-Za-z0-9_ .,'()+#-]{1,48}")  # what a label read back may be, to be put in a log line


@dataclass(frozen=True)
class Where:
    """Where one rank's loop is."""

    rank: int
    step: int  # the last step done
    collectives: int  # the collectives entered so far in this attempt
    inside: str | None = None  # the collective it is in (None: outside any)
    phase: str | None = None  # the hang watchdog's phase
    since: float | None = None  # (wall clock) when it got there, as its watchdog saw it

    @property
    def at(self) -> tuple[int, int]:
        return self.step, self.collectives


def path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"hangwatch.rank{rank}.json")


def forget(run_dir: str, rank: int) -> None:
    """This rank's file from an earlier attempt, removed (its peers must not read where it was then)."""
    try:
        os.remove(path(run_dir, rank))
    except FileNotFoundError:
        pass


def publish(run_dir: str, where: Where) -> None:
    doc = {"rank": where.rank, "step": where.step, "collectives": where.collectives, "inside": where.inside}
    doc.update(phase=where.phase, since=where.since if where.since is not None else time.time())
    write_text_atomic(path(run_dir, where.rank), json.dumps(doc), fsync=False)


def read(run_dir: str, rank: int) -> Where | str:
    """Rank ``rank``'s published place, or why there is none (a line's words)."""
    try:
        doc = parse(path(run_dir, rank), HANGWATCH)
    except FileNotFoundError:
        return "published nothing"
    except (OSError, Damaged) as e:
        return f"unreadable ({str(e)[:80]})"
    if doc["rank"] != rank:
        return f"unreadable (it names rank {doc['rank']})"
    return Where(
        rank, doc["step"], doc["collectives"], _label(doc.get("inside")), _label(doc.get("phase")), doc.get("since")
    )


def gather(run_dir: str, world_size: int, own: Where) -> tuple[list[Where], dict[int, str]]:
    """Every rank's place (``own``, this rank's, as it is now), and the ranks with none (why)."""
    places, missing = [own], {}
    for r in range(world_size):
        if r != own.rank:
            got = read(run_dir, r)
            if isinstance(got, Where):
                places.append(got)
            else:
                missing[r] = got
    return sorted(places, key=lambda w: w.rank), missing


def behind(places: Sequence[Where]) -> list[Where]:
    """The ranks at the earliest (step, collectives entered), when not every rank is there: the ones the others
    wait for. Empty when all are level or fewer than two are known."""
    if len(places) < 2:
        return []
    low = min(w.at for w in places)
    if all(w.at == low for w in places):
        return []
    return [w for w in places if w.at == low]


def describe(places: Sequence[Where], missing: dict[int, str] | None = None) -> str:
    """The clause of the hang's line: who is behind, where, and where the others are."""
    late, missing = behind(places), missing or {}
    if late:
        rest = [w for w in places if w not in late]
        who = _ranks([w.rank for w in late])
        text = f"{who} {'is' if len(late) == 1 else 'are'} behind: {_place(late)} (the others: {_place(rest)})"
    elif len(places) >= 2:
        text = f"no rank is behind: every rank {_place(places)}"
    else:
        text = "where the other ranks are is not known"
    if missing:
        text += "; " + "; ".join(f"rank {r} {why}" for r, why in sorted(missing.items()))
    return text


def table(places: Sequence[Where], missing: dict[int, str] | None = None, now: float | None = None) -> str:
    """Every rank's place, a line each (for ``hang.rank<R>.txt``)."""
    now, lines = time.time() if now is None else now, []
    for w in places:
        there = f" for {max(0.0, now - w.since):.0f} s" if w.since is not None else ""
        inside = f"in {w.inside}" if w.inside else "outside any collective"
        lines.append(
            f"rank {w.rank}: after step {w.step} and {w.collectives} collectives, {inside}, phase '{w.phase}'{there}"
        )
    lines += [f"rank {r}: {why}" for r, why in sorted((missing or {}).items())]
    return "\n".join(lines) + "\n"


def _place(ws: Sequence[Where]) -> str:
    """Where these ranks are: exactly if they are all at one place, else the range of their steps."""
    first = ws[0]
    if any((w.at, w.inside) != (first.at, first.inside) for w in ws):
        low, high = min(w.at for w in ws), max(w.at for w in ws)
        if low[0] != high[0]:
            return f"after steps {low[0]} to {high[0]} (not level)"
        return f"after step {low[0]} and {low[1]} to {high[1]} collectives (not level)"
    where = "in " + first.inside if first.inside else "outside any collective"
    where += f", in phase '{first.phase}'" if first.phase and not first.inside else ""
    return f"after step {first.step} and {first.collectives} collectives, {where}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def _label(value: str | None) -> str | None:
    """A label read back, as it may go in a log line (anything else: '?')."""
    if value is None:
        return None
    return value if _LABEL.fullmatch(value) else "?"
