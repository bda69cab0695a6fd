"""``logger=mlflow``: a real MLflow run, fed from a separate process so logging never slows the loop.

The training loop only writes one short JSON line per log step to the stdin of a logger process
(``python -m pitstop.telemetry.logger.mlflow``; a clean interpreter, so no GIL shared with MLflow's client,
SQLAlchemy or HTTP code, and no re-import of the training script).  That process creates (or, on
resume, reopens) the run, logs the resolved config as params and sends metrics in batches with
``log_batch``.  The run id is kept in ``RUN_DIR/mlflow_run_id`` so a resumed job continues the same run.

Artifacts (the run's ``timeline.png``) go beside a sqlite store, in ``<store's folder>/mlartifacts``: MLflow's own
default for a sqlite store is ``./mlruns`` of the *current directory* at the time the experiment is made, so a run
whose outputs went elsewhere scattered pictures into whatever folder it was started from. The experiment pitstop makes
names that folder as an absolute path, so ``mlflow ui --backend-store-uri sqlite:///...`` finds them from anywhere.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from pitstop.telemetry.logger.base import Logger

log = logging.getLogger(__name__)

# The tag that says an MLflow experiment's kind, and the model-training value (MLflow 3.17's UI reads its view from the
# link, not from this tag: see close()).
EXPERIMENT_KIND, TRAINING = "mlflow.experimentKind", "custom_model_development"
_PARAM_BATCH = 100
_METRIC_BATCH = 1000


class MLflowLogger(Logger):
    name = "mlflow"

    def __init__(
        self,
        tracking_uri: str,
        experiment: str = "pitstop",
        run_name: str | None = None,
        flush_every_seconds: float = 2.0,
        tags: dict | None = None,
        close_timeout: float = 300,
    ):
        self.opts = {
            "tracking_uri": str(tracking_uri),
            "experiment": experiment,
            "run_name": run_name,
            "flush_every": float(flush_every_seconds),
        }
        self.tags, self.close_timeout = dict(tags or {}), float(close_timeout)
        self.proc: subprocess.Popen | None = None
        self.enqueue_seconds = 0.0  # time the training loop spent handing metrics over
        self.broken: str | None = None
        self.buffer: list[str] = []
        self.last_write = time.monotonic()

    def hello(self, run_dir: str, params: dict, tags: dict | None = None) -> dict:
        """The logger process's first message: the options, the run dir, and the params and tags as the tracker may
        have them (redacted here, at the sink, whoever built them)."""
        from pitstop.config.secrets import redact  # (here: the logger process itself never imports the config)

        return {
            "opts": self.opts,
            "run_dir": os.path.abspath(run_dir),
            "params": redact(params),
            "tags": redact({**self.tags, **(tags or {})}),
        }

    def start(self, run_dir: str, params: dict, tags: dict | None = None) -> None:
        uri = self.opts["tracking_uri"]
        if uri.startswith("sqlite:///"):
            os.makedirs(os.path.dirname(os.path.abspath(uri[len("sqlite:///") :])) or ".", exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pitstop.telemetry.logger.mlflow"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1 << 16,
        )
        self._send(self.hello(run_dir, params, tags))

    def _send(self, msg: Any, now: bool = True) -> None:
        """Queue one message; write the queue to the pipe only every ``flush_every`` seconds (or ``now``),
        so the logger process is woken rarely and does not preempt the training thread each step."""
        if self.proc is None or self.broken:
            return
        self.buffer.append(json.dumps(msg, separators=(",", ":"), default=str))
        if not now and time.monotonic() - self.last_write < self.opts["flush_every"]:
            return
        try:
            self.proc.stdin.write("\n".join(self.buffer) + "\n")
            self.proc.stdin.flush()
            self.buffer.clear()
            self.last_write = time.monotonic()
        except (BrokenPipeError, OSError, ValueError) as e:  # the logger died: keep training, say so once
            self.broken = f"MLflow logger process exited ({e}); metrics stay in metrics.jsonl"
            log.warning("%s", self.broken)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        t0 = time.perf_counter()
        self._send(
            [int(step), int(time.time() * 1000), {k: float(v) for k, v in metrics.items() if v is not None}], now=False
        )
        self.enqueue_seconds += time.perf_counter() - t0

    def close(self, status: str = "FINISHED") -> dict:
        if self.proc is None:
            return {}
        self._send(["close", status])
        out: dict = {}
        try:
            stdout, _ = self.proc.communicate(timeout=self.close_timeout)  # closes stdin, waits
            lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
            out = json.loads(lines[-1]) if lines else {"error": self.broken or f"logger exited {self.proc.returncode}"}
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out = {"error": f"MLflow logger did not finish within {self.close_timeout:.0f} s"}
        except (OSError, ValueError) as e:
            out = {"error": str(e)}
        self.proc = None
        if out.get("mlflow_warning"):
            log.warning("%s", out["mlflow_warning"])
        if out.get("error"):
            log.warning("MLflow logging failed: %s", out["error"])
        elif out.get("mlflow_run_id") and out.get("mlflow_experiment_id"):
            # (MLflow 3's UI opens an experiment on its GenAI view whatever its kind: the link asks for the runs)
            log.info(
                "MLflow run %s: `mlflow ui --backend-store-uri %s`, then open "
                "http://127.0.0.1:5000/#/experiments/%s/runs/%s?workflowType=machine_learning",
                out["mlflow_run_id"],
                self.opts["tracking_uri"],
                out["mlflow_experiment_id"],
                out["mlflow_run_id"],
            )
        out["mlflow_enqueue_seconds"] = round(self.enqueue_seconds, 6)
        return out


# ---- the logger process ---------------------------------------------------------------------------
def _serve() -> None:
    os.nice(10)  # yield the CPU to training when both want it
    # A scheduler's notice to every process of the job (SLURM's --signal=USR1, submitit's USR2) is the trainer's:
    # it saves, then closes this logger, which must still be here to send what is left.
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    lines: queue.Queue = queue.Queue()

    def read() -> None:  # drain stdin continuously so the trainer's writes never block
        for line in sys.stdin:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    # (the run's time line is drawn at the end: matplotlib imported meanwhile, in this niced process)
    threading.Thread(target=_import_matplotlib, daemon=True).start()
    first = lines.get()
    if first is None:
        return
    hello = json.loads(first)
    opts = hello["opts"]
    attempts = _attempts(hello["run_dir"])  # (on record as this attempt started: its own is the last)
    state = {"mlflow_run_id": None, "mlflow_metrics_sent": 0, "mlflow_send_seconds": 0.0, "error": None}
    try:
        client = _open(opts, hello["run_dir"], hello["params"], hello["tags"], state, attempts)
    except Exception as e:  # noqa: BLE001 - reported at close(); training goes on
        state["error"], client = f"{type(e).__name__}: {e}", None
    pending: list = []
    last = time.monotonic()
    status, told = "FAILED", False  # unless told otherwise: stdin closing without "close" means the trainer died
    while True:
        try:
            line = lines.get(timeout=max(0.05, opts["flush_every"] - (time.monotonic() - last)))
        except queue.Empty:
            line = ""
        item = json.loads(line) if line else None
        closing = line is None or (item is not None and item[0] == "close")
        if item is not None and not closing:
            step, ts, metrics = item
            pending.extend((k, v, ts, step) for k, v in metrics.items())
        if pending and (closing or len(pending) >= _METRIC_BATCH or time.monotonic() - last >= opts["flush_every"]):
            _flush(client, pending, state)
            pending, last = [], time.monotonic()
        elif not pending:
            last = time.monotonic()
        if closing:
            if item is not None:
                status, told = item[1], True
            break
    _end(client, state, None if not told and _attempts(hello["run_dir"]) > attempts else status, told, hello["run_dir"])


def _end(client, state: dict, status: str | None, told: bool, run_dir: str) -> None:
    """The run's end: its time line (when the trainer closed it), its status (None: the trainer died and a later
    attempt of the run has begun, whose status the run's is), and this process's report to the trainer."""
    if client is not None and state["mlflow_run_id"] and status is not None:
        if told:  # (a trainer that died says nothing more: its run is marked FAILED at once, before a restarted
            # attempt reopens it; that attempt's end draws the whole time line)
            state["mlflow_timeline"] = _log_timeline(client, state["mlflow_run_id"], run_dir)
        try:
            client.set_terminated(state["mlflow_run_id"], status=status)
        except Exception as e:  # noqa: BLE001
            state["error"] = f"{type(e).__name__}: {e}"
    state["mlflow_send_seconds"] = round(state["mlflow_send_seconds"], 4)
    try:
        print(json.dumps(state), flush=True)
    except BrokenPipeError:  # (the trainer died: nobody reads it)
        pass


def _client(uri: str):
    """An ``MlflowClient`` on ``uri``, its store ready. MLflow creates and migrates a sqlite store's tables on first
    use, and two processes doing it at once leave it half-migrated for good (``table _alembic_tmp_... already
    exists`` on every later use): two replica groups' trackers on a fresh store, a restarted attempt's beside the
    killed one's, a parallel sweep. So a sqlite store is first used under an exclusive lock (``<db>.lock`` beside
    it), one process at a time; a store served over HTTP is the server's to guard."""
    from mlflow.tracking import MlflowClient

    if not uri.startswith("sqlite:///"):
        return MlflowClient(tracking_uri=uri)
    import fcntl

    with open(os.path.abspath(uri[len("sqlite:///") :]) + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released as the file closes)
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)  # (creates and migrates the tables: once, by the first)
    return client


