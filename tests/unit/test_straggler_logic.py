"""The slow-rank decision (``pitstop.train.straggler.Detector``): median of the others, windows in a row, what is
booked, no flag on noise; and the rules and readers around it (the launch rules, the time line, the model)."""

from __future__ import annotations

import json
import random

import pytest

from pitstop.errors import ConfigError
from pitstop.goodput.ledger import JOB_BUCKETS, Ledger
from pitstop.goodput.model import at_scale, with_stragglers
from pitstop.train.straggler import Detector, median_of_others


def feed(detector: Detector, windows: list[list[float]], window: int = 20, wall: float = 1.0):
    """Each window's work figures, in turn; the verdicts."""
    return [detector.window(k * window + 1, (k + 1) * window, work, wall) for k, work in enumerate(windows)]


def test_the_median_is_of_the_other_ranks_alone():
    assert median_of_others([1.0, 2.0, 9.0], 2) == 1.5  # (9 itself left out: a slow rank cannot hide in the median)
    assert median_of_others([1.0, 2.0, 9.0], 0) == 5.5
    assert median_of_others([1.0, 3.0], 1) == 1.0


def test_a_rank_is_named_after_two_slow_windows_in_a_row_since_the_first():
    d = Detector(1.3, 2)
    v = feed(d, [[1.0, 1.0], [1.0, 1.5], [1.0, 1.5]])
    assert v[0].named == [] and v[1].named == []  # (one slow window is not enough)
    (flag,) = v[2].named
    assert (flag.rank, flag.since, flag.windows) == (1, 21, 2) and flag.ratio == pytest.approx(1.5)


def test_one_slow_window_between_normal_ones_names_no_one_and_books_nothing():
    d = Detector(1.3, 2)
    v = feed(d, [[1.0, 1.6], [1.0, 1.0], [1.0, 1.6], [1.0, 1.0]])
    assert not any(x.named for x in v) and d.flags == [] and d.booked == 0


def test_the_wait_is_booked_from_the_first_slow_window_once_confirmed_and_stops_when_well_again():
    d = Detector(1.3, 2)
    v = feed(d, [[1.0, 1.5], [1.0, 1.5], [1.0, 1.8], [1.0, 1.2], [1.0, 1.0], [1.0, 1.0]])
    assert v[0].booked == 0  # (not yet named: nothing booked)
    assert v[1].booked == pytest.approx(1.0)  # (both windows at once: 0.5 + 0.5)
    assert v[2].booked == pytest.approx(0.8)
    assert v[3].booked == pytest.approx(0.2) and v[3].recovered == []  # (named: one window under the factor is noise)
    assert v[4].booked == 0 and [f.rank for f in v[4].recovered] == [1] and v[4].recovered[0].until == 60
    assert v[5].booked == 0 and v[5].recovered == [] and d.runs == {}
    assert d.booked == pytest.approx(2.0) and d.flags[0].seconds == pytest.approx(2.0) and len(d.flags) == 1


def test_the_pace_decides_who_is_slow_and_the_sums_what_is_booked():
    # Rank 1's sum is high (a burst of a few slow steps) but its typical step is rank 0's: not slow (the sums alone
    # would name it).
    assert Detector(1.3, 1).window(1, 20, [1.0, 1.9], 1.0, pace=[0.05, 0.05]).named == []
    assert [f.rank for f in Detector(1.3, 1).window(1, 20, [1.0, 1.9], 1.0).named] == [1]
    d = Detector(1.3, 1)
    (flag,) = d.window(1, 20, [1.0, 1.4], 1.0, pace=[0.05, 0.08]).named
    assert flag.ratio == pytest.approx(1.6) and flag.seconds == pytest.approx(0.4)


def test_two_slow_ranks_in_one_window_book_the_slowest_only():
    d = Detector(1.3, 1)
    (v,) = feed(d, [[1.0, 1.0, 1.0, 2.0, 1.5]])
    assert sorted(f.rank for f in v.named) == [3, 4]
    assert v.booked == pytest.approx(1.0)  # (the job waits for rank 3, not for 3 and then 4)


