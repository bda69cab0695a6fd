"""Checkpoint processes that outlive their trainer.

``ckpt.checkpointer=process`` hands each save to a process of its own. When the trainer is SIGKILLed (a fault, the
OOM killer, a scheduler), that process goes on writing the save it holds: its parent's death reaches it only when
it next reads a request. A new attempt that restored and saved the same step at the same time would share a step
dir with it, and the old writer's commit marker could land among the new attempt's files.

So each checkpoint process is recorded, per machine, in ``<folder>/<key>-<trainer pid>.json`` (``key`` names
``ckpt.dir``). Before it restores, a new attempt finds the writers of trainers that are gone, lets each finish
the save it holds (up to ``ORPHAN_WAIT`` seconds: a finished save is one step less to redo), and stops any still
writing after that. A live trainer's writer (another replica group on this machine) is left alone.

A record is a request to SIGKILL a process, so nothing in it is believed unchecked:

- the folder is this user's own: ``$XDG_RUNTIME_DIR/pitstop-writers`` (when that is a private dir of ours), else
  ``<tmp>/pitstop-writers-<uid>``, created ``0700``; one that is not ours, is a link, or lets group or others in
  (anyone could have planted records there) is refused with a warning, and then no process is signalled;
- a record is a regular file of ours, not a link, that only we may write, of the shape :func:`record` writes;
- its ``dir`` is the dir being restored, its machine and boot are this one's;
- the process it names is the one the trainer recorded: same start time (a pid alone is reused), owned by us, and
  carrying the record's ``token``, a digest of the process's pid, start time, command line and environment taken
  when the trainer recorded its own child. ``/proc/PID/environ`` is readable by the process's owner alone, so
  whoever can write a record but not read our processes cannot make one that names an innocent process of ours.

The signal itself goes through a pidfd opened before the last check, so the pid cannot be reused between them.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import signal
import socket
import stat
import tempfile
import time

from pitstop.statefile import Damaged, integer, listof, record as shape, string

log = logging.getLogger("pitstop.ckpt")

ORPHAN_WAIT = 30.0


def _folder() -> str:
    """This user's folder of records (see the module docstring; :func:`_private` checks it before use)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime) and _private(runtime) is None:
        return os.path.join(runtime, "pitstop-writers")
    return os.path.join(tempfile.gettempdir(), f"pitstop-writers-{os.getuid()}")


def _private(path: str) -> str | None:
    """None if ``path`` is a real dir of ours that only we may enter; else what is wrong with it."""
    from pitstop.ckpt.layout import not_ours

    try:
        return not_ours(path, 0o077)
    except OSError as e:
        return f"cannot be read ({e.strerror})"


_refused: set[tuple[str, str]] = set()  # (folder, what is wrong) already warned about in this process


def _checked_folder(create: bool) -> str | None:
    """The records' folder, made ``0700`` if ``create`` and missing; None (warned once) if it is not private, or
    (quietly) if it does not exist and is not to be made."""
    folder = _folder()
    if create:
        try:
            os.mkdir(folder, 0o700)  # (the umask may only take bits away)
        except FileExistsError:
            pass
        except OSError:
            return None
    elif not os.path.lexists(folder):
        return None
    wrong = _private(folder)
    if wrong is None:
        return folder
    if (folder, wrong) not in _refused:
        _refused.add((folder, wrong))
        log.warning(
            "the checkpoint processes' records folder %s %s: not used, and no orphaned checkpoint process is stopped; "
            "remove it (another user may have planted records in it) or set TMPDIR to a private dir",
            folder,
            wrong,
        )
    return None


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


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat_ = f.read()
    except OSError:
        return None
    return int(stat_[stat_.rindex(")") + 2 :].split()[1])  # field 4: the parent's pid


def _token(pid: int, start: int) -> str | None:
    """A digest of what only the process's owner can read of it (its environment) with what names it: the same for
    the life of the process, and not computable by someone who cannot read our processes. None: unreadable."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:
        return None
    if not cmdline:  # (a process in the middle of its exec: nothing to know it by yet)
        return None
    return hashlib.sha256(b"%d\0%d\0%s\0%s" % (pid, start, cmdline, environ)).hexdigest()


def _settled_token(pid: int, start: int, limit: float = 1.0) -> str | None:
    """The token of a process that was just started: read until two reads agree (a child returned by spawn may
    still be in its exec, its command line and environment not yet those it keeps), for up to ``limit`` s."""
    t0, last = time.monotonic(), None
    while time.monotonic() - t0 < limit:
        token = _token(pid, start)
        if token is not None and token == last:
            return token
        last = token
        time.sleep(0.005)
    return None


def _ours(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


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
    if writer is None or trainer is None or _parent(writer_pid) != me:  # (no /proc: not Linux; not our child)
        return
    token = _settled_token(writer_pid, writer)
    folder = _checked_folder(create=True)
    if token is None or folder is None:
        return
    doc = {"trainer": [me, trainer], "writer": [writer_pid, writer], "dir": root, "boot": _boot(), "token": token}
    path = os.path.join(folder, f"{_key(root)}-{me}.json")
    try:
        fd = os.open(f"{path}.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(f"{path}.tmp", path)
    except OSError:
        pass


def forget(root: str) -> None:
    """This trainer's checkpoint process is gone (the run ended cleanly)."""
    folder = _checked_folder(create=False)
    if folder is None:
        return
    try:
        os.unlink(os.path.join(folder, f"{_key(root)}-{os.getpid()}.json"))
    except OSError:
        pass


