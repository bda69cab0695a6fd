"""How this command launches the job, decided once: the composed config's ``trainer`` and ``strategy`` as their typed
schema objects (``pitstop.config.schema``), checked, and the facts every launcher reads from them.

The launchers (:mod:`supervisor`, :mod:`elastic`, :mod:`replicas`) and the rendezvous read a :class:`LaunchPlan`'s
typed fields, never the raw config with a fallback of their own: a default lives in the schema and the YAML, and a
rule that relates launch keys (which restart limit applies, how long a rendezvous waits) lives here.
"""

from __future__ import annotations

import dataclasses
import signal
from dataclasses import dataclass
from typing import Mapping

from omegaconf import DictConfig, OmegaConf

from pitstop.config import schema, validate
from pitstop.errors import ConfigError
from pitstop.launch.mode import LaunchMode, launch_mode, started_by_launcher


@dataclass(frozen=True)
class LaunchPlan:
    """What a launcher needs of the config, typed. ``strategy`` is the typed ``strategy`` section (one of the
    schema's ``Single``, ``DDP``, ``FSDP``, ``FT``); ``ranks`` are this node's processes (a replica group's under
    ``strategy=ft``); ``restarts`` the limit of the launcher that restarts them, named by ``restarts_key``."""

    mode: LaunchMode
    trainer: schema.Trainer
    strategy: schema.Single
    ranks: int = 1
    nodes: tuple[int, int] = (1, 1)
    restarts: int = 0
    restarts_key: str = "trainer.max_restarts"

    @property
    def grace(self) -> float:
        """``trainer.preempt_grace_seconds``: how long a launcher waits for its ranks' saves after a notice."""
        return float(self.trainer.preempt_grace_seconds)

    @property
    def notices(self) -> list[signal.Signals]:
        """``trainer.preempt_signals``: the signals that are a preemption notice."""
        from pitstop.resilience.preempt import parse_signals

        return parse_signals(self.trainer.preempt_signals)

    @property
    def replica_groups(self) -> schema.FT | None:
        """The ``strategy=ft`` section when the job runs as replica groups."""
        return self.strategy if isinstance(self.strategy, schema.FT) else None

    @property
    def rendezvous_timeout(self) -> int:
        """Seconds the elastic agent's rendezvous waits: ``strategy.timeout``; inside a replica group at least a
        minute (``strategy=ft``'s own timeout is torchft's, per step)."""
        if isinstance(self.strategy, schema.FT):
            return max(60, int(self.strategy_timeout))
        return int(self.strategy_timeout) if isinstance(self.strategy, schema.DDP) else 300

    @property
    def strategy_timeout(self) -> float:
        """``strategy.timeout``: how long a collective waits for a peer (ddp, fsdp, ft)."""
        return float(self.strategy.timeout) if isinstance(self.strategy, (schema.DDP, schema.FT)) else 0.0

    @property
    def last_call_seconds(self) -> int:
        """``strategy.nnodes=MIN:MAX``: after MIN nodes joined, how long the rendezvous waits for more."""
        return self.strategy.last_call_seconds if isinstance(self.strategy, schema.DDP) else 5

    @property
    def nodes_text(self) -> str:
        """``strategy.nnodes`` as given: N or MIN:MAX."""
        low, high = self.nodes
        return f"{low}" if low == high else f"{low}:{high}"

    def group(self) -> LaunchPlan:
        """The plan of one replica group of several ranks: its own elastic agent on this machine restarts them
        together (``strategy.max_restarts``)."""
        return dataclasses.replace(self, mode=LaunchMode.ELASTIC, nodes=(1, 1))


def typed(cfg: DictConfig, key: str, kind: type) -> object:
    """The config section ``key`` as its schema object (composed configs are typed already; a config read back
    from YAML is checked against ``kind`` here)."""
    node = cfg[key]
    if not isinstance(OmegaConf.get_type(node), type) or not issubclass(OmegaConf.get_type(node), kind):
        node = OmegaConf.merge(OmegaConf.structured(kind), node)
    return OmegaConf.to_object(node)


