"""A checkpoint process that outlives its SIGKILLed trainer (``pitstop.ckpt.orphans``): the next attempt lets it
finish the save it holds, stops it after the wait, and leaves a live trainer's writer alone. The trainer here is a
small interpreter without torch whose "writer" is a ``sleep``; the real checkpoint process is in
``system/test_ckpt.py::test_sigkill_during_background_staging_and_write``."""

from __future__ import annotations

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
    return tmp_path


def trainer(root, writer_seconds: float, fate: str, tmp) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "TMPDIR": str(tmp)}
    p = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(root), str(writer_seconds), fate],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    return p, int(p.stdout.readline())


def records(tmp) -> list[str]:
    return sorted(os.listdir(tmp / "pitstop-writers"))


def test_a_dead_trainers_writer_is_waited_for_then_stopped_and_a_live_ones_left_alone(tmp_folder, caplog):
    caplog.set_level(logging.INFO, "pitstop.ckpt")
    root = tmp_folder / "ckpt"
    # (a writer that finishes the save it holds within the wait: waited for, never killed)
    p, writer = trainer(root, 3, "die", tmp_folder)
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
