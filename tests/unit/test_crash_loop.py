"""A failure a restart cannot fix is told from one it can (pitstop.launch.repeats): pure logic of the run dir's
failures.jsonl; the launchers' use of it is tests/system/test_crash_loop_launchers.py."""

from __future__ import annotations

import json

import pytest

from pitstop.launch import repeats
from pitstop.launch.repeats import Failure
from pitstop.resilience.fault_record import killed_by_fault


def test_a_signature_is_the_type_and_first_line_with_what_differs_per_process_made_alike():
    a = ValueError("expected a batch of 64, got 14\n  more detail")
    assert repeats.signature(a) == "ValueError: expected a batch of 64, got 14"
    b = RuntimeError("connection to 127.0.0.1:41234 from pid 123456 at 0x7f3a9c reset")
    c = RuntimeError("connection to 127.0.0.1:51999 from pid 654321 at 0x7f00aa reset")
    assert repeats.signature(b) == repeats.signature(c)
    assert repeats.signature(ValueError("step 12 went wrong")) != repeats.signature(ValueError("step 13 went wrong"))
    assert repeats.signature(KeyError()) == "KeyError"


@pytest.mark.parametrize(
    "past,now,loop",
    [
        ([], Failure(0, 1, 6, "E: x"), False),  # the first failure: restarted
        ([Failure(0, 0, 6, "E: x")], Failure(0, 1, 6, "E: x"), True),  # the same, at the same step
        ([Failure(0, 0, 6, "E: x")], Failure(0, 1, 5, "E: x"), True),  # the same, not even as far
        ([Failure(0, 0, 6, "E: x")], Failure(0, 1, 9, "E: x"), False),  # progress since: restarted
        ([Failure(0, 0, 6, "E: x")], Failure(0, 1, 6, "E: y"), False),  # another failure: restarted
        ([Failure(1, 0, 6, "E: x")], Failure(0, 1, 6, "E: x"), False),  # another rank's
        ([Failure(0, 0, 6, "E: x"), Failure(0, 1, 9, "E: y")], Failure(0, 2, 6, "E: x"), False),  # not the last
        ([Failure(0, 0, None, "E: x")], Failure(0, 1, None, "E: x"), True),  # at start-up, twice
        ([Failure(0, 0, None, "E: x")], Failure(0, 1, 3, "E: x"), False),  # start-up, then steps: progress
    ],
)
def test_a_failure_repeats_the_ranks_last_one_only_without_progress_since(past, now, loop):
    assert (repeats.previous(past, now) is not None) == loop


def test_note_appends_and_the_second_identical_failure_gets_a_one_line_verdict(tmp_path):
    first = Failure(0, 0, 6, "ValueError: expected a batch of 64, got 14")
    assert repeats.note(str(tmp_path), first) is None
    second = Failure(0, 1, 6, first.what)
    prev = repeats.note(str(tmp_path), second)
    assert prev == first and [f.attempt for f in repeats.history(str(tmp_path))] == [0, 1]
    line = repeats.verdict(second, prev, str(tmp_path))
    assert "\n" not in line and "the same failure happened twice at step 6 on rank 0" in line
    assert "(attempts 1 and 2)" in line and first.what in line and f"{tmp_path}/train.log" in line


def test_a_damaged_history_is_skipped_not_a_crash(tmp_path):
    (tmp_path / repeats.FILE).write_text('{"rank": "x"}\n[\n' + json.dumps({"rank": 0, "attempt": 0, "step": 6,
                                          "what": "E: x"}) + "\n")  # fmt: skip
    assert repeats.previous(repeats.history(str(tmp_path)), Failure(0, 1, 6, "E: x")) is not None


def test_the_verdict_marker_counts_only_for_this_launch(tmp_path):
    repeats.mark(str(tmp_path), "the same failure happened twice")
    assert repeats.marked(str(tmp_path), since=0) == "the same failure happened twice"
    assert repeats.marked(str(tmp_path), since=4e9) is None  # (left by an earlier launch)


def test_a_kill_the_fault_injection_made_is_told_by_its_pid(tmp_path):
    (tmp_path / "faults.jsonl").write_text(json.dumps({"key": "random#0", "time": 1.0, "pid": 4242}) + "\n")
    assert killed_by_fault(str(tmp_path), 4242) and not killed_by_fault(str(tmp_path), 4243)


def F(attempt: int, step: int | None, what: str = "E: x", rank: int = 0) -> Failure:
    return Failure(rank, attempt, step, what)


@pytest.mark.parametrize(
    "past,extra",
    [
        ([], 0),
        ([F(0, 6)], 0),  # a launch's first failure is never dearer
        ([F(0, 6), F(1, 9, "E: y"), F(2, 14, "E: z")], 0),  # new steps between failures: each costs 1
        ([F(0, 6), F(1, 6, "E: y")], 1),  # another failure where the last one was: costs 2
        ([F(0, 6), F(1, 4, "E: y"), F(2, 5, "E: z")], 2),  # never past step 6 again
        ([F(0, 6), F(1, None, "E: y")], 1),  # failed before its first step
        ([F(0, 6), F(0, 7, rank=1), F(1, 7, "E: y")], 1),  # an attempt's step: its furthest rank's
        ([F(0, 6), F(1, 6, "E: y"), F(0, 50), F(1, 60, "E: y")], 0),  # only the latest launch (attempts from 0 again)
    ],
)
def test_failures_without_progress_cost_the_restart_budget_one_more(past, extra):
    assert repeats.without_progress(past) == extra


def test_the_budget_line_says_what_was_used_and_why():
    assert repeats.budget_line(3, 0, "trainer.max_restarts", 5) == "3 failure(s): 3 of trainer.max_restarts=5"
    line = repeats.budget_line(3, 2, "trainer.max_restarts", 4)
    assert (
        line
        == "3 failure(s), 2 of them with no step past the failure before (each counts 2): 5 of trainer.max_restarts=4"
    )
