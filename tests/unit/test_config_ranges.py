"""A key's range is declared next to its schema field (``config/schema.py``: ``key(..., check=...)``) and applied once
to the composed config (``pitstop.config.validate``): one line naming the key, what it must be and what it got."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from omegaconf import OmegaConf

from conftest import compose_cfg
from pitstop.config import schema, validate
from pitstop.errors import ConfigError


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.batch_size=0"], "trainer.batch_size must be a positive integer, got 0"),
        (["trainer.hang.grace_seconds=0"], "trainer.hang.grace_seconds must be a positive number, got 0.0"),
        (["loader.shuffle_shards_window=0"], "loader.shuffle_shards_window must be a positive integer (1: one shard"),
        (["loader.retries=-1"], "loader.retries must be an integer >= 0, got -1"),
        (["loader=cached", "loader.verify=md5"], "loader.verify='md5': use sha256 (hash each download) or size"),
        (["loader=cached", "loader.cache_policy=mru"], "loader.cache_policy='mru': use future (evict the shard read"),
        (["ckpt=sync_save", "ckpt.on_error=ignore"], "ckpt.on_error must be 'raise' or 'warn', got 'ignore'"),
        (["ckpt=sync_save", "ckpt.keep_last_k=-1"], "ckpt.keep_last_k must be an integer >= 0 (0 keeps all), got -1"),
        (["logger=mlflow", "logger.flush_every_seconds=0"], "logger.flush_every_seconds must be a positive number"),
        (["trainer.sdc.interval=0"], "trainer.sdc.interval must be a positive integer, got 0"),
        (["fault=bitflip", "fault.step=3", "fault.bit=-1"], "fault.bit must be an integer >= 0, got -1"),
    ],
)
def test_a_value_out_of_its_keys_range_is_one_line_naming_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(overrides, tmp_path))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("strategy.heartbeat_ms", 0, "strategy.heartbeat_ms must be a positive number, got 0"),
        ("trainer.hang.factor", -1, "trainer.hang.factor must be a positive number, got -1"),
        ("loader.num_workers", -2, "loader.num_workers must be an integer >= 0, got -2"),
    ],
)
def test_a_range_is_checked_on_a_config_read_back_from_yaml_too(tmp_path, key, value, message):
    # (untyped, as a replica group's agent gets it: each section's schema is found by its _target_, else its keys)
    again = OmegaConf.create(OmegaConf.to_yaml(compose_cfg(["strategy=ft"], tmp_path), resolve=True))
    validate(again)  # (in range as composed)
    OmegaConf.update(again, key, value)
    with pytest.raises(ConfigError) as e:
        validate(again)
    assert str(e.value) == message


def test_every_default_is_inside_its_own_range():
    # (a default out of its range would refuse every run that does not set the key)
    seen = 0
    kinds = [k for options in schema.SCHEMAS.values() for k in options.values()]
    for kind in kinds:  # (and the nested ones: trainer.hang, ckpt.local, ...)
        kinds += [t for t in typing.get_type_hints(kind).values() if dataclasses.is_dataclass(t) and t not in kinds]
        for f in dataclasses.fields(kind):
            check, default = f.metadata.get("check"), f.default
            if check is None or default is dataclasses.MISSING or str(default).startswith(("${", "???")):
                continue
            check(f"{kind.__name__}.{f.name}", default)
            seen += 1
    assert seen >= 40  # (the checks are declared: a schema that lost them would pass with nothing to check)
    checked = [f.name for f in dataclasses.fields(schema.Trainer) if f.metadata.get("check") is not None]
    assert {"batch_size", "max_restarts", "preempt_grace_seconds", "grad_accum_steps"} <= set(checked)


def test_a_key_without_a_range_is_not_resolved_by_the_check(tmp_path):
    # (its interpolation is its reader's business: an environment variable that only the tracker's process has, say)
    cfg = compose_cfg(["logger=mlflow"], tmp_path)
    cfg.logger.run_name = "${oc.env:PITSTOP_TESTS_NEVER_SET}"
    validate(cfg)
    cfg.logger.flush_every_seconds = "${oc.env:PITSTOP_TESTS_NEVER_SET}"  # (a key with a range is read, and says so)
    with pytest.raises(Exception, match="PITSTOP_TESTS_NEVER_SET"):
        validate(cfg)
