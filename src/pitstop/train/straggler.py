"""Slow ranks (``trainer.straggler``): named, booked, and (``action=exclude``) left behind.

In synchronous training every rank waits for the slowest at each collective, so a slow rank's step takes as long as
everyone's, and its gradient all-reduce looks *fast* (the others are already there) while the healthy ranks' looks
slow. Step times cannot tell them apart: each rank times its own **work** per step apart from its waits in
collectives:

- ``strategy=ddp``: a hook on each parameter notes when its gradient is accumulated on this rank (as DDP's reducer
  marks it ready for its bucket; DDP's communication is untouched: bitwise the same steps); the work of the step's
  synced micro-batch is from its start (after the batch is fetched) to its last gradient ready (its last bucket); a
  ``no_sync`` micro-batch counts whole; the clipping and the optimizer step count too (no collective in them). A
  batch's fetch is no work.
  On CUDA the marks are CUDA events on the stream (the device's time, not the host's, which runs ahead), read once
  the step's end has synchronised; the optimizer is left out there (the host only queues it). Not yet run on a GPU.
- ``strategy=single``: one rank has no peer to compare with: the detector says once it is off.
- ``strategy=fsdp``: its all-gathers and reduce-scatters run inside forward and backward, so a rank's work cannot be
  told from its waits without timing every collective: not covered (said once, and in ``summary.json``).

Every ``window`` steps the ranks share their window's work (its sum, its median step: the rank's pace, and the
window's wall clock) in one all-gather of three numbers per rank (:meth:`Stragglers.after_step`), and every rank
feeds the same figures to the same pure :class:`Detector`: a rank whose pace is above ``factor`` x the median of the
*other* ranks' for ``windows`` windows in a row is named (a median step: a burst of slow steps that another process
on a shared machine causes does not name a rank; a slow device slows every step),
in one log line (rank, node, how much slower, since which step), in ``metrics.jsonl`` (an ``"event": "straggler"``
line the time line marks), in the tracker and in ``summary.json``'s ``straggler`` section.

Booked: the ledger's ``straggler`` bucket holds what the job lost waiting for its slowest rank, i.e. what its
steps would have taken at the median (other) ranks' pace: over the named rank's slow windows (the first ones of the
run included, once it is confirmed), its work minus the median of the others' (at most the slowest rank's per
window: the job waits for one rank at a time). Every rank moves it out of ``compute`` in its own ledger (rank 0's
is the one ``goodput.json`` holds).

``action=exclude``: a named rank slow for longer than ``exclude_after_seconds`` (the wall clock of its slow
windows, as gathered: every rank decides the same at the same window) is treated as a failed node: the job saves
and waits until the save is durable, rank 0 records the node in ``RUN_DIR/nodes.json``
(``node_book.exclude(..., by="straggler")``), the decision is logged once, the excluded node's ranks exit with
``node_book.EXCLUDED_EXIT`` (:class:`NodeExcluded`) and the others with ``node_book.REFORM_EXIT`` (:class:`Reform`):
the launchers re-form the job without the node.

The interface other detectors build on (``strategy=ft``'s groups): :class:`Detector` takes each window's figures
(``Detector.window(first_step, last_step, work, wall, pace)``: per member, in the same order everywhere, its work
summed over the window and, optionally, its median step) and returns a :class:`Verdict` (the members named, those
well again, the seconds newly booked); it holds no clock and no process group. :class:`Stragglers` is the ranks'
side (timing, the all-gather, the log, the booking) for the strategies whose ranks are the members.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

from pitstop.goodput.ledger import Ledger
from pitstop.resilience.node_book import REFORM_EXIT, NodeExcluded, exclude, node_name
from pitstop.strategy.base import Strategy

log = logging.getLogger("pitstop")


# ---- the decision (pure) -------------------------------------------------------------------------------------


@dataclass
class Flag:
    """A member (a rank) named slow: ``since`` the first step of its first slow window in a row, ``ratio`` its pace
    over the median of the others' in its latest slow window, ``windows`` its slow windows, ``seconds`` what the job
    lost waiting for it (booked), ``slow_seconds`` the wall clock since its first slow window, ``until`` the last
    step of its last slow window once it is well again (as many windows in a row as it took to name it; None: still
    slow). While it is named, the job's wait for it in each window is booked, also in a window of noise below the
    factor."""

    rank: int
    since: int
    ratio: float
    windows: int
    seconds: float = 0.0
    slow_seconds: float = 0.0
    node: str = ""
    until: int | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ratio=round(self.ratio, 4), seconds=round(self.seconds, 4), slow_seconds=round(self.slow_seconds, 3))
        return d


@dataclass
class Verdict:
    """What one window changed: the members named in it (``named``), those well again (``recovered``), and the
    seconds newly booked as lost waiting (``booked``)."""

    named: list[Flag] = field(default_factory=list)
    recovered: list[Flag] = field(default_factory=list)
    booked: float = 0.0


@dataclass
class _Run:
    """A member's slow windows in a row (not yet named: their excess waits in ``pending``)."""

    since: int
    windows: int = 0
    wall: float = 0.0
    pending: list[tuple[int, float]] = field(default_factory=list)  # (window's last step, excess seconds)
    well: int = 0  # (named) windows in a row not slow since its last slow one
    last_slow: int = 0  # the last step of its last slow window
    ratio: float = 0.0  # its pace over the others' in its last slow window
    flag: Flag | None = None


