"""Helpers shared by the benchmarks: compose the real conf/ the way tests do, prepare data once."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def compose(overrides: list[str], config_name: str = "train"):
    from pitstop.config import compose as compose_config

    return compose_config(str(ROOT / "conf"), overrides, str(ROOT), config_name)


def ensure_data(overrides: list[str] = ()) -> None:
    from recipe.prepare import prepare

    prepare(compose(list(overrides), config_name="prepare").data)


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def fmt_row(cols, widths):
    return "  ".join(str(c).ljust(w) for c, w in zip(cols, widths))