PAIR = listof(integer(0))
RECORD = shape({"trainer": PAIR, "writer": PAIR, "dir": string, "boot": string, "token": string})


def _read(path: str) -> dict:
    """A record of ours, or Damaged saying why it is not believed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise Damaged("a symbolic link" if os.path.islink(path) else f"unreadable ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise Damaged("not a regular file")
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise Damaged(f"owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}, not ours alone")
        data = f.read(1 << 16)
    try:
        doc = json.loads(data)
    except ValueError:
        raise Damaged("not JSON") from None
    RECORD(doc, "")
    if len(doc["trainer"]) != 2 or len(doc["writer"]) != 2:
        raise Damaged("trainer and writer must be [pid, start time]")
    return doc


def _same_dir(a: str, b: str) -> bool:
    return a == b if "://" in a or "://" in b else os.path.abspath(a) == os.path.abspath(b)


def end_orphans(root: str, wait: float = ORPHAN_WAIT) -> int:
    """Wait for, then stop, the checkpoint processes of dead trainers that wrote to ``root`` from this machine.
    Returns how many were still running."""
    folder = _checked_folder(create=False)
    if folder is None:
        return 0
    orphans, records, boot = [], [], _boot()
    for path in glob.glob(os.path.join(glob.escape(folder), f"{_key(root)}-*.json")):
        try:
            doc = _read(path)
        except Damaged as e:
            log.warning("%s is not a record pitstop wrote (%s): ignored, and no process is signalled for it", path, e)
            continue
        (tpid, tstart), (wpid, wstart) = doc["trainer"], doc["writer"]
        if doc["boot"] != boot or not _same_dir(doc["dir"], root):  # another machine's, boot's or dir's: not ours
            continue
        if _alive(tpid, tstart):
            continue  # a live trainer's (another replica group here, or another rank)
        if _alive(wpid, wstart):
            if not _ours(wpid) or _token(wpid, wstart) != doc["token"]:
                log.warning(
                    "%s names process %d, which is not the checkpoint process its trainer recorded (another owner, "
                    "or another command line or environment): left alone",
                    path,
                    wpid,
                )
                continue  # (and the record stays: pitstop did not make what it names)
            orphans.append((wpid, wstart, doc["token"]))
        records.append(path)  # (removed once its writer is gone: another rank here may be looking at it too)
    if orphans:
        _wait_or_stop(orphans, wait)
    for path in records:
        try:
            os.unlink(path)
        except OSError:
            pass
    return len(orphans)


def _wait_or_stop(orphans: list[tuple[int, int, str]], wait: float) -> None:
    pids = ", ".join(str(p) for p, _, _ in orphans)
    log.warning(
        "the checkpoint process of a killed attempt (pid %s) is still writing its last save: waiting up to %.0f s "
        "for it to finish before restoring",
        pids,
        wait,
    )
    t0 = time.monotonic()
    while any(_alive(p, s) for p, s, _ in orphans) and time.monotonic() - t0 < wait:
        time.sleep(0.05)
    late = [o for o in orphans if _alive(o[0], o[1])]
    for pid, start, token in late:
        _stop(pid, start, token)  # its save stays partial (no commit marker) and is never loaded
    while any(_alive(p, s) for p, s, _ in late) and time.monotonic() - t0 < wait + 5:
        time.sleep(0.05)
    if late:
        log.warning("stopped it after %.0f s; its save stays partial and is skipped", wait)
    else:
        log.info("it finished in %.2f s", time.monotonic() - t0)


def _stop(pid: int, start: int, token: str) -> None:
    """SIGKILL the process ``pid`` if it still is the one recorded: checked through a pidfd opened first, so the
    pid cannot name another process by the time the signal is sent."""
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:  # (gone meanwhile)
        return
    except (OSError, AttributeError):  # (a kernel before 5.3: the checks just before the signal must do)
        pidfd = None
    try:
        if not (_alive(pid, start) and _ours(pid) and _token(pid, start) == token):
            return
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except OSError:  # (gone meanwhile)
        pass
    finally:
        if pidfd is not None:
            os.close(pidfd)
