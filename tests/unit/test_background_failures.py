"""Failures in background threads are told: an exception that ends any thread of a run reaches the run's log (not
only stderr), and a hang watchdog whose thread died says so and disarms its native backstop (left armed, it would
kill a healthy process later as if it hung)."""

from __future__ import annotations

import faulthandler
import threading

from pitstop.resilience.watchdog import Watchdog
from pitstop.train.process import log_thread_failures


def test_an_exception_that_ends_a_background_thread_reaches_the_log(caplog):
    before = threading.excepthook
    try:
        log_thread_failures()
        log_thread_failures()  # (installed once)

        def boom() -> None:
            raise OSError(28, "No space left on device")

        t = threading.Thread(target=boom, name="pitstop-ckpt-purge_0")
        with caplog.at_level("ERROR", logger="pitstop.train.runner"):
            t.start()
            t.join()
    finally:
        threading.excepthook = before
    assert "background thread pitstop-ckpt-purge_0 failed: OSError: [Errno 28] No space left on device" in caplog.text


def test_a_watchdog_whose_thread_dies_says_so_and_disarms_its_backstop(caplog, monkeypatch):
    w = Watchdog(factor=10, min_seconds=0.4, first_seconds=50)
    cancelled = []
    monkeypatch.setattr(faulthandler, "cancel_dump_traceback_later", lambda: cancelled.append(True))

    def broken(name: str) -> float:
        raise KeyError(name)

    monkeypatch.setattr(w, "limit", broken)
    with caplog.at_level("ERROR", logger="pitstop.resilience.watchdog"):
        close = w.start(0, "/tmp", on_hang=lambda msg: None, exit_process=False)
        thread = w._thread
        try:
            with w.phase("step"):
                thread.join(timeout=10)
        finally:
            close()
    assert not thread.is_alive() and cancelled
    assert "the hang watchdog stopped (KeyError: 'step'): hangs on rank 0 are no longer detected" in caplog.text
