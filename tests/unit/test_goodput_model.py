"""Goodput as pure arithmetic: the goodput model (one and two tiers, Young-Daly), the ledger's ``account`` of
hand-written attempts, ckpt.interval=auto's sources and start value, and bad preemption settings.
"""

from __future__ import annotations

import logging
import math
import time

import pytest

from pitstop.config.schema_loop import Health
from pitstop.errors import ConfigError
from pitstop.goodput.interval import AutoInterval
from pitstop.goodput.model import best_interval, exact_goodput, expected_goodput, young_daly
from pitstop.goodput.ledger import JOB_BUCKETS, account


def check_account(doc: dict) -> None:
    t = doc["totals"]
    assert math.isclose(sum(t[b] for b in JOB_BUCKETS), t["total"], abs_tol=0.01)
    assert all(t[b] >= 0 for b in JOB_BUCKETS)
    assert math.isclose(doc["goodput"], t["productive"] / t["total"], abs_tol=1e-3)


# ---- the model ---------------------------------------------------------------------------------------
def test_model_reproduces_the_published_case_and_young_daly():
    mtbf = 86400 / 8.6
    assert round(expected_goodput(2 * 3600, mtbf) * 100) == 64
    assert round(expected_goodput(30 * 60, mtbf) * 100) == 91
    # With a save cost the optimum is near Young's sqrt(2 C M) (and as good to 0.1 point); costs only lower it.
    c = 60.0
    best, yd = best_interval(mtbf, c), young_daly(c, mtbf)
    assert math.isclose(best, yd, rel_tol=0.1)
    assert expected_goodput(yd, mtbf, c) > expected_goodput(best, mtbf, c) - 0.001
    assert expected_goodput(1800, mtbf, save_cost=60, restart_cost=600) < expected_goodput(1800, mtbf, save_cost=60)
    # The exact form for exponential failures: equal to first order when T << M, higher (less loss) otherwise.
    assert math.isclose(exact_goodput(60, mtbf, 1, 5, 2), expected_goodput(60, mtbf, 1, 5, 2), abs_tol=1e-4)
    assert exact_goodput(7200, mtbf) - expected_goodput(7200, mtbf) > 0.03


def test_two_tier_model_reduces_to_one_tier_and_a_cheap_local_tier_pays():
    from pitstop.goodput.model import two_tier_goodput

    m = 8.0
    # A local tier no failure survives, saving for free: the durable tier's own model.
    assert math.isclose(
        two_tier_goodput(0.5, 2.5, m, 0.0, 0.05, 0.9, 0.0, 0.1, local_share=0.0),
        expected_goodput(2.5, m, 0.05, 0.9, 0.1),
        rel_tol=1e-12,
    )
    # Cheap, frequent local saves that every failure survives (process kills): less lost work.
    one = expected_goodput(2.5, m, 0.05, 0.9, 0.1)
    two = two_tier_goodput(0.5, 2.5, m, 0.01, 0.05, 0.9, 0.0, 0.1, local_share=1.0)
    assert two - one > 0.08
    # Its saves are not free: a local tier as slow as the durable one, saving 5x as often, costs more than it saves.
    assert two_tier_goodput(0.5, 2.5, m, 0.3, 0.05, 0.9, 0.0, 0.1, local_share=1.0) < one


def test_account_moves_redone_work_to_lost():
    b = lambda compute, wait: {  # noqa: E731
        "program_start": 0.5,
        "init": 0.3,
        "restore": 0.2,
        "compute": compute,
        "data_wait": wait,
        "checkpoint": 0.5,
        "eval": 0.4,
        "logging": 0.0,
        "other": 0.1,
    }
    attempts = [
        {
            "status": "running",
            "start": 0.0,
            "end": 11.6,
            "step": 25,
            "resumed_from": None,
            "auto_restart": False,
            "buckets": b(8.0, 2.0),
            "marks": {
                "10": {"compute": 3.0, "data_wait": 1.0, "eval": 0, "logging": 0},
                "20": {"compute": 6.0, "data_wait": 1.5, "eval": 0.4, "logging": 0},
            },
        },
        {
            "status": "finished",
            "start": 12.6,
            "end": 20.0,
            "step": 40,
            "resumed_from": 20,
            "auto_restart": True,
            "buckets": b(6.0, 0.5),
            "marks": {},
        },
    ]
    doc = account(attempts)
    t = doc["totals"]
    assert t["lost"] == 2.5  # compute 8-6 and data wait 2-1.5 after step 20 were redone
    assert t["productive"] == 6.0 + 6.0 and t["data_wait"] == 1.5 + 0.5
    assert (t["program_start"], t["init"], t["restore"]) == (1.0, 0.6, 0.4)
    assert t["recovery_gap"] == 1.0  # the 1 s between the attempts (an automatic restart)
    assert t["eval"] == 0.4 + 0.4 and t["other"] == 0.2  # eval of surviving steps only; its own bucket
    assert doc["restart_seconds"] == 1.0 + 0.5 + 0.3 + 0.2  # R: gap + program start + init + restore
    assert doc["restarts"] == 1 and doc["failures"] == 1
    assert doc["restore_by_tier"] == {}  # (no attempt said where its state came from)
    check_account(doc)


