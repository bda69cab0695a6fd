"""The comparison report of a ``-m`` sweep: a Hydra callback writing ``report.md``, ``report.csv`` and
``report.png`` into the sweep dir.

It reads what every job left in its own dir — ``.hydra/overrides.yaml``, ``summary.json`` (``goodput``
totals, samples, accuracy) or, for a failed job, ``failed.json`` / the last error line of ``train.log`` —
so it works the same with the basic, joblib and submitit launchers. The report is refreshed after every
job (``on_job_end``: a sweep whose jobs fail still gets one, with the failures in their rows) and at the
end of the sweep (``on_multirun_end``).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import uuid
from typing import TYPE_CHECKING, Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from pitstop.goodput.ledger import JOB_BUCKETS
from pitstop.statefile import SUMMARY, Damaged, parse
from pitstop.telemetry.metrics import write_json_atomic, write_text_atomic

if TYPE_CHECKING:
    from hydra.core.utils import JobReturn

log = logging.getLogger("pitstop.goodput.report")

BUCKETS = JOB_BUCKETS
COLORS = {
    "productive": "#2e7d32",
    "data_wait": "#f9a825",
    "checkpoint": "#1565c0",
    "eval": "#7b1fa2",
    "program_start": "#4e342e",
    "health": "#26a69a",
    "init": "#795548",
    "restore": "#a1887f",
    "recovery_gap": "#ff7043",
    "compile": "#bcaaa4",
    "lost": "#c62828",
    "quorum": "#00838f",
    "discarded": "#ef9a9a",
    "instability": "#ff6f00",
    "sdc": "#4a148c",
    "straggler": "#f06292",
    "other": "#9e9e9e",
}


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _summary(job_dir: str) -> tuple[dict | None, str]:
    """The job's ``summary.json`` if it has the shape pitstop writes; else None and why (the report reads the
    user's files: a damaged one is named, never moved)."""
    path = os.path.join(job_dir, "summary.json")
    try:
        return parse(path, SUMMARY), ""
    except FileNotFoundError:
        return None, ""
    except (OSError, Damaged) as e:
        why = f"{path} is unreadable ({e})"
        log.warning("%s: its row says so", why)
        return None, why


def _overrides(job_dir: str) -> list[str]:
    import yaml

    try:
        with open(os.path.join(job_dir, ".hydra", "overrides.yaml")) as f:
            return [str(o) for o in (yaml.safe_load(f) or [])]
    except OSError:
        return []


def _last_error(job_dir: str) -> str:
    failed = _read_json(os.path.join(job_dir, "failed.json"))
    if failed:
        return str(failed.get("error", "failed"))
    try:
        with open(os.path.join(job_dir, "train.log")) as f:
            errors = [ln.strip() for ln in f if "[ERROR]" in ln]
        if errors:
            return errors[-1].split(" - ", 1)[-1][:200]
    except OSError:
        pass
    return "no summary.json (killed, or still running)"


def collect(sweep_dir: str) -> list[dict[str, Any]]:
    """One row per job dir of the sweep, in job order."""
    rows = []
    names = sorted((d for d in os.listdir(sweep_dir) if d.isdigit()), key=int) if os.path.isdir(sweep_dir) else []
    for name in names:
        job_dir = os.path.join(sweep_dir, name)
        row: dict[str, Any] = {"job": int(name), "overrides": _overrides(job_dir), "dir": job_dir}
        s, damaged = _summary(job_dir)
        if s is None:
            row.update(status="FAILED", error=damaged or _last_error(job_dir))
        else:
            g = s.get("goodput") or {}
            totals = g.get("totals") or {}
            total = totals.get("total") or s.get("wall_clock", {}).get("total") or 0.0
            row.update(
                status="ok",
                goodput=g.get("goodput"),
                total_s=total,
                totals=totals,
                checkpoint_s=totals.get("checkpoint"),
                restarts=g.get("restarts", 0),
                failures=g.get("failures", 0),
                restart_s=g.get("restart_seconds"),
                data_wait=(totals.get("data_wait", 0.0) / total) if total else None,
                samples_per_s=(s.get("samples_seen", 0) / total) if total else None,
                accuracy=(s.get("metrics") or {}).get("val_accuracy"),
                per_device=(s.get("throughput") or {}).get("samples_per_s_per_device"),
                step_p50_ms=_ms((s.get("throughput") or {}).get("step_seconds_p50")),
                mfu=(s.get("throughput") or {}).get("mfu"),
            )
        rows.append(row)
    varying = _varying_keys(rows)
    for row in rows:
        row["label"] = " ".join(o for o in row["overrides"] if o.split("=", 1)[0] in varying) or f"job {row['job']}"
    return rows


