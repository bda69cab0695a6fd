"""``strategy=ft``'s replica groups, the side the loop sees (:class:`~pitstop.strategy.groups.ReplicaGroups`): each
step's quorum at the Lighthouse through torchft's ``Manager``, a heal from a live peer, the all-reduce over the
step's groups and the commit that keeps or discards the step. :class:`pitstop.strategy.ft.FT` is a ``Strategy`` and
these ``Quorums``: it builds the ``Manager`` (``setup``) that everything here uses.
"""

from __future__ import annotations

import hashlib
import logging
import time
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Callable

import torch
from omegaconf import DictConfig
from torch import nn

from pitstop.errors import ConfigError, Interrupt, PitstopError
from pitstop.parts.batch import local_shard
from pitstop.strategy.groups import ReplicaGroups

if TYPE_CHECKING:
    from torchft import Manager

    from pitstop.strategy.single import Single

log = logging.getLogger("pitstop.strategy")


class Quorums(ReplicaGroups):
    """What replica groups joined by torchft add to the loop: quorum, heal, reduce, commit (its state is set by
    :meth:`_init_quorums`; ``manager``, ``inner`` and ``lighthouse`` by :class:`pitstop.strategy.ft.FT`)."""

    manager: Manager | None
    inner: Single
    lighthouse: str | None

    def _init_quorums(
        self,
        replicas: int,
        replica_id: int | None,
        min_replicas: int,
        timeout: float,
        quorum_timeout: float,
        heartbeat_ms: int,
    ) -> None:
        """The keys of ``strategy=ft`` these read (their meaning: the FT schema), and this attempt's state."""
        self.replicas, self.min_replicas = int(replicas), int(min_replicas)
        self.replica_id = None if replica_id is None else int(replica_id)
        self.timeout, self.quorum_timeout, self.heartbeat_ms = float(timeout), float(quorum_timeout), int(heartbeat_ms)
        self._sections: dict[str, str] = {}  # the config's top-level sections -> a digest (expect_config)
        self._code = "-"  # their digests, in order: what a peer's id must carry
        self._twins: dict[str, int] = {}  # another process's id with this group's replica_id -> quorums seen in
        self._formation = (0, 1)  # the last quorum's furthest step, and how many groups it had
        self._ready = False  # a quorum was formed (by join) that the next step uses
        self.heals: list[dict] = []  # {"step", "seconds"} per heal from a peer
        self.quorum_seconds = 0.0  # waiting for quorums (heals included), this attempt
        self.discarded = 0  # steps of this attempt whose commit failed
        self._in_a_row = 0  # of them since the last committed step
        self._last_commit: float | None = None  # when the last step committed (or the first began)
        self._heal_served: list[Callable[[int], None]] = []  # called as a heal from this process starts
        self._heal_applied: list[Callable[[int], None]] = []  # called as this process applies a peer's state
        self.participants, self.place = 1, 0
        self._model: nn.Module | None = None
        self._buffers: list[torch.Tensor] = []

    @property
    def shares_data_order(self) -> bool:
        """The groups cut one global data order among each step's groups (``pitstop.data.loader.replica``)."""
        return True

    # ---- joining ------------------------------------------------------------------------------------
    def expect_config(self, cfg: DictConfig) -> None:
        """The job's config, as a digest per top-level section (the keys a group may set on its own left out:
        node-local ones, ``strategy.replica_id`` and ``strategy.lighthouse``). It travels in this group's
        replica id, so each quorum shows every group's, and a group started with another config is refused."""
        from pitstop.strategy.nodes import flat_config

        digests: dict[str, Any] = {}
        flat = flat_config(cfg)
        flat["strategy.nproc_per_node"] = str(self.nproc_per_node)  # (node-local elsewhere; every group's here)
        for key, value in sorted(flat.items()):
            if key in ("strategy.replica_id", "strategy.lighthouse"):
                continue
            digests.setdefault(key.split(".")[0], hashlib.sha256()).update(f"{key}={value}\n".encode())
        self._sections = {name: h.hexdigest()[:4] for name, h in digests.items()}
        self._code = "".join(self._sections.values()) or "-"

    def _check_peers(self, quorum: Any) -> None:
        """Refuse, in this group, a peer group of the quorum started with another config or with the same
        ``strategy.replica_id``, if this group is the later one of the two to start (the earlier one goes on)."""
        self._asked_heal = bool(getattr(quorum, "heal", False))  # (this rank must heal in this quorum)
        mine = self._full_id
        # (what join's first formation needs: the furthest step of the quorum, and which groups are in it)
        names = {other.split(":")[0] for other in quorum.replica_ids} | {mine.split(":")[0]}
        self._formation = (int(getattr(quorum, "max_step", 0) or 0), len(names))
        for other in quorum.replica_ids:
            parts = other.split(":")
            if other == mine or len(parts) != 4 or not parts[0].startswith("replica"):
                continue  # this group, or not a pitstop group
            name, code, started = parts[0], parts[1], parts[2]
            if not started.isdigit() or (int(started), other) > (self._started_ms, mine):
                continue  # the other group started later (ties: by id): it refuses, not this one
            if code != self._code:
                names, width = list(self._sections), 4
                theirs = [code[i * width : (i + 1) * width] for i in range(len(names))]
                differ = [n for n, t in zip(names, theirs) if self._sections[n] != t] or ["(the config's layout)"]
                raise ConfigError(
                    f"strategy=ft: replica group {name.removeprefix('replica')} was started with another config than "
                    f"this group (replica group {self.replica_id}); they differ in {', '.join(differ)}: start every "
                    f"group with the same overrides (only strategy.replica_id and strategy.lighthouse differ)"
                )
            if name == f"replica{self.replica_id}":
                self._twins[other] = self._twins.get(other, 0) + 1
                if self._twins[other] >= 2:  # (a dead earlier attempt of this group is in one quorum at most)
                    raise ConfigError(
                        f"strategy.replica_id={self.replica_id} is taken: another process runs as replica group "
                        f"{self.replica_id} at the same Lighthouse ({self.lighthouse}); give every group its own "
                        f"strategy.replica_id (0 .. strategy.replicas-1)"
                    )

    def attach(
        self,
        state: Callable[[], dict],
        load: Callable[[dict], None],
        watch: Callable[[str, float], AbstractContextManager],
    ) -> None:
        """What a heal sends and receives: the run's whole live state (``state()``), applied with ``load`` in the
        watchdog's ``heal`` phase (``watch``): applying a state takes less than receiving it, which
        ``strategy.timeout`` bounds, so a stall there is this process's hang, not a restore's first long read."""

        def loaded(sd: dict) -> None:
            try:
                with watch("heal", self.timeout):
                    for call in self._heal_applied:
                        call(self.manager.current_step())
                    load(sd)
            except Interrupt:  # (the watchdog's hang, raised in here: not a state this process cannot take)
                raise
            except Exception as e:  # noqa: BLE001 - a state this process cannot take is no transient failure
                raise HealFailed(
                    f"replica group {self.replica_id} cannot load the state a peer sent ({type(e).__name__}: "
                    f"{str(e).splitlines()[0][:200] if str(e) else ''}); the group restarts"
                ) from None
            self._healed = True

        def served() -> dict:  # (torchft asks for it as this group starts sending it to a healing peer)
            for call in self._heal_served:
                call(self.manager.current_step())
            return state()

        self._healed = False
        self.manager.register_state_dict_fn("pitstop", loaded, served)

    def on_heal_served(self, call: Callable[[int], None]) -> None:
        """``call(step)`` as this process starts sending its state to a healing peer (``fault=during_heal``)."""
        self._heal_served.append(call)

    def on_heal(self, call: Callable[[int], None]) -> None:
        """``call(step)`` as this process starts applying the state a live peer sent it (``fault.phase=heal``)."""
        self._heal_applied.append(call)

    def join(self) -> bool:
        """The first quorum of this attempt; True if the group healed from a live peer in it (its state is that
        peer's: no checkpoint is read), False if no peer is ahead (a new job, or every group restarted: restore
        from the newest durable checkpoint, as every group of the quorum does). When no group of the quorum has
        taken a step yet, it waits for every group of the job first (:meth:`_gather`)."""
        until = time.monotonic() + self.quorum_timeout
        for attempt in range(3):  # a heal that failed (its source died meanwhile): the next quorum, another peer
            self._quorum()
            self._gather(until)
            # (the group's ranks decide together: each heals its own part, and one whose transfer failed must not
            # ask for a quorum alone while the others train or restore)
            if not self.inner.any(not (self.heals or self.manager.errored() is None)):
                break
            log.warning("joining: the quorum or the heal failed; trying again (%d of 3)", attempt + 1)
        healed = bool(self.heals)
        if self.inner.any(healed) and self.inner.any(not healed):
            raise HealFailed(
                f"replica group {self.replica_id}: some of its ranks healed from a live peer and some did not (the "
                f"peer failed during the transfer); the group restarts"
            )
        self._ready = True
        return healed

    def _gather(self, until: float) -> None:
        """The job's first formation: while no group of the quorum has taken a step (all at step 0: a new job, or
        every group restarted, as after the whole job was killed) and a group of the job (``strategy.replicas``) is
        not in it, ask again, one heartbeat interval apart, until every group is or ``until`` has passed
        (``strategy.quorum_timeout`` after the join began). With ``strategy.min_replicas`` below the job's groups,
        the Lighthouse forms a quorum of the groups that have started; one that took a step alone would make the
        others heal from it, and the run would differ from one whose every step had every group."""
        t0, pause = time.monotonic(), max(10, self.heartbeat_ms // 5) / 1000  # (torchft's heartbeat interval)
        asked = 0
        while self.inner.any(self._short_of_groups() and time.monotonic() < until):
            time.sleep(pause)
            self.quorum_seconds += pause
            self._quorum()
            asked += 1
        if not asked:
            return
        waited, groups = time.monotonic() - t0, self._formation[1]
        if self._short_of_groups():
            log.warning(
                "the job's first quorum has %d of its %d replica groups after %.0f s (strategy.quorum_timeout=%g): "
                "starting without the others (they heal from this one when they come)",
                groups,
                self.replicas,
                waited,
                self.quorum_timeout,
            )
        else:
            log.info("the job's first quorum: waited %.2f s for every replica group (%d)", waited, self.replicas)

    def _short_of_groups(self) -> bool:
        """This quorum formed without every group of the job, none of which has taken a step."""
        step, groups = self._formation
        return self.manager.errored() is None and step == 0 and groups < self.replicas

    def peer_wait_seconds(self) -> float:
        """A quorum waits up to ``strategy.quorum_timeout``; a heal's transfer, the all-reduce and the commit each
        up to ``strategy.timeout``."""
        return self.quorum_timeout + 2 * self.timeout

    def restored(self, step: int) -> None:
        """The durable checkpoint set the run at ``step``: torchft's step must agree."""
        self.manager.load_state_dict({"step": int(step), "batches_committed": int(step) * self.participants})

    def _quorum(self) -> None:
        t0 = time.perf_counter()
        step = self.manager.current_step()
        self._healed, self._asked_heal = False, False
        try:
            self.manager.start_quorum()
        except (ConfigError, HealFailed, Interrupt):
            raise
        except Exception as e:  # noqa: BLE001 - e.g. no quorum within strategy.quorum_timeout (a stalled peer
            # still sends heartbeats): this step is discarded and the next one asks again; the process goes on
            self.manager._quorum_future = None  # (torchft would raise the same error again at the next quorum)
            self.manager.report_error(e)
        took = time.perf_counter() - t0
        if self._asked_heal and not self._healed and self.world_size > 1:
            # (this rank's transfer failed while others of its group may have healed: the group's ranks would hold
            # different states, and the next quorum may no longer ask it to heal)
            raise HealFailed(
                f"replica group {self.replica_id}: rank {self.rank}'s heal from a live peer failed "
                f"({str(self.manager.errored()).splitlines()[0][:200]}); the group restarts"
            )
        self.quorum_seconds += took
        if self._healed:
            self.heals.append({"step": self.manager.current_step(), "from_step": step, "seconds": round(took, 4)})
            log.info("healed from a live peer at step %d in %.3fs", self.manager.current_step(), took)
        if self.manager.errored() is not None:
            log.warning("quorum: %s", str(self.manager.errored()).splitlines()[0][:300])
        self.participants = max(1, self.manager.num_participants())
        place = self.manager.participating_rank()
        self.place = 0 if place is None else int(place)

    # ---- one step -----------------------------------------------------------------------------------
    def begin_step(self) -> None:
        if self._last_commit is None:
            self._last_commit = time.monotonic()
        if not self._ready:
            self._quorum()
        self._ready = False
        # what the forward changes besides parameters (BatchNorm statistics): put back if the step is discarded
        self._buffers = [b.detach().clone() for b in self._model.buffers()]

    @property
    def quorum_id(self) -> int:
        """The id of this step's quorum (the same in every group of it)."""
        return int(getattr(self.manager, "_quorum_id", -1)) if self.manager is not None else -1

    def participation(self) -> tuple[int, int]:
        """(groups taking part in this step, this group's place among them)."""
        return self.participants, self.place

    def reduce_gradients(self, model: nn.Module) -> None:
        """Average the gradients over the step's groups, and the floating-point buffers (BatchNorm's running
        statistics, updated by each group's own forward) with them: one flat all-reduce, after which every
        group holds the same numbers."""
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        buffers = [b for b in model.buffers() if b.is_floating_point()]
        # (FSDP inside the group: a gradient is a DTensor; rank r of every group holds the same shard of it)
        tensors = [local_shard(p.grad) for p in params] + buffers
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self.manager.allreduce(flat).wait()
        at = 0
        with torch.no_grad():
            for t in tensors:
                n = t.numel()
                t.copy_(flat[at : at + n].view_as(t))
                at += n

    def give_up_seconds(self) -> float:
        """How long a group goes on discarding steps before it ends: five times the longest one wait for peers can
        take (a peer that restarts comes back well within it; one gone for good, with ``strategy.min_replicas``
        groups needed, would otherwise be waited for forever, each discarded step looking like progress)."""
        return 5 * self.peer_wait_seconds()

    def commit(self) -> bool:
        ok = bool(self.manager.should_commit())
        if ok:
            self._in_a_row, self._last_commit = 0, time.monotonic()
            return True
        with torch.no_grad():
            for b, saved in zip(self._model.buffers(), self._buffers):
                b.copy_(saved)
        self.discarded += 1
        self._in_a_row += 1
        why = self.manager.errored()
        log.warning(
            "step discarded (a peer group failed during it)%s", f": {str(why).splitlines()[0][:200]}" if why else ""
        )
        waited = time.monotonic() - (self._last_commit or time.monotonic())
        if self.inner.any(waited > self.give_up_seconds()):  # (every rank of the group ends, or none)
            raise PeersGone(
                f"strategy=ft: replica group {self.replica_id} committed no step for {waited:.0f} s ({self._in_a_row} "
                f"discarded in a row; strategy.min_replicas={self.min_replicas}, {self.participants} group(s) in the "
                f"last quorum): a peer group is gone for good; ending here (the same command resumes from the newest "
                f"checkpoint once enough groups can meet)"
            )
        return False

    def saves_checkpoints(self) -> bool:
        """One group writes the durable checkpoints: the first of the step's quorum (another takes over when
        it is gone)."""
        return self.place == 0

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every group's ``t`` through one all-reduce of the step's quorum (torchft's, as the gradients'): each group
        puts its vector in its own row of a zero matrix (its place), and the sum is every row. Rank ``r`` of each
        group meets rank ``r`` of the others. None when it failed (a peer died meanwhile: torchft said so)."""
        if self.manager is None or self.manager.errored() is not None:
            return None
        from torch.distributed import ReduceOp

        rows = torch.zeros((self.participants, t.numel()), dtype=t.dtype, device=t.device)
        rows[self.place] = t.reshape(-1)
        self.manager.allreduce(rows, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            return None
        return list(rows)

    def stats(self) -> dict:
        return {
            "replica_id": self.replica_id,
            "replicas": self.replicas,
            "heals": self.heals,
            "quorum_seconds": round(self.quorum_seconds, 4),
            "discarded_steps": self.discarded,
        }


class PeersGone(PitstopError):
    """Too few replica groups for a step to commit, for longer than a restarting peer could take: the group ends
    (exit status 2, not restarted: the same wait would follow)."""


class HealFailed(PitstopError):
    """A heal this process cannot complete: its group restarts (a bounded count) rather than train on."""


class _SeenQuorums:
    """torchft's manager client, each quorum's result shown to ``check`` before the manager acts on it (torchft
    keeps no list of the quorum's replica ids)."""

    def __init__(self, client: Any, check: Callable[[Any], None]):
        self._client, self._check = client, check

    def _quorum(self, **kw: Any) -> Any:
        quorum = self._client._quorum(**kw)
        self._check(quorum)
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)
