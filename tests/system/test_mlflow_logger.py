"""logger=mlflow against a real MLflow store (sqlite): the run's params and metrics arrive through the logger's own
process (a fresh interpreter that imports MLflow and creates the store: ~10 s, most of it MLflow's, so this test is
in the system tier)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import check_run, train

pytestmark = pytest.mark.slow


def test_logger_mlflow_real_store(make_cfg, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = make_cfg("logger=mlflow", f"logger.tracking_uri={uri}")
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
    # a training experiment to MLflow's UI (opened on its runs, not on the GenAI overview)
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"


def test_an_experiment_made_before_without_a_kind_becomes_a_training_one(make_cfg, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("pitstop")  # (as an older pitstop, or a person, made it)
    summary = train(make_cfg("logger=mlflow", f"logger.tracking_uri={uri}"))
    assert client.get_run(summary["mlflow_run_id"]).info.experiment_id == exp
    assert client.get_experiment(exp).tags["mlflow.experimentKind"] == "custom_model_development"