def test_the_account_books_each_restore_by_the_tier_it_read():
    from pitstop.goodput.ledger import table

    def attempt(start, resumed, tier, restore):
        a = {"status": "failed", "start": start, "end": start + 5, "step": 10, "resumed_from": resumed,
             "auto_restart": start > 0, "buckets": {"restore": restore, "compute": 4.0}, "marks": {}}  # fmt: skip
        return a if tier is None else {**a, "restored_from": tier}

    attempts = [attempt(0, None, None, 0.0), attempt(6, 0, "durable", 2.5), attempt(12, 10, "peer", 0.25),
                attempt(18, 10, "peer", 0.5), attempt(24, 10, "lost-and-found", 9.0)]  # fmt: skip
    doc = account(attempts)
    assert doc["restore_by_tier"] == {"durable": {"seconds": 2.5, "count": 1}, "peer": {"seconds": 0.75, "count": 2}}
    assert doc["totals"]["restore"] == 2.5 + 0.75 + 9.0  # (every restore is in the restore bucket, whatever its tier)
    assert "restore by tier: durable 2.50 s (1x), peer 0.75 s (2x)" in table(doc)


def test_an_attempt_killed_before_its_restore_does_not_throw_away_its_predecessors_work():
    # Attempt 2 died in init (no restore, step 0): what attempt 1 did up to step 20 survived, because attempt
    # 3 resumed from 20. (This account once compared attempt 1 with attempt 2's step 0 and called all of
    # attempt 1's work lost: the cold-restart bench reported 5% goodput for a job that had 25%.)
    b = lambda compute: {  # noqa: E731
        "program_start": 0.5,
        "init": 0.3,
        "restore": 0.2,
        "compute": compute,
        "data_wait": 0.0,
        "checkpoint": 0.0,
        "eval": 0.0,
        "logging": 0.0,
        "other": 0.0,
    }
    attempts = [
        {
            "status": "running",
            "start": 0.0,
            "end": 9.0,
            "step": 25,
            "restored": True,
            "resumed_from": None,
            "auto_restart": False,
            "buckets": b(8.0),
            "marks": {"20": {"compute": 6.0, "data_wait": 0, "eval": 0, "logging": 0}},
        },
        {
            "status": "running",
            "start": 9.5,
            "end": 10.3,
            "step": 0,
            "restored": False,
            "resumed_from": None,
            "auto_restart": True,
            "buckets": {"program_start": 0.5, "init": 0.3},
            "marks": {},
        },
        {
            "status": "finished",
            "start": 10.5,
            "end": 17.5,
            "step": 40,
            "restored": True,
            "resumed_from": 20,
            "auto_restart": True,
            "buckets": b(6.0),
            "marks": {},
        },
    ]
    t = account(attempts)["totals"]
    assert t["lost"] == 2.0 and t["productive"] == 6.0 + 6.0
    # An attempt that restored and found nothing (resumed_from None) does throw everything away.
    attempts[1].update(restored=True, buckets=b(0.0))
    assert account(attempts)["totals"]["lost"] == 8.0


def test_auto_interval_sources_and_start_value(caplog):
    with caplog.at_level(logging.INFO, logger="pitstop.goodput.interval"):
        auto = AutoInterval(None, "")
    assert auto.mtbf == 86400 and "no MTBF known yet" in caplog.text
    assert math.isclose(auto.update(0.5, 0.0), math.sqrt(2 * 0.5 * 86400))
    assert AutoInterval(None, "", observed_failures=4, observed_seconds=200).mtbf == 50  # seen in this run dir
    assert AutoInterval(30.0, "fault.mtbf_seconds", observed_failures=4, observed_seconds=200).mtbf == 30
    async_ = AutoInterval(30.0, "x")
    assert async_.update(0.01, write_seconds=2.0) == 2.0  # never due before the previous save is durable


