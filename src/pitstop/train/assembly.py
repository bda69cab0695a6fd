"""Assembly: what a step needs, built from the config once the strategy has set up its process group.

Every component is built with ``hydra.utils.instantiate`` from its config group (``pitstop.config.build``),
so a new model, data set, optimizer, loader or schedule is a new YAML file (and module), not an edit here.
Precision is checked against the strategy (FSDP's mixed-precision policy casts on its own), the model is
placed and wrapped by the strategy (then compiled in place, after wrapping, when ``trainer.compile``), and
the loaders get this rank's share of the data.
"""

from __future__ import annotations

import os
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf

from pitstop.config.build import build
from pitstop.data.dataset import build_dataset
from pitstop.errors import ConfigError
from pitstop.goodput.interval import IntervalPolicy
from pitstop.goodput.ledger import GoodputLog, Ledger
from pitstop import fsurl
from pitstop.ckpt.contract import Checkpointer
from pitstop.config.schema_loop import Hang
from pitstop.data.dataset import ShardedDataset
from pitstop.data.loader.base import ShardLoader
from pitstop.parts.task import Task
from pitstop.resilience.fault import Fault, FaultContext
from pitstop.telemetry.logger.base import Logger
from torch import nn
from pitstop.resilience.watchdog import Watchdog
from pitstop.strategy.base import Strategy
from pitstop.strategy.groups import ReplicaGroups
from pitstop.telemetry.metrics import MetricsFile
from pitstop.telemetry.profiler import StepProfiler
from pitstop.parts import compiler
from pitstop.parts.batch import map_tensors
from pitstop.parts.launch_facts import LaunchFacts
from pitstop.train.metering import StepMeter
from pitstop.parts.precision import DTYPES, Precision
from pitstop.train.sample_log import SampleLog
from pitstop.train.state import TrainLoader
from pitstop.telemetry.throughput import Throughput

NULL_LOGGER = {"_target_": "pitstop.telemetry.logger.base.NullLogger"}


@dataclass
class StepParts:
    precision: Precision
    accum: int
    data: ShardedDataset
    task: Task
    model: nn.Module
    compile_clock: compiler.CompileClock | None
    optimizer: torch.optim.Optimizer
    loader: TrainLoader
    eval_loader: ShardLoader


def build_step_parts(cfg: DictConfig, strategy: Strategy, groups: ReplicaGroups, fresh: bool = True) -> StepParts:
    """``fresh``: no earlier attempt of this run (the data position will be the start: the cached loader's first
    shards can download while the model is built)."""
    t = cfg.trainer
    precision = Precision(t.precision, strategy.device, strategy_casts=strategy_casts(strategy, t.precision))
    if t.compile:
        compiler.check(t.compile_backend, t.compile_mode)
    # (the data set as the loaders reach it: the run's fingerprint, its checks and the loop read its index too)
    reach = fsurl.storage_options(cfg.loader.get("storage_options"), "loader.storage_options")
    data = build_dataset(cfg.data).reaching(reach)
    task = build(cfg.task)
    common = dict(
        dataset=data,
        batch_size=t.batch_size,
        seed=cfg.seed,
        rank=strategy.rank,
        world_size=strategy.world_size,
        pin_memory=strategy.pin_memory,
    )
    loader = build(cfg.loader, split="train", train=True, **common)
    if groups.shares_data_order:  # strategy=ft: one global order, cut among the step's groups
        from pitstop.data.loader.replica import ReplicaLoader

        loader = ReplicaLoader(
            loader,
            groups.participation,
            groups.replicas,
            int(t.grad_accum_steps),
            ranks=strategy.world_size,
            rank=strategy.rank,
        )
    elif fresh:  # (loader=cached) first shards downloading while the model is built
        loader.warm()
    model = build(cfg.model)
    if t.channels_last and strategy.channels_last_params:  # (else the inputs alone are NHWC)
        model = model.to(memory_format=torch.channels_last)
    model = strategy.wrap(model)
    if t.compile:  # in place, after wrapping (torch's advice for DDP and FSDP2); parameter names unchanged
        compiler.compile_model(model, t.compile_backend, t.compile_mode)
    optimizer = build(cfg.optim.optimizer)(model.parameters())
    return StepParts(
        precision=precision,
        accum=int(t.grad_accum_steps),
        data=data,
        task=task,
        model=model,
        compile_clock=compiler.CompileClock() if t.compile else None,
        optimizer=optimizer,
        loader=loader,
        eval_loader=build(cfg.loader, split=t.eval_split, train=False, **common),
    )


def watchdog(hang: Hang) -> Watchdog:
    """The hang detector from ``trainer.hang``."""
    return Watchdog(
        enabled=hang.enabled,
        factor=hang.factor,
        min_seconds=hang.min_seconds,
        first_seconds=hang.first_seconds,
        grace=hang.grace_seconds,
    )


@dataclass
class Telemetry:
    metrics_file: MetricsFile
    logger: Logger  # the tracker; a NullLogger on ranks other than the main one
    profiler: StepProfiler
    throughput: Throughput
    meter: StepMeter


