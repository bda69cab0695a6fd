"""When the loader may fork its workers' fork server from this process: never beside another Python thread."""

from __future__ import annotations

import _thread
import threading
from multiprocessing import forkserver

from pitstop.data.loader import server


def test_a_thread_that_threading_does_not_list_still_forbids_the_fork():
    # execnet (pytest-xdist) starts its I/O thread like this: threading.active_count() does not see it, and a
    # fork server forked beside it hung in a futex wait once, in a clean-clone run of the suite.
    before = server.python_threads()
    started, release, done = threading.Event(), threading.Event(), threading.Event()

    def raw() -> None:
        started.set()
        release.wait()
        done.set()

    _thread.start_new_thread(raw, ())
    try:
        assert started.wait(10)
        assert server.python_threads() == before + 1
        why = server._cannot_fork(forkserver._forkserver)
        assert why is not None and "threads already" in why
    finally:
        release.set()
        assert done.wait(10)