def strategy_schema(cfg: DictConfig) -> type:
    """The schema class of the composed ``strategy`` section (of a config read back from YAML: the smallest schema
    that has all its keys)."""
    kind = OmegaConf.get_type(cfg.strategy)
    if isinstance(kind, type) and issubclass(kind, schema.Single):
        return kind
    keys = set(cfg.strategy.keys())
    for candidate in (schema.Single, schema.DDP, schema.FSDP, schema.FT):
        if {f.name for f in dataclasses.fields(candidate)} >= keys:
            return candidate
    raise ConfigError(f"strategy has keys no strategy schema knows: {sorted(keys)}")


def nnodes(value: object) -> tuple[int, int]:
    """``strategy.nnodes``: N or "MIN:MAX" (elastic: the job runs on any number of nodes in the range)."""
    text = str(value)
    try:
        lo, _, hi = text.partition(":")
        low, high = int(lo), int(hi or lo)
    except ValueError:
        low = high = 0
    if isinstance(value, bool) or low < 1 or high < low:
        raise ConfigError(f"strategy.nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {value!r}")
    return low, high


def check_straggler_and_fault(cfg: DictConfig, trainer: schema.Trainer, strategy: schema.Single) -> None:
    """Rules that relate ``trainer.straggler`` and ``fault`` to the launch: ``action=exclude`` needs a job that can go
    on without a node (several nodes, or replica groups); a fault's ``rank`` must be a rank of the job."""
    if isinstance(strategy, schema.FT):
        groups, ranks = strategy.replicas, strategy.nproc_per_node  # (a fault's rank: within its group)
        nodes = 1
    elif isinstance(strategy, schema.DDP):
        groups, ranks, nodes = 1, strategy.nproc_per_node * nnodes(strategy.nnodes)[1], nnodes(strategy.nnodes)[1]
    else:
        groups, ranks, nodes = 1, 1, 1
    s = trainer.straggler
    if s.enabled and s.action == "exclude" and nodes < 2 and groups < 2:
        raise ConfigError(
            f"trainer.straggler.action=exclude needs a job that can go on without a node: strategy.nnodes with a "
            f"maximum above 1, or strategy=ft with several replica groups (this job: strategy={strategy_name(strategy)}"
            f", {nodes} node); use trainer.straggler.action=report"
        )
    rank = OmegaConf.select(cfg, "fault.rank", default=None)
    if isinstance(rank, int) and not isinstance(rank, bool) and not 0 <= rank < ranks:
        raise ConfigError(f"fault.rank={rank} but the job has {ranks} rank(s); use 0..{ranks - 1}")


def strategy_name(strategy: schema.Single) -> str:
    return {schema.FT: "ft", schema.FSDP: "fsdp", schema.DDP: "ddp"}.get(type(strategy), "single")


def plan(cfg: DictConfig, env: Mapping[str, str]) -> LaunchPlan:
    """The launch of this job, from its composed config and this process's environment (checked once, here)."""
    validate(cfg)
    trainer = typed(cfg, "trainer", schema.Trainer)
    strategy = typed(cfg, "strategy", strategy_schema(cfg))
    assert isinstance(trainer, schema.Trainer) and isinstance(strategy, schema.Single)
    check_straggler_and_fault(cfg, trainer, strategy)
    restarts = trainer.max_restarts
    if isinstance(strategy, schema.FT):
        from pitstop.strategy.ft_keys import check_keys

        s = strategy
        check_keys(s.replicas, s.replica_id, s.min_replicas, s.inner, s.nproc_per_node)
        if started_by_launcher(env):  # a rank that torchrun or SLURM started: restarts are theirs
            return LaunchPlan(LaunchMode.CHILD, trainer, strategy)
        mode = LaunchMode.REPLICAS if s.replica_id is None else LaunchMode.REPLICA_GROUP
        return LaunchPlan(mode, trainer, strategy, s.nproc_per_node, (1, 1), s.max_restarts, "strategy.max_restarts")
    if isinstance(strategy, schema.DDP):
        ranks, nodes, elastic = strategy.nproc_per_node, nnodes(strategy.nnodes), strategy.max_restarts
        mode = launch_mode(ranks, restarts, env, nodes[1])
        if mode == LaunchMode.ELASTIC:
            return LaunchPlan(mode, trainer, strategy, ranks, nodes, elastic, "strategy.max_restarts")
        return LaunchPlan(mode, trainer, strategy, ranks, nodes, restarts)
    return LaunchPlan(launch_mode(1, restarts, env), trainer, strategy, 1, (1, 1), restarts)
