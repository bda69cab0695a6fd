"""One contract per component kind: every option in conf/ implements it (composed from the real conf/ and built);
evaluation in lockstep as a plan over real loaders; a setup that fails half way releases what it acquired.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from conftest import config_options
from pitstop.config.build import build
from pitstop.ckpt.contract import Checkpointer, SaveResult
from pitstop.resilience.fault import Fault
from pitstop.data.dataset import build_dataset
from pitstop.data.loader.base import ShardLoader
from pitstop.telemetry.logger.base import Logger
from pitstop.strategy.base import Strategy

CONTRACTS = {"ckpt": Checkpointer, "loader": ShardLoader, "strategy": Strategy, "logger": Logger, "fault": Fault}

REQUIRED = {
    "fault": {
        "crash_at_step": ["fault.step=3"],
        "bug": ["fault.step=3"],
        "stall": ["fault.step=3"],
        "preempt": ["fault.step=3"],
        "random": ["fault.mtbf_seconds=9"],
        "nonfinite": ["fault.step=3"],
        "bitflip": ["fault.step=3"],
        "poison": ["fault.sample=0000000"],
        "bad_node": ["fault.node=n1"],
        "lose_node": ["fault.node=n1", "fault.step=3"],
        "corrupt_peer_copy": ["fault.node=n1", "fault.step=3"],
        "lose_node_and_partner": ["fault.node=n1", "fault.step=3"],
    }
}


def contract_methods(base: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(fn)
        for name, fn in inspect.getmembers(base, inspect.isfunction)
        if getattr(fn, "__isabstractmethod__", False)
        or name in ("iterate_once", "state_dict", "load_state_dict", "steps_per_epoch")
    }


@pytest.mark.parametrize("group,option", [(g, o) for g in CONTRACTS for o in config_options(g)])
def test_every_option_implements_its_contract(group, option, make_cfg):
    cfg = make_cfg(f"{group}={option}", *REQUIRED.get(group, {}).get(option, []))
    kw = {}
    if group == "loader":
        kw = dict(dataset=build_dataset(cfg.data), split="train", batch_size=8, seed=0)
    obj = build(cfg[group], **kw)
    base = CONTRACTS[group]
    assert isinstance(obj, base), f"{group}={option} builds {type(obj).__name__}, not a {base.__name__}"
    assert not getattr(type(obj), "__abstractmethods__", None)
    for name, want in contract_methods(base).items():
        got = inspect.signature(getattr(type(obj), name))
        assert list(got.parameters) == list(want.parameters), (group, option, name, got, want)
    assert isinstance(obj.name if group != "loader" else obj.kind, str)


# Every accelerator option on at once (tests/system/test_accel_kills.py trains with them, killed and resumed, per
# strategy).
ALL_ON = [
    "trainer.precision=bf16",
    "trainer.compile=true",
    "trainer.compile_backend=aot_eager",
    "trainer.channels_last=true",
    "trainer.grad_accum_steps=2",
]


@pytest.mark.parametrize("strategy", config_options("strategy"))
@pytest.mark.parametrize("ckpt", config_options("ckpt"))
def test_accelerator_options_compose_with_every_strategy_and_ckpt_backend(strategy, ckpt, make_cfg):
    import torch

    from pitstop.config import validate

    cfg = make_cfg(f"strategy={strategy}", f"ckpt={ckpt}", *ALL_ON)
    validate(cfg)
    s = build(cfg.strategy)
    # one key sets the precision everywhere: FSDP's policy follows it (and then nothing autocasts on top)
    assert s.compute_dtype == (torch.bfloat16 if strategy == "fsdp" else None)
    assert s.channels_last_params == (strategy != "fsdp")
    assert isinstance(build(cfg.ckpt), Checkpointer) and cfg.trainer.grad_accum_steps == 2


def test_no_checkpoint_is_a_full_checkpointer(make_cfg):
    ckpt = build(make_cfg("ckpt=none").ckpt)
    assert ckpt.maybe_save(None, 5, last=True) == SaveResult(0.0, None)
    assert ckpt.wait() == 0.0 and ckpt.wait_staging() == 0.0 and ckpt.poll() is None and ckpt.close() is None
    assert ckpt.root is None and ckpt.last_started is None and ckpt.stats()["saves"] == 0


# ---- evaluation in lockstep: the DDP/FSDP deadlock's cause, as a pure plan ----------------------------------
def eval_loaders(cfg, world: int, workers: int):
    data = build_dataset(cfg.data)
    return [
        build(
            cfg.loader,
            dataset=data,
            split="val",
            batch_size=64,
            seed=0,
            rank=r,
            world_size=world,
            train=False,
            num_workers=workers,
        )
        for r in range(world)
    ]


def test_evaluation_spreads_shards_over_ranks_before_workers(make_cfg):
    # 2 val shards, 2 ranks x 2 workers: rank 1 used to get no shard at all, so it skipped the forwards (DDP
    # buffer broadcast, FSDP all-gather) that rank 0 ran, and the two ranks deadlocked in different collectives.
    loaders = eval_loaders(make_cfg(), world=2, workers=2)
    assert loaders[0].eval_batches() == [3, 3]  # 180 and 179 samples: one shard each
    assert [loaders[r].eval_batches() for r in (0, 1)] == [[3, 3], [3, 3]]  # the same plan on every rank


def test_a_rank_without_evaluation_data_pads_in_lockstep(make_cfg, tmp_path):
    from recipe.prepare import prepare

    # One val shard for two ranks: rank 1 has nothing; it runs padding forwards with a sample rank 0 shares.
    cfg = make_cfg(f"data.root={tmp_path}/one", "data.prepare.samples_per_shard=400")
    prepare(cfg.data)
    r0, r1 = eval_loaders(cfg, world=2, workers=0)
    assert r0.eval_batches() == [6, 0]
    shared = {}

    def share(obj, src):  # a stand-in for the broadcast: rank 0 runs first here
        assert src == 0
        if obj is not None:
            shared["x"] = obj
        return shared["x"]

    got0 = list(r0.iterate_once(share=share))
    got1 = list(r1.iterate_once(share=share))
    assert len(got0) == len(got1) == 6
    assert all(counted for _, counted in got0) and not any(counted for _, counted in got1)
    assert sum(len(b[1]) for b, _ in got0) == 359 and all(len(b[1]) == 1 for b, _ in got1)
    capped = list(r1.iterate_once(max_batches=2, share=share))
    assert len(capped) == 2 == len(list(r0.iterate_once(max_batches=2, share=share)))


def test_a_setup_that_fails_half_way_releases_what_it_acquired(make_cfg):
    import torch.distributed as dist

    from pitstop.errors import ConfigError
    from pitstop.train.runner import Runner

    # The fault's check is the last step of setup: by then the process group, the checkpoint process's
    # stager and the logger exist. A config error must release all of them and leave no progress behind.
    cfg = make_cfg(
        "strategy=ddp",
        "strategy.nproc_per_node=1",
        "ckpt=async_dcp_pinned",
        "logger=mlflow",
        "fault=crash_at_step",
        "fault.step=1000",
    )
    runner = Runner(cfg, cfg.run_dir)
    with pytest.raises(ConfigError, match=r"fault.step=1000 is not a step of this run \(1..12\)"):
        runner.run()
    assert not dist.is_initialized()  # the process group setup() joined is gone
    assert runner.ckpt.stager is None and runner.records.logger is None
    left = sorted(str(p.relative_to(cfg.run_dir)) for p in Path(cfg.run_dir).rglob("*"))
    assert left == ["checkpoints"], left  # no goodput.json, metrics.jsonl or checkpoint: nothing to resume
