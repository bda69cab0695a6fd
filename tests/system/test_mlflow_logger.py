"""logger=mlflow against a real MLflow store (sqlite): the run's params and metrics arrive through the logger's own
process (a fresh interpreter that imports MLflow and creates the store: ~10 s, most of it MLflow's, so this test is
in the system tier)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import check_run, train

pytestmark = pytest.mark.slow


def test_logger_mlflow_real_store(make_cfg, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    # the default store (sqlite:///${paths.output_dir}/mlflow.db), the run started from a folder of its own
    cwd = tmp_path / "started_here"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    cfg = make_cfg("logger=mlflow")
    uri = f"sqlite:///{tmp_path}/outputs/mlflow.db"
    assert cfg.logger.tracking_uri == uri
    summary = train(cfg)
    check_run(cfg, summary)
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert (
        run.data.params["trainer.batch_size"] == "16" and run.data.params["model._target_"] == "recipe.vision.SmallCNN"
    )
    for key in (
        "loss",
        "lr",
        "samples_per_s",
        "samples_per_s_per_device",
        "fetch_seconds",
        "compute_seconds",
        "val_accuracy",
        "val_top5",
    ):
        assert key in run.data.metrics, key
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [4, 8, 12]
    # where its time went, as a picture in the run dir and on the run
    assert (
        summary["mlflow_timeline"] == f"{cfg.run_dir}/timeline.png"
        and (Path(cfg.run_dir) / "timeline.png").stat().st_size
    )
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["timeline.png"]
    # ... kept under the output dir, beside the store, not in ./mlruns of the folder the run was started from
    # (MLflow's default for a sqlite store)
    assert not (cwd / "mlruns").exists() and not list(cwd.iterdir())
    assert (tmp_path / "outputs" / "mlartifacts" / run.info.run_id / "artifacts" / "timeline.png").stat().st_size
    assert "mlflow_warning" not in summary
    # a training experiment to MLflow's UI (opened on its runs, not on the GenAI overview)
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"


def test_an_experiment_made_before_without_a_kind_becomes_a_training_one(make_cfg, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/outputs/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    # (as an older pitstop, or a person, made it: its artifacts where MLflow's default put them, ./mlruns then)
    elsewhere = tmp_path / "cwd_back_then" / "mlruns"
    exp = client.create_experiment("pitstop", artifact_location=str(elsewhere))
    summary = train(make_cfg("logger=mlflow", f"logger.tracking_uri={uri}"))
    assert client.get_run(summary["mlflow_run_id"]).info.experiment_id == exp
    assert client.get_experiment(exp).tags["mlflow.experimentKind"] == "custom_model_development"
    # MLflow cannot move its artifact location: they stay where it says, and the run says so, with what to do
    assert (elsewhere / summary["mlflow_run_id"] / "artifacts" / "timeline.png").is_file()
    assert str(elsewhere) in summary["mlflow_warning"] and "logger.experiment=NAME" in summary["mlflow_warning"]


RACE = """
import os, sys, time
from mlflow.tracking import MlflowClient  # (imported before the start line: the race is the store's first use)
from pitstop.telemetry.logger.mlflow import _client
folder, uri, me, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
open(os.path.join(folder, f"ready{me}"), "w").close()
while sum(f.startswith("ready") for f in os.listdir(folder)) < n:  # (all at the start line, then all at once)
    pass
_client(uri).get_experiment_by_name("pitstop")
print("ok")
"""


def test_trackers_that_first_use_one_new_store_at_once_leave_it_whole(tmp_path):
    # two replica groups' trackers on a fresh store, or a restarted attempt's beside the killed one's: MLflow
    # creates and migrates the tables on first use, and without a lock the store was left half-migrated for good
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    uri, n = f"sqlite:///{tmp_path / 'mlflow.db'}", 3
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACE, str(tmp_path), uri, str(k), str(n)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in range(n)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    errors = [e[-500:] for _, e in outs]
    assert all(p.returncode == 0 and out.strip() == "ok" for p, (out, _) in zip(procs, outs)), errors
    assert [e.name for e in MlflowClient(tracking_uri=uri).search_experiments()] == ["Default"]  # (usable after)