def artifact_home(uri: str) -> str | None:
    """Where the experiments pitstop makes in the store at ``uri`` keep their artifacts: ``mlartifacts`` beside a
    sqlite store's file, as an absolute path (None for any other store: its server or MLflow decides)."""
    if not uri.startswith("sqlite:///"):
        return None
    return os.path.join(os.path.dirname(os.path.abspath(uri[len("sqlite:///") :])), "mlartifacts")


def _under(location: str | None, folder: str) -> bool:
    """Whether an experiment's artifact ``location`` (a path or a ``file:`` URI) lies under ``folder``."""
    from urllib.parse import urlparse

    if not location:
        return False
    parsed = urlparse(location)
    if parsed.scheme not in ("", "file"):
        return True  # (an object store or a server's: chosen on purpose, not the current directory)
    path = os.path.abspath(parsed.path if parsed.scheme else location)
    return os.path.commonpath([path, os.path.abspath(folder)]) == os.path.abspath(folder)


def _attempts(run_dir: str) -> int:
    """The attempts of the run on record in its ``goodput.json`` (0 when there is none yet, or it is damaged: the
    trainer's ledger keeps that one aside; this reader, polled, says so once and never moves it)."""
    from pitstop.statefile import GOODPUT, read_state

    doc = read_state(os.path.join(run_dir, "goodput.json"), GOODPUT, keep_aside=False, then="read as no attempt yet")
    return len(doc["attempts"]) if doc is not None else 0