@pytest.mark.parametrize(
    "signals,grace,expected",
    [
        (["SIGKILL"], 30, "trainer.preempt_signals: 'SIGKILL' is not a signal that can be caught"),
    ],
)
def test_bad_preemption_settings_are_one_line_config_errors(signals, grace, expected):
    from pitstop.resilience.preempt import PreemptionNotice

    with pytest.raises(ConfigError, match=expected):
        PreemptionNotice(signals, grace)


def test_the_sweep_reports_plot_has_a_colour_for_every_job_bucket():
    from pitstop.goodput.report import COLORS

    assert set(COLORS) == set(JOB_BUCKETS)  # (a missing one made the plot fail: the report had no report.png)


def test_a_launchers_notice_goes_once_to_each_running_attempt_and_sigterm_keeps_its_own_path(monkeypatch):
    import signal

    from pitstop.resilience.preempt import LauncherNotice

    class Child:
        def __init__(self, pid: int, alive: bool):
            self.pid, self.alive = pid, alive

        def is_alive(self) -> bool:
            return self.alive

    sent: list[tuple[int, int]] = []
    monkeypatch.setattr("os.kill", lambda pid, sig: sent.append((pid, sig)))
    children = [Child(11, True), Child(12, False), Child(13, True)]
    notice = LauncherNotice(["SIGTERM", "SIGUSR1", "USR2"], lambda: children)
    assert notice.signals == [signal.SIGUSR1, signal.SIGUSR2]  # (SIGTERM: the launcher stops and terminates them)
    notice._on_signal(signal.SIGUSR1, None)
    notice._on_signal(signal.SIGUSR2, None)  # a second notice: the attempts already have one
    assert notice.received == signal.SIGUSR1 and sent == [(11, signal.SIGUSR1), (13, signal.SIGUSR1)]


def test_replica_groups_at_scale_lose_a_pause_and_a_step_per_failure_and_the_failed_groups_restart_share():
    from pitstop.goodput.model import ft_at_scale

    # 4 groups of 2 nodes, 8 nodes failing every 8000 s each (1 failure per 1000 s of the job): per failure the
    # 3 healthy groups lose pause + step (1 + 2 s) and the failed one R + heal + step (30 + 2 + 2 s), over 4 groups
    per_failure = 3 / 4 * (1 + 2) + (30 + 2 + 2) / 4
    expected = 100 / (100 + 10) * 2 / (2 + 0.5) * (1 - per_failure / 1000)
    assert math.isclose(ft_at_scale(8, 8000, 2, 1, 2, 30, 2, quorum=0.5, save_cost=10, interval=100), expected)
    assert ft_at_scale(2, 8000, 2, 1, 2, 30, 2) == 0.0  # one group is no replica: not this model's case


def test_recipe_goodput_nodes_ft_prints_the_replica_groups_next_to_in_job_restart(capsys):
    from recipe.goodput import main

    main(["--nodes", "1", "2048", "--ft", "--save-cost", "60", "--restart-cost", "10min", "--step-time", "2"])
    out = capsys.readouterr().out
    one, many = (line.split() for line in out.splitlines() if line.lstrip().startswith(("1 ", "2048 ")))
    assert one[-3:] == ["-", "(1", "group)"]
    (restart, _, ft), gain = [float(t[:-1]) for t in many if t.endswith("%")], float(many[-1])  # (durations: "2.79 h")
    assert 80 < restart < ft < 100 and math.isclose(ft - restart, gain, abs_tol=0.11)


