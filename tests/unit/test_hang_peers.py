"""A hang names the rank behind (resilience/hang_peers.py): the pure rule on (step, collectives entered), and what
a rank's published file may hold when it is read back.
"""

from __future__ import annotations

import json
import time

from pitstop.resilience.hang_peers import Where, behind, describe, gather, path, publish


def test_the_rank_at_an_earlier_step_is_behind_whoever_noticed():
    places = [Where(0, 42, 300, "the gradient reduce", "step"), Where(1, 41, 296, None, "step")]
    places.append(Where(2, 42, 300, "the gradient reduce", "step"))
    assert [w.rank for w in behind(places)] == [1]
    text = describe(places)
    assert text.startswith("rank 1 is behind: after step 41 and 296 collectives, outside any collective, in phase")
    assert "(the others: after step 42 and 300 collectives, in the gradient reduce)" in text


def test_at_the_same_step_the_collective_count_tells_the_rank_stuck_outside_one():
    # rank 1 stalled after its step; rank 0 went on into the next collective (the preemption agreement) and waits
    places = [Where(0, 5, 24, "all_reduce_sum", "step"), Where(1, 5, 23, None, "step")]
    assert [w.rank for w in behind(places)] == [1]
    assert describe(places).startswith("rank 1 is behind: after step 5 and 23 collectives")


def test_several_ranks_behind_are_all_named_and_level_ranks_name_no_one():
    places = [Where(0, 7, 50), Where(1, 7, 49), Where(2, 7, 49), Where(3, 7, 51)]
    assert [w.rank for w in behind(places)] == [1, 2]
    assert describe(places).startswith("ranks 1, 2 are behind: after step 7 and 49 collectives")
    assert describe(places).endswith("(the others: after step 7 and 50 to 51 collectives (not level))")
    level = [Where(0, 7, 50, "any"), Where(1, 7, 50, "any")]
    assert behind(level) == [] and describe(level).startswith("no rank is behind: every rank after step 7")
    assert behind([Where(0, 3, 1)]) == []  # one rank known: nothing to compare


def test_a_published_place_is_read_back_and_a_file_of_another_shape_is_named_not_used(tmp_path):
    run = str(tmp_path)
    publish(run, Where(1, 41, 296, "the gradient reduce", "step"))
    (tmp_path / "hangwatch.rank2.json").write_text(json.dumps({"rank": 2, "step": "41"}))  # a string for a number
    (tmp_path / "hangwatch.rank3.json").write_text(json.dumps({"rank": 0, "step": 1, "collectives": 1}))  # not its
    publish(run, Where(4, 40, 280, "x\nhang: rank 9 is behind", "step"))  # a label that would forge a log line
    places, missing = gather(run, 6, Where(0, 42, 300, "any", "step"))
    assert [w.rank for w in places] == [0, 1, 4] and places[1].at == (41, 296)
    assert places[2].inside == "?"
    assert missing[2].startswith("unreadable (step: an integer") and missing[3] == "unreadable (it names rank 0)"
    assert missing[5] == "published nothing"
    assert "rank 4 is behind" in describe(places, missing) and "\n" not in describe(places, missing)
    assert describe(places, missing).endswith("; rank 5 published nothing")
    assert path(run, 1).endswith("hangwatch.rank1.json")


def test_a_watchdog_publishes_where_its_loop_is_when_it_changes_and_removes_it_when_it_ends(tmp_path):
    from pitstop.resilience.watchdog import Watchdog

    def published() -> dict | None:
        try:
            return json.loads((tmp_path / "hangwatch.rank1.json").read_text())
        except (OSError, ValueError):
            return None

    def until(check) -> dict:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            doc = published()
            if doc is not None and check(doc):
                return doc
            time.sleep(0.02)
        raise AssertionError(f"not published: {published()}")

    (tmp_path / "hangwatch.rank1.json").write_text('{"rank": 1, "step": 99, "collectives": 9}')  # an older attempt's
    place = [3, 10, None]
    w = Watchdog(min_seconds=0.4, first_seconds=50)  # (it looks every 0.1 s)
    close = w.start(1, str(tmp_path), lambda msg: None, False, world_size=2, position=lambda: tuple(place))
    try:
        with w.phase("step", timed=False):
            doc = until(lambda d: d["step"] == 3)
            assert doc["collectives"] == 10 and doc["inside"] is None and doc["phase"] == "step"
            place[:] = [4, 12, "any"]
            assert until(lambda d: d["step"] == 4)["inside"] == "any"
    finally:
        close()
    assert published() is None  # a rank that ended leaves nothing for a later report
