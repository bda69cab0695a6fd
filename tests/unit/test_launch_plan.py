"""The launch plan: the composed config's trainer and strategy as typed schema objects, read once, and what every
launcher reads of them (the mode, the ranks, which restart limit applies, the grace period)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from conftest import compose_cfg
from pitstop.config import schema
from pitstop.errors import ConfigError
from pitstop.launch.mode import LaunchMode
from pitstop.launch.plan import plan


def _plan(tmp_path, *overrides, env=None):
    return plan(compose_cfg(list(overrides), tmp_path), env or {})


def test_the_plan_decides_every_launch_mode_and_the_restart_limit_that_applies(tmp_path):
    one = _plan(tmp_path)
    assert (one.mode, one.ranks, one.restarts) == (LaunchMode.IN_PROCESS, 1, 0)
    sup = _plan(tmp_path, "trainer.max_restarts=2")
    assert (sup.mode, sup.restarts, sup.restarts_key) == (LaunchMode.SUPERVISED, 2, "trainer.max_restarts")
    # ddp's agent restarts its ranks: strategy.max_restarts (it follows trainer.max_restarts unless set)
    ddp = _plan(tmp_path, "strategy=ddp", "trainer.max_restarts=3", "strategy.max_restarts=1")
    assert (ddp.mode, ddp.ranks, ddp.nodes, ddp.restarts) == (LaunchMode.ELASTIC, 2, (1, 1), 1)
    assert ddp.restarts_key == "strategy.max_restarts" and isinstance(ddp.strategy, schema.DDP)
    assert _plan(tmp_path, "strategy=ddp", "strategy.nnodes=1:4").nodes == (1, 4)
    # strategy=ft is a launch mode like the others: the groups here, or one group of a job on several machines
    ft = _plan(tmp_path, "strategy=ft")
    assert (ft.mode, ft.ranks, ft.restarts, ft.restarts_key) == (LaunchMode.REPLICAS, 1, 5, "strategy.max_restarts")
    assert ft.replica_groups is ft.strategy and isinstance(ft.strategy, schema.FT)
    group = _plan(tmp_path, "strategy=ft", "strategy.replica_id=1", "strategy.lighthouse=h:1")
    assert group.mode == LaunchMode.REPLICA_GROUP and group.group().mode == LaunchMode.ELASTIC
    assert _plan(tmp_path, "strategy=ft", env={"RANK": "0"}).mode == LaunchMode.CHILD  # torchrun's rank
    assert _plan(tmp_path, "strategy=ddp", env={"RANK": "1"}).mode == LaunchMode.CHILD
    assert _plan(tmp_path, "strategy=ddp").replica_groups is None


def test_launch_settings_are_typed_fields_with_one_rule_each(tmp_path):
    p = _plan(tmp_path, "trainer.preempt_grace_seconds=7", "trainer.preempt_signals=[SIGUSR1]")
    assert p.grace == 7.0 and [s.name for s in p.notices] == ["SIGUSR1"]
    assert _plan(tmp_path, "strategy=ddp", "strategy.timeout=42").rendezvous_timeout == 42
    # inside a replica group the rendezvous waits at least a minute (strategy=ft's own timeout is per step)
    assert _plan(tmp_path, "strategy=ft", "strategy.timeout=10").rendezvous_timeout == 60
    assert _plan(tmp_path, "strategy=ddp", "strategy.nnodes=2:3").nodes_text == "2:3"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.preempt_grace_seconds=-1"], "trainer.preempt_grace_seconds must be a number of seconds >= 0"),
        (["trainer.max_restarts=-1"], "trainer.max_restarts must be an integer >= 0, got -1"),
        (["strategy=ddp", "strategy.nproc_per_node=0"], "strategy.nproc_per_node must be a positive integer, got 0"),
        (["strategy=ddp", "strategy.nnodes=3:2"], "strategy.nnodes must be N or MIN:MAX with 1 <= MIN <= MAX"),
        (["strategy=ft", "strategy.heartbeat_ms=0"], "strategy.heartbeat_ms must be a positive number, got 0"),
        (
            ["strategy=ft", "strategy.replicas=0"],
            "strategy.replicas must be a positive integer (replica groups), got 0",
        ),
        (["strategy=ft", "strategy.nproc_per_node=0"], "strategy.nproc_per_node must be a positive integer (ranks per"),
        (["strategy=ft", "strategy.timeout=0"], "strategy.timeout must be a positive number, got 0.0"),
        (["strategy=ft", "strategy.max_restarts=-1"], "strategy.max_restarts must be an integer >= 0, got -1"),
    ],
)
def test_a_bad_launch_setting_is_refused_in_one_line_before_anything_starts(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as e:
        _plan(tmp_path, *overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp", "ft"])
def test_a_config_read_back_from_yaml_plans_as_the_composed_one(tmp_path, strategy):
    # (a replica group's agent gets the job's config as YAML: untyped, it is checked against its schema)
    cfg = compose_cfg([f"strategy={strategy}"], tmp_path)
    again = OmegaConf.create(OmegaConf.to_yaml(cfg, resolve=True))
    assert plan(again, {}) == plan(cfg, {})
    assert type(plan(again, {}).strategy) is type(plan(cfg, {}).strategy)
