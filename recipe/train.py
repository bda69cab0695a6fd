"""Train an image classifier from the composed config.

    python -m recipe.train                                    # digits, small CNN, MLflow in outputs/
    python -m recipe.train model=resnet18 optim=adamw trainer.epochs=3
    python -m recipe.train -m optim=sgd,adamw                 # a sweep, one run dir per job, + report.md
    python -m recipe.train -m ckpt=sync_save,async_dcp loader=plain,cached fault=random fault.mtbf_seconds=30 \
        trainer.max_restarts=50                               # what each configuration loses to failures
    python -m recipe.train strategy=ddp strategy.nproc_per_node=2   # one command starts every rank
"""

from __future__ import annotations

import logging
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

from pitstop.errors import PitstopError
from pitstop.resilience.node_book import EXCLUDED_EXIT, NodeExcluded
from pitstop.resilience.preempt import Preempted
from pitstop import cli
from pitstop.launch import launcher as launch

log = logging.getLogger("recipe.train")
# Overrides that say where a sweep's files go, not what a job trains: left out of its run's name.
PLUMBING = ("paths.", "run_dir=", "hydra.", "logger.")


def train(cfg: DictConfig) -> dict:
    """Run one training job in the run dir Hydra resolved; return its summary."""
    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    with open_dict(cfg):
        cfg.run_dir = run_dir  # single runs and sweep jobs alike: this job's own dir
        if hc.mode == RunMode.MULTIRUN:  # groups the sweep's runs in the tracker
            cfg.sweep = {
                "id": os.path.basename(os.path.normpath(hc.sweep.dir)),
                "job": hc.job.num,
                "overrides": " ".join(hc.overrides.task),
            }
            # and names each by what it sets (`digits-cnn-sgd ckpt=async_dcp loader=cached`), where files go aside
            chosen = [o for o in hc.overrides.task if not o.lstrip("+~").startswith(PLUMBING)]
            cfg.run_name = " ".join([str(cfg.run_name), *chosen])
    return launch.run(cfg, run_dir)  # in this process, or one process per rank


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    try:
        summary = train(cfg)
    except Preempted as e:  # saved (or the newest checkpoint kept): exit "requeue me", not "failed"
        log.warning("%s", e)
        raise SystemExit(e.exit_code) from None
    except PitstopError as e:
        log.error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise  # Hydra marks this job failed and runs the others; the sweep report shows it
        raise SystemExit(EXCLUDED_EXIT if isinstance(e, NodeExcluded) else 2) from None
    return summary["metrics"].get("val_accuracy")


if __name__ == "__main__":
    cli.run(main)
