"""A checkpoint process that outlives its SIGKILLed trainer (``pitstop.ckpt.orphans``): the next attempt lets it
finish the save it holds, stops it after the wait, and leaves a live trainer's writer alone. The trainer here is a
small interpreter without torch whose "writer" is a ``sleep``; the real checkpoint process is in
``system/test_ckpt.py::test_sigkill_during_background_staging_and_write``."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

import pytest

from pitstop.ckpt import orphans

TRAINER = """
import os, signal, subprocess, sys
from pitstop.ckpt import orphans
writer = subprocess.Popen(["sleep", sys.argv[2]])
orphans.record(sys.argv[1], writer.pid)
print(writer.pid, flush=True)
if sys.argv[3] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
sys.stdin.read()
"""


@pytest.fixture
def tmp_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)  # (records under <tmp>/pitstop-writers-<uid>)
    return tmp_path


def trainer(root, writer_seconds: float, fate: str, tmp) -> tuple[subprocess.Popen, int]:
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"} | {"TMPDIR": str(tmp)}
    p = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(root), str(writer_seconds), fate],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    return p, int(p.stdout.readline())


def records(tmp) -> list[str]:
    return sorted(os.listdir(tmp / f"pitstop-writers-{os.getuid()}"))


def test_a_dead_trainers_writer_is_waited_for_then_stopped_and_a_live_ones_left_alone(tmp_folder, caplog):
    caplog.set_level(logging.INFO, "pitstop.ckpt")
    root = tmp_folder / "ckpt"
    # (a writer that finishes the save it holds within the wait: waited for, never killed)
    p, writer = trainer(root, 1.5, "die", tmp_folder)
    p.wait()
    t0 = time.monotonic()
    assert orphans.end_orphans(str(root), wait=20) == 1
    assert time.monotonic() - t0 < 10 and orphans.started(writer) is None and records(tmp_folder) == []
    assert "still writing its last save" in caplog.text and "it finished in" in caplog.text
    # (one that is still writing after the wait: stopped; its record goes with it)
    p, writer = trainer(root, 120, "die", tmp_folder)
    p.wait()
    assert orphans.end_orphans(str(root), wait=0.5) == 1
    assert orphans.started(writer) is None and records(tmp_folder) == []
    assert "stopped it after" in caplog.text
    # a live trainer's writer (another replica group or rank on this machine), and another dir's: left alone
    live, writer = trainer(root, 120, "live", tmp_folder)
    other, elsewhere = trainer(tmp_folder / "other", 120, "die", tmp_folder)
    other.wait()
    try:
        assert orphans.end_orphans(str(root), wait=0.5) == 0
        assert orphans.started(writer) is not None and orphans.started(elsewhere) is not None
        assert len(records(tmp_folder)) == 2
        assert orphans.end_orphans(str(tmp_folder / "other"), wait=0.1) == 1 and orphans.started(elsewhere) is None
    finally:
        live.kill()
        live.wait()
    # its trainer gone, the writer is an orphan now: stopped after the wait
    assert orphans.end_orphans(str(root), wait=0.5) == 1 and records(tmp_folder) == []
    assert orphans.started(writer) is None


# ---- planted records: nothing is signalled that pitstop did not record ------------------------------------------
@pytest.fixture
def genuine(tmp_folder):
    """A record as a trainer writes it for its checkpoint process (here this test's own ``sleep`` child), its trainer
    then gone: the orphan that ``end_orphans`` stops. Yields (root, the writer, the record's path)."""
    root = str(tmp_folder / "ckpt")
    writer = subprocess.Popen(["sleep", "60"])
    orphans.record(root, writer.pid)
    path = os.path.join(orphans._folder(), f"{orphans._key(root)}-{os.getpid()}.json")
    dead = subprocess.Popen(["sleep", "60"])  # (a trainer that was SIGKILLed: its pid and start time, no process)
    trainer = [dead.pid, orphans.started(dead.pid)]
    dead.kill()
    dead.wait()
    doc = json.loads(open(path).read())
    with open(path, "w") as f:
        json.dump({**doc, "trainer": trainer}, f)
    try:
        yield root, writer, path
    finally:
        writer.kill()
        writer.wait()


def stopped(root, writer) -> bool:
    """``end_orphans`` ran: whether it stopped ``writer`` (a process not stopped is still running)."""
    n = orphans.end_orphans(root, wait=0.1)
    assert n in (0, 1)
    return orphans.started(writer.pid) is None and n == 1


def test_the_records_folder_is_private_and_one_anyone_else_could_have_filled_is_refused(genuine, tmp_folder, caplog):
    caplog.set_level(logging.WARNING, "pitstop.ckpt")
    root, writer, path = genuine
    folder = orphans._folder()
    assert folder == str(tmp_folder / f"pitstop-writers-{os.getuid()}")
    assert os.stat(folder).st_mode & 0o777 == 0o700 and os.stat(path).st_mode & 0o077 == 0
    os.chmod(folder, 0o755)  # (group and others may enter it, if not write: not ours alone)
    assert not stopped(root, writer)
    assert f"records folder {folder} has mode 0755 (group or others may enter it): not used" in caplog.text
    if os.getuid() == 0:  # (only root can give a folder away)
        os.chmod(folder, 0o700)
        os.chown(folder, 65534, 65534)
        assert not stopped(root, writer)
        assert f"{folder} is owned by uid 65534, not by this user (0)" in caplog.text
        os.chown(folder, 0, 0)
    os.chmod(folder, 0o700)
    os.rename(folder, tmp_folder / "elsewhere")  # a link in its place, to a private dir of ours holding the record
    os.symlink(tmp_folder / "elsewhere", folder)
    assert not stopped(root, writer)
    assert f"{folder} is a symbolic link" in caplog.text
    os.unlink(folder)
    os.rename(tmp_folder / "elsewhere", folder)
    assert stopped(root, writer)  # (the same record, in its own folder: the genuine orphan is stopped)


def test_a_record_that_is_not_ours_alone_or_names_another_dir_is_not_believed(genuine, tmp_folder, caplog):
    caplog.set_level(logging.WARNING, "pitstop.ckpt")
    root, writer, path = genuine
    os.chmod(path, 0o666)  # (anyone could have written it)
    assert not stopped(root, writer)
    assert f"{path} is not a record pitstop wrote (owned by uid {os.getuid()} with mode 0666" in caplog.text
    os.chmod(path, 0o600)
    if os.getuid() == 0:
        os.chown(path, 65534, -1)
        assert not stopped(root, writer)
        assert "(owned by uid 65534 with mode 0600, not ours alone)" in caplog.text
        os.chown(path, 0, -1)
    os.rename(path, tmp_folder / "record.json")
    os.symlink(tmp_folder / "record.json", path)
    assert not stopped(root, writer)
    assert f"{path} is not a record pitstop wrote (a symbolic link)" in caplog.text
    os.unlink(path)
    doc = json.loads((tmp_folder / "record.json").read_text())
    with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        json.dump({**doc, "dir": str(tmp_folder / "another")}, f)  # (the right name, another dir inside)
    assert not stopped(root, writer) and os.path.exists(path)
    with open(path, "w") as f:
        json.dump(doc, f)
    assert stopped(root, writer) and not os.path.exists(path)


def test_a_planted_record_naming_an_innocent_process_of_ours_with_its_true_start_time_stops_nothing(
    genuine, tmp_folder, caplog
):
    caplog.set_level(logging.WARNING, "pitstop.ckpt")
    root, writer, path = genuine
    real = json.loads(open(path).read())
    innocent = subprocess.Popen(["sleep", "60"])  # (ours, but no checkpoint process: e.g. the user's editor)
    try:
        pid, start = innocent.pid, orphans.started(innocent.pid)
        # all a planter can learn without reading our processes' environments: pid, start time, command line, boot
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        forged = [
            real["token"],  # (a genuine record's token, lifted)
            hashlib.sha256(b"%d\0%d\0%s\0%s" % (pid, start, cmdline, b"")).hexdigest(),
        ]
        for token in forged:
            plant = os.path.join(orphans._folder(), f"{orphans._key(root)}-{pid + 1}.json")
            with open(os.open(plant, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                json.dump({**real, "writer": [pid, start], "token": token}, f)
            # the old fixed folder, where anyone could plant it, is not read at all
            os.makedirs(tmp_folder / "pitstop-writers", exist_ok=True)
            with open(tmp_folder / "pitstop-writers" / os.path.basename(plant), "w") as f:
                json.dump({**real, "writer": [pid, start], "token": orphans._token(pid, start)}, f)
            assert orphans.end_orphans(root, wait=0.1) == 1  # (the genuine orphan, only)
            assert orphans.started(pid) == start and orphans.started(writer.pid) is None
            assert (
                f"{plant} names process {pid}, which is not the checkpoint process its trainer recorded" in caplog.text
            )
            assert os.path.exists(plant)  # (left as it is: pitstop did not make it)
            writer.wait()
            writer = subprocess.Popen(["sleep", "60"])  # (a genuine orphan again, for the next forgery)
            orphans.record(root, writer.pid)
            fresh = json.loads(open(path).read())
            with open(path, "w") as f:
                json.dump({**fresh, "trainer": real["trainer"]}, f)
    finally:
        innocent.kill()
        innocent.wait()
        writer.kill()
        writer.wait()


def test_the_records_go_under_a_private_xdg_runtime_dir_and_not_under_one_that_is_not(tmp_folder, monkeypatch):
    runtime = tmp_folder / "run-user"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert orphans._folder() == str(runtime / "pitstop-writers")
    runtime.chmod(0o755)  # (su to another user keeps the first user's XDG_RUNTIME_DIR: not ours alone)
    assert orphans._folder() == str(tmp_folder / f"pitstop-writers-{os.getuid()}")
