"""What a run reports at its end (``RUN_DIR/summary.json``), and the read-only view of a run that callbacks get."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Protocol

from omegaconf import DictConfig

from pitstop.config import secrets
from pitstop.goodput.ledger import table
from pitstop.telemetry.metrics import write_json_atomic

if TYPE_CHECKING:
    from pitstop.train.runner import Runner

log = logging.getLogger("pitstop")


class Callback(Protocol):
    """The contract of a user callback: code of yours that reads the run as it goes (a progress note, a metric sent
    elsewhere, an early look at a value), named in the config's ``callbacks`` (name -> ``{_target_: ...}``).

    Any object with these three methods is a callback (a protocol: no base class to inherit), e.g.
    ``python -m recipe.train +callbacks.note._target_=mypkg.Note``. Every rank builds its callbacks (use
    ``run`` and the rank's own logic if only one should act) and each method is handed the same read-only
    :class:`RunView`. A callback reads; it must not change the run (the view hands out copies and figures, never the
    model, the optimizer or the loader), and it must be quick: :meth:`on_step_end` runs on the step's path, every
    step. An exception raised in one fails the run like an error of the loop's own.
    """

    def on_train_start(self, run: RunView) -> None:
        """Once per attempt, after the restore (``run.resumed_from`` says from which step) and before the first
        step."""
        ...

    def on_step_end(self, run: RunView) -> None:
        """After every step applied (its save started, if one was due): ``run.step`` is the step just done. Not after
        a step that was not applied: skipped as unstable, discarded by a replica group, or rolled back."""
        ...

    def on_train_end(self, run: RunView) -> None:
        """Once, when the last step is done and before the summary is written (not when the run fails)."""
        ...


class RunView:
    """What a callback (``on_train_start``, ``on_step_end``, ``on_train_end``) and the run's summary may read of a
    run: its progress, its last evaluation and the figures its components report, never the components."""

    def __init__(self, runner: Runner):
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

    def reports(self) -> dict[str, Any]:
        """What the components report of the run: the data position's epoch and the loader's counters, the
        checkpointer's, the strategy's, the throughput and precision, the corruption check's, and (replica groups) heals
        and quorums."""
        r = self._runner
        out = {
            "epoch": r.loader.epoch,
            "data": {**r.loader.stats, "data_wait_fraction": data_wait_fraction(r.ledger.seconds)},
            "checkpoint": r.ckpt.stats(),
            "strategy": r.strategy.name,
            "world_size": r.strategy.world_size,
            "throughput": r.throughput.summary(),
            "precision": r.precision.name,
            "sdc": r.sdc.stats(),
            "instability": r.instability.stats(),  # (skipped steps, rollbacks, quarantined samples)
            "straggler": r.straggler.stats(),  # (the ranks named slow, the seconds booked waiting for them)
        }
        return {**out, "ft": r.groups.stats()} if r.groups.stats() is not None else out

    @property
    def is_main(self) -> bool:
        return self._runner.strategy.is_main


def run_tags(cfg: DictConfig, strategy: str, ckpt: str, loader: str) -> dict[str, str]:
    """The tracker run's tags: the options compared most, and the sweep a job belongs to (in the mlflow ui,
    filter ``tags.sweep = '<id>'`` to compare a sweep's jobs side by side)."""
    tags = {"strategy": strategy, "ckpt": ckpt, "loader": loader}
    sweep = cfg.get("sweep")
    if sweep:
        overrides = secrets.mask(str(sweep.overrides))  # (redact() masks the tags again, at the tracker)
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


def write_summary(view: RunView, account: dict, tracker: dict, split: dict[str, float], digest: str) -> dict[str, Any]:
    """``summary.json`` of a finished run (written by the main rank), logged in one line and the goodput table.
    ``view``: the run, its components closed; ``tracker``: what the tracker run's end added (e.g. its id);
    ``digest``: the final parameters' sha256."""
    reports = view.reports()
    ft = reports.pop("ft", None)
    out = {
        "final_step": view.step,
        "total_steps": view.total_steps,
        "epoch": reports.pop("epoch"),
        "samples_seen": view.samples_seen,
        "resumed_from": view.resumed_from,
        "metrics": view.last_eval,
        "params_sha256": digest,
        **reports,
        "goodput": {k: account[k] for k in ("goodput", "totals", "restarts", "failures", "restart_seconds")},
    }
    if ft is not None:
        out["ft"] = ft
    out.update(tracker)
    out["wall_clock"] = split
    out["samples_per_s"] = view.samples_seen / max(split["total"], 1e-9)
    out = secrets.redact(out)  # (a store's URL, a tracker's error: the text a run reports, masked)
    if view.is_main:
        write_json_atomic(os.path.join(view.run_dir, "summary.json"), out)
        evals = ", ".join(f"{k}={v:.4f}" for k, v in view.last_eval.items())
        log.info("done: step %d, %s, params_sha256=%s", view.step, evals, digest[:16])
        log.info("%s", table(account))
    return out
