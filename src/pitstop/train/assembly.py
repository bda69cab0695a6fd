"""Assembly: what a step needs, built from the config once the strategy has set up its process group.

Every component is built with ``hydra.utils.instantiate`` from its config group (``pitstop.config.build``),
so a new model, data set, optimizer, loader or schedule is a new YAML file (and module), not an edit here.
Precision is checked against the strategy (FSDP's mixed-precision policy casts on its own), the model is
placed and wrapped by the strategy (then compiled in place, after wrapping, when ``trainer.compile``), and
the loaders get this rank's share of the data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from pitstop.config.build import build
from pitstop.errors import ConfigError
from pitstop.train import compiler
from pitstop.train.batch import map_tensors
from pitstop.train.precision import DTYPES, Precision


@dataclass
class StepParts:
    precision: Precision
    accum: int
    data: Any
    task: Any
    model: Any
    compile_clock: compiler.CompileClock | None
    optimizer: Any
    loader: Any
    eval_loader: Any


def build_step_parts(cfg: DictConfig, strategy: Any) -> StepParts:
    t = cfg.trainer
    precision = Precision(t.precision, strategy.device, strategy_casts=strategy_casts(strategy, t.precision))
    if t.compile:
        compiler.check(t.compile_backend, t.compile_mode)
    data = build(cfg.data, _convert_="partial")
    task = build(cfg.task)
    model = build(cfg.model)
    if t.channels_last and strategy.channels_last_params:  # (else the inputs alone are NHWC)
        model = model.to(memory_format=torch.channels_last)
    model = strategy.wrap(model)
    if t.compile:  # in place, after wrapping (torch's advice for DDP and FSDP2); parameter names unchanged
        compiler.compile_model(model, t.compile_backend, t.compile_mode)
    optimizer = build(cfg.optim.optimizer)(model.parameters())
    common = dict(
        dataset=data,
        batch_size=t.batch_size,
        seed=cfg.seed,
        rank=strategy.rank,
        world_size=strategy.world_size,
        pin_memory=strategy.pin_memory,
    )
    return StepParts(
        precision=precision,
        accum=int(t.grad_accum_steps),
        data=data,
        task=task,
        model=model,
        compile_clock=compiler.CompileClock() if t.compile else None,
        optimizer=optimizer,
        loader=build(cfg.loader, split="train", train=True, **common),
        eval_loader=build(cfg.loader, split=t.eval_split, train=False, **common),
    )


def strategy_casts(strategy: Any, precision: str) -> bool:
    """The strategy applies ``trainer.precision`` itself (FSDP's mixed-precision policy): it must agree."""
    casts = strategy.compute_dtype
    if casts is not None and casts != DTYPES.get(precision):
        raise ConfigError(
            f"strategy.mixed_precision casts to {str(casts).replace('torch.', '')} but "
            f"trainer.precision={precision}; set only trainer.precision"
        )
    return casts is not None


def fingerprint(cfg: DictConfig, data: Any, accum: int) -> dict:
    """Config parts that must not change across a resume."""
    fp = {
        **data.fingerprint(),
        "seed": int(cfg.seed),
        "model": OmegaConf.to_yaml(cfg.model, resolve=True),
        "batch_size": int(cfg.trainer.batch_size),
    }
    if accum != 1:  # (absent when 1: checkpoints from before the option still resume)
        fp["grad_accum_steps"] = accum
    return fp


def channels_last(batch: Any) -> Any:
    """Every 4-D floating input (images) in NHWC, as the model's weights."""
    return map_tensors(_nhwc, batch)


def _nhwc(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 and t.is_floating_point() else t