def _varying_keys(rows: list[dict]) -> set[str]:
    values: dict[str, set[str]] = {}
    for row in rows:
        for o in row["overrides"]:
            k, _, v = o.partition("=")
            values.setdefault(k, set()).add(v)
    varying = {
        k
        for k, vs in values.items()
        if len(vs) > 1 or any(k not in {o.partition("=")[0] for o in r["overrides"]} for r in rows)
    }
    return varying or set(values)


def _ms(seconds: float | None) -> float | None:
    return seconds * 1e3 if seconds is not None else None


def _fmt(v: str | float | None, kind: str) -> str:
    if v is None:
        return "n/a" if kind == "mfu" else "–"
    if kind == "mfu":
        return f"{v * 100:.1f}%"
    if kind == "pct":
        return f"{v * 100:.1f}%"
    if kind == "f1":
        return f"{v:.1f}"
    if kind == "f2":
        return f"{v:.2f}"
    if kind == "acc":
        return f"{v:.4f}"
    return str(v)


COLUMNS = [
    ("configuration", "label", "str"),
    ("status", "status", "str"),
    ("goodput", "goodput", "pct"),
    ("ckpt stall s", "checkpoint_s", "f2"),
    ("data wait", "data_wait", "pct"),
    ("samples/s", "samples_per_s", "f1"),
    ("samples/s/device (steps)", "per_device", "f1"),
    ("step p50 ms", "step_p50_ms", "f1"),
    ("MFU", "mfu", "mfu"),
    ("val acc", "accuracy", "acc"),
    ("restarts", "restarts", "str"),
    ("R s/restart", "restart_s", "f2"),
    ("wall s", "total_s", "f1"),
]


def write_report(sweep_dir: str) -> list[dict]:
    rows = collect(sweep_dir)
    if not rows:
        return rows
    md = io.StringIO()
    md.write(f"# Sweep comparison: {os.path.basename(os.path.normpath(sweep_dir))}\n\n")
    md.write("| " + " | ".join(c[0] for c in COLUMNS) + " |\n")
    md.write("|" + "|".join("---" if c[2] == "str" else "---:" for c in COLUMNS) + "|\n")
    for r in rows:
        cells = [_fmt(r.get(key), kind) for _, key, kind in COLUMNS]
        if r["status"] != "ok":
            cells[1] = f"FAILED: {r['error']}".replace("|", "/")
        md.write("| " + " | ".join(cells) + " |\n")
    md.write(
        "\ngoodput = productive compute / wall clock summed over restarts (each job's goodput.json). "
        "samples/s/device (steps) = samples per second of training steps on one device (fetch + compute; MFU "
        "against the device's peak, n/a on CPU). "
        "R = restart cost per automatic restart: recovery gap + program start + init + restore + compile. Every job is "
        "charged a program start (interpreter + imports): jobs that ran after the first in one process "
        "(in-process sweeps) are charged the one their process measured, as if started alone. "
        "![breakdown](report.png)\n"
    )
    write_text_atomic(os.path.join(sweep_dir, "report.md"), md.getvalue(), fsync=False)

    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(
        [
            "job",
            "configuration",
            "status",
            "error",
            "goodput",
            "checkpoint_s",
            "data_wait_fraction",
            "samples_per_s",
            "val_accuracy",
            "restarts",
            "failures",
            "restart_seconds",
            "wall_s",
            "samples_per_s_per_device",
            "step_p50_ms",
            "mfu",
            *[f"{b}_s" for b in BUCKETS],
        ]
    )
    for r in rows:
        t = r.get("totals") or {}
        w.writerow(
            [
                r["job"],
                r["label"],
                r["status"],
                r.get("error", ""),
                r.get("goodput"),
                r.get("checkpoint_s"),
                r.get("data_wait"),
                r.get("samples_per_s"),
                r.get("accuracy"),
                r.get("restarts"),
                r.get("failures"),
                r.get("restart_s"),
                r.get("total_s"),
                r.get("per_device"),
                r.get("step_p50_ms"),
                r.get("mfu"),
                *[t.get(b) for b in BUCKETS],
            ]
        )
    write_text_atomic(os.path.join(sweep_dir, "report.csv"), buf.getvalue(), fsync=False)
    _plot(rows, os.path.join(sweep_dir, "report.png"))
    return rows


