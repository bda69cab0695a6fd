"""Checkpoint processes that outlive their trainer.

``ckpt.checkpointer=process`` hands each save to a process of its own. When the trainer is SIGKILLed (a fault, the
OOM killer, a scheduler), that process goes on writing the save it holds: its parent's death reaches it only when
it next reads a request. A new attempt that restored and saved the same step at the same time would share a step
dir with it, and the old writer's commit marker could land among the new attempt's files.

So each checkpoint process is recorded, per machine, in ``<tmp>/pitstop-writers/<key>-<trainer pid>.json`` (``key``
names ``ckpt.dir``). Before it restores, a new attempt finds the writers of trainers that are gone, lets each finish
the save it holds (up to ``ORPHAN_WAIT`` seconds: a finished save is one step less to redo), and stops any still
writing after that. A live trainer's writer (another replica group on this machine) is left alone.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import signal
import socket
import tempfile
import time

log = logging.getLogger("pitstop.ckpt")

ORPHAN_WAIT = 30.0


def _folder() -> str:
    return os.path.join(tempfile.gettempdir(), "pitstop-writers")


def _key(root: str) -> str:
    return hashlib.sha256(os.path.abspath(root).encode() if "://" not in root else root.encode()).hexdigest()[:16]


def started(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot, from /proc), or None if there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # from field 3 (the name before may hold spaces)
    return None if fields[0] in ("Z", "X") else int(fields[19])  # (a zombie has ended) field 22: start time


def _alive(pid: int, start: int | None) -> bool:
    return start is not None and started(pid) == start


def _boot() -> str:
    """This machine and boot (a pid and its start time name one process only within them)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def record(root: str, writer_pid: int) -> None:
    """Note this trainer's checkpoint process (a hint: without it, only the cleanup below is lost)."""
    me = os.getpid()
    writer, trainer = started(writer_pid), started(me)
    if writer is None or trainer is None:  # (no /proc: not Linux)
        return
    path = os.path.join(_folder(), f"{_key(root)}-{me}.json")
    try:
        os.makedirs(_folder(), exist_ok=True)
        with open(f"{path}.tmp", "w") as f:
            json.dump({"trainer": [me, trainer], "writer": [writer_pid, writer], "dir": root, "boot": _boot()}, f)
        os.replace(f"{path}.tmp", path)
    except OSError:
        pass


def forget(root: str) -> None:
    """This trainer's checkpoint process is gone (the run ended cleanly)."""
    try:
        os.unlink(os.path.join(_folder(), f"{_key(root)}-{os.getpid()}.json"))
    except OSError:
        pass


def end_orphans(root: str, wait: float = ORPHAN_WAIT) -> int:
    """Wait for, then stop, the checkpoint processes of dead trainers that wrote to ``root`` from this machine.
    Returns how many were still running."""
    orphans, records, boot = [], [], _boot()
    for path in glob.glob(os.path.join(_folder(), f"{_key(root)}-*.json")):
        try:
            with open(path) as f:
                doc = json.load(f)
            (tpid, tstart), (wpid, wstart) = doc["trainer"], doc["writer"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if doc.get("boot") != boot:  # another machine's or boot's (a temp dir that is shared or kept): not ours
            continue
        if _alive(tpid, tstart):
            continue  # a live trainer's (another replica group here, or another rank)
        if _alive(wpid, wstart):
            orphans.append((wpid, wstart))
        records.append(path)  # (removed once its writer is gone: another rank here may be looking at it too)
    if orphans:
        _wait_or_stop(orphans, wait)
    for path in records:
        try:
            os.unlink(path)
        except OSError:
            pass
    return len(orphans)


def _wait_or_stop(orphans: list[tuple[int, int]], wait: float) -> None:
    pids = ", ".join(str(p) for p, _ in orphans)
    log.warning(
        "the checkpoint process of a killed attempt (pid %s) is still writing its last save: waiting up to %.0f s "
        "for it to finish before restoring",
        pids,
        wait,
    )
    t0 = time.monotonic()
    while any(_alive(*o) for o in orphans) and time.monotonic() - t0 < wait:
        time.sleep(0.05)
    late = [o for o in orphans if _alive(*o)]
    for pid, _ in late:
        try:
            os.kill(pid, signal.SIGKILL)  # its save stays partial (no commit marker) and is never loaded
        except OSError:  # (gone meanwhile; or not ours to stop after all)
            pass
    while any(_alive(*o) for o in late) and time.monotonic() - t0 < wait + 5:
        time.sleep(0.05)
    if late:
        log.warning("stopped it after %.0f s; its save stays partial and is skipped", wait)
    else:
        log.info("it finished in %.2f s", time.monotonic() - t0)