def median_of_others(work: Sequence[float], i: int) -> float:
    """The median of every member's figure but member ``i``'s."""
    return float(statistics.median([w for j, w in enumerate(work) if j != i]))


class Detector:
    """Slow members, from each window's work figures: fed the same figures in the same order, it decides the same
    on every rank. ``factor`` (> 1): slow is above ``factor`` x the median of the others; ``windows``: in a row
    before a member is named."""

    def __init__(self, factor: float, windows: int):
        self.factor, self.windows = float(factor), int(windows)
        self.runs: dict[int, _Run] = {}
        self.flags: list[Flag] = []  # every member named, in order (a member named again is a new flag)
        self.lost: dict[int, float] = {}  # per window (its last step): what the job lost waiting (the slowest's)
        self.checked = 0  # windows compared
        self.max_ratio = 0.0  # the highest work / median of the others' seen in a window (how close a clean run came)

    @property
    def booked(self) -> float:
        """Seconds lost waiting for slow members, over the whole run so far."""
        return sum(self.lost.values())

    def window(
        self,
        first_step: int,
        last_step: int,
        work: Sequence[float],
        wall: float = 0.0,
        pace: Sequence[float] | None = None,
        ids: Sequence[int] | None = None,
    ) -> Verdict:
        """Steps ``first_step``..``last_step``: each member's work (seconds, summed over the window) and the window's
        wall clock; ``pace``: each member's typical step (the median of its steps' work), which decides who is slow
        (a burst of a few slow steps, another process's on a shared machine, does not move it); without it the sums
        decide. What is booked is always of the sums: the time actually lost. ``ids``: each member's own id, when the
        members change from window to window (replica groups in and out of the quorum; default: its place)."""
        out = Verdict()
        if len(work) < 2:
            return out
        self.checked += 1
        before = self.booked
        pace = work if pace is None else pace
        for i, w in enumerate(work):
            member = i if ids is None else ids[i]
            others, typical = median_of_others(work, i), median_of_others(pace, i)
            ratio = pace[i] / typical if typical > 0 else 0.0
            slow = ratio > self.factor
            self.max_ratio = max(self.max_ratio, ratio)
            run = self.runs.get(member)
            if not slow:
                if run is None or run.flag is None:  # (not named: its slow windows were not in a row)
                    self.runs.pop(member, None)
                    continue
                run.well += 1
                if run.well >= self.windows:  # (well again as long as it took to be named: noise does not end it)
                    run.flag.until = run.last_slow
                    out.recovered.append(run.flag)
                    del self.runs[member]
                    continue
            else:
                if run is None:
                    run = self.runs[member] = _Run(since=first_step)
                run.windows, run.well, run.last_slow, run.ratio = run.windows + 1, 0, last_step, ratio
            run.wall += wall
            run.pending.append((last_step, max(0.0, w - others)))
            if run.flag is None and run.windows >= self.windows:
                run.flag = Flag(member, run.since, run.ratio, run.windows)
                self.flags.append(run.flag)
                out.named.append(run.flag)
            if run.flag is not None:
                run.flag.ratio, run.flag.windows, run.flag.slow_seconds = run.ratio, run.windows, run.wall
                for at, excess in run.pending:  # (the job waits for its slowest member: one per window)
                    if excess > self.lost.get(at, 0.0):
                        run.flag.seconds += excess - self.lost.get(at, 0.0)
                        self.lost[at] = excess
                run.pending.clear()
        out.booked = self.booked - before
        return out

    def overdue(self, seconds: float) -> Flag | None:
        """The first named member still slow for longer than ``seconds`` (its slow windows' wall clock)."""
        return next((r.flag for r in self.runs.values() if r.flag is not None and r.wall > seconds), None)