SEEN = 0.002  # the least share of a bar the legend names (less is under a pixel wide)


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(  # (constrained: the legend below the axes' labels, never over them)
        1, 2, figsize=(12, 1.6 + 0.55 * len(rows)), sharey=True, gridspec_kw={"width_ratios": [3, 1.3]},
        layout="constrained",
    )  # fmt: skip
    y = list(range(len(rows)))
    shown: set[str] = set()
    for i, r in enumerate(rows):
        t, total = r.get("totals") or {}, r.get("total_s") or 0.0
        if r["status"] != "ok" or not total:
            ax1.barh(i, 1.0, color="white", edgecolor=COLORS["lost"], hatch="//")
            ax1.text(0.5, i, "FAILED", ha="center", va="center", color=COLORS["lost"], fontweight="bold")
            continue
        left = 0.0
        for b in BUCKETS:
            frac = (t.get(b) or 0.0) / total
            ax1.barh(
                i,
                frac,
                left=left,
                color=COLORS[b],
                label=b if frac >= SEEN and b not in shown and not shown.add(b) else None,  # (only what is seen)
            )
            left += frac
        ax1.text(0.01, i, f"{r['goodput'] * 100:.1f}%", va="center", color="white", fontweight="bold", fontsize=9)
        ax2.barh(i, r.get("samples_per_s") or 0.0, color="#455a64")
        ax2.text(r.get("samples_per_s") or 0.0, i, f" {r.get('samples_per_s') or 0:.0f}", va="center", fontsize=8)
    ax1.set_yticks(y, labels, fontsize=8)
    ax1.invert_yaxis()
    ax1.set_xlim(0, 1)
    ax1.set_xlabel("share of wall clock (all restarts)")
    ax1.set_title("where the time went (goodput = productive)")
    ax2.set_xlabel("samples/s (wall clock)")
    ax2.set_title("throughput")
    if shown:
        fig.legend(ncol=6, fontsize=8, loc="outside lower center", frameon=False)
    tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


class SweepReport(Callback):
    """Registered in ``conf/train.yaml`` under ``hydra.callbacks``; acts only in ``-m`` runs."""

    def on_job_end(self, config: DictConfig, job_return: JobReturn | None, **kwargs: object) -> None:
        from hydra.core.utils import JobStatus
        from hydra.types import RunMode

        if config.hydra.mode != RunMode.MULTIRUN:
            return
        if job_return is not None and job_return.status == JobStatus.FAILED:
            err = job_return._return_value
            line = (str(err).strip().splitlines() or [type(err).__name__])[-1][:300]
            write_json_atomic(
                os.path.join(config.hydra.runtime.output_dir, "failed.json"),
                {"error": f"{type(err).__name__}: {line}" if not _is_pitstop(err) else line},
                fsync=False,
            )
        self._write(config.hydra.sweep.dir)

    def on_multirun_end(self, config: DictConfig, **kwargs: object) -> None:
        rows = self._write(config.hydra.sweep.dir)
        if rows:
            log.info("sweep report: %s (and report.csv, report.png)", os.path.join(config.hydra.sweep.dir, "report.md"))

    @staticmethod
    def _write(sweep_dir: str) -> list[dict]:
        from filelock import FileLock

        try:
            with FileLock(os.path.join(sweep_dir, ".report.lock")):  # one writer at a time (joblib, submitit)
                return write_report(sweep_dir)
        except Exception as e:  # noqa: BLE001 - a report problem must not fail the sweep's jobs
            log.error("could not write the sweep report in %s: %s", sweep_dir, e)
            return []


def _is_pitstop(err: BaseException) -> bool:
    from pitstop.errors import PitstopError

    return isinstance(err, PitstopError)
