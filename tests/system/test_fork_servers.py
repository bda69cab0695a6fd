"""The one place a fork server starts (``pitstop.data.loader.server.start``), as a launcher uses it for its attempts
and a rank for its data workers: real processes, each in a fresh interpreter (single-threaded, as a launcher is)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow  # (real processes: a launcher and its children, each a fresh interpreter)

SCRIPT = """
import multiprocessing as mp, sys
from pitstop.data.loader import server

def child(q):  # an attempt: it starts a fork server of its own, for its data workers
    q.put(server.start())

if __name__ == "__main__":
    print(server.start(fork=sys.argv[1] == "fork"), flush=True)
    ctx = mp.get_context("forkserver")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    print(q.get(timeout=60), flush=True)
    p.join(60)
    print(p.exitcode, flush=True)
"""


def run(tmp_path, how: str) -> list[str]:
    (tmp_path / "launcher.py").write_text(SCRIPT)
    p = subprocess.run([sys.executable, str(tmp_path / "launcher.py"), how], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.split()


def test_an_attempt_forked_from_a_copy_of_its_launcher_starts_its_own_fork_server(tmp_path):
    # The launcher's server is a fork of the launcher, taken while it held the fork server's lock: the copy frees
    # it, or the attempt's own start() (for its data workers) waits on it forever.
    assert run(tmp_path, "fork") == ["forked", "forked", "0"]


def test_ranks_that_will_use_cuda_get_a_fresh_interpreter_as_their_server(tmp_path):
    # fork=False (the launcher's ranks run on GPUs): multiprocessing's own server, a fresh interpreter
    assert run(tmp_path, "spawn") == ["spawned", "forked", "0"]
