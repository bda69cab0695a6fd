"""One test per option of every config group: compose the real conf/, shrink with debug=tiny, train."""

from __future__ import annotations

import os
import socket
import time

import pytest

from conftest import check_run, config_options, read_jsonl, refused, tiny_cfg, train


@pytest.fixture(scope="module")
def default_run(data_root, tmp_path_factory):
    """One run of the default options (shrunk by debug=tiny), shared by every test of a default option."""
    cfg = tiny_cfg(data_root, tmp_path_factory.mktemp("default"))
    return cfg, train(cfg)


def run_option(group: str, option: str, make_cfg, default_run, *overrides: str):
    """Train with ``group=option``; the default option of a group reuses the shared default run."""
    if option == DEFAULTS.get(group) and not overrides:
        return default_run
    cfg = make_cfg(f"{group}={option}", *overrides)
    return cfg, train(cfg)


DEFAULTS = {"model": "cnn", "optim": "sgd", "strategy": "single", "ckpt": "none", "fault": "none", "logger": "none"}


@pytest.mark.parametrize("model", config_options("model"))
def test_model(make_cfg, default_run, model):
    # (resnet18 wants 3 channels of 32 x 32; torchvision's default, resnet50 by name, is the largest: 4 steps of
    # each show it builds, trains a step at a time and evaluates, as debug=tiny's 12 show for the small CNN)
    rgb = ["data.channels=3", "data.image_size=32", "data.mean=[0.5,0.5,0.5]", "data.std=[0.5,0.5,0.5]"]
    overrides = {"resnet18": [*rgb, "trainer.max_steps=4"], "torchvision": ["trainer.max_steps=4"]}.get(model, [])
    check_run(*run_option("model", model, make_cfg, default_run, *overrides))


@pytest.mark.parametrize("optim", config_options("optim"))
def test_optim(make_cfg, default_run, optim):
    cfg, summary = run_option("optim", optim, make_cfg, default_run)
    check_run(cfg, summary)
    lrs = [r["lr"] for r in read_jsonl(os.path.join(cfg.run_dir, "metrics.jsonl")) if "lr" in r]
    peak = lrs.index(max(lrs))
    assert 0 < peak < len(lrs) - 1 and lrs[0] < lrs[peak] > lrs[-1]  # the schedule warms up, then decays


@pytest.mark.parametrize("opt", config_options("loader"))
def test_loader(make_cfg, opt):
    cfg = make_cfg(f"loader={opt}", "loader.num_workers=2")
    check_run(cfg, train(cfg))


@pytest.mark.parametrize("opt", config_options("strategy"))
def test_strategy(make_cfg, default_run, opt, recwarn):
    # In-process (a world of one; multi-rank runs are in test_strategy.py, replica groups in test_ft.py).
    if opt == "ft":  # one replica group, against a real Lighthouse started here
        lighthouse = pytest.importorskip("torchft.coordination").LighthouseServer(
            bind="[::]:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=20, heartbeat_timeout_ms=250
        )
        try:
            extra = ["strategy.replicas=1", "strategy.replica_id=0", f"strategy.lighthouse={lighthouse.address()}"]
            cfg, summary = run_option("strategy", opt, make_cfg, default_run, *extra)
        finally:
            lighthouse.shutdown()
        check_run(cfg, summary)
        assert summary["ft"]["discarded_steps"] == 0 and summary["ft"]["heals"] == []
        return
    check_run(
        *run_option("strategy", opt, make_cfg, default_run, *([] if opt == "single" else ["strategy.nproc_per_node=1"]))
    )
    # No FSDP unit of the model hands back a view (FSDP2 warns: an in-place op on one would skip its all-gather).
    assert not [str(w.message)[:80] for w in recwarn if "returned a view tensor" in str(w.message)]


def test_an_unreachable_lighthouse_is_refused_in_one_line_naming_the_key(make_cfg):
    pytest.importorskip("torchft")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    group = ["strategy=ft", "strategy.replicas=1", "strategy.replica_id=0", "strategy.timeout=0.5"]
    cfg = make_cfg(*group, f"strategy.lighthouse=127.0.0.1:{port}")
    t0 = time.monotonic()
    message = refused(cfg)
    assert message.startswith(f"strategy.lighthouse=127.0.0.1:{port} cannot be reached within strategy.timeout=0.5s")
    assert "start the job's Lighthouse or fix the address" in message and time.monotonic() - t0 < 30


@pytest.mark.parametrize("opt", config_options("ckpt"))
def test_ckpt(make_cfg, default_run, opt):
    cfg, summary = run_option("ckpt", opt, make_cfg, default_run, *([] if opt == "none" else ["ckpt.interval_steps=5"]))
    check_run(cfg, summary)
    if opt != "none":
        assert summary["checkpoint"]["saves"] == 3 and summary["checkpoint"]["failures"] == 0  # steps 5, 10, 12
        assert sorted(os.listdir(cfg.ckpt.dir)) == ["step_00000005", "step_00000010", "step_00000012"]


def test_fault_none_and_crash_config(make_cfg, default_run):
    check_run(*run_option("fault", "none", make_cfg, default_run))  # (real faults: tests/test_goodput.py)
    from pitstop.errors import ConfigError

    with pytest.raises(ConfigError, match="fault.step must be a positive integer"):
        train(make_cfg("fault=crash_at_step", "fault.step=-3"))
    with pytest.raises(ConfigError, match=r"fault.step=1000 is not a step of this run \(1..12\)"):
        train(make_cfg("fault=crash_at_step", "fault.step=1000"))
    with pytest.raises(ConfigError, match=r"fault.phase=heal fires as a replica group .*: it needs strategy=ft"):
        train(make_cfg("fault=stall", "fault.rank=0", "fault.step=3", "fault.phase=heal"))


def test_trainer_epochs(make_cfg):
    cfg = make_cfg(
        "trainer.max_steps=null", "trainer.epochs=1", "trainer.batch_size=128", "trainer.eval_every_steps=null"
    )
    summary = train(cfg)
    assert summary["epoch"] == 0 and summary["final_step"] == summary["total_steps"] > 0
    assert summary["data"]["samples"] == 1438  # one full epoch: every training sample once


def test_logger_none(make_cfg, default_run):
    cfg, summary = run_option("logger", "none", make_cfg, default_run)
    check_run(cfg, summary)
    assert not os.path.exists(os.path.join(cfg.run_dir, "mlflow_run_id")) and "mlflow_run_id" not in summary


def test_debug_preset_is_tiny(make_cfg):
    cfg = make_cfg()
    assert cfg.trainer.max_steps <= 20 and cfg.logger._target_.endswith("NullLogger")