def test_noise_of_ten_percent_names_no_one_over_a_thousand_windows():
    d = Detector(1.3, 2)
    rng = random.Random(0)
    feed(d, [[rng.uniform(0.9, 1.1) for _ in range(4)] for _ in range(1000)])
    assert d.flags == [] and d.booked == 0 and d.checked == 1000


def test_one_rank_has_no_one_to_compare_with():
    d = Detector(1.3, 1)
    assert feed(d, [[5.0]])[0].named == [] and d.checked == 0


def test_exclusion_is_due_after_the_slow_windows_wall_clock_passes_the_limit():
    d = Detector(1.3, 2)
    feed(d, [[1.0, 2.0], [1.0, 2.0]], wall=3.0)
    assert d.overdue(10.0) is None
    feed(d, [[1.0, 2.0], [1.0, 2.0]], wall=3.0)
    flag = d.overdue(10.0)
    assert flag is not None and flag.rank == 1 and flag.slow_seconds == pytest.approx(12.0)


def test_the_ledger_has_a_straggler_bucket_taken_out_of_compute():
    ledger = Ledger(0.0)
    ledger.add("compute", 5.0)
    ledger.move("compute", "straggler", 2.0)
    assert ledger.split()["straggler"] == 2.0 and ledger.split()["compute"] == 3.0
    assert "straggler" in JOB_BUCKETS


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["strategy=ddp", "trainer.straggler.action=exclude"], "trainer.straggler.action=exclude needs"),
        (["trainer.straggler.action=exclude"], "trainer.straggler.action=exclude needs"),
        (["strategy=ddp", "fault=slow_rank", "fault.rank=2"], "fault.rank=2 but the job has 2 rank(s)"),
        (["fault=slow_rank"], "fault.rank=1 but the job has 1 rank(s)"),
    ],
)
def test_what_the_job_cannot_honour_is_refused_at_launch_naming_the_key(tmp_path, overrides, message):
    from conftest import compose_cfg
    from pitstop.launch.plan import plan

    with pytest.raises(ConfigError) as e:
        plan(compose_cfg(overrides, tmp_path), {})
    assert str(e.value).startswith(message)


def test_exclude_is_accepted_where_a_node_can_go(tmp_path):
    from conftest import compose_cfg
    from pitstop.launch.plan import plan

    cfg = compose_cfg(["strategy=ddp", "strategy.nnodes=1:2", "trainer.straggler.action=exclude"], tmp_path)
    assert plan(cfg, {}).nodes == (1, 2)


def test_the_time_line_marks_a_named_rank(tmp_path):
    from pitstop.goodput.ledger import GoodputLog
    from pitstop.goodput.timeline import draw, read

    GoodputLog(str(tmp_path), Ledger(1000.0), heartbeat=0.0).write(40, status="finished")
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 40, "loss": 0.1, "time": 1010.0}) + "\n")
        f.write(json.dumps({"event": "straggler", "step": 40, "rank": 1, "since": 21, "ratio": 1.5, "time": 1010})
                + "\n")  # fmt: skip
        f.write(json.dumps({"event": "straggler", "step": 60, "rank": 1, "recovered": True, "time": 1011}) + "\n")
    line = read(str(tmp_path))
    assert [(s, since, r) for _, s, since, r in line.stragglers] == [(40, 21, 1)]  # (named; not the recovery)
    assert draw(str(tmp_path)).endswith("timeline.png")


def test_the_model_takes_the_share_spent_waiting_for_slow_ranks():
    assert with_stragglers(0.9, 0.1) == pytest.approx(0.81)
    base, slow = at_scale(16, 1e7, 10, 60), at_scale(16, 1e7, 10, 60, straggler_share=0.25)
    assert slow["goodput"] == pytest.approx(base["goodput"] * 0.75) and slow["exact"] < base["exact"]