def test_a_launchers_notice_is_handed_on_to_the_handler_it_replaced_also_after_close():
    # under hydra/launcher=slurm that handler is submitit's requeue: the launcher closes its handlers on the way out
    # (a finally), then hands the notice on once the attempts' saves are durable
    import signal

    from pitstop.resilience.preempt import LauncherNotice

    called: list[int] = []
    before = signal.signal(signal.SIGUSR2, lambda signum, frame: called.append(signum))
    try:
        notice = LauncherNotice(["SIGUSR2"], lambda: []).install()
        notice._on_signal(signal.SIGUSR2, None)
        notice.close()
        notice.forward()
        assert called == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_a_notice_that_comes_while_an_attempt_starts_reaches_it_and_no_attempt_follows(monkeypatch, tmp_path):
    # the signal is blocked while the attempt starts; its handler runs as the block ends, before the supervisor knew
    # of the child: the supervisor then hands it on itself, and starts no other attempt
    import signal

    from pitstop.config import schema
    from pitstop.launch.mode import LaunchMode
    from pitstop.launch.plan import LaunchPlan
    from pitstop.launch.supervisor import attempts
    from pitstop.resilience.preempt import PREEMPTED_EXIT, LauncherNotice, Preempted

    sent: list[tuple[int, int]] = []
    monkeypatch.setattr("os.kill", lambda pid, sig: sent.append((pid, sig)))
    notice = LauncherNotice(["SIGUSR1"], lambda: [])

    class Child:
        pid, exitcode = 4242, None

        def __init__(self, **kw):
            pass

        def start(self):
            notice._on_signal(signal.SIGUSR1, None)  # (as the handler would, once the notices are unblocked)

        def join(self, timeout=None):
            self.exitcode = PREEMPTED_EXIT if sent else 1  # saved and left, if it got the notice

        def is_alive(self):
            return False

    class Ctx:
        Process = Child

        @staticmethod
        def get_start_method():
            return "fake"

    with pytest.raises(Preempted):
        trainer = schema.Trainer(preempt_grace_seconds=30, health=Health(enabled=False))  # (no real fork)
        job = LaunchPlan(LaunchMode.SUPERVISED, trainer, schema.Single(), restarts=3)
        attempts(Ctx, "{}", str(tmp_path), job, 0.0, notice=notice)
    assert sent == [(4242, signal.SIGUSR1)]


class _RaisingHandler(logging.Handler):
    """A log handler that gets ``signum`` in the middle of writing the line "trigger", as a scheduler's signal can
    land while the main thread writes to train.log; it records how deep its writes were nested."""

    def __init__(self, signum: int):
        super().__init__()
        self.signum, self.depth, self.deepest, self.lines = signum, 0, 0, []

    def emit(self, record: logging.LogRecord) -> None:
        self.depth += 1
        self.deepest = max(self.deepest, self.depth)
        try:
            if record.getMessage() == "trigger":
                import signal

                signal.raise_signal(self.signum)  # (the Python handler runs here, inside this write)
            self.lines.append(record.getMessage())
        except Exception:  # (as logging's own handlers do: the exception is printed, not raised)
            self.handleError(record)
        finally:
            self.depth -= 1


@pytest.fixture
def preempt_log():
    import signal

    logger = logging.getLogger("pitstop.resilience.preempt")
    handler = _RaisingHandler(signal.SIGUSR1)
    logger.addHandler(handler)
    before = signal.getsignal(signal.SIGUSR1)
    yield logger, handler
    logger.removeHandler(handler)
    signal.signal(signal.SIGUSR1, before)


