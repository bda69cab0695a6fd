"""Checks that turn bad config values into one clear line before anything expensive starts."""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pitstop.config import checks
from pitstop.errors import ConfigError


def _get(cfg: DictConfig, key: str) -> Any:
    return OmegaConf.select(cfg, key, throw_on_missing=False)


def validate(cfg: DictConfig) -> None:
    """Every key against the range its schema declares (``pitstop.config.schema``), and the rules every run relies
    on that no one component owns (the rules between a component's keys live in that component's module)."""
    from pitstop.config import schema

    schema.check_all(cfg)
    if _get(cfg, "trainer.max_steps") is None and _get(cfg, "trainer.epochs") is None:
        raise ConfigError("set trainer.max_steps or trainer.epochs")
    checks.positive("optim.lr", _get(cfg, "optim.lr"))
    if not checks.is_integer(_get(cfg, "seed")):
        raise ConfigError(f"seed must be an integer, got {_get(cfg, 'seed')!r}")


def flatten(cfg: DictConfig) -> dict[str, str]:
    """The resolved config as flat ``a.b.c -> value`` pairs (for tracker params)."""
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            out[prefix] = str(node)

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out


def compose(config_dir: str, overrides: list[str], cwd: str, config_name: str = "train") -> DictConfig:
    """Compose a config outside ``@hydra.main`` (tests, benchmarks) the way a real job sees it: the
    ``hydra:`` resolvers answer as if launched from ``cwd``, and the job config has no ``hydra`` node."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.cwd = str(cwd)
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def launch_dir() -> str:
    """The directory the command was started in: Hydra's ``runtime.cwd`` inside a job (and in tests, which
    set it), the process's working directory where Hydra has not set its config yet (a sweep's own dir is
    resolved before any job: ``hydra:`` interpolations fail there)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return str(HydraConfig.get().runtime.cwd)
    return os.getcwd()


def register() -> None:
    """Config schemas and resolvers, before Hydra composes anything, and the log records' masking (idempotent)."""
    from pitstop.config import schema, secrets

    schema.register()
    secrets.mask_logs()  # (every process that reads a config: the command's, each rank's)
    if not OmegaConf.has_resolver("pitstop.launch_dir"):
        OmegaConf.register_new_resolver("pitstop.launch_dir", launch_dir)


register()
