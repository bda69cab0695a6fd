"""A run's time line (pitstop.goodput.timeline): read from the run dir alone, also for a killed attempt, and drawn."""

from __future__ import annotations

import json
import os
import time

import pytest

from pitstop.goodput.ledger import GoodputLog, Ledger
from pitstop.goodput.timeline import draw, lines, read


def _attempt(run_dir, t0, steps, status=None, resumed_from=None):
    """One attempt as the runner records it: its ledger's goodput.json record and its metrics.jsonl lines."""
    ledger = Ledger(t0)
    log = GoodputLog(str(run_dir), ledger, heartbeat=0.0)
    log.resumed(resumed_from)
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        for step in steps:
            f.write(json.dumps({"step": step, "loss": 1.0 / step, "time": t0 + step}) + "\n")
            if step % 5 == 0:
                f.write(json.dumps({"step": step, "ckpt_block_seconds": 0.01, "time": t0 + step + 0.5}) + "\n")
            if step % 10 == 0:
                f.write(json.dumps({"step": step, "val_accuracy": 0.5, "time": t0 + step + 0.7}) + "\n")
        f.write('{"step": 99, "loss"')  # (a line cut by a kill)
        f.write("\n")
    log.write(steps[-1], status=status or "running")
    return log


def test_a_killed_attempt_and_its_restart_are_read_from_the_run_dir(tmp_path):
    _attempt(tmp_path, 1000.0, [1, 2, 3, 4, 5, 6, 7])  # killed after step 7: no end status on record
    _attempt(tmp_path, 1000.0, [6, 7, 8, 9, 10], status="finished", resumed_from=5)
    line = read(str(tmp_path))
    assert [a.status for a in line.attempts] == ["running", "finished"]
    assert line.attempts[1].resumed_from == 5 and line.attempts[0].start == 0.0
    assert [s for _, s in line.steps] == [1, 2, 3, 4, 5, 6, 7, 6, 7, 8, 9, 10]  # (the cut line is skipped)
    assert [s for _, s in line.saves] == [5, 10] and [s for _, s in line.evals] == [10]
    assert all(b != "total" for a in line.attempts for b in a.buckets)  # (a bucket of its own, not a sum)
    path = draw(str(tmp_path))
    assert path == str(tmp_path / "timeline.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_job_of_replica_groups_draws_a_line_per_group(tmp_path):
    for k in (1, 0):
        (tmp_path / f"replica{k}").mkdir()
        _attempt(tmp_path / f"replica{k}", 1000.0, [1, 2, 3], status="finished")
    assert [line.name for line in lines(str(tmp_path))] == ["replica0", "replica1"]
    assert os.path.getsize(draw(str(tmp_path), str(tmp_path / "job.png"))) > 0


def test_a_dir_that_is_no_run_is_refused_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no goodput.json"):
        lines(str(tmp_path))


def test_a_skipped_step_and_a_rollback_are_marked(tmp_path):
    _attempt(tmp_path, 1000.0, [1, 2, 3, 4])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"event": "skip", "step": 5, "value": "nan", "why": "x", "time": 1005.2}) + "\n")
        f.write(json.dumps({"event": "rollback", "step": 2, "from": 4, "bucket": "instability", "time": 1005.5}) + "\n")
    line = read(str(tmp_path))
    assert [(round(t, 3), s) for t, s in line.skips] == [(5.2, 5)] and line.rollbacks == [(5.5, 2)]
    assert [s for _, s in line.steps] == [1, 2, 3, 4]  # (neither is a step taken)
    assert draw(str(tmp_path)).endswith("timeline.png")


def _attempt_since(run_dir, seconds, resumed_from=None):
    """An attempt whose program started ``seconds`` ago, as the runner opens its goodput log; its start (the wall
    clock) is the time line's zero when it is the first."""
    log = GoodputLog(str(run_dir), Ledger(time.time() - seconds), heartbeat=0.0)
    log.resumed(resumed_from)
    return log, log.ledger.start_wall


def _line(path, t0, record):
    with open(path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({**record, "time": round(t0 + record["time"], 3)}) + "\n")


def test_each_stretch_is_drawn_where_it_happened_not_summed(tmp_path):
    # the runner's order: a step's line as it ends (its data wait and compute before it), an evaluation's as it
    # ends, then the save blocks; the start buckets one after the other from the attempt's start
    log, t0 = _attempt_since(tmp_path, 2.0)
    log.ledger.add("init", 0.5)
    _line(tmp_path, t0, {"step": 1, "loss": 1.0, "fetch_seconds": 0.2, "compute_seconds": 0.3, "time": 3.0})
    _line(tmp_path, t0, {"step": 2, "loss": 1.0, "fetch_seconds": 0.0, "compute_seconds": 0.4, "time": 3.5})
    _line(tmp_path, t0, {"step": 2, "val_loss": 1.0, "time": 3.9})
    _line(tmp_path, t0, {"step": 2, "ckpt_block_seconds": 0.25, "ckpt_total_seconds": 0.25, "time": 4.2})
    _line(tmp_path, t0, {"step": 3, "loss": 1.0, "fetch_seconds": 1.0, "compute_seconds": 0.3, "time": 5.6})
    log.write(3, status="finished")
    line = read(str(tmp_path))
    assert [(s.start, s.end, s.what) for s in line.spans] == [
        (0.0, pytest.approx(2.0, abs=0.01), "program_start"),
        (pytest.approx(2.0, abs=0.01), pytest.approx(2.5, abs=0.01), "init"),
        (pytest.approx(2.5, abs=0.002), pytest.approx(2.7, abs=0.002), "data_wait"),  # step 1's, before its compute
        (pytest.approx(2.7, abs=0.002), pytest.approx(3.0, abs=0.002), "compute"),
        (pytest.approx(3.1, abs=0.002), pytest.approx(3.5, abs=0.002), "compute"),  # (no wait: none drawn)
        (pytest.approx(3.5, abs=0.002), pytest.approx(3.9, abs=0.002), "eval"),  # after its step's line, to its own
        (pytest.approx(3.9, abs=0.002), pytest.approx(4.15, abs=0.002), "checkpoint"),  # then the save blocks
        (pytest.approx(4.3, abs=0.002), pytest.approx(5.3, abs=0.002), "data_wait"),  # step 3's: not summed with 1's
        (pytest.approx(5.3, abs=0.002), pytest.approx(5.6, abs=0.002), "compute"),
    ]
    assert line.present() == ["program_start", "init", "data_wait", "compute", "eval", "checkpoint"]