def _import_matplotlib() -> None:
    """At the lowest priority (this thread's own nice value): only idle CPU, never the trainer's."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):
        pass
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except ImportError:
        pass


def _log_timeline(client, run_id: str, run_dir: str) -> str:
    """Draw the run's time line (``RUN_DIR/timeline.png``, this attempt and those before it) and log it as the run's
    artifact; what went wrong instead, in one line (the run's metrics are sent already: nothing else is lost)."""
    try:
        from pitstop.goodput.timeline import draw

        path = draw(run_dir)
        client.log_artifact(run_id, path)
        return path
    except Exception as e:  # noqa: BLE001 - a picture that cannot be drawn or sent fails nothing else
        return f"not logged: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _open(opts: dict, run_dir: str, params: dict, tags: dict, state: dict, attempts: int):
    """The run to log to: the run dir's (``RUN_DIR/mlflow_run_id``, a resumed job's), marked RUNNING unless a later
    attempt of the run has begun meanwhile (this tracker then belongs to one that died: the run's status is the later
    one's); else a new run in the experiment. Found or made under the run dir's lock (``mlflow_run_id.lock``): a
    killed attempt's tracker and its restart's, starting together, make one run, not two."""
    import fcntl

    with open(os.path.join(run_dir, "mlflow_run_id.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released as the file closes)
        return _find_or_make(opts, run_dir, params, tags, state, attempts)


def _find_or_make(opts: dict, run_dir: str, params: dict, tags: dict, state: dict, attempts: int):
    from mlflow.entities import Param

    t0 = time.perf_counter()
    client = _client(opts["tracking_uri"])
    id_file = os.path.join(run_dir, "mlflow_run_id")
    if os.path.isfile(id_file):
        with open(id_file) as f:
            run_id = f.read().strip()
        try:
            if _attempts(run_dir) <= attempts:
                client.update_run(run_id, status="RUNNING")
            state["mlflow_run_id"] = run_id
            state["mlflow_experiment_id"] = client.get_run(run_id).info.experiment_id
            state["mlflow_send_seconds"] += time.perf_counter() - t0
            return client
        except Exception:  # noqa: BLE001 - store moved or run deleted: start a new run
            pass
    exp = client.get_experiment_by_name(opts["experiment"])
    home = artifact_home(opts["tracking_uri"])
    # (what kind of experiment it is, for whatever reads the tag: MLflow 3.17's UI picks its view from the link's
    # workflowType instead, whatever the tag says; close() logs a link that asks for the training view)
    kind = {EXPERIMENT_KIND: TRAINING}
    if exp is None:
        try:
            exp_id = client.create_experiment(opts["experiment"], artifact_location=home, tags=kind)
        except Exception:  # noqa: BLE001 - another tracker (a replica group's) made it just now
            exp = client.get_experiment_by_name(opts["experiment"])
            if exp is None:
                raise
    if exp is not None:
        exp_id = exp.experiment_id
    if exp is not None and EXPERIMENT_KIND not in exp.tags:  # (one made before, by hand or by an older pitstop)
        client.set_experiment_tag(exp_id, EXPERIMENT_KIND, TRAINING)
    if exp is not None and home and not _under(exp.artifact_location, os.path.dirname(home)):
        # (MLflow cannot move an experiment's artifact location: one made before, by hand or by an older pitstop, keeps
        # its own; the trainer says so at the run's end, with what to do)
        state["mlflow_warning"] = (
            f"MLflow experiment {opts['experiment']!r} keeps its artifacts in {exp.artifact_location}, not beside the "
            f"store ({home}): it was made before, with MLflow's default; logger.experiment=NAME starts one whose "
            "artifacts go beside the store"
        )
    run = client.create_run(exp_id, run_name=opts["run_name"], tags={"run_dir": run_dir, **tags})
    state["mlflow_run_id"], state["mlflow_experiment_id"] = run.info.run_id, exp_id
    with open(id_file, "w") as f:
        f.write(run.info.run_id)
    items = [Param(k[:250], str(v)[:6000]) for k, v in sorted(params.items())]
    for i in range(0, len(items), _PARAM_BATCH):
        client.log_batch(run.info.run_id, params=items[i : i + _PARAM_BATCH])
    state["mlflow_send_seconds"] += time.perf_counter() - t0
    return client


def _flush(client, pending: list, state: dict) -> None:
    if client is None or state["mlflow_run_id"] is None:
        return
    from mlflow.entities import Metric

    t0 = time.perf_counter()
    try:
        for i in range(0, len(pending), _METRIC_BATCH):
            client.log_batch(
                state["mlflow_run_id"], metrics=[Metric(k, v, ts, s) for k, v, ts, s in pending[i : i + _METRIC_BATCH]]
            )
        state["mlflow_metrics_sent"] += len(pending)
    except Exception as e:  # noqa: BLE001 - keep training; report at close
        state["error"] = f"{type(e).__name__}: {e}"
    state["mlflow_send_seconds"] += time.perf_counter() - t0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    _serve()
    # The report is printed and every write is done: leave without the interpreter freeing MLflow's and
    # SQLAlchemy's modules one by one (~1 s of CPU here, which the trainer's close() would wait for).
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, OSError):  # (the trainer died: nobody reads them)
            pass
    os._exit(0)
