"""A node's health, checked in about a second before it is used (``trainer.health``): before the first rendezvous and
before each restart, by the launcher of each node (:mod:`pitstop.launch.vetting` decides what a failure means).

The checks, in order; the first that fails is the node's one line:

- ``dirs``: the run dir, ``ckpt.dir`` and ``ckpt.local.dir`` (where local; the local tier is optional: a run
  switches it off with a warning when it cannot be written, so here too it is a warning, not a failure) can be written
  (a probe file is written, synced and removed; in a dir's nearest existing parent while it is not made yet: the check
  makes nothing) and have room for ``trainer.health.room_factor`` checkpoints. A checkpoint's size is the newest
  checkpoint's in ``ckpt.dir`` (its files' sizes), else an estimate from the model's parameters: the model is built on
  torch's ``meta`` device (no memory, no data) and its parameters' float32 bytes are counted once for the weights and
  once per state the optimizer keeps per parameter (``optim.optimizer``: Adam's two moments, SGD's momentum buffer).
- ``shm``: with an async save (``ckpt=async_dcp``), whether ``/dev/shm`` has room for one checkpoint's staging. A
  warning, not a failure: the save's own check is exact (``ckpt/async_dcp.py``: ``ckpt.checkpointer=process`` stops in
  one line at its first save, ``auto`` writes from a thread instead), this one an estimate.
- ``memory``: ``MemAvailable`` of ``/proc/meminfo`` is at least ``trainer.health.min_free_memory_gb``.
- ``matmul``: the best of 5 timings of an N x N float32 matmul on one CPU thread (``trainer.health.matmul_size``) is
  at most ``trainer.health.slow_factor`` x the reference: the faster of the median of the other nodes' medians and the
  median of this node's own past timings (``RUN_DIR/health.json``, the last 8 of each node's passing checks, put on
  record by the attempt the check let start: ``pitstop.resilience.health_record``). With no reference yet (the first
  check in the run dir) it passes and becomes one. A timing over the limit is taken again
  (best of 20) before the check fails: a busy moment is not a bad node.

Where the launcher runs without torch (pitstop's supervisor), the checks run in a fork of its warm server
(:func:`run_checks`), which has torch imported: a few tens of milliseconds.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from pitstop import fsurl
from pitstop.ckpt.layout import write_probe
from pitstop.resilience.bad_node import unwritable
from pitstop.resilience.health_record import HEALTH_FILE, timings

log = logging.getLogger("pitstop.health")

GIB = 1024**3


@dataclass(frozen=True)
class Outcome:
    check: str  # dirs, shm, memory, matmul
    ok: bool
    said: str  # what was measured, or why it failed


@dataclass
class Report:
    node: str
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    matmul: float | None = None  # a passing matmul's seconds: recorded by the attempt once its setup is done

    @property
    def failed(self) -> Outcome | None:
        return next((o for o in self.outcomes if not o.ok), None)

    def line(self) -> str:
        bad = self.failed
        if bad is not None:  # (what is wrong first: the one line a one-node job stops with reads as its cause)
            return f"{bad.said} (node {self.node} failed its health check '{bad.check}')"
        return f"node {self.node} is healthy ({self.seconds:.2f} s): " + "; ".join(o.said for o in self.outcomes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "seconds": self.seconds,
            "outcomes": [asdict(o) for o in self.outcomes],
            "matmul": self.matmul,
        }

    @staticmethod
    def from_dict(doc: dict[str, Any]) -> Report:
        outcomes = [Outcome(**o) for o in doc["outcomes"]]
        return Report(str(doc["node"]), outcomes, float(doc["seconds"]), doc.get("matmul"))


# ---- pure rules ---------------------------------------------------------------------------------------------------
def reference(own: list[float], peers: dict[str, list[float]]) -> float | None:
    """The matmul time a healthy node should be near: the faster of the median of the other nodes' medians and the
    median of this node's own past (None: nothing on record yet)."""
    medians = [statistics.median(v) for v in peers.values() if v]
    candidates = [statistics.median(medians)] if medians else []
    if own:
        candidates.append(statistics.median(own))
    return min(candidates) if candidates else None


def too_slow(seconds: float, ref: float | None, factor: float) -> bool:
    return ref is not None and seconds > factor * ref


def mem_available(meminfo: str) -> int | None:
    """``MemAvailable`` of ``/proc/meminfo``'s text, in bytes (None if it is not there)."""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            return int(parts[1]) * 1024
    return None


def room(path: str, need: int, free: int) -> Outcome:
    if free < need:
        return Outcome(
            "dirs", False, f"{path} has {free / GIB:.2f} GiB free, a checkpoint needs {need / GIB:.2f} GiB there"
        )
    return Outcome("dirs", True, f"{path} writable, {free / GIB:.1f} GiB free")


