"""Silent data corruption found and undone (``trainer.sdc``).

Under ``strategy=ddp`` every rank holds the whole model, and pitstop's steps are bitwise deterministic: after each
step the replicas' parameters and optimizer state are bitwise equal. Every ``interval`` steps (and at the last step,
before its save) each rank sums the bit patterns of each of those tensors (``parts.digest.replica_digest``: one
pass, one int64 per tensor) and the ranks all-gather the vectors (one small collective). Any difference is
corruption (a flipped bit in memory, a faulty core):

- with three or more ranks the odd one out (the ranks that differ from the majority) is named at once;
- with two there is no majority, and both ranks' states have left the right trajectory (the corrupted rank's
  gradients were averaged into the other's): each rank keeps a host copy of its parameters at the detection, the
  run rolls back and replays the same steps, and at the same step the replay (which every rank agrees on) names the
  rank whose copy is far from it where it is farthest, while the other rank's same element is not (at least 10
  times closer: a flipped bit is its rank's alone, what the averaged gradients carried is both ranks'); when that is
  not clear no rank is named (said in the log);
- the rank is recorded in ``RUN_DIR/suspects.json`` (shape ``statefile.SUSPECTS``, written by rank 0, atomically;
  node health reads it), the detection is a line in ``metrics.jsonl`` (``"event": "sdc"``, the time line marks it)
  and in the log, naming the step, the rank and the tensors that differ;
- the run goes back to the newest verified checkpoint taken at or before the last step whose digests agreed (a
  checkpoint saved after it may hold the corruption: never that one; the rollback removes those newer ones) and
  takes the same data again, so it ends with the parameters of an uninterrupted run, bitwise.

The checks, the rollback's restore and the steps computed again are booked in the ledger's ``sdc`` bucket. A
mismatch at the same step again after its rollback (the corruption repeats: a faulty device that computes wrong,
or a bug that is not deterministic) stops the run in one line (exit status 2).

One process (``strategy=single``) has no replica; with ``trainer.sdc.replay`` it takes every ``interval``-th step
twice from the same state and batches and compares the results bitwise (``pitstop.train.replay``): a difference
is a fault in that step's computation; rank 0 is recorded as suspect and the run rolls back to a checkpoint from
before the step (at most the step before it), the same data again.

What is covered: ``strategy=ddp`` (parameters and optimizer state; not buffers, which follow each rank's batch);
``strategy=single`` with ``replay``: the computation of the sampled steps (not corruption at rest between steps).
``strategy=fsdp`` shards parameters and optimizer state, so no rank holds a copy of another's: nothing to compare,
the check is off (said once).

``strategy=ft`` (replica groups): the groups hold bitwise-equal parameters and optimizer state after each committed
step (what a heal relies on). Every ``interval`` committed steps the groups of the step's quorum compare the same
digests through one all-reduce of torchft's (``ReplicaGroups.gather``: each group's vector in its own row, with its
``replica_id``; rank ``r`` of each group with rank ``r`` of the others, the group's ranks then decide together).
Three or more groups name the odd one out at once, two through the replay as above. The undo is the rollback, not a
heal: the odd group's gradients were averaged into every group's since the flip, so a heal from a "healthy" peer
would make the groups equal again but not the uninterrupted run; every group goes back to the same durable
checkpoint (the job's, at or before the last step that agreed; the group that writes them removes the newer ones)
and takes the same steps again, so the job ends with the uninterrupted job's parameters, bitwise. Each group records
the named group in its own run dir (``replica`` in ``suspects.json``, ``replicas`` in ``summary.json``'s ``sdc``).
A check whose all-reduce fails (a peer died during it) compares nothing; the next one does.
"""

from __future__ import annotations

import logging
import os

import time
from typing import Any, Callable

import torch

