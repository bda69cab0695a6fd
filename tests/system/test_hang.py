"""Hang detection (trainer.hang) under launchers: a stalled rank ends its attempt and is restarted (the
supervisor, the elastic agent, the native backstop); a stuck data worker or a store that stops answering (slow,
in-process).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import cli, train
from pitstop.resilience.watchdog import Hung


def attempts(run_dir) -> list[dict]:
    return json.loads((Path(run_dir) / "goodput.json").read_text())["attempts"]


@pytest.mark.slow
def test_a_stall_under_the_supervisor_is_restarted_and_the_job_finishes(data_root, tmp_path):
    run_dir = tmp_path / "r"
    t0 = time.monotonic()
    p = cli(
        [
            "debug=tiny",
            "trainer.max_steps=30",
            "ckpt=sync_save",
            "ckpt.interval_steps=2",
            "fault=stall",
            "fault.step=7",
            "fault.rank=0",
            "trainer.hang.min_seconds=3",
            "trainer.max_restarts=1",
            f"run_dir={run_dir}",
        ],
        data_root,
        tmp_path,
        timeout=180,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert time.monotonic() - t0 < 90
    a = attempts(run_dir)
    assert [x["status"] for x in a] == ["hung", "finished"] and a[1]["resumed_from"] == 6
    assert "made no progress in phase 'step'" in (run_dir / "train.log").read_text()
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == 30


@pytest.mark.slow
def test_a_rank_stuck_in_native_code_holding_the_gil_is_ended_by_the_native_backstop(data_root, tmp_path):
    # As a fork stuck in a C library's at-fork handler: the GIL is never released, so the Python watcher
    # cannot run; the faulthandler backstop it keeps armed (the loop's limit + grace) dumps the stacks and exits.
    run_dir = tmp_path / "r"
    t0 = time.monotonic()
    p = cli(
        [
            "debug=tiny",
            "trainer.max_steps=30",
            "ckpt=sync_save",
            "ckpt.interval_steps=2",
            "fault=stall",
            "fault.step=9",
            "fault.rank=0",
            "fault.hold_gil=true",
            "trainer.hang.min_seconds=3",
            "trainer.hang.grace_seconds=3",
            "trainer.max_restarts=1",
            f"run_dir={run_dir}",
        ],
        data_root,
        tmp_path,
        timeout=180,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert time.monotonic() - t0 < 90
    assert "Timeout (0:00:0" in p.stderr and "in fire" in p.stderr  # faulthandler's dump: where it was stuck
    assert "attempt 1 failed (exit status 1); restarting" in (run_dir / "train.log").read_text()
    a = attempts(run_dir)
    assert [x["status"] for x in a] == ["running", "finished"] and a[1]["resumed_from"] == 8
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == 30


@pytest.mark.slow
def test_a_stalled_rank_under_ddp_is_restarted_by_the_elastic_agent(data_root, tmp_path):
    run_dir = tmp_path / "r"
    t0 = time.monotonic()
    p = cli(
        [
            "debug=tiny",
            "trainer.max_steps=24",
            "trainer.batch_size=32",
            "loader.num_workers=1",
            "strategy=ddp",
            "strategy.max_restarts=1",
            "ckpt=sync_dcp",
            "ckpt.interval_steps=2",
            "fault=stall",
            "fault.step=5",
            "fault.rank=1",
            "trainer.hang.min_seconds=3",
            f"run_dir={run_dir}",
        ],
        data_root,
        tmp_path,
        timeout=240,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert time.monotonic() - t0 < 150  # not strategy.timeout (300 s) or the stall (3600 s)
    logs = (run_dir / "train.log").read_text() + (run_dir / "rank1.log").read_text()
    assert "made no progress in phase 'step'" in logs
    # whichever rank declared it, the line names rank 1 (stalled after step 5) as the one behind: rank 0 waits in the
    # next collective (the preemption agreement), one collective ahead at the same step
    hangs = [line for line in logs.splitlines() if "made no progress in phase 'step'" in line]
    assert all("rank 1 is behind: after step 5 and " in line for line in hangs), hangs
    assert all("(the others: after step 5 and " in line and "in all_reduce_sum)" in line for line in hangs), hangs
    report = "".join(f.read_text() for f in run_dir.glob("hang.rank*.txt"))
    assert "rank 1 is behind" in report and "rank 1: after step 5 and " in report
    assert not list(run_dir.glob("hangwatch.rank*.json"))  # (where each rank was: removed by the ranks that ended well)
    a = attempts(run_dir)
    assert len(a) == 2 and a[0]["status"] in ("hung", "failed") and a[1]["status"] == "finished"
    assert a[1]["resumed_from"] == 4
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == 24


def remote(store, *extra: str) -> list[str]:
    return [
        f"data.root={store.url}/digits",
        "loader.num_workers=2",
        "loader.read_timeout=3600",
        "trainer.max_steps=60",
        "trainer.eval_every_steps=null",
        "trainer.hang.min_seconds=2",
        *extra,
    ]


@pytest.mark.slow  # (in-process, but ~30 s each)
@pytest.mark.serial
def test_a_data_worker_stuck_once_is_restarted_in_place_and_the_run_stays_exact(make_cfg, data_root, tmp_path, caplog):
    # One request to the store never returns (the 3rd training-shard read): the loop waits for that worker's
    # batch, the watchdog raises DataStall, the runner restarts the workers from the current data position.
    from conftest import step_losses
    from pitstop.testing.slowstore import SlowStore

    with SlowStore(str(data_root / "data")) as store:
        ref = make_cfg(*remote(store), f"run_dir={tmp_path / 'ref'}")
        ref_sha = train(ref)["params_sha256"]
    with SlowStore(str(data_root / "data"), fault_glob="*/train-*", stall_after=2, stall_count=1) as store:
        cfg = make_cfg(*remote(store), f"run_dir={tmp_path / 'healed'}")
        s = train(cfg)
    assert "data stall: rank 0 got no batch for" in caplog.text  # it did stall, and was healed in place
    assert s["params_sha256"] == ref_sha and step_losses(cfg.run_dir) == step_losses(ref.run_dir)
    assert [a["status"] for a in attempts(cfg.run_dir)] == ["finished"]


@pytest.mark.slow  # (in-process, but ~30 s each)
@pytest.mark.serial
def test_a_store_that_stops_answering_is_a_hang_with_the_data_workers_stacks(make_cfg, data_root, capfd, caplog):
    # Healing does not help (every later read hangs too): after the restart of the workers it is a hang.
    from pitstop.testing.slowstore import SlowStore

    with SlowStore(str(data_root / "data"), fault_glob="*/train-*", stall_after=2) as store:
        cfg = make_cfg(*remote(store))
        t0 = time.monotonic()
        with pytest.raises(Hung, match=r"^hang: rank 0 made no progress in phase 'data' .* \(and 2 data worker"):
            train(cfg)
        assert time.monotonic() - t0 < 90
    assert "data stall: rank 0 got no batch for" in caplog.text and "restarting the data workers" in caplog.text
    err = capfd.readouterr().err
    assert err.count("(most recent call first)") >= 4  # each worker's threads, at the stall and at the hang
