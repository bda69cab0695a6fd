"""``logger=mlflow``: a real MLflow run; every call to MLflow happens on a background thread.

The training loop only appends to a queue (microseconds).  The thread creates (or, on resume, reopens)
the run, logs the config as params, and sends metrics in batches with ``log_batch``.  The run id is
kept in ``RUN_DIR/mlflow_run_id`` so a resumed job continues the same MLflow run.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

_PARAM_BATCH = 100
_METRIC_BATCH = 1000


class MLflowLogger:
    name = "mlflow"

    def __init__(self, tracking_uri: str, experiment: str = "pitstop", run_name: str | None = None,
                 flush_every_seconds: float = 2.0, tags: dict | None = None, **_: Any):
        self.tracking_uri, self.experiment, self.run_name = str(tracking_uri), experiment, run_name
        self.flush_every, self.tags = float(flush_every_seconds), dict(tags or {})
        self.queue: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.run_id: str | None = None
        self.send_seconds = 0.0  # time the background thread spent in MLflow calls
        self.enqueue_seconds = 0.0  # time the training loop spent handing metrics over
        self.sent = 0

    def start(self, run_dir: str, params: dict, tags: dict | None = None) -> None:
        if self.tracking_uri.startswith("sqlite:///"):
            os.makedirs(os.path.dirname(os.path.abspath(self.tracking_uri[len("sqlite:///"):])) or ".", exist_ok=True)
        self.thread = threading.Thread(target=self._work, args=(run_dir, params, {**self.tags, **(tags or {})}),
                                       name="pitstop-mlflow", daemon=True)
        self.thread.start()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        t0 = time.perf_counter()
        self.queue.put((int(step), int(time.time() * 1000), metrics))
        self.enqueue_seconds += time.perf_counter() - t0

    def close(self, status: str = "FINISHED") -> dict:
        if self.thread is None:
            return {}
        self.queue.put(("close", status))
        self.thread.join(timeout=300)
        if self.thread.is_alive():
            log.warning("MLflow logger did not finish within 300 s; some metrics may be missing")
        if self.error is not None:
            log.warning("MLflow logging failed: %s", self.error)
        return {"mlflow_run_id": self.run_id, "mlflow_send_seconds": round(self.send_seconds, 4),
                "mlflow_enqueue_seconds": round(self.enqueue_seconds, 6), "mlflow_metrics_sent": self.sent}

    # ---- background thread ------------------------------------------------------------------------
    def _work(self, run_dir: str, params: dict, tags: dict) -> None:
        try:
            client = self._open(run_dir, params, tags)
        except BaseException as e:  # noqa: BLE001 - reported at close(), training goes on
            self.error = e
            client = None
        pending: list = []
        last = time.monotonic()
        while True:
            try:
                item = self.queue.get(timeout=max(0.05, self.flush_every - (time.monotonic() - last)))
            except queue.Empty:
                item = None
            closing = isinstance(item, tuple) and item and item[0] == "close"
            if item is not None and not closing:
                step, ts, metrics = item
                pending.extend((k, float(v), ts, step) for k, v in metrics.items() if v is not None)
            if pending and (closing or time.monotonic() - last >= self.flush_every or len(pending) >= _METRIC_BATCH):
                self._flush(client, pending)
                pending, last = [], time.monotonic()
            elif not pending:
                last = time.monotonic()
            if closing:
                if client is not None and self.run_id:
                    try:
                        client.set_terminated(self.run_id, status=item[1])
                    except Exception as e:  # noqa: BLE001
                        self.error = e
                return

    def _open(self, run_dir: str, params: dict, tags: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        t0 = time.perf_counter()
        client = MlflowClient(tracking_uri=self.tracking_uri)
        id_file = os.path.join(run_dir, "mlflow_run_id")
        if os.path.isfile(id_file):
            with open(id_file) as f:
                self.run_id = f.read().strip()
            try:
                client.update_run(self.run_id, status="RUNNING")
                self.send_seconds += time.perf_counter() - t0
                return client
            except Exception:  # noqa: BLE001 - store moved or run deleted: start a new run
                self.run_id = None
        exp = client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(self.experiment)
        run = client.create_run(exp_id, run_name=self.run_name, tags={"run_dir": os.path.abspath(run_dir), **tags})
        self.run_id = run.info.run_id
        with open(id_file, "w") as f:
            f.write(self.run_id)
        items = [Param(k[:250], str(v)[:6000]) for k, v in sorted(params.items())]
        for i in range(0, len(items), _PARAM_BATCH):
            client.log_batch(self.run_id, params=items[i:i + _PARAM_BATCH])
        self.send_seconds += time.perf_counter() - t0
        return client

    def _flush(self, client, pending: list) -> None:
        if client is None or self.run_id is None:
            return
        from mlflow.entities import Metric

        t0 = time.perf_counter()
        try:
            for i in range(0, len(pending), _METRIC_BATCH):
                client.log_batch(self.run_id, metrics=[Metric(k, v, ts, s) for k, v, ts, s in pending[i:i + _METRIC_BATCH]])
            self.sent += len(pending)
        except Exception as e:  # noqa: BLE001 - keep training; report at close
            self.error = e
        self.send_seconds += time.perf_counter() - t0