def _planted(run_dir, attempts):
    """``goodput.json`` as the goodput log writes it: ``attempts`` = (start, end, status, resumed_from)."""
    records = [
        {"attempt": k + 1, "start": start, "end": end, "status": status, "step": 0, "resumed_from": resumed,
         "buckets": {"program_start": 0.05, "compute": end - start - 0.05}}
        for k, (start, end, status, resumed) in enumerate(attempts)
    ]  # fmt: skip
    (run_dir / "goodput.json").write_text(json.dumps({"attempts": records}))


def test_a_killed_attempt_ends_at_its_last_line_and_the_gap_before_a_restart_is_drawn(tmp_path):
    # attempt 1's last heartbeat at 0.5 s, then it took steps 1 and 2 and was killed; attempt 2 resumed at 3 s
    _planted(tmp_path, [(100.0, 100.5, "running", None), (103.0, 104.0, "finished", 0)])
    for step in (1, 2):
        _line(tmp_path, 100.0, {"step": step, "loss": 1.0, "fetch_seconds": 0.1, "compute_seconds": 0.2, "time": step})
    line = read(str(tmp_path))
    first, second = line.attempts
    assert (first.end, first.last_step, first.status) == (2.0, 2, "running")
    assert [(s.start, s.end) for s in line.spans if s.what == "recovery_gap"] == [(2.0, 3.0)]
    assert [s.what for s in line.spans if s.start >= 3.0] == ["program_start"]  # (attempt 2 took no step)


def test_the_legend_lists_only_what_the_picture_shows_and_no_text_covers_another(tmp_path):
    from matplotlib.text import Text

    from pitstop.goodput.timeline_draw import _legend, figure

    # four short attempts close together, then a long one: on one row their labels would cover one another
    _planted(tmp_path, [(100.0, 100.2, "running", None), (100.25, 100.4, "running", 0), (100.45, 100.6, "running", 0),
                        (100.65, 100.8, "running", 0), (100.85, 110.0, "finished", 0)])  # fmt: skip
    for k, t in enumerate((100.1, 100.3, 100.5, 100.7, 101.0, 109.0)):
        _line(tmp_path, 0.0, {"step": k + 1, "loss": 1.0, "compute_seconds": 0.05, "time": t})
    found = lines(str(tmp_path))
    labels = [h.get_label() for h in _legend(found, {})]
    assert "quorum" not in labels and "data wait" not in labels and "compute" in labels  # (no replicas, no wait)
    fig = figure(found)
    renderer = fig.canvas.get_renderer()
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    assert sum(text.startswith("attempt ") for text, _ in boxes) == 5
    for i, (a, box) in enumerate(boxes):
        for b, other in boxes[i + 1 :]:
            assert not box.overlaps(other), f"{a!r} covers {b!r}"


def test_a_metrics_file_that_is_a_fifo_or_nested_too_deep_is_passed_over_not_a_hang_or_a_crash(tmp_path, caplog):
    fifo, deep = tmp_path / "fifo", tmp_path / "deep"
    for d in (fifo, deep):
        d.mkdir()
        _attempt(d, 1000.0, [1, 2], status="finished")
    os.unlink(fifo / "metrics.jsonl")
    os.mkfifo(fifo / "metrics.jsonl")  # (opened without O_NONBLOCK, a reader would wait for a writer for ever)
    assert read(str(fifo)).steps == [] and "left out of the time line" in caplog.text
    with open(deep / "metrics.jsonl", "a") as f:
        f.write("[" * 100_000 + "\n")  # (json.loads: RecursionError)
    assert [s for _, s in read(str(deep)).steps] == [1, 2]


def test_an_attempt_that_took_no_step_has_no_last_step(tmp_path):
    log = GoodputLog(str(tmp_path), Ledger(1000.0), heartbeat=0.0)
    log.resumed(None)
    log.write(0, status="running")  # (killed in init: the ledger's start value, step 0)
    assert read(str(tmp_path)).attempts[0].last_step is None


def test_a_slow_rank_is_shaded_from_its_step_in_the_attempt_that_named_it():
    from pitstop.goodput.timeline import Attempt, Line
    from pitstop.goodput.timeline_draw import slow_since

    attempts = [Attempt(1, 0.0, 100.0, "running", {}, None), Attempt(2, 200.0, 300.0, "finished", {}, 60)]
    steps = [(float(s), s) for s in range(1, 101)] + [(200.0 + s - 60, s) for s in range(61, 101)]
    line = Line("r", attempts, steps, [], [])
    assert slow_since(line, 230.0, 70) == 210.0  # (not 70.0: step 70 of the attempt before, which was killed)
