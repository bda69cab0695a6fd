"""The straggler detector keyed by replica id (strategy=ft): the quorum's groups come and go and change places, and
a group is still the same member of the decision (train/straggler.py's Detector, as train/straggler_groups.py feeds
it)."""

from __future__ import annotations

from pitstop.train.straggler import Detector


def test_a_group_is_named_by_its_replica_id_whatever_its_place_and_an_absent_window_does_not_reset_it():
    d = Detector(factor=1.3, windows=2)
    assert d.window(1, 10, [1.0, 3.0], ids=[4, 7]).named == []  # group 7 slow once
    assert d.window(11, 20, [1.0, 1.0], ids=[4, 9]).named == []  # (7 not in this quorum: its run is kept)
    (flag,) = d.window(21, 30, [3.0, 1.0], ids=[7, 4]).named  # 7 slow again, now in the first place
    assert flag.rank == 7 and flag.since == 1 and flag.windows == 2
    assert d.booked > 0 and 4 not in d.runs and 9 not in d.runs
    # keyed by place (no ids), the same figures would have named place 0 (group 7's place this time) as a new run
    by_place = Detector(factor=1.3, windows=2)
    by_place.window(1, 10, [1.0, 3.0])
    assert by_place.window(21, 30, [3.0, 1.0]).named == []


def test_a_group_named_slow_is_well_again_after_as_many_windows_as_it_took_and_only_it_is_overdue():
    d = Detector(factor=1.3, windows=2)
    d.window(1, 10, [1.0, 3.0], wall=1.0, ids=[0, 1])
    d.window(11, 20, [1.0, 3.0], wall=1.0, ids=[0, 1])
    assert d.overdue(1.5).rank == 1 and d.overdue(5.0) is None  # (slow for 2 s of wall clock)
    assert d.window(21, 30, [1.0, 1.0], ids=[0, 1]).recovered == []
    (back,) = d.window(31, 40, [1.0, 1.0], ids=[1, 0]).recovered
    assert back.rank == 1 and back.until == 20 and d.overdue(0.0) is None