from pitstop.errors import Unrecoverable
from pitstop.resilience.node_book import SUSPECTS_FILE, node_name
from pitstop.ckpt.contract import Target
from pitstop.goodput.ledger import Ledger
from pitstop.parts.batch import local_shard
from pitstop.parts.digest import (
    deviation_at,
    differing,
    named_by_replay,
    odd_ones_out,
    replica_digest,
    replica_state,
    worst_element,
)
from pitstop.statefile import SUSPECTS, read_state
from pitstop.strategy.base import Strategy
from pitstop.strategy.groups import ReplicaGroups
from pitstop.telemetry.metrics import write_json_atomic
from pitstop.train.replay import Recording, Replaying, Snapshot, state_digest

log = logging.getLogger("pitstop")


class CorruptionRepeats(Unrecoverable):
    """The replicas differ again at the step where a rollback already found them differing (exit status 2, never
    restarted: the same steps would differ again)."""


def covered(strategy: Strategy, enabled: bool, replay: bool = False, groups: ReplicaGroups | None = None) -> str:
    """What the check compares under ``strategy`` (the log's first line and ``summary.json``)."""
    if not enabled:
        return "off (trainer.sdc.enabled=false)"
    if groups is not None and groups.replica_id is not None:
        if groups.replicas > 1:
            return f"parameters and optimizer state of {groups.replicas} replica groups"
        return "nothing: one replica group has no peer to compare"
    if strategy.replicated and strategy.world_size > 1:
        return f"parameters and optimizer state of {strategy.world_size} replicas"
    if strategy.name == "fsdp":
        return "nothing: strategy=fsdp shards the parameters and optimizer state, no rank holds another's copy"
    if strategy.world_size == 1 and strategy.name != "ft":
        if replay:
            return "the computation of every sampled step, taken twice (not corruption at rest between steps)"
        return "nothing: one process has no replica to compare (trainer.sdc.replay=true takes sampled steps twice)"
    return f"nothing: strategy={strategy.name} is not covered"


