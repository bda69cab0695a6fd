"""Step metering: what the steps cost and what the log shows of them.

``StepMeter`` keeps the log window (samples, fetch and compute seconds since the last log line), feeds
throughput (samples/s, MFU) with the steps that did not compile, counts the FLOPs of one optimizer step once
per attempt (remembered in ``RUN_DIR/flops.json``: a restarted attempt reads them back instead of counting
again), and writes each step's record to ``metrics.jsonl`` and, every
``trainer.log_every_steps``, the window's figures to the tracker.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from pitstop.config.build import build
from pitstop.telemetry.logger.base import Logger

from pitstop.telemetry.metrics import MetricsFile
from pitstop.parts.batch import map_tensors
from pitstop.telemetry.throughput import Throughput, cached_count, count_step_flops

if TYPE_CHECKING:
    from tqdm import tqdm

log = logging.getLogger("pitstop")


class Window:
    """The steps since the last log line."""

    def __init__(self) -> None:
        self.reset(time.perf_counter())

    def reset(self, now: float) -> None:
        self.t, self.samples, self.fetch, self.compute, self.n = now, 0, 0.0, 0.0, 0

    def add(self, samples: int, fetch: float, compute: float) -> None:
        self.samples += samples
        self.fetch += fetch
        self.compute += compute
        self.n += 1


class StepMeter:
    def __init__(self, throughput: Throughput, metrics_file: MetricsFile, world_size: int, log_every: int):
        self.throughput, self.metrics_file = throughput, metrics_file
        self.world_size, self.log_every = world_size, log_every
        self.window = Window()
        self.flops_counted = False
        self._first_batch: Any = None
        self._last_io: dict[str, float] = {}
        self.logger: Logger | None = None  # (start() sets where the records go)
        self.bar: tqdm | None = None
        self.io: Callable[[], dict[str, float]] = dict

    def start(self, logger: Logger, bar: tqdm | None, io: Callable[[], dict[str, float]]) -> None:
        """The loop starts: the first window starts now. Where each step's record goes besides ``metrics.jsonl``: the
        tracker (every ``log_every`` steps), the progress bar; ``io()``: the data counters."""
        self.logger, self.bar, self.io = logger, bar, io
        self.window.reset(time.perf_counter())

    def first_batch(self, batch: Any) -> None:
        """The first micro-batch of a step: its shapes, for counting a step's FLOPs once."""
        if not self.flops_counted:
            self._first_batch = batch

    def step_done(self, samples: int, fetch: float, compute: float, compiling: float) -> None:
        if not compiling:  # (a step that compiled is no measure of throughput)
            self.throughput.add(fetch + compute, samples)
        self.window.add(samples, fetch, compute)

    def count_flops(
        self,
        cfg: DictConfig,
        task_loss: Callable[[nn.Module, Any], torch.Tensor],
        run_dir: str,
        is_main: bool,
        accum: int,
    ) -> None:
        """FLOPs of one optimizer step on this rank (forward + backward of each micro-batch), once per attempt."""
        batch, self._first_batch, self.flops_counted = self._first_batch, None, True
        # (counting runs under a dispatch mode, which imports torch._dynamo if nothing did yet — the optimizer's
        # constructor does, ~1.5 s — then ~0.1 s for a small model: a restart reads the count back instead)
        key = json.dumps(
            [
                OmegaConf.to_yaml(cfg.model, resolve=True),
                str(cfg.task.loss),
                map_tensors(lambda t: [list(t.shape), str(t.dtype)], batch),
            ],
            sort_keys=True,
            default=lambda leaf: type(leaf).__name__,
        )
        flops = cached_count(
            os.path.join(run_dir, "flops.json"),
            key,
            is_main,
            lambda: count_step_flops(lambda: build(cfg.model), task_loss, batch),
        )
        self.throughput.flops_per_step = flops * accum if flops is not None else None
        if flops:
            log.info("one step: %.3g GFLOP per rank (%s)", flops * accum / 1e9, self.throughput.peak_note)

    def record(
        self,
        step: int,
        total_steps: int,
        epoch: int,
        loss: float,
        lr: float,
        fetch: float,
        compute: float,
    ) -> None:
        """This step in ``metrics.jsonl`` (and the progress bar); every ``log_every`` steps (and the last), the
        window's figures and the data counters that moved (``io()``) in the tracker too."""
        self.metrics_file.write(
            {
                "step": step,
                "epoch": epoch,
                "loss": loss,
                "lr": lr,
                "fetch_seconds": round(fetch, 6),
                "compute_seconds": round(compute, 6),
                "time": round(time.time(), 3),  # (wall clock: the run's time line places the step by it)
            }
        )
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", epoch=epoch, refresh=False)
        if step % self.log_every == 0 or step == total_steps:
            self._log_window(step, epoch, loss, lr)

    def _log_window(self, step: int, epoch: int, loss: float, lr: float) -> None:
        """The window's figures since the last log, and the data counters that moved, to the tracker."""
        window, logger = self.window, self.logger
        now = time.perf_counter()
        elapsed = max(now - window.t, 1e-9)
        speed = {
            "samples_per_s": window.samples * self.world_size / elapsed,
            "samples_per_s_per_device": window.samples / elapsed,
        }
        mfu = self.throughput.mfu(window.n / elapsed)
        if mfu is not None:
            speed["mfu"] = mfu
        logger.log_metrics(
            {
                "loss": loss,
                "lr": lr,
                "epoch": epoch,
                **speed,
                "fetch_seconds": window.fetch / window.n,
                "compute_seconds": window.compute / window.n,
                "data_wait_fraction": window.fetch / elapsed,
            },
            step,
        )
        self.metrics_file.write({"step": step, **{k: round(v, 6) for k, v in speed.items()}})
        # cumulative: cache hits/misses, bytes from the source, retries (samples: the step's own figures say it)
        counters = {k: v for k, v in self.io().items() if k != "samples"}
        changed = {k: v for k, v in counters.items() if self._last_io.get(k) != v}
        if changed:  # counters that moved since the last log (most stop moving once the cache is warm)
            logger.log_metrics(changed, step)
            self.metrics_file.write({"step": step, **changed})
            self._last_io = counters
        self.metrics_file.flush()
        window.reset(now)


def progress_bar(mode: bool | str, is_main: bool, total: int, initial: int) -> tqdm | None:
    """A tqdm bar on the main rank: ``trainer.progress_bar`` true, or auto when stderr is a terminal."""
    if not is_main or mode is False or (mode == "auto" and not sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)
