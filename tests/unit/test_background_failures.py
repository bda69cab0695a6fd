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
    real_cancel = faulthandler.cancel_dump_traceback_later

    def cancel() -> None:  # counted, and still done: a no-op here left the real backstop (re-armed at the phase's
        cancelled.append(True)  # end: ~31 s) armed; it ended pytest (status 1) mid-suite whenever the suite was slower
        real_cancel()

    monkeypatch.setattr(faulthandler, "cancel_dump_traceback_later", cancel)
    armed = []
    real_arm = faulthandler.dump_traceback_later
    monkeypatch.setattr(faulthandler, "dump_traceback_later", lambda s, **k: (armed.append(s), real_arm(s, **k)))

    def broken(name: str) -> float:
        raise KeyError(name)

    monkeypatch.setattr(w, "limit", broken)
    with caplog.at_level("ERROR", logger="pitstop.resilience.watchdog"):
        close = w.start(0, "/tmp", on_hang=lambda msg: None, exit_process=False)
        thread = w._thread
        try:
            with w.phase("step"):
                thread.join(timeout=10)
                armed_by_the_watcher = len(armed)
            after_its_death = armed[armed_by_the_watcher:]  # the phase's end must not arm it again: nothing re-arms it
        finally:
            close()
            real_cancel()  # (whatever happened above, no native backstop outlives this test)
    assert not thread.is_alive() and cancelled and after_its_death == []
    assert "the hang watchdog stopped (KeyError: 'step'): hangs on rank 0 are no longer detected" in caplog.text