# ---- probes -------------------------------------------------------------------------------------------------------
def free_bytes(path: str) -> int:
    """Free bytes for this user on the filesystem of ``path`` (its nearest existing parent)."""
    while not os.path.exists(path):
        path = os.path.dirname(path) or "/"
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def probe_write(path: str) -> str | None:
    """Why ``path`` cannot be written (a probe file written, synced, removed), or None. A dir not made yet is probed in
    its nearest existing parent (where it would be made): the check leaves nothing behind."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        return f"{path} is not a directory"
    try:
        write_probe(os.path.join(path, f".health-probe-{os.getpid()}"))
    except OSError as e:
        return e.strerror or str(e)
    return None


def newest_checkpoint_bytes(root: str) -> int | None:
    """The size of the newest complete checkpoint under ``root`` (None: there is none)."""
    from pitstop.ckpt.layout import list_checkpoints

    try:
        done = [path for _, path, complete in list_checkpoints(root) if complete]
    except OSError:
        return None
    if not done:
        return None
    total = 0
    for base, _, files in os.walk(done[-1]):
        for name in files:
            try:
                total += os.lstat(os.path.join(base, name)).st_size
            except OSError:
                pass
    return total


def optimizer_copies(optimizer: Any) -> int:
    """Copies of the parameters a checkpoint holds: the weights, and each state the optimizer keeps per parameter
    (``optim.optimizer``: Adam/AdamW 2, SGD with momentum 1, else 0)."""
    target = str(OmegaConf.select(optimizer, "_target_", default="") or "") if optimizer is not None else ""
    if "Adam" in target:
        return 3
    if target.endswith(".SGD") and float(OmegaConf.select(optimizer, "momentum", default=0) or 0) > 0:
        return 2
    return 1


def estimated_checkpoint_bytes(cfg: DictConfig) -> int | None:
    """The float32 bytes of the model's parameters x :func:`optimizer_copies`, the model built on the meta device
    (None if it cannot be)."""
    try:
        import torch

        from pitstop.config.build import build

        with torch.device("meta"):
            model = build(cfg.model)
        copies = optimizer_copies(OmegaConf.select(cfg, "optim.optimizer", default=None))
        return copies * 4 * sum(p.numel() for p in model.parameters())
    except Exception as e:  # noqa: BLE001 - a model that cannot be built here is the attempt's to report
        log.debug("health: the model's size could not be estimated (%s)", e)
        return None


def matmul_seconds(n: int, reps: int = 5) -> float:
    """The best of ``reps`` timings of an n x n float32 matmul on one thread (after one untimed)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.rand(n, n, generator=g), torch.rand(n, n, generator=g)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t)
        return best
    finally:
        torch.set_num_threads(threads)


# ---- the checks ---------------------------------------------------------------------------------------------------
def dirs_to_check(cfg: DictConfig, run_dir: str) -> list[tuple[str, str, bool]]:
    """``(key, local path, holds checkpoints)`` of each dir the node writes: run dir, ckpt.dir, ckpt.local.dir."""
    out = [("run_dir", run_dir, False)]
    ckpt = cfg.get("ckpt")
    if ckpt is None or str(ckpt.get("_target_", "")).endswith(".NoCheckpoint"):
        return out
    root = OmegaConf.select(cfg, "ckpt.dir", default=None)
    if root and not fsurl.is_url(str(root)):
        out.append(("ckpt.dir", str(root), True))
    local = OmegaConf.select(cfg, "ckpt.local.dir", default=None)
    if local and root:
        local = f"/dev/shm/pitstop-{os.getuid()}" if local == "auto" else str(local)
        out.append(("ckpt.local.dir", local, True))
    return out


