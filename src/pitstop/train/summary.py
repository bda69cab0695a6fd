"""What a run reports at its end (``RUN_DIR/summary.json``), and the read-only view of a run that callbacks get."""

from __future__ import annotations

import logging
import os
from typing import Any

from pitstop.config import secrets
from pitstop.goodput.ledger import table
from pitstop.telemetry.metrics import write_json_atomic

log = logging.getLogger("pitstop")


class RunView:
    """What a callback may read of a run (``on_train_start``, ``on_step_end``, ``on_train_end``): its progress
    and last evaluation, never the components themselves."""

    def __init__(self, runner: Any):
        self._runner = runner

    @property
    def step(self) -> int:
        return self._runner.progress.step

    @property
    def samples_seen(self) -> int:
        return self._runner.progress.samples_seen

    @property
    def total_steps(self) -> int:
        return self._runner.total_steps

    @property
    def resumed_from(self) -> int | None:
        return self._runner.resumed_from

    @property
    def last_eval(self) -> dict[str, float]:
        return dict(self._runner.last_eval)

    @property
    def run_dir(self) -> str:
        return self._runner.run_dir


def run_tags(cfg: Any, strategy: str, ckpt: str, loader: str) -> dict[str, str]:
    """The tracker run's tags: the options compared most, and the sweep a job belongs to (in the mlflow ui,
    filter ``tags.sweep = '<id>'`` to compare a sweep's jobs side by side)."""
    tags = {"strategy": strategy, "ckpt": ckpt, "loader": loader}
    sweep = cfg.get("sweep")
    if sweep:
        overrides = secrets.mask(str(sweep.overrides))
        tags.update({"sweep": str(sweep.id), "sweep_job": str(sweep.job), "sweep_overrides": overrides})
    return tags


def goodput_metrics(account: dict) -> dict[str, float]:
    """The job's goodput account as tracker metrics."""
    restart = {"restart_seconds": account["restart_seconds"]} if account["restart_seconds"] is not None else {}
    return {
        "goodput": account["goodput"],
        "restarts": account["restarts"],
        **restart,
        **{f"goodput_{k}_seconds": v for k, v in account["totals"].items()},
    }


def data_wait_fraction(seconds: dict[str, float]) -> float:
    """Share of step time (fetch + compute) spent waiting for the next batch."""
    wait, compute = seconds["data_wait"], seconds["compute"]
    return round(wait / max(wait + compute, 1e-9), 4)


def write_summary(run: Any, account: dict, tracker: dict, split: dict[str, float], digest: str) -> dict[str, Any]:
    """``summary.json`` of a finished run (written by the main rank), logged in one line and the goodput table.
    ``run``: the Runner, its components closed; ``tracker``: what the tracker run's end added (e.g. its id);
    ``digest``: the final parameters' sha256."""
    strategy, ledger = run.strategy, run.ledger
    out = {
        "final_step": run.step,
        "total_steps": run.total_steps,
        "epoch": run.loader.epoch,
        "samples_seen": run.samples_seen,
        "resumed_from": run.resumed_from,
        "metrics": run.last_eval,
        "params_sha256": digest,
        "data": {**run.loader.stats, "data_wait_fraction": data_wait_fraction(ledger.seconds)},
        "checkpoint": run.ckpt.stats(),
        "strategy": strategy.name,
        "world_size": strategy.world_size,
        "throughput": run.throughput.summary(),
        "precision": run.precision.name,
        "goodput": {k: account[k] for k in ("goodput", "totals", "restarts", "failures", "restart_seconds")},
    }
    if strategy.groups.stats() is not None:
        out["ft"] = strategy.groups.stats()
    out.update(tracker)
    out["wall_clock"] = split
    out["samples_per_s"] = run.samples_seen / max(split["total"], 1e-9)
    if strategy.is_main:
        write_json_atomic(os.path.join(run.run_dir, "summary.json"), out)
        evals = ", ".join(f"{k}={v:.4f}" for k, v in run.last_eval.items())
        log.info("done: step %d, %s, params_sha256=%s", run.step, evals, digest[:16])
        log.info("%s", table(account))
    return out
