"""The contract of replica groups: what a job of several groups that train together and fail alone adds to the loop
(``strategy=ft``: :class:`pitstop.strategy.ft.FT`). The Runner holds one :class:`ReplicaGroups` (a strategy's
``groups``); this base class is the job of one group that always commits, every other strategy's: its hooks do
nothing. Another fault-tolerance library would be one subclass (and one launch branch), not hooks on every
strategy.

The loop calls, in order: ``expect_config`` and ``peer_wait_seconds`` (setup), ``attach`` (what a heal sends and
applies), ``join`` or ``restored`` (restore), then per step ``begin_step``, ``reduce_gradients``, ``commit`` and
``saves_checkpoints``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable

import torch
from omegaconf import DictConfig
from torch import nn

from pitstop.config import checks
from pitstop.errors import ConfigError


class ReplicaGroups:
    participants: int = 1  # replica groups taking part in this step
    quorum_id: int | None = None  # the id of this step's quorum (None: no quorums)
    replica_id: int | None = None  # this process's group (None: no replica groups)
    replicas: int = 1  # the job's groups

    def expect_config(self, cfg: DictConfig) -> None:
        """Before ``setup``: the job's config, which every group must share (replica groups, which meet only at
        their coordinator, compare theirs in each quorum)."""

    def peer_wait_seconds(self) -> float:
        """The longest one wait for peer groups (a quorum, a heal, the all-reduce, the commit) can take before the
        groups' own timeouts fail it (the step is discarded): 0, no peers."""
        return 0.0

    def attach(
        self,
        state: Callable[[], dict],
        load: Callable[[dict], None],
        watch: Callable[[str, float], AbstractContextManager],
    ) -> None:
        """What a heal from a peer sends (``state()``) and applies (``load``, inside ``watch(phase, limit)``, the
        hang watchdog's phase)."""

    def on_heal_served(self, call: Callable[[int], None]) -> None:
        """``call(step)`` as this process starts sending its state to a healing peer (none here)."""

    def on_heal(self, call: Callable[[int], None]) -> None:
        """``call(step)`` as this process starts applying a peer's state (none here)."""

    def join(self) -> bool:
        """Before restore: True if this process healed from a live peer (no checkpoint to read)."""
        return False

    def restored(self, step: int) -> None:
        """The checkpoint set the run at ``step``."""

    def begin_step(self) -> None:
        """Before a step's first fetch: the step's quorum."""

    def reduce_gradients(self, model: nn.Module) -> None:
        """After the last backward: the gradients averaged over the step's groups (one group: nothing to do)."""

    def commit(self) -> bool:
        """Before the optimizer step: False discards the step (nothing changes, the loop goes on)."""
        return True

    def saves_checkpoints(self) -> bool:
        """This process writes the durable checkpoints (with its ranks, via the checkpointer)."""
        return True

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """After a committed step: every group's ``t`` (a vector of the same length and dtype in each), one per group
        of the step's quorum in its place's order (``trainer.sdc`` compares their digests); None when it failed (a
        peer died during it) or there are no groups."""
        return None

    def stats(self) -> dict | None:
        """This attempt's heals, quorum seconds and discarded steps; None: no replica groups."""
        return None

    @property
    def shares_data_order(self) -> bool:
        """The groups cut one global data order among each step's groups (``pitstop.data.loader.replica``): the
        run's end follows the data position. False: one group, whose ranks each read their own share."""
        return self.replica_id is not None

    def participation(self) -> tuple[int, int]:
        """(groups taking part in this step, this group's place among them)."""
        return 1, 0

    def aim_fault(self, spec: dict) -> dict:
        """The ``fault`` section for this group: ``fault.replica`` aims it at one group (K), or at every group (any:
        a random fault then fires in each with ``replicas x mtbf_seconds`` (or ``mtbf_steps``), seeded per group, so
        the job sees failures at the mean ``mtbf_seconds``)."""
        spec = dict(spec)
        replica, group = spec.pop("replica", None), self.replica_id
        if replica is not None and group is None:
            raise ConfigError(f"fault.replica={replica!r} aims a fault at a replica group: it needs strategy=ft")
        if replica not in (None, "any") and (not checks.is_integer(replica) or not 0 <= replica < self.replicas):
            raise ConfigError(f"fault.replica={replica!r} must be null, any or 0 .. strategy.replicas-1")
        if replica not in (None, "any") and replica != group:
            return {"_target_": "pitstop.resilience.fault.NoFault"}
        mtbf = [k for k in ("mtbf_seconds", "mtbf_steps") if spec.get(k) is not None]
        if group is not None and mtbf and replica == "any":
            for k in mtbf:
                spec[k] = float(spec[k]) * self.replicas
            spec["seed"] = int(spec.get("seed") or 0) * 1000 + int(group)
        return spec


ONE_GROUP = ReplicaGroups()
