"""Pure decisions, as unit tables: the launch mode, the launch facts, which rank failed first, the save schedule,
and the checkpoint layout on hand-made dirs. That every option implements its contract is in
tests/integration/test_contracts.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pitstop.launch.failures import root_failure
from pitstop.launch.mode import LaunchMode, launch_mode


@pytest.mark.parametrize(
    "nproc,restarts,env,mode",
    [
        (1, 0, {}, LaunchMode.IN_PROCESS),
        (1, 3, {}, LaunchMode.SUPERVISED),
        (2, 0, {}, LaunchMode.ELASTIC),
        (2, 3, {}, LaunchMode.ELASTIC),  # the agent restarts the ranks
        (2, 0, {"RANK": "1", "WORLD_SIZE": "2"}, LaunchMode.CHILD),  # under torchrun / SLURM / the agent
        (1, 3, {"RANK": "0"}, LaunchMode.CHILD),  # torchrun's --max-restarts, not ours
        (1, 3, {"PITSTOP_SUPERVISED": "1"}, LaunchMode.SUPERVISED),  # no pitstop variable decides anything
    ],
)
def test_launch_mode_is_a_pure_function_of_config_and_environment(nproc, restarts, env, mode):
    assert launch_mode(nproc, restarts, env) == mode


def test_launch_facts_are_one_value_read_once_at_the_entry(monkeypatch, tmp_path):
    import time

    from pitstop.parts import launch_facts as attempt
    from pitstop.launch.attempt import run_attempt

    facts = attempt.facts_from_env({"RANK": "1", "TORCHELASTIC_RESTART_COUNT": "2"})
    assert (facts.launched, facts.restart, facts.supervised, facts.agent_pid) == (True, 2, False, None)
    mine = attempt.facts_from_env({})
    assert (mine.launched, mine.restart) == (False, 0) and mine.program_start <= time.time()
    # a later job of this process is charged the same imports: its program start is as long as the first's
    assert abs((time.time() - attempt.facts_from_env({}).program_start) - (time.time() - mine.program_start)) < 0.05
    # The modules below the launcher read no PITSTOP_* variable: the facts are passed to them.
    import pathlib
    import re

    src = pathlib.Path(attempt.__file__).parent
    readers = {
        str(p.relative_to(src))
        for p in src.rglob("*.py")
        if re.search(r"environ(\.get\(|\[)[\"']PITSTOP_(?!TRACEBACK)", p.read_text())
    }
    assert readers == set(), readers
    # A supervised attempt that fails writes down why, in one line, and exits with the kind of failure.
    monkeypatch.setattr("pitstop.launch.attempt.log_to", lambda run_dir, rank: None)
    with pytest.raises(SystemExit) as e:
        run_attempt("seed: [oops", str(tmp_path), attempt.LaunchFacts(time.time(), True, True, 1, "spawn"))
    assert e.value.code == 1 and (tmp_path / ".last_error").read_text().startswith("ParserError: ")


def test_the_launcher_names_the_rank_that_failed_first_of_all_not_the_peer_that_lost_it():
    # A SIGKILLed rank's exit can be noticed after its peer's "Connection closed by peer": the earliest
    # failure alone named the wrong rank (seen in the suite once ranks were forks of a fork server).
    from types import SimpleNamespace as F

    lost = F(exitcode=1, timestamp=10.0, message={"message": "RuntimeError: [pair.cc:561] Connection closed by peer"})
    assert root_failure({0: lost, 1: F(exitcode=-9, timestamp=11.0, message="")})[0] == 1
    assert (
        root_failure(
            {
                0: F(exitcode=1, timestamp=12.0, message="ValueError: bad"),
                1: F(exitcode=1, timestamp=11.0, message="KeyError: k"),
            }
        )[0]
        == 1
    )  # else the earliest
    assert root_failure({0: lost, 1: F(exitcode=75, timestamp=13.0, message="")})[0] == 1  # preempted
    assert (
        root_failure({0: F(exitcode=-9, timestamp=11.0, message=""), 1: F(exitcode=124, timestamp=14.0, message="")})[0]
        == 1
    )  # hung


# ---- the schedule and the layout: pure pieces of checkpointing ------------------------------------------
def test_save_schedule_steps_seconds_last_and_agreement():
    from pitstop.ckpt.schedule import SaveSchedule

    s = SaveSchedule(interval_steps=5, interval_seconds=None, save_last=True)
    never = lambda flag: pytest.fail("no time-based decision expected")  # noqa: E731
    assert [st for st in range(1, 13) if s.due(st, st == 12, never)] == [5, 10, 12]
    assert not SaveSchedule(None, None, save_last=False).due(12, True, never)
    timed = SaveSchedule(None, interval_seconds=3600, save_last=True)
    asked = []
    assert timed.due(1, False, lambda flag: asked.append(flag) or True)  # a peer says it is due: all save
    assert asked == [False]


def test_layout_candidates_skip_and_remove_partial_dirs_and_purge_keeps_the_newest(tmp_path):
    from pitstop.ckpt import layout
    from pitstop.errors import CheckpointError

    for step, marker in ((5, layout.DCP_MARKER), (10, layout.SAVE_MARKER), (15, None), (20, layout.DCP_MARKER)):
        d = Path(layout.step_dir(str(tmp_path), step))
        d.mkdir()
        if marker:
            (d / marker).write_text("x")
    assert layout.candidates(str(tmp_path), "auto") == [layout.step_dir(str(tmp_path), s) for s in (20, 10, 5)]
    assert not os.path.exists(layout.step_dir(str(tmp_path), 15))  # partial: removed
    assert layout.candidates(str(tmp_path), "10") == [layout.step_dir(str(tmp_path), 10)]
    with pytest.raises(CheckpointError, match="ckpt.load=15: .* is not a complete checkpoint"):
        layout.candidates(str(tmp_path), 15)
    layout.purge(str(tmp_path), keep_last_k=2)
    assert [s for s, _, _ in layout.list_checkpoints(str(tmp_path))] == [10, 20]