class SdcCheck:
    """The check, held by the Runner: ``started(step)`` after the restore, ``before_step(step, batches, last)`` around
    the batches a step takes, ``after_step(step, last)`` after each step's update and before its save; True when it
    rolled back (the loop goes on from the step restored)."""

    def __init__(
        self,
        enabled: bool,
        interval: int,
        strategy: Strategy,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        ledger: Ledger,
        run_dir: str,
        event: Callable[[int, dict[str, Any]], None],
        rollback: Callable[[int, str], int],
        replay: bool = False,
        target: Target | None = None,
        retake: Callable[[Any], None] | None = None,
        pin: Callable[[int | None], None] | None = None,
        groups: ReplicaGroups | None = None,
    ):
        """``event(step, fields)``: a detection, to ``metrics.jsonl`` and the tracker; ``rollback(at_most, why)``:
        back to the newest verified checkpoint of a step at most ``at_most``, the same data again (its step).
        ``replay`` (one process): ``retake(batches)`` takes the step just taken again, from ``target``'s state.
        ``pin(step)``: retention keeps the newest checkpoint at or before ``step`` (a rollback's target). ``groups``
        (``strategy=ft``): the replica groups, which compare across groups (``groups.gather``)."""
        self.strategy, self.model, self.optimizer, self.ledger = strategy, model, optimizer, ledger
        self.run_dir, self.event, self.rollback = run_dir, event, rollback
        self.groups = groups if groups is not None and groups.replica_id is not None else None
        if self.groups is not None:
            self.active = bool(enabled) and self.groups.replicas > 1
        else:
            self.active = bool(enabled) and strategy.replicated and strategy.world_size > 1
        self._ids: list[int] = []  # (groups) the replica ids of the last comparison's places
        self.who = "replica group(s)" if self.groups is not None else "rank(s)"
        single = strategy.world_size == 1 and not strategy.replicated and strategy.name != "ft"
        self.replaying = bool(enabled) and bool(replay) and single and retake is not None
        self.target, self.retake = target, retake
        self._taken: tuple[int, Snapshot, Recording, float] | None = None  # (replay) the sampled step in flight
        self.interval = int(interval)
        self.covers = covered(strategy, bool(enabled), self.replaying, self.groups)
        self.checks, self.seconds, self.digest_seconds = 0, 0.0, 0.0
        self.found: list[dict[str, Any]] = []  # each detection: its step, the ranks named (or not yet), the tensors
        self.pending: dict[str, Any] | None = None  # (no majority) the parameters at the detection, for the replay
        self._hosts: list[str] | None = None
        self._pin = pin if pin is not None and (self.active or self.replaying) else (lambda step: None)
        self.agreed = 0
        if enabled and strategy.is_main and not self.active and not self.replaying:
            log.info("trainer.sdc: %s", self.covers)

    @property
    def agreed(self) -> int:
        """The last step whose digests agreed (or that every rank restored): a rollback goes back to a checkpoint at
        or before it, which retention keeps (``pin``)."""
        return self._agreed

    @agreed.setter
    def agreed(self, step: int) -> None:
        self._agreed = step
        self._pin(step)

    def started(self, step: int) -> None:
        """The run starts (or resumes) from ``step``: every rank holds the same state there."""
        self.agreed = step

    def due(self, step: int, last: bool) -> bool:
        return (self.active or self.replaying) and (step % self.interval == 0 or last)

    def before_step(self, step: int, batches: Any, last: bool) -> Any:
        """(replay) Before a sampled step: a copy of the state, and the batches it takes kept."""
        if not self.replaying or not self.due(step, last):
            return batches
        t = time.perf_counter()
        snapshot, recording = Snapshot(self.target), Recording(batches)
        self._taken = (step, snapshot, recording, time.perf_counter() - t)
        return recording

    def after_step(self, step: int, last: bool) -> bool:
        if self._taken is not None and self._taken[0] != step:
            self._taken = None  # (the sampled step did not end as a step: e.g. its update was not applied)
        if self._taken is not None:
            return self._replayed(step)
        if not self.active or not self.due(step, last):
            return False
        t = time.perf_counter()
        with self.ledger.measure("sdc"):
            named = replica_state(self.model, self.optimizer)
            local = replica_digest([local_shard(v) for _, v in named])  # (ft's fsdp inside: rank r's shard)
            if local.device.type == "cuda":
                torch.cuda.synchronize(local.device)  # (the digest's own time, apart from the collective's)
            t1 = time.perf_counter()
            digests = self._digests(local)
        self.checks += 1
        t2 = time.perf_counter()
        self.digest_seconds += t1 - t
        self.seconds += t2 - t
        if digests is None:  # (groups: a peer died during the check's all-reduce)
            log.warning("trainer.sdc: the check at step %d compared nothing (a peer group failed during it)", step)
            return False
        odd, majority = odd_ones_out(digests)
        differ = bool(odd) or majority is None
        if self.groups is not None and self.strategy.world_size > 1:
            differ = self.strategy.any(differ)  # (the group's ranks compared their own parts: they decide together)
        if not differ:
            if self.pending is not None and self.pending["step"] == step:
                self._named_by_replay(step)
            self.agreed = step
            return False
        return self._mismatch(step, digests, odd, [n for n, _ in named])

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every replica's ``t``: the ranks' (all-gather), or the replica groups' (``groups.gather``)."""
        if self.groups is not None:
            return self.groups.gather(t)
        return self.strategy.all_gather(t)

    def _digests(self, local: torch.Tensor) -> list[list[int]] | None:
        if self.groups is None:
            return [d.tolist() for d in self.strategy.all_gather(local)]
        mine = torch.tensor([int(self.groups.replica_id)], dtype=torch.int64, device=local.device)
        rows = self.groups.gather(torch.cat([mine, local.to(torch.int64)]))
        if rows is None:
            return None
        self._ids = [int(r[0]) for r in rows]
        return [r[1:].tolist() for r in rows]

    def _names(self, places: list[int]) -> list[int]:
        """The ranks, or the replica groups' ids, at ``places`` of the last comparison."""
        return [self._ids[p] for p in places] if self.groups is not None else list(places)

    def _replayed(self, step: int) -> bool:
        _, snapshot, recording, copied = self._taken
        self._taken = None
        self.ledger.move("compute", "sdc", copied)  # (the copy was made inside the step's time)
        t = time.perf_counter()
        with self.ledger.measure("sdc"):
            first = state_digest(self.target)
            snapshot.restore(self.target)
            del snapshot
            self.retake(Replaying(recording.kept))
            again = state_digest(self.target)
        self.checks += 1
        self.seconds += time.perf_counter() - t + copied
        if first == again:
            self.agreed = step
            return False
        tensors = [n for n in first if first[n] != again.get(n)][:3]
        self._repeats(step, [0], tensors)
        how = "its two computations of the step (trainer.sdc.replay) differed"
        self._record([0], step, how, tensors)
        self.found.append({"step": step, "ranks": [0], "tensors": tensors, "rolled_back_to": None})
        self.event(step, {"sdc_detected": 1.0, "ranks": [0], "tensors": tensors})
        log.error(
            "silent data corruption at step %d: its two computations differ (in %s): rolling back to a checkpoint "
            "from before it",
            step,
            ", ".join(tensors),
        )
        to = self.rollback(step - 1, f"silent data corruption at step {step}")
        self.found[-1]["rolled_back_to"] = to
        self.agreed = to
        return True

    # ---- a mismatch ---------------------------------------------------------------------------------------------
    def _mismatch(self, step: int, digests: list[list[int]], odd: list[int], names: list[str]) -> bool:
        tensors = differing(digests, names)
        kind = "replica groups" if self.groups is not None else "replicas"
        named = self._names(odd)
        self._repeats(step, named or self._names(list(range(len(digests)))), tensors)
        if odd:
            how = f"the odd one out of {len(digests)} {kind}"
            self._record(odd, step, how, tensors)
            said = f"{self.who} {', '.join(map(str, named))} differ from the other {len(digests) - len(odd)} {kind}"
        else:
            kept = [local_shard(p.detach()).to("cpu", copy=True) for p in self.model.parameters()]  # (freed once named)
            self.pending = {"step": step, "kept": kept, "tensors": tensors}
            one = "replica group" if self.groups is not None else "rank"
            said = f"the {len(digests)} {kind} differ (no majority: the replay of the steps names the {one})"
        key = "replicas" if self.groups is not None else "ranks"
        detection = {"step": step, key: named, "tensors": tensors, "rolled_back_to": None}
        self.found.append(detection)
        self.event(step, {"sdc_detected": 1.0, key: named, "tensors": tensors})
        if self.strategy.is_main:
            log.error(
                "silent data corruption at step %d: %s in %s; the last step that agreed is %d: rolling back to a "
                "checkpoint at or before it",
                step,
                said,
                ", ".join(tensors),
                self.agreed,
            )
        why = f"silent data corruption at step {step}"
        to = self.rollback(self.agreed, why)
        detection["rolled_back_to"] = to
        self.agreed = to
        return True

    def _repeats(self, step: int, ranks: list[int], tensors: list[str]) -> None:
        """A corruption found again at a step where one was found and rolled back already (a device that computes
        wrong again, or a step that is not deterministic): the ranks recorded, and the run stops in one line."""
        if not any(f["step"] == step for f in self.found):
            return
        self.pending = None
        if self.groups is None:  # (groups: the places of the last comparison are recorded)
            self._record(ranks, step, "differed again at this step after a rollback", tensors)
        else:
            places = [i for i, r in enumerate(self._ids) if r in ranks]
            self._record(places, step, "differed again at this step after a rollback", tensors)
        raise CorruptionRepeats(
            f"silent data corruption at step {step} again after rolling back: {self.who} {', '.join(map(str, ranks))} "
            f"({', '.join(tensors)}); a device that computes wrong every time, or a step that is not deterministic: "
            f"stopped (see {os.path.join(self.run_dir, SUSPECTS_FILE)})"
        )

    def _named_by_replay(self, step: int) -> None:
        pending, self.pending = self.pending, None
        kept, now = pending["kept"], [local_shard(p.detach()) for p in self.model.parameters()]
        where = self._gather(torch.tensor(worst_element(kept, now), dtype=torch.int64, device=now[0].device))
        if where is not None:
            places = [tuple(int(x) for x in w.tolist()) for w in where]
            mine = [deviation_at(kept, now, w) for w in places]
            where = self._gather(torch.tensor(mine, dtype=torch.float64, device=now[0].device))
        if where is None:
            log.error("silent data corruption at step %d: not named (a peer group failed during the replay)", step)
            return
        devs = [d.tolist() for d in where]
        ranks = named_by_replay(devs)
        one = "group" if self.groups is not None else "rank"
        names = self._names(list(range(len(devs))))
        said = "; ".join(
            f"{one} {names[j]}'s worst element: "
            + ", ".join(f"{devs[r][j]:.3g} on {one} {names[r]}" for r in range(len(devs)))
            for j in range(len(devs))
        )
        if not ranks:
            if self.strategy.is_main:
                log.error(
                    "silent data corruption at step %d: the replay cannot tell which %s it was on (how far each "
                    "one's parameters were from the replay: %s)",
                    step,
                    one,
                    said,
                )
            return
        how = f"its parameters at this step were far from the replay's, which every {one} agrees on ({said})"
        self._record(ranks, step, how, pending["tensors"])
        key = "replicas" if self.groups is not None else "ranks"
        for f in self.found:
            if f["step"] == step and not f[key]:
                f[key] = self._names(ranks)
        if self.strategy.is_main:
            log.error(
                "silent data corruption at step %d was on %s %s (named by the replay: %s)",
                step,
                self.who,
                self._names(ranks),
                said,
            )

    def _record(self, ranks: list[int], step: int, how: str, tensors: list[str]) -> None:
        """``RUN_DIR/suspects.json`` gets each rank named (every rank takes part: the hosts are gathered); under
        replica groups ``ranks`` are places of the last comparison, each recorded as its group (``replica``)."""
        if self.groups is not None:
            hosts = self._gather(_as_bytes(node_name()))
            self._hosts = [_text(h) for h in hosts] if hosts is not None else ["?"] * len(self._ids)
        elif self._hosts is None:
            self._hosts = [str(h) for h in self.strategy.all_gather_object(node_name())]
        if not self.strategy.is_main:
            return
        path = os.path.join(self.run_dir, SUSPECTS_FILE)
        doc = read_state(path, SUSPECTS, keep_aside=True, then="it starts again with this suspect", logger=log)
        suspects = list(doc["suspects"]) if doc is not None else []
        now = round(time.time(), 3)
        world = self.strategy.world_size
        for r in ranks:
            host = self._hosts[r]
            rank = r if self.groups is None else self.strategy.rank  # (groups: this rank's part of the group)
            suspects.append({"rank": rank, "step": step, "how": how, "host": host, "time": now, "tensors": tensors})
            suspects[-1]["world_size"] = world
            if self.groups is not None:
                suspects[-1]["replica"] = self._ids[r]
        write_json_atomic(path, {"suspects": suspects}, fsync=True, indent=1, sort_keys=False)

    def stats(self) -> dict[str, Any]:
        """``summary.json``'s ``sdc``: what was compared, how often, and each corruption found."""
        return {
            "covered": self.covers,
            "interval": self.interval if self.active or self.replaying else None,
            "checks": self.checks,
            "check_seconds": round(self.seconds, 4),  # digests and the all-gather (waiting for the slowest rank)
            "digest_seconds": round(self.digest_seconds, 4),  # this rank's digest alone
            "found": list(self.found),
        }


def _as_bytes(text: str, width: int = 256) -> torch.Tensor:
    """``text`` as a fixed-width int64 vector (what ``groups.gather`` carries; nothing is unpickled)."""
    return torch.tensor(list(text.encode()[:width].ljust(width, b"\0")), dtype=torch.int64)


def _text(t: torch.Tensor) -> str:
    return bytes(int(x) for x in t.tolist()).rstrip(b"\0").decode(errors="replace")
