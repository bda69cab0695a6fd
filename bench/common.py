"""Helpers shared by the benchmarks: compose the real conf/ the way tests do, prepare data once."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def compose(overrides: list[str], config_name: str = "train"):
    from hydra import compose as hcompose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hcompose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.cwd = str(ROOT)
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def ensure_data(overrides: list[str] = ()) -> None:
    from recipe.prepare import prepare

    prepare(compose(list(overrides), config_name="prepare").data)


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def fmt_row(cols, widths):
    return "  ".join(str(c).ljust(w) for c, w in zip(cols, widths))

