"""The two ends of a command's process: when its program start began (``launch_facts.process_start_wall``, the
ledger's first bucket) and how it leaves (``cli.exit_now``: what the interpreter does at exit that matters, not
the teardown of every module). Small interpreters without torch: the point is a process of their own."""

from __future__ import annotations

import subprocess
import sys
import time

START = "from pitstop.parts.launch_facts import process_start_wall; print(repr(process_start_wall()))"

EXIT = """
import atexit, sys, threading, time
from pitstop.cli import exit_now
atexit.register(lambda: print("atexit ran", flush=False))
def late():
    time.sleep(0.3)
    with open(sys.argv[1], "w") as f:
        f.write("written")
threading.Thread(target=late).start()  # (not a daemon: the interpreter would wait for it, so must exit_now)
print("unflushed", end=" ")
exit_now(int(sys.argv[2]) if sys.argv[2].isdigit() else sys.argv[2])
print("never")
"""


def test_program_start_is_when_the_process_started_not_a_second_off():
    # The boot time in /proc/stat is whole seconds: a start computed from it was 0.6 s early on this machine,
    # 0.6 s of program start that never happened in every run's ledger.
    for _ in range(3):
        before = time.time()
        out = subprocess.run([sys.executable, "-c", START], capture_output=True, text=True, check=True)
        after = time.time()
        start = float(out.stdout)
        assert before - 0.02 <= start <= after, (before, start, after)  # (the kernel counts in 10-ms ticks)


def test_exit_now_joins_threads_runs_atexit_flushes_and_keeps_the_code(tmp_path):
    for code, expected in (("0", 0), ("3", 3), ("refused: say why", 1)):
        out = tmp_path / f"late-{expected}"
        p = subprocess.run([sys.executable, "-c", EXIT, str(out), code], capture_output=True, text=True, timeout=60)
        assert p.returncode == expected, p.stderr
        assert p.stdout == "unflushed atexit ran\n"  # (stdout flushed after the atexit handlers wrote to it)
        assert out.read_text() == "written"  # the non-daemon thread finished first
        if expected == 1:  # a message, as SystemExit("...") prints it
            assert p.stderr.strip().endswith("refused: say why")
