"""State files read back by shape (``pitstop.statefile``): a ``goodput.json``, ``flops.json``, ``summary.json`` or
sample log that is valid JSON of another shape, or not JSON, is kept aside (by the process that owns it, at start)
or named and skipped (by a read-only tool), never a crash; what pitstop itself writes is read back whole."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time

import pytest

from pitstop.goodput.ledger import GoodputLog, Ledger
from pitstop.goodput.report import collect
from pitstop.goodput.timeline import lines, read
from pitstop.telemetry.logger.mlflow import _attempts
from pitstop.telemetry.throughput import cached_count

# Valid JSON of shapes other than the one pitstop writes, and documents that are not JSON at all.
GOODPUT_DAMAGED = {
    "null": "null",
    "list": "[]",
    "string": '"attempts"',
    "attempts a dict": '{"attempts": {}}',
    "attempt a list": '{"attempts": [[]]}',
    "start a string": '{"attempts": [{"start": "1000", "end": null, "status": "x", "step": 0, "buckets": {}}]}',
    "start missing": '{"attempts": [{"end": null, "status": "x", "step": 0, "buckets": {}}]}',
    "negative bucket": '{"attempts": [{"start": 1, "end": 2, "status": "x", "step": 0, "buckets": {"compute": -5}}]}',
    "NaN bucket": '{"attempts": [{"start": 1, "end": 2, "status": "x", "step": 0, "buckets": {"compute": NaN}}]}',
    "marks a list": '{"attempts": [{"start": 1, "end": 2, "status": "x", "step": 0, "buckets": {}, "marks": []}]}',
    "bool step": '{"attempts": [{"start": 1, "end": 2, "status": "x", "step": true, "buckets": {}}]}',
    "torn": '{"attempts": [{"status": "fin',
    "not utf-8": b'{"attempts": "\xff"}',
    "nested too deep": "[" * 200_000 + "]" * 200_000,
    "attempts nested too deep": '{"attempts": ' + "[" * 200_000 + "]" * 200_000 + "}",
}
FLOPS_DAMAGED = {
    "null": "null",
    "list": "[]",
    "string": '"x"',
    "string count": '{"%s": "12"}',
    "float count": '{"%s": 1.5}',
    "negative": '{"%s": -1}',
    "bool": '{"%s": true}',
    "list count": '{"%s": [1]}',
    "torn": '{"%s": 1',
    "nested too deep": "[" * 200_000 + "]" * 200_000,
}
KEY = "model+batch"
DIGEST = hashlib.sha256(KEY.encode()).hexdigest()[:16]  # (as cached_count names it)


def _plant(path, text) -> bytes:
    data = text if isinstance(text, bytes) else text.encode()
    path.write_bytes(data)
    return data


def _ledger(run_dir, **kw) -> GoodputLog:
    return GoodputLog(str(run_dir), Ledger(time.time()), heartbeat=0.0, **kw)


@pytest.mark.parametrize("name", GOODPUT_DAMAGED)
def test_a_goodput_json_of_another_shape_is_kept_aside_and_the_account_starts_again(tmp_path, caplog, name):
    planted = _plant(tmp_path / "goodput.json", GOODPUT_DAMAGED[name])
    with caplog.at_level(logging.WARNING, "pitstop.goodput"):
        log = _ledger(tmp_path)  # (the attempt's start: no AttributeError, no KeyError)
    assert log.previous == [] and log.attempt["attempt"] == 1 and log.failures() == 0
    aside = tmp_path / "goodput.json.corrupt"
    assert aside.read_bytes() == planted
    assert f"{tmp_path / 'goodput.json'} is unreadable (" in caplog.text and f"kept aside as {aside}" in caplog.text
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert json.loads((tmp_path / "goodput.json").read_text())["attempts_count"] == 1  # (a fresh account)


def test_what_the_ledger_writes_is_read_back_and_a_second_damaged_file_keeps_the_first(tmp_path, caplog):
    first = _ledger(tmp_path, extra=lambda: {"ft": {"heals": [{"step": 3, "from_step": 2, "seconds": 0.5}]}})
    first.resumed(None)
    first.mark(2)
    first.write(5, status="failed")
    again = _ledger(tmp_path, auto_restart=True)
    again.resumed(2)
    assert [a["attempt"] for a in again.previous] == [1] and again.failures() == 1  # (every key of it passed)
    assert read(str(tmp_path)).attempts[0].heals == [pytest.approx(0.5, abs=0.5)]
    _plant(tmp_path / "goodput.json.corrupt", "an earlier one")
    _plant(tmp_path / "goodput.json", "[]")
    with caplog.at_level(logging.WARNING, "pitstop.goodput"):
        _ledger(tmp_path)
    assert (tmp_path / "goodput.json.corrupt").read_text() == "an earlier one"
    assert (tmp_path / "goodput.json.corrupt-2").read_text() == "[]"
    assert "attempts" in json.loads((tmp_path / "goodput.json").read_text())


def test_a_rank_that_does_not_write_the_ledger_neither_moves_nor_reports_a_damaged_one(tmp_path, caplog):
    _plant(tmp_path / "goodput.json", "[]")
    with caplog.at_level(logging.WARNING):
        log = _ledger(tmp_path, enabled=False)
    assert log.previous == [] and (tmp_path / "goodput.json").read_text() == "[]" and caplog.text == ""
    assert not (tmp_path / "goodput.json.corrupt").exists()


@pytest.mark.parametrize("name", FLOPS_DAMAGED)
def test_a_flops_json_of_another_shape_is_kept_aside_and_counted_again(tmp_path, caplog, name):
    path = tmp_path / "flops.json"
    planted = _plant(path, FLOPS_DAMAGED[name].replace("%s", DIGEST))
    counted = []
    with caplog.at_level(logging.WARNING):
        flops = cached_count(str(path), KEY, True, lambda: counted.append(1) or 1234)
    assert flops == 1234 and counted == [1]
    assert (tmp_path / "flops.json.corrupt").read_bytes() == planted
    assert f"{path} is unreadable (" in caplog.text and "FLOPs counted again" in caplog.text
    assert json.loads(path.read_text()) == {DIGEST: 1234}
    assert cached_count(str(path), KEY, True, lambda: pytest.fail("counted again")) == 1234  # (the cache works)


def test_a_damaged_flops_json_is_left_alone_by_a_rank_that_does_not_write_it(tmp_path, caplog):
    path = tmp_path / "flops.json"
    _plant(path, "[]")
    with caplog.at_level(logging.WARNING):
        assert cached_count(str(path), KEY, False, lambda: 7) == 7
    assert path.read_text() == "[]" and caplog.text == ""


SUMMARY = {  # the keys write_summary writes that are read back, as a real run writes them
    "final_step": 12,
    "samples_seen": 384,
    "metrics": {"val_accuracy": 0.5, "val_loss": float("nan")},  # (a diverged run's NaN is a real metric)
    "throughput": {"samples_per_s_per_device": 10.0, "step_seconds_p50": 0.1, "mfu": None},
    "checkpoint": {"saves": 2, "block_seconds_mean": 0.01, "total_seconds_mean": 0.02},
    "goodput": {
        "goodput": 0.5,
        "totals": {"productive": 2.0, "data_wait": 0.5, "total": 4.0},
        "restarts": 0,
        "failures": 0,
        "restart_seconds": None,
    },
    "wall_clock": {"total": 4.0},
}


@pytest.mark.parametrize(
    "text",
    ["null", "[]", '"ok"', json.dumps({**SUMMARY, "goodput": []}), json.dumps({**SUMMARY, "samples_seen": "384"})]
    + [
        json.dumps({**SUMMARY, "wall_clock": {"total": -4.0}}),
        json.dumps({k: v for k, v in SUMMARY.items() if k != "goodput"}),
    ],
    ids=["null", "list", "string", "goodput a list", "samples a string", "negative wall clock", "goodput missing"],
)
def test_the_sweep_report_names_a_damaged_summary_json_in_its_row_and_leaves_it(tmp_path, caplog, text):
    for job, doc in (("0", text), ("1", json.dumps(SUMMARY))):
        (tmp_path / job).mkdir()
        _plant(tmp_path / job / "summary.json", doc)
    with caplog.at_level(logging.WARNING, "pitstop.goodput.report"):
        rows = collect(str(tmp_path))
    path = tmp_path / "0" / "summary.json"
    assert rows[0]["status"] == "FAILED" and rows[0]["error"].startswith(f"{path} is unreadable (")
    assert rows[1]["status"] == "ok" and rows[1]["total_s"] == 4.0 and rows[1]["accuracy"] == 0.5
    assert path.read_text() == text and f"{path} is unreadable" in caplog.text


def test_read_only_readers_of_goodput_json_name_it_and_never_move_it(tmp_path, caplog):
    (tmp_path / "replica0").mkdir()
    (tmp_path / "replica1").mkdir()
    _ledger(tmp_path / "replica1").write(3, status="finished")
    bad = tmp_path / "replica0" / "goodput.json"
    _plant(bad, '{"attempts": [null]}')
    with caplog.at_level(logging.WARNING):
        assert _attempts(str(tmp_path / "replica0")) == 0 and _attempts(str(tmp_path / "replica0")) == 0
        assert _attempts(str(tmp_path / "replica1")) == 1
        with pytest.raises(ValueError, match=f"{bad} is unreadable \\(attempts\\[0\\]: an object belongs there"):
            read(str(tmp_path / "replica0"))
        assert [line.name for line in lines(str(tmp_path))] == ["replica1"]  # (the damaged group is skipped)
    assert bad.read_text() == '{"attempts": [null]}' and sorted(os.listdir(bad.parent)) == ["goodput.json"]
    said = [r.getMessage() for r in caplog.records if r.name == "pitstop.state"]
    assert len(said) == 1 and said[0].startswith(f"{bad} is unreadable (")  # (the tracker polls: said once)


def test_a_fifo_or_a_link_in_place_of_a_state_file_is_damaged_not_a_hang_nor_another_runs(tmp_path, caplog):
    os.mkfifo(tmp_path / "goodput.json")
    with caplog.at_level(logging.WARNING, "pitstop.goodput"):
        log = _ledger(tmp_path)
    assert log.previous == [] and (tmp_path / "goodput.json.corrupt").exists()
    assert "(not a regular file)" in caplog.text
    other = tmp_path / "other"  # (another run's account, linked in: its attempts are not this run's)
    other.mkdir()
    _ledger(other).write(3, status="failed")
    os.remove(tmp_path / "goodput.json")
    os.symlink(other / "goodput.json", tmp_path / "goodput.json")
    with caplog.at_level(logging.WARNING, "pitstop.goodput"):
        log = _ledger(tmp_path)
    assert log.previous == [] and os.path.islink(tmp_path / "goodput.json.corrupt-2")
    assert "(a symbolic link, not a file of this run)" in caplog.text
    assert json.loads((other / "goodput.json").read_text())["attempts"][0]["status"] == "failed"  # (untouched)


@pytest.mark.timeout(60)
def test_the_audit_reads_a_fifo_or_a_deeply_nested_sample_log_as_damaged_and_ends(tmp_path, caplog):
    """A FIFO in place of the sample log or metrics.jsonl hung ``pitstop.audit``; a line nested 200,000 deep crashed
    it (RecursionError): both are damaged input, said in one line, and the audit ends."""
    from pitstop.audit import main as audit_main

    os.mkfifo(tmp_path / "samples.rank0.jsonl")
    os.mkfifo(tmp_path / "metrics.jsonl")
    (tmp_path / "goodput.json").write_text('{"attempts": []}')
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING), pytest.raises(SystemExit, match="no readable attempt header"):
        audit_main([str(tmp_path)])  # (its one-line refusal: nothing it could read)
    assert time.monotonic() - t0 < 30 and "not a regular file" in caplog.text
    os.remove(tmp_path / "samples.rank0.jsonl")
    (tmp_path / "samples.rank0.jsonl").write_text("[" * 200_000 + "]" * 200_000 + "\n")
    with caplog.at_level(logging.WARNING), pytest.raises(SystemExit, match="no readable attempt header"):
        audit_main([str(tmp_path)])
    assert "damaged line" in caplog.text
