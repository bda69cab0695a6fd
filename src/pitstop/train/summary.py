"""What a run reports at its end (``RUN_DIR/summary.json``), and the read-only view of a run that callbacks get."""

from __future__ import annotations

from typing import Any


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
        tags.update({"sweep": str(sweep.id), "sweep_job": str(sweep.job), "sweep_overrides": str(sweep.overrides)})
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


def summary(
    *,
    step: int,
    total_steps: int,
    epoch: int,
    samples_seen: int,
    resumed_from: int | None,
    metrics: dict[str, float],
    params_sha256: str,
    data: dict[str, Any],
    checkpoint: dict[str, Any],
    strategy: Any,
    throughput: dict[str, Any],
    precision: str,
    account: dict,
) -> dict[str, Any]:
    """``summary.json`` (its wall clock and tracker fields are added when the run has closed them)."""
    return {
        "final_step": step,
        "total_steps": total_steps,
        "epoch": epoch,
        "samples_seen": samples_seen,
        "resumed_from": resumed_from,
        "metrics": metrics,
        "params_sha256": params_sha256,
        "data": data,
        "checkpoint": checkpoint,
        "strategy": strategy.name,
        "world_size": strategy.world_size,
        "throughput": throughput,
        "precision": precision,
        "goodput": {k: account[k] for k in ("goodput", "totals", "restarts", "failures", "restart_seconds")},
    }