def build_telemetry(cfg: DictConfig, run_dir: str, strategy: Strategy, total_steps: int, hold: ExitStack) -> Telemetry:
    """``metrics.jsonl``, the tracker, the profiler and the step meter (``hold`` closes the file and the profiler;
    the tracker run is ended by its owner, who knows how the run ended)."""
    t, main = cfg.trainer, strategy.is_main
    metrics_file = MetricsFile(os.path.join(run_dir, "metrics.jsonl"), enabled=main)
    hold.callback(metrics_file.close)
    logger = build(cfg.logger if main else NULL_LOGGER)
    profiler = StepProfiler(t.profile.steps, t.profile.memory, run_dir, strategy.rank, strategy.device, total_steps)
    hold.callback(profiler.close)
    throughput = Throughput(strategy.device, t.precision)
    meter = StepMeter(throughput, metrics_file, strategy.world_size, t.log_every_steps)
    return Telemetry(metrics_file, logger, profiler, throughput, meter)


def build_goodput_log(run_dir: str, ledger: Ledger, strategy: Strategy, launch: LaunchFacts) -> GoodputLog:
    """This attempt's line in ``RUN_DIR/goodput.jsonl`` (written by the main rank); under ``strategy=ft`` it
    carries the attempt's heals and discarded steps."""
    groups = strategy.groups
    return GoodputLog(
        run_dir,
        ledger,
        enabled=strategy.is_main,
        auto_restart=launch.restart > 0,
        start_method=launch.start_method,
        extra=(lambda: {"ft": groups.stats()}) if groups.stats() is not None else None,
    )


def build_sample_log(
    cfg: DictConfig,
    run_dir: str,
    strategy: Strategy,
    accum: int,
    taking: Callable[[], tuple[int, int]],
    loader: TrainLoader,
    hold: ExitStack,
) -> SampleLog | None:
    """``data.record_sample_ids``: every sample each step takes, per rank and attempt (the exactly-once proof);
    ``taking()`` names the step and micro-batch being taken."""
    if not cfg.data.get("record_sample_ids"):
        return None
    attempt_id = strategy.broadcast_object(round(time.time(), 6))  # rank 0's clock
    groups = strategy.groups
    quorum = (lambda: groups.quorum_id) if groups.quorum_id is not None else None
    samples = SampleLog(run_dir, strategy.rank, attempt_id, accum, taking, quorum, lambda: loader.batch_epoch)
    hold.callback(samples.close)
    loader.sample_log = samples.write
    return samples


def interval_policy(cfg: DictConfig, failures: int, job_seconds: float) -> IntervalPolicy:
    """What ``ckpt.interval=auto`` knows of failures: ``fault.mtbf_seconds``, and those seen in this run dir."""
    mtbf = OmegaConf.select(cfg, "fault.mtbf_seconds") or None
    return IntervalPolicy(mtbf, "fault.mtbf_seconds" if mtbf else "", failures, job_seconds)


def build_fault(
    cfg: DictConfig,
    run_dir: str,
    strategy: Strategy,
    groups: ReplicaGroups,
    total_steps: int,
    ledger: Ledger,
    ckpt: Checkpointer | None,
    hold: ExitStack,
    data: ShardedDataset | None = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Fault:
    """The fault injector of ``fault`` (``fault=none`` injects nothing), bound to this run; ``fault.replica``
    (``strategy=ft``) aims it at replica groups (``ReplicaGroups.aim_fault``)."""
    fault = build(OmegaConf.create(groups.aim_fault(OmegaConf.to_container(cfg.fault, resolve=True))))
    hold.callback(fault.close)
    in_groups = groups.replica_id is not None
    max_restarts = int(cfg.strategy.max_restarts if in_groups else cfg.trainer.get("max_restarts") or 0)
    fault.bind(
        FaultContext(
            run_dir=run_dir,
            rank=strategy.rank,
            world_size=strategy.world_size,
            total_steps=total_steps,
            max_restarts=max_restarts,
            start_wall=ledger.start_wall,
            checkpointer=ckpt,
            grad_accum_steps=int(cfg.trainer.grad_accum_steps),
            on_heal_served=groups.on_heal_served if in_groups else None,
            on_heal=groups.on_heal if in_groups else None,
            on_restore=ckpt.on_load if ckpt is not None and ckpt.root is not None else None,
            sample_keys=(lambda: train_keys(data)) if data is not None else None,
            model=model,
            optimizer=optimizer,
        )
    )
    return fault


def train_keys(data: ShardedDataset) -> set[str]:
    """The training split's sample keys, from its shards' member names (read when a fault names a sample)."""
    import tarfile

    from pitstop.data.shards import split_key

    keys: set[str] = set()
    for shard in data.index.shards("train"):
        fs, path = fsurl.filesystem(data.index.resolve(shard))
        with fs.open(path, "rb") as f, tarfile.open(fileobj=f, mode="r|") as tar:
            keys.update(split_key(m.name)[0] for m in tar if m.isfile())
    return keys


def strategy_casts(strategy: Strategy, precision: str) -> bool:
    """The strategy applies ``trainer.precision`` itself (FSDP's mixed-precision policy): it must agree."""
    casts = strategy.compute_dtype
    if casts is not None and casts != DTYPES.get(precision):
        raise ConfigError(
            f"strategy.mixed_precision casts to {str(casts).replace('torch.', '')} but "
            f"trainer.precision={precision}; set only trainer.precision"
        )
    return casts is not None


def fingerprint(cfg: DictConfig, data: ShardedDataset, accum: int) -> dict:
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
