"""The watchdog's limits (trainer.hang) come from measured durations: per phase, with a floor, a first-step
allowance and the native backstop's grace.
"""

from __future__ import annotations

import time

import pytest

from pitstop.resilience.watchdog import Watchdog


def test_limits_come_from_measured_durations():
    w = Watchdog(factor=10, min_seconds=2, first_seconds=50)
    assert w.limit("step") == 50  # nothing measured yet
    with w.phase("step", timed=False):
        w.beat()  # the first beat only starts the clock
        assert "step" not in w.longest
        time.sleep(0.3)
        w.beat()
        with w.phase("checkpoint"):  # nested: pauses the step's clock
            time.sleep(0.05)
    assert 0.3 <= w.longest["step"] < 1.0 and w.longest["checkpoint"] >= 0.05
    assert w.limit("step") == pytest.approx(10 * w.longest["step"])
    assert w.limit("checkpoint") == 2  # 10 x 0.05 s is below the floor
    assert w.limit("eval") == 50
    # The native backstop: the loop's longest limit (not the current phase's: it may change meanwhile) + grace.
    assert w.backstop_seconds() == pytest.approx(10 * w.longest["step"] + w.grace)
    assert Watchdog(first_seconds=50, grace=7).backstop_seconds() == 57  # nothing measured yet


def test_a_wait_that_something_else_bounds_gets_at_least_its_bound():
    # replica groups: a wait for peers (torchft's quorum_timeout + 2 x timeout) is not this process's hang
    w = Watchdog(factor=10, min_seconds=2, first_seconds=50)
    w.at_least("peers", 80)
    assert w.limit("peers") == 80  # above first_seconds too
    with w.phase("peers"):
        time.sleep(0.01)
    assert w.limit("peers") == 80 and w.limit("step") == 50  # only that phase


def test_a_phase_that_something_else_bounds_is_not_given_the_first_allowance():
    # applying the state a peer sent (replica groups' heal): received within strategy.timeout, it has no imports or
    # compilation to wait for: its first run's limit is that bound (at least min_seconds), not first_seconds
    w = Watchdog(factor=10, min_seconds=2, first_seconds=900)
    with w.phase("heal", first=10):
        assert w.limit("heal") == 10 and w.limit("restore") == 900
    assert Watchdog(min_seconds=60, first_seconds=900).limit("heal") == 900  # (not told: the first allowance)
    w60 = Watchdog(min_seconds=60, first_seconds=900)
    with w60.phase("heal", first=10):
        assert w60.limit("heal") == 60  # never below the floor of every phase


def test_a_closed_watchdog_never_arms_the_native_backstop_again():
    # (a watcher thread that close() did not wait out must not arm faulthandler's process-wide exit timer afterwards:
    # the process, a test worker for one, would end minutes later)
    import faulthandler

    w = Watchdog(min_seconds=2, first_seconds=50)
    w.close()
    w._arm()  # what the watcher's loop, or a hang being reported, does next
    w._arm(65)
    assert w._armed is None
    faulthandler.cancel_dump_traceback_later()  # (had it armed, this test must not end the worker)