def checks(cfg: DictConfig, run_dir: str, node: str, meminfo: Callable[[], str] | None = None) -> Report:
    """Run the node's checks (in this process; torch is imported for the matmul and the model's size)."""
    t0 = time.perf_counter()
    h = cfg.trainer.health
    report = Report(node)
    spots = dirs_to_check(cfg, run_dir)
    root = next((p for k, p, _ in spots if k == "ckpt.dir"), None)
    size = newest_checkpoint_bytes(root) if root else None
    how = "the newest checkpoint's size"
    if size is None and any(holds for _, _, holds in spots):
        size, how = estimated_checkpoint_bytes(cfg), "the model's parameters and optimizer state, estimated"
    need = int((size or 0) * float(h.room_factor))
    fault = cfg.get("fault")
    notes = []
    for key, path, holds in spots:
        why = "fault=bad_node: unwritable (injected)" if key == "ckpt.dir" and unwritable(fault, node) else None
        why = why or probe_write(path)
        said = f"{key} {path} is not writable ({why})" if why else None
        if said is None:
            out = room(path, need if holds else 0, free_bytes(path))
            said = None if out.ok else f"{key} {out.said} ({how} x trainer.health.room_factor={h.room_factor:g})"
        if said is not None and key == "ckpt.local.dir":  # (optional: the run switches it off with a warning)
            log.warning("health: %s; the local checkpoint tier will be off", said)
            notes.append(f"{said}: the local tier will be off")
        elif said is not None:
            report.outcomes.append(Outcome("dirs", False, said))
            break
    else:
        text = f"{len(spots)} dir(s) writable, room for {need / GIB:.2f} GiB"
        report.outcomes.append(Outcome("dirs", True, "; ".join([text, *notes])))
    if str(OmegaConf.select(cfg, "ckpt._target_", default="")).endswith(".AsyncDCP") and size:
        free = free_bytes("/dev/shm") if os.path.isdir("/dev/shm") else None
        if free is not None and free < size:
            said = (
                f"/dev/shm has {free / GIB:.2f} GiB free, an async save's staging needs ~{size / GIB:.2f} "
                "(ckpt.checkpointer=process would stop at its first save, auto writes from a thread)"
            )
            log.warning("health: %s", said)
            report.outcomes.append(Outcome("shm", True, said))  # (a warning: the save's own check is exact)
        else:
            report.outcomes.append(Outcome("shm", True, "/dev/shm has room for staging"))
    text = meminfo() if meminfo is not None else _read("/proc/meminfo")
    avail = mem_available(text)
    want = float(h.min_free_memory_gb) * GIB
    if avail is not None and avail < want:
        report.outcomes.append(
            Outcome("memory", False, f"{avail / GIB:.2f} GiB free, trainer.health.min_free_memory_gb={want / GIB:g}")
        )
    else:
        report.outcomes.append(Outcome("memory", True, f"{(avail or 0) / GIB:.1f} GiB free"))
    outcome, report.matmul = matmul_check(run_dir, node, int(h.matmul_size), float(h.slow_factor))
    report.outcomes.append(outcome)
    report.seconds = round(time.perf_counter() - t0, 4)
    return report


def matmul_check(run_dir: str, node: str, n: int, factor: float) -> tuple[Outcome, float | None]:
    """The matmul's outcome, and its seconds when it passed (for the record)."""
    past = timings(run_dir)
    own = past.pop(node, [])
    ref = reference(own, past)
    seconds = matmul_seconds(n)
    if too_slow(seconds, ref, factor):
        seconds = min(seconds, matmul_seconds(n, reps=20))  # (taken again: a busy moment is not a bad node)
    ref_text = f"{ref * 1e3:.2f} ms" if ref is not None else "none yet"
    if too_slow(seconds, ref, factor):
        said = (
            f"a {n}x{n} matmul took {seconds * 1e3:.2f} ms, over trainer.health.slow_factor={factor:g} x the "
            f"reference {ref_text} (its peers' and its own past timings, {HEALTH_FILE})"
        )
        return Outcome("matmul", False, said), None
    return Outcome("matmul", True, f"matmul {seconds * 1e3:.2f} ms (reference {ref_text})"), seconds


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


# ---- in a fork of the launcher's warm server ------------------------------------------------------------------------
def _child(conn: Any, cfg_yaml: str, run_dir: str, node: str) -> None:
    try:
        conn.send(checks(OmegaConf.create(cfg_yaml), run_dir, node).to_dict())
    except BaseException as e:  # noqa: BLE001 - said as the check's failure
        conn.send({"node": node, "seconds": 0.0, "outcomes": [asdict(Outcome("checks", False, repr(e)[:300]))]})
    finally:
        conn.close()


def run_checks(ctx: Any, cfg_yaml: str, run_dir: str, node: str, timeout: float = 60.0) -> Report:
    """:func:`checks` in a child of ``ctx`` (the launcher's multiprocessing context: a fork of its warm server)."""
    from pitstop.notices import notices_blocked

    t0 = time.perf_counter()
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, cfg_yaml, run_dir, node), name="pitstop-health")
    with notices_blocked():
        child.start()
    send.close()
    try:
        if receive.poll(timeout):
            report = Report.from_dict(receive.recv())
        else:
            report = Report(node, [Outcome("checks", False, f"the checks did not finish within {timeout:.0f} s")])
    except (EOFError, OSError):
        report = Report(node, [Outcome("checks", False, f"the checks' process died (exit {child.exitcode})")])
    finally:
        child.join(5)
        if child.is_alive():
            child.kill()
            child.join()
    report.seconds = round(time.perf_counter() - t0, 4)
    return report
