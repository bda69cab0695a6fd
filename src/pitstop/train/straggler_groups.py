"""``trainer.straggler`` under ``strategy=ft``: a slow replica group told apart from a slow rank inside a group.

- **Inside a group** of several ranks, its ranks are compared as under ``strategy=ddp`` (the :class:`Stragglers`
  detector, on the group's own process group, one all-gather per window): "rank r of replica group K is slow".
- **Across groups**, each group's *pace* is compared: its slowest rank's typical step of work in the window (its
  ranks wait for that one, and every group waits for the slowest group at the cross-group all-reduce), carried from
  each group to the others by one ``groups.gather`` per window (rank r of each group meets rank r of the others;
  every rank of a group sends its group's figures): "replica group K is slow". A group's work is counted per step: a
  group that healed in during a window measured fewer of its steps than the others. A group with nothing measured
  (the first step of its attempt) sends none and is left out of that window.

Every group calls the gather at each window's last step, measured or not: it is a collective of the step's quorum.
The same pure :class:`~pitstop.train.straggler.Detector` decides, keyed by replica id (the quorum's groups change).

Booked, in each group's ledger, per window: what that group lost waiting, i.e. the slowest group's work over the
median of the other groups' (every group's step takes as long as the slowest group's, the slow group's own
included) or, when larger, what it lost inside the group waiting for a slow rank of its own: one wait is not booked
twice.

``action=exclude``: the slow group, slow for longer than ``exclude_after_seconds``, leaves the quorum: it saves if it
writes the durable checkpoints (as the Runner does before any exclusion), says why once and exits with
``REFORM_EXIT`` (:class:`~pitstop.train.straggler.Reform`); its supervisor starts it again and the new attempt
rejoins by healing from a live peer (``strategy=ft``'s join). The other groups go on without it
(``strategy.min_replicas`` permitting) or wait for it in their quorum. The cost is booked where a group's restart's
is: the leaving group's restart, set-up and heal in its own ledger, the others' wait in ``quorum``. A slow rank inside
a group makes its group slow: the group leaves, not the rank.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Callable

import torch

from pitstop.strategy.base import Strategy
from pitstop.strategy.groups import ReplicaGroups
from pitstop.train.straggler import Detector, Flag, Reform, Stragglers, Verdict

log = logging.getLogger("pitstop")


def build(
    settings: Any, strategy: Strategy, groups: ReplicaGroups, model: torch.nn.Module, event: Callable[[int, dict], None]
) -> Stragglers:
    """The detector for this job: across replica groups too under ``strategy=ft``."""
    if groups.replica_id is not None:
        return GroupStragglers(settings, strategy, groups, model, event)
    return Stragglers(settings, strategy, model, event)


class GroupStragglers(Stragglers):
    """:class:`Stragglers` inside the group (``detector``), and a second detector across the groups (``across``)."""

    def __init__(
        self,
        settings: Any,
        strategy: Strategy,
        groups: ReplicaGroups,
        model: torch.nn.Module,
        event: Callable[[int, dict], None],
    ):
        self.groups = groups
        self.across = Detector(settings.factor, settings.windows)
        self._said_leaving = False
        super().__init__(settings, strategy, model, event)

    def _measures(self, settings: Any, strategy: Strategy, model: torch.nn.Module) -> bool:
        if not settings.enabled or (self.groups.replicas < 2 and strategy.world_size < 2):
            return False
        if strategy.world_size == 1:
            return True  # (no collective in its backward: its work is its forward and backward)
        return bool(strategy.watch_gradients(model, self._gradient_ready))

    def _covers(self, settings: Any, strategy: Strategy) -> str:
        if not settings.enabled:
            return "off (trainer.straggler.enabled=false)"
        if not self.on:
            if self.groups.replicas < 2 and strategy.world_size < 2:
                return "nothing: one replica group of one rank has no peer to compare with"
            inner = getattr(getattr(strategy, "inner", None), "name", strategy.name)
            return f"nothing: the group's strategy ({inner}) does not say when its gradients are ready (not covered)"
        inside = f", and inside each group its {strategy.world_size} ranks" if strategy.world_size > 1 else ""
        return f"the pace of {self.groups.replicas} replica groups (each its slowest rank's work){inside}"

    def after_step(self, step: int) -> Verdict | None:
        if not self.on:
            return None
        self._take(step)
        if step % self.window:
            return None
        t = time.perf_counter()
        wall, steps = t - self._since, len(self._steps)
        pace = statistics.median(self._steps) if steps else 0.0
        per_step = self._work / steps if steps else 0.0
        inside = Verdict()
        if self.strategy.world_size > 1:  # the group's ranks: the ddp detector, and the group's figures (its slowest)
            mine = torch.tensor(
                [self._work, pace, wall, float(steps)], dtype=torch.float64, device=self.strategy.device
            )
            rows = [r.tolist() for r in self.strategy.all_gather(mine)]
            if all(r[3] > 0 for r in rows):
                work, paces = [r[0] for r in rows], [r[1] for r in rows]
                inside = self.detector.window(self._first, step, work, max(r[2] for r in rows), paces)
            pace = max((r[1] for r in rows if r[3] > 0), default=0.0)
            per_step = max((r[0] / r[3] for r in rows if r[3] > 0), default=0.0)
        across = self._across(step, pace, per_step, wall)
        self.exchange_seconds += time.perf_counter() - t
        self._work, self._first, self._since = 0.0, step + 1, time.perf_counter()
        self._steps.clear()
        for flag in inside.named:
            self._say(flag, step)
        for flag in across.named:
            self._say_group(flag, step)
        for flag in inside.recovered + across.recovered:
            group = flag in across.recovered
            who = (
                f"replica group {flag.rank}" if group else f"rank {flag.rank} of replica group {self.groups.replica_id}"
            )
            if self.strategy.is_main:
                log.info("straggler: %s is well again after step %s", who, flag.until)
            key = "replica" if group else "rank"
            self.event(step, {key: flag.rank, "recovered": True, "until": flag.until, "group": group})
        return Verdict(
            inside.named + across.named, inside.recovered + across.recovered, max(inside.booked, across.booked)
        )

    def _across(self, step: int, pace: float, per_step: float, wall: float) -> Verdict:
        """This group's figures to every group of the step's quorum, theirs back; the cross-group detector's window."""
        k = float(self.groups.replica_id)
        mine = torch.tensor([k, pace, per_step, wall], dtype=torch.float64, device=self.strategy.device)
        rows = self.groups.gather(mine)
        if rows is None:  # (a peer failed during it: this window compares nothing across groups)
            return Verdict()
        known = [r for r in (row.tolist() for row in rows) if r[1] > 0 and r[2] > 0]
        if len(known) < 2:
            return Verdict()
        steps = step - self._first + 1
        ids, paces, work = [int(r[0]) for r in known], [r[1] for r in known], [r[2] * steps for r in known]
        log.debug("straggler groups %d..%d: ids %s, pace %s, work %s", self._first, step, ids, paces, work)
        return self.across.window(self._first, step, work, max(r[3] for r in known), paces, ids=ids)

    def _say(self, flag: Flag, step: int) -> None:
        k = self.groups.replica_id
        flag.node = self.nodes[flag.rank] if flag.rank < len(self.nodes) else ""
        if self.strategy.is_main:
            log.warning(
                "straggler: rank %d of replica group %d (node %s) works %.2fx as long as the median of the group's "
                "other ranks since step %d (%d windows of %d steps in a row, factor %g); its group waits for it: "
                "%.2f s lost so far (ledger: straggler)",
                flag.rank, k, flag.node, flag.ratio, flag.since, flag.windows, self.window, self.settings.factor,
                flag.seconds,
            )  # fmt: skip
        self.event(step, {"rank": flag.rank, "replica": k, "since": flag.since, "ratio": round(flag.ratio, 4)})

    def _say_group(self, flag: Flag, step: int) -> None:
        if self.strategy.is_main:
            log.warning(
                "straggler: replica group %d%s is slow: its pace (its slowest rank's work) is %.2fx the median of the "
                "other groups' since step %d (%d windows of %d steps in a row, factor %g); every group waits for it: "
                "%.2f s lost so far (ledger: straggler); action=%s",
                flag.rank, " (this group)" if flag.rank == self.groups.replica_id else "", flag.ratio, flag.since,
                flag.windows, self.window, self.settings.factor, flag.seconds, self.settings.action,
            )  # fmt: skip
        self.event(step, {"replica": flag.rank, "since": flag.since, "ratio": round(flag.ratio, 4), "group": True})

    def overdue(self) -> Flag | None:
        """(``action=exclude``) This group's flag, when it is the group slow for longer than ``exclude_after_seconds``
        (only the slow group leaves the quorum; the others go on)."""
        if not self.on or self.settings.action != "exclude":
            return None
        flag = self.across.overdue(float(self.settings.exclude_after_seconds))
        return flag if flag is not None and flag.rank == self.groups.replica_id else None

    def leave(self, flag: Flag, run_dir: str, step: int) -> BaseException:
        """This group leaves the quorum (said once, by its rank 0); it rejoins by healing from a live peer when its
        supervisor starts it again."""
        why = (
            f"replica group {flag.rank} was slow ({flag.ratio:.2f}x the median pace of the other groups) since step "
            f"{flag.since} for {flag.slow_seconds:.1f} s, more than trainer.straggler.exclude_after_seconds"
        )
        if self.strategy.is_main and not self._said_leaving:
            log.warning(
                "straggler: replica group %d leaves the quorum after step %d: %s; it restarts and rejoins by healing "
                "from a live peer",
                flag.rank,
                step,
                why,
            )
        self._said_leaving = True
        return Reform(f"replica group {flag.rank} left the quorum after step {step} (slow); it rejoins by healing")

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        flags = [
            {"replica": f.rank, **{k: v for k, v in f.as_dict().items() if k != "rank"}} for f in self.across.flags
        ]
        out["groups"] = {
            "replica": self.groups.replica_id,
            "checked": self.across.checked,
            "max_ratio": round(self.across.max_ratio, 4),
            "seconds": round(self.across.booked, 4),
            "flags": flags,
        }
        return out
