"""MLflow's own UI, in a real browser (Debian's ``chromium``, headless), on a store with a sweep and a run that failed
and was restarted: the runs are listed by name in the training view, the restarted run ended FINISHED, and its
page shows the picture of where its time went. Skipped where chromium is not installed (``.ci/run`` installs it)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request

import pytest

from conftest import PY, cli

# (serial: after the parallel part, alone: a browser and MLflow's server beside two workers' jobs were too much once,
# on 2 cores, and its worker died)
pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.browser]  # (make docs-check runs it, not make test)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def browse(url: str, *args: str) -> str:
    """What headless chromium renders of ``url`` (``--dump-dom``), or a screenshot (``--screenshot=PATH``). It runs
    in a session of its own: whatever it signals on its way out (its process group) never reaches this worker."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,900",
           "--virtual-time-budget=30000", *args, url]  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=240)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # (its helpers, if any is left)
        except ProcessLookupError:
            pass
    assert p.returncode == 0, err[-2000:]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium; .ci/run installs it)")
def test_the_mlflow_ui_lists_a_sweeps_runs_by_name_and_shows_a_restarted_runs_time_line(data_root, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).search_experiments()  # (the store exists, as after a first run)
    tracked = ["logger=mlflow", f"logger.tracking_uri={uri}", "debug=tiny"]
    sweep = ["-m", "ckpt=none,sync_save", f"hydra.sweep.dir={tmp_path / 'sweep'}", "trainer.max_steps=4"]
    p = cli([*sweep, *tracked], data_root, tmp_path, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    run_dir = tmp_path / "restarted"
    restarted = ["trainer.max_steps=8", "trainer.max_restarts=1", "fault=crash_at_step", "fault.step=5",
                 "ckpt=sync_save", "ckpt.interval_steps=2", f"run_dir={run_dir}"]  # fmt: skip
    p = cli([*restarted, *tracked], data_root, tmp_path, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("pitstop")
    runs = client.search_runs([exp.experiment_id])
    rid = (run_dir / "mlflow_run_id").read_text().strip()
    names = {r.info.run_name for r in runs}
    jobs = {f"digits-cnn-sgd ckpt={c} trainer.max_steps=4 logger=mlflow debug=tiny" for c in ("none", "sync_save")}
    assert len(runs) == 3 and names == {*jobs, "digits-cnn-sgd"}, names  # (a sweep's job by what it set)
    run = client.get_run(rid)
    assert run.info.status == "FINISHED"  # (not the killed attempt's FAILED, written after the restart's end)
    assert [a.path for a in client.list_artifacts(rid)] == ["timeline.png"]

    port = free_port()
    server = subprocess.Popen(
        [PY, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while True:  # (until the server answers its health check)
            assert server.poll() is None, server.stderr.read().decode()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline, "mlflow ui did not answer within 180 s"
                time.sleep(0.5)
        # MLflow 3's UI opens an experiment on its GenAI view whatever the experiment's kind; the training view
        # (the runs table) is the one its link asks for (pitstop logs the link at the run's end)
        base = f"http://127.0.0.1:{port}/#/experiments/{exp.experiment_id}"
        page = browse(f"{base}/runs?workflowType=machine_learning", "--dump-dom")
        for name in names:
            assert f">{name}<" in page, name
        browse(f"{base}/runs?workflowType=machine_learning", f"--screenshot={tmp_path / 'runs.png'}")
        artifacts = f"{base}/runs/{rid}/artifacts/timeline.png?workflowType=machine_learning"
        assert 'alt="timeline.png"' in browse(artifacts, "--dump-dom")  # the picture itself, rendered
        browse(artifacts, f"--screenshot={tmp_path / 'timeline_in_mlflow.png'}")
        for shot in ("runs.png", "timeline_in_mlflow.png"):
            assert (tmp_path / shot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # (the server and its workers)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