def test_a_notice_that_lands_inside_a_log_write_is_logged_after_it_not_inside(preempt_log):
    # a second write into the same file from the handler raised "RuntimeError: reentrant call" (CI, SLURM)
    import signal

    from pitstop.resilience.preempt import LauncherNotice

    logger, handler = preempt_log
    notice = LauncherNotice(["SIGUSR1"], lambda: []).install()
    try:
        logger.warning("trigger")
        deadline = time.monotonic() + 5
        while len(handler.lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        notice.close()
    assert notice.received == signal.SIGUSR1 and handler.deepest == 1
    assert handler.lines[0] == "trigger" and handler.lines[1].startswith("preemption notice (SIGUSR1)")


def test_an_agents_notice_that_lands_inside_a_log_write_still_stops_it(preempt_log):
    # logging turns an exception raised inside a write into a printed traceback: the notice would have been lost
    import signal

    from pitstop.resilience.preempt import JobNotice

    class Stop(Exception):
        pass

    logger, handler = preempt_log
    notice = JobNotice([signal.SIGUSR1], lambda msg, sig: Stop(msg)).install()
    try:
        with pytest.raises(Stop, match="SIGUSR1"):
            logger.warning("trigger")
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        notice.close()
    assert notice.received == signal.SIGUSR1 and handler.deepest == 1


def test_a_copy_on_a_partner_turns_a_lost_nodes_durable_recovery_into_a_local_one(tmp_path, capsys):
    import json

    from pitstop.goodput.model import replicated_at_scale, two_tier_goodput

    local, durable = (0.05, 0.5, 120.0), (0.05, 30.0, 1800.0)  # (C, W, T) of each tier
    common = (4096, 5000 * 3600.0, 0.6, 300.0, 60.0)
    alone = replicated_at_scale(*common, local, durable, 20.0, 200.0, replicas=False)
    copy = replicated_at_scale(*common, local, durable, 20.0, 200.0, replicas=True)
    m = 5000 * 3600.0 / 4096
    # a lost node (60% of failures): a replacement (300 s), the restart (60 s), then the recovery from the peer (20 s
    # more) and half a local cycle redone, or from the durable tier (200 s more) and half a durable cycle; the rest
    # restart in place (60 s)
    assert math.isclose(alone["restart"], 0.4 * 60 + 0.6 * (300 + 60 + 200))
    assert math.isclose(copy["restart"], 0.4 * 60 + 0.6 * (300 + 60 + 20))
    assert math.isclose(alone["goodput"], two_tier_goodput(120, 1800, m, 0.05, 0.05, alone["restart"], 0.5, 30, 0.4))
    assert math.isclose(copy["goodput"], two_tier_goodput(120, 1800, m, 0.05, 0.05, copy["restart"], 0.5, 30, 1.0))
    assert copy["goodput"] - alone["goodput"] > 0.05
    # no interval given: each tier at its Young-Daly interval for the job's MTBF (the durable one no shorter)
    free = replicated_at_scale(*common, (0.05, 0.5, None), (2.0, 30.0, None), 20.0, 200.0, replicas=True)
    assert math.isclose(free["local_interval"], young_daly(0.05, m)) and free["durable_interval"] == young_daly(2, m)
    from recipe.goodput import main

    fig = {"local_save": {"block": 0.05, "lag": 0.5}, "replicated_save": {"block": 0.05, "lag": 0.5},
           "durable_save": {"block": 0.05, "lag": 30}, "recovery": {"peer": 26, "durable": 235},
           "parts": {"peer": {"redone": 1, "restart": 5}, "durable": {"redone": 30, "restart": 5}}}  # fmt: skip
    (tmp_path / "peer.json").write_text(json.dumps({"figures": fig}))
    main(["--nodes", "1", "4096", "--node-mtbf", "5000h", "--peer", str(tmp_path / "peer.json"), "--interval",
          "30min", "--local-interval", "2min", "--restart-cost", "1min", "--replace-cost", "5min", "--replace-share",
          "0.6"])  # fmt: skip
    out = capsys.readouterr().out
    assert "recover from the peer in 20.00 s, from the durable tier in 3.3 min" in out  # (less restart, redone)
    table = out.split("with copy")[1]  # (after the main table, the one with and without the copy)
    rows = [ln.split() for ln in table.splitlines() if ln.lstrip().startswith(("1 ", "4096 "))]
    assert [r[0] for r in rows] == ["1", "4096"] and math.isclose(
        float(rows[1][-1]), (copy["goodput"] - alone["goodput"]) * 100, abs_tol=0.051
    )


def test_interval_auto_of_a_replicated_local_tier_waits_for_the_copy_whatever_the_backend():
    from pitstop.ckpt.contract import SaveRecord
    from pitstop.ckpt.tiers import complete_seconds

    def saved(step, total, copied=None, tier="local", error=None):
        return SaveRecord(step, f"/l/step_{step}", tier=tier, started=100.0, total_seconds=total,
                          copied=None if copied is None else 100.0 + copied, error=error)  # fmt: skip

    records = [
        saved(5, 0.2, 1.0),
        saved(10, 0.2, 3.0),
        saved(15, 0.2, 9.0, error="full"),
        saved(20, 5.0, 7.0, "durable"),
    ]
    # with the copy: a local save is complete once its copy ended (its write alone took 0.2 s), sync or async
    assert complete_seconds(records, "local", False, True) == complete_seconds(records, "local", True, True) == 2.0
    assert complete_seconds(records, "local", True, False) == 0.2  # without: once written (async)
    assert complete_seconds(records, "local", False, False) == 0.0  # a sync save without a copy: with the loop
    # the newest five of 1, 3, 1, 3, 1, 3, 1, 3 s
    assert math.isclose(complete_seconds(records[:2] * 4, "local", True, True, last=5), (3 + 1 + 3 + 1 + 3) / 5)
    auto = AutoInterval(3600.0, "test")
    assert auto.update(0.01, complete_seconds(records, "local", False, True)) == max(young_daly(0.01, 3600.0), 2.0)


def test_the_projection_with_the_copy_prints_what_the_checkpoints_guide_shows(capsys):
    import shlex

    from manual import ROOT, assert_shows, page_output, page_outputs
    from recipe.goodput import main

    key = "--peer bench/results/peer_restore.json"
    cmd = next(c for _, c, _ in page_outputs() if c and key in c)  # (the page's command, run in the checkout)
    main([str(ROOT / a) if a.endswith(".json") else a for a in shlex.split(cmd)[3:]])
    shown = page_output("--peer bench/results/peer_restore.json")
    assert_shows(shown, capsys.readouterr().out, "the projection with a copy on a partner (checkpoints guide)")