# ---- the measurement and the exchange ------------------------------------------------------------------------


def covered(strategy: Strategy, enabled: bool, hooked: bool) -> str:
    """What the detector compares under ``strategy`` (its first log line, ``summary.json``)."""
    if not enabled:
        return "off (trainer.straggler.enabled=false)"
    if strategy.name == "ft":
        return "nothing: strategy=ft's replica groups are not covered yet"
    if strategy.world_size < 2:
        return "nothing: one rank has no peer to compare with"
    if strategy.name == "fsdp":
        return (
            "nothing: strategy=fsdp's collectives run inside forward and backward, its work cannot be told from "
            "its waits (not covered)"
        )
    if not hooked:
        return f"nothing: strategy={strategy.name} does not say when its gradients are ready"
    return f"the work of {strategy.world_size} ranks (forward, backward to the last gradient ready, optimizer)"


class Reform(Exception):
    """A node was excluded at run time and this rank's state is saved: the launcher starts it again at once and the
    job re-forms without that node (exit status ``node_book.REFORM_EXIT``; not a failure)."""

    exit_code = REFORM_EXIT


class Stragglers:
    """The detector as the loop holds it: ``start()`` after a micro-batch's fetch, ``stop(synced)`` after its
    backward (``synced``: the micro-batch whose backward reduced the gradients), ``extra(seconds)`` for more work of
    the step (the optimizer), ``after_step(step)`` after each applied step (every ``window`` steps: the all-gather
    and the decision; returns the :class:`Verdict`, or None)."""

    def __init__(self, settings: Any, strategy: Strategy, model: torch.nn.Module, event: Callable[[int, dict], None]):
        """``settings``: ``trainer.straggler``; ``event(step, fields)``: a named or recovered rank, to
        ``metrics.jsonl`` and the tracker."""
        self.settings, self.strategy, self.event = settings, strategy, event
        self.window = int(settings.window)
        self.detector = Detector(settings.factor, settings.windows)
        self._ready: Any = None  # when this rank's latest gradient was ready
        self._end: Any = None  # (CUDA) the micro-batch's one event for that, recorded again at each gradient
        # On CUDA the host runs ahead of the device: the marks are CUDA events on the current stream, read after the
        # step's end has synchronised (``_spans``); on the CPU the clock itself.
        self._cuda = strategy.device.type == "cuda"
        self._spans: list[tuple[Any, Any]] = []
        self.on = self._measures(settings, strategy, model)
        self.covered = self._covers(settings, strategy)
        self.nodes = strategy.all_gather_object(node_name()) if self.on else [node_name()]
        self._work = 0.0  # this window's work so far (this rank)
        self._steps: list[float] = []  # its steps' work (their median: this rank's pace in the window)
        self._step_work = 0.0  # the step's so far
        self._t = 0.0
        self._since = time.perf_counter()
        self._first = 1  # the window's first step
        self.exchange_seconds = 0.0  # the all-gathers' time (the detector's own cost, with the windows' decisions)
        self._fresh = True  # the attempt's first step (lazy set-up, cold caches) is no measure of a rank's pace
        if settings.enabled and strategy.is_main:
            log.info("straggler detection: %s", self.covered)

    def _measures(self, settings: Any, strategy: Strategy, model: torch.nn.Module) -> bool:
        """Whether this rank's work is timed and compared (its gradients watched where a collective ends them)."""
        able = settings.enabled and strategy.world_size > 1 and strategy.name not in ("ft", "fsdp")
        return bool(able and strategy.watch_gradients(model, self._gradient_ready))

    def _covers(self, settings: Any, strategy: Strategy) -> str:
        return covered(strategy, settings.enabled, self.on)

    def _now(self) -> Any:
        if self._cuda:
            mark = torch.cuda.Event(enable_timing=True)
            mark.record()
            return mark
        return time.perf_counter()

    def _gradient_ready(self) -> None:
        if self._cuda:  # (one event per micro-batch, not one per parameter: its last record is the one read)
            self._end.record()
            self._ready = self._end
        else:
            self._ready = time.perf_counter()

    def start(self) -> None:
        if self.on:
            self._ready = None
            self._t = self._now()
            if self._cuda:
                self._end = torch.cuda.Event(enable_timing=True)

    def stop(self, synced: bool) -> None:
        if self.on:
            end = self._ready if synced and self._ready is not None else self._now()
            if self._cuda:
                self._spans.append((self._t, end))
            else:
                self._step_work += end - self._t

    def extra(self, seconds: float) -> None:
        """More of the step's work, timed by the host (on CUDA left out: the host only queued it)."""
        if not self._cuda:
            self._step_work += seconds

    def discard(self) -> None:
        """The step was not applied (skipped, discarded): its work is not compared."""
        self._step_work = 0.0
        self._spans.clear()

    def restarted(self, step: int) -> None:
        """The loop goes on from ``step`` (a resume, a rollback): a new window starts after it."""
        self._work, self._step_work, self._first, self._since = 0.0, 0.0, step + 1, time.perf_counter()
        self._fresh = True
        self._spans.clear()
        self._steps.clear()

    def after_step(self, step: int) -> Verdict | None:
        if not self.on or not self._take(step) or step % self.window:
            return None
        t = time.perf_counter()
        wall = t - self._since
        pace = statistics.median(self._steps) if self._steps else 0.0
        mine = torch.tensor([self._work, pace, wall], dtype=torch.float64, device=self.strategy.device)
        rows = [r.tolist() for r in self.strategy.all_gather(mine)]
        work, paces, wall = [r[0] for r in rows], [r[1] for r in rows], max(r[2] for r in rows)
        verdict = self.detector.window(self._first, step, work, wall, paces)
        self.exchange_seconds += time.perf_counter() - t
        log.debug("straggler window %d..%d: work %s, pace %s, wall %.4f", self._first, step, work, paces, wall)
        self._work, self._first, self._since = 0.0, step + 1, time.perf_counter()
        self._steps.clear()
        for flag in verdict.named:
            flag.node = self.nodes[flag.rank] if flag.rank < len(self.nodes) else ""
            self._say(flag, step)
        for flag in verdict.recovered:
            if self.strategy.is_main:
                log.info("straggler: rank %d (node %s) is well again after step %d", flag.rank, flag.node, flag.until)
            self.event(step, {"rank": flag.rank, "node": flag.node, "recovered": True, "until": flag.until})
        return verdict

    def _take(self, step: int) -> bool:
        """The step's work into the window's; False for the attempt's first step (not compared: the window starts
        after it)."""
        if self._spans:  # (CUDA: the step's end synchronised with the device, its events are done)
            self._spans[-1][1].synchronize()  # (done already: loss.item() waited for the stream)
            self._step_work += sum(a.elapsed_time(b) for a, b in self._spans) / 1e3
            self._spans.clear()
        if self._fresh:
            self._fresh, self._step_work, self._first, self._since = False, 0.0, step + 1, time.perf_counter()
            return False
        self._work += self._step_work
        self._steps.append(self._step_work)
        self._step_work = 0.0
        return True

    def _say(self, flag: Flag, step: int) -> None:
        if self.strategy.is_main:
            log.warning(
                "straggler: rank %d (node %s) works %.2fx as long as the median of the other ranks since step %d "
                "(%d windows of %d steps in a row, factor %g); the job waits for it: %.2f s lost so far "
                "(ledger: straggler); action=%s",
                flag.rank, flag.node, flag.ratio, flag.since, flag.windows, self.window, self.settings.factor,
                flag.seconds, self.settings.action,
            )  # fmt: skip
        self.event(step, {"rank": flag.rank, "node": flag.node, "since": flag.since, "ratio": round(flag.ratio, 4)})

    def book(self, ledger: Ledger, verdict: Verdict | None) -> None:
        """The seconds this window booked, out of ``compute`` into ``straggler`` (at most what compute holds)."""
        if verdict is not None and verdict.booked > 0:
            ledger.move("compute", "straggler", min(verdict.booked, max(0.0, ledger.seconds["compute"])))

    def overdue(self) -> Flag | None:
        """(``action=exclude``) The named rank slow for longer than ``exclude_after_seconds``, if any."""
        if not self.on or self.settings.action != "exclude":
            return None
        return self.detector.overdue(float(self.settings.exclude_after_seconds))

    def leave(self, flag: Flag, run_dir: str, step: int) -> BaseException:
        """(``action=exclude``, after the save is durable) What this rank leaves with (:func:`leave`)."""
        return leave(flag, self.strategy, run_dir, step)

    def stats(self) -> dict[str, Any]:
        """``summary.json``'s ``straggler`` section."""
        return {
            "covered": self.covered,
            "window": self.window,
            "factor": float(self.settings.factor),
            "windows": int(self.settings.windows),
            "action": str(self.settings.action),
            "checked": self.detector.checked,
            "max_ratio": round(self.detector.max_ratio, 4),
            "exchange_seconds": round(self.exchange_seconds, 4),
            "flags": [f.as_dict() for f in self.detector.flags],
            "seconds": round(self.detector.booked, 4),
        }


def leave(flag: Flag, strategy: Strategy, run_dir: str, step: int) -> BaseException:
    """(``action=exclude``, after the save is durable) Rank 0 records ``flag``'s node as excluded; the exception this
    rank leaves with: :class:`NodeExcluded` on that node, :class:`Reform` elsewhere."""
    why = (
        f"rank {flag.rank} was slow ({flag.ratio:.2f}x the median of the other ranks) since step {flag.since} for "
        f"{flag.slow_seconds:.1f} s, more than trainer.straggler.exclude_after_seconds"
    )
    if strategy.is_main:
        if exclude(run_dir, flag.node, why, by="straggler"):
            log.warning("straggler: node %s excluded from the job after step %d: %s; the job re-forms", flag.node,
                        step, why)  # fmt: skip
    strategy.barrier()  # (the book is written before any rank leaves)
    if node_name() == flag.node:
        return NodeExcluded(f"node {flag.node} excluded after step {step}: {why}")
    return Reform(f"node {flag.node} excluded after step {step} (saved): the job re-forms without it")
