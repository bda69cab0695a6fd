"""Sizes in config values (``2GB``, ``auto``) and in batches."""

from __future__ import annotations

import logging
import re

import torch

from pitstop.errors import ConfigError

log = logging.getLogger("pitstop.data.loader")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_size(value: object, what: str = "loader.cache_limit", off: str = "null") -> int | None:
    """``null`` (no limit), a number of bytes, or a string like ``"20GB"`` / ``"512MiB"``."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "null", "none")):
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"{what}={value!r} is not a size; use bytes or e.g. 500MB, 20GB, 1.5TiB, or {off}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def nbytes(batch: object) -> int:
    """The bytes of a batch's tensors."""
    if isinstance(batch, torch.Tensor):
        return batch.element_size() * batch.nelement()
    if isinstance(batch, (list, tuple)):
        return sum(nbytes(b) for b in batch)
    if isinstance(batch, dict):
        return sum(nbytes(b) for b in batch.values())
    return 0


def memory_budget(value: object) -> int:
    """``loader.eval_in_memory``: a size (bytes, "256MB"), or 0 / false for none."""
    if value is False or value == 0 or str(value).strip().lower() in ("0", "false", "off"):
        return 0
    size = parse_size(value, "loader.eval_in_memory", off="0")
    if size is None:
        raise ConfigError(
            "loader.eval_in_memory=null: give a size such as 256MB, or 0 to read the evaluation "
            "data at every evaluation"
        )
    return size


def first_sample(batch: object) -> object:
    """A one-sample batch of the same structure (copied: it must not pin the whole batch's memory)."""
    if isinstance(batch, torch.Tensor):
        return batch[:1].clone()
    if isinstance(batch, (list, tuple)):
        return type(batch)(first_sample(b) for b in batch)
    if isinstance(batch, dict):
        return {k: first_sample(v) for k, v in batch.items()}
    return batch
