"""Accelerator options in-process: any torchvision model by name, top-5, label smoothing, throughput/MFU and the
profiler; no all-reduce on accumulation micro-batches (a real one-rank gloo DDP); the GradScaler's state in the
train state; bad values refused in one line before training. Also here, not marked slow: the CUDA kill/resume and
NCCL checks (run only where CUDA is present). bench/device_check.sh runs in tests/system/test_device_check.py, the
kill in the middle of an accumulation window in tests/system/test_accel_kills.py; that the options compose with
every strategy and backend is in tests/integration/test_contracts.py. The MLflow store is checked once, in
tests/integration/test_config_groups.py::test_logger_mlflow_real_store.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import assert_accuracy_counts, cli, read_jsonl, refused, train

CKPTS = ["none", "sync_save", "sync_dcp", "async_dcp", "async_dcp_pinned"]


def summary(run_dir) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def test_model_by_name_top5_label_smoothing_throughput_and_profile(make_cfg, tmp_path):
    cfg = make_cfg(
        "model=torchvision",
        "model.name=mobilenet_v3_small",
        "task.label_smoothing=0.1",
        "trainer.profile.steps=[3,4]",
        "trainer.profile.memory=true",
    )
    s = train(cfg)
    assert s["final_step"] == 12
    assert_accuracy_counts(s["metrics"])
    t = s["throughput"]
    assert (
        t["samples_per_s_per_device"] > 0
        and 0 < t["step_seconds_p50"] <= t["step_seconds_p90"] <= t["step_seconds_p99"]
    )
    assert t["flops_per_step"] > 0 and t["mfu"] is None and t["mfu_note"].startswith("n/a on cpu")
    speeds = [r for r in read_jsonl(Path(cfg.run_dir) / "metrics.jsonl") if "samples_per_s_per_device" in r]
    assert [r["step"] for r in speeds] == [4, 8, 12]
    trace = json.loads((Path(cfg.run_dir) / "profile" / "trace.rank0.steps3-4.json").read_text())
    assert any("conv" in str(e.get("name", "")).lower() for e in trace["traceEvents"])
    # label smoothing reaches the loss: the same run without it has another loss at step 1
    plain = make_cfg(
        "model=torchvision", "model.name=mobilenet_v3_small", "trainer.max_steps=1", f"run_dir={tmp_path / 'plain'}"
    )
    train(plain)
    first = [r["loss"] for r in read_jsonl(Path(cfg.run_dir) / "metrics.jsonl") if "loss" in r][0]
    assert first != [r["loss"] for r in read_jsonl(tmp_path / "plain" / "metrics.jsonl") if "loss" in r][0]


def test_no_gradient_all_reduce_on_accumulation_micro_batches(make_cfg):
    # A real one-rank DDP (gloo): count the buckets DDP hands to its communication hook.
    from pitstop.train.runner import Runner

    cfg = make_cfg("strategy=ddp", "strategy.nproc_per_node=1", "trainer.grad_accum_steps=4", "trainer.max_steps=3")
    r = Runner(cfg, cfg.run_dir)
    calls = []

    def counting(state, bucket):
        calls.append(bucket.index())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    try:
        r.setup()
        r.model.register_comm_hook(None, counting)
        r.restore()
        r.fit()
    finally:
        r.close()
    buckets = len(set(calls))
    assert r.step == 3 and len(calls) == 3 * buckets  # one reduction per step, not per micro-batch


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["trainer.precision=fp16"], "trainer.precision=fp16 needs a CUDA device (this run is on CPU)"),
        (["trainer.precision=fp8"], "trainer.precision='fp8' is not supported"),
        (
            ["trainer.compile=true", "trainer.compile_backend=nope"],
            "trainer.compile_backend='nope' is not a torch.compile backend",
        ),
        (["model=torchvision", "model.name=fasterrcnn_resnet50_fpn"], "is not a torchvision classification model"),
        (["model=torchvision", "model.name=vit_b_16"], "needs data.image_size divisible by its patch size 16 (got 8)"),
        (["trainer.grad_accum_steps=0"], "trainer.grad_accum_steps must be a positive integer, got 0"),
        (["trainer.profile.steps=[10,13]"], "ends past the last step (12)"),
        (["trainer.profile.steps=10"], "trainer.profile.steps must be [start, end] (two step numbers), got 10"),
        (["trainer.epochs=1", "trainer.max_steps=null", "trainer.grad_accum_steps=1000"], "not one step"),
        (["task.label_smoothing=1.5"], "task.label_smoothing must be a number in [0, 1)"),
        (
            ["strategy=fsdp", "strategy.mixed_precision=float16"],
            "strategy.mixed_precision casts to float16 but trainer.precision=fp32",
        ),
    ],
)
def test_bad_accelerator_options_are_one_line_before_training(overrides, message, make_cfg):
    cfg = make_cfg(*overrides)
    assert message in refused(cfg)
    assert not (Path(cfg.run_dir) / "metrics.jsonl").exists()


def test_the_grad_scaler_state_travels_with_the_train_state(make_cfg):
    # fp16 itself needs CUDA (the cuda tests resume it end to end); the state's round trip through the train
    # state (JSON, as every backend stores it) is the same code on any device.
    from pitstop.parts.precision import Precision
    from pitstop.train.runner import Runner

    cfg = make_cfg()
    r = Runner(cfg, cfg.run_dir)
    r.setup()
    try:
        saved = r.state.precision
        saved.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=7)
        saved.scaler.scale(torch.ones(()))  # (the scale tensor exists once used)
        saved.scaler.update(new_scale=48.0)
        state = json.loads(json.dumps(r.state.state_dict()))
        assert state["scaler"]["scale"] == 48.0 and state["scaler"]["growth_interval"] == 7
        fresh = Precision("fp32", torch.device("cpu"))
        fresh.scaler = torch.amp.GradScaler("cpu")
        r.state.precision = fresh
        r.state.load_state_dict(state)
        assert fresh.scaler.get_scale() == 48.0 and fresh.scaler.state_dict() == saved.scaler.state_dict()
    finally:
        r.close()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ON_CUDA = ["debug=tiny", "trainer.deterministic=true", "ckpt.interval_steps=4"]

CUDA_CASES = [(c, "fp32") for c in CKPTS[1:]] + [
    ("async_dcp_pinned", "fp16"),
    ("async_dcp_pinned", "bf16-channels_last"),
]

PRECISION = {
    "fp32": [],
    "fp16": ["trainer.precision=fp16"],
    "bf16-channels_last": ["trainer.precision=bf16", "trainer.channels_last=true"],
}


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("ckpt,precision", CUDA_CASES)
def test_kill_and_resume_on_cuda_is_bitwise(ckpt, precision, data_root, tmp_path):
    # fp16: the GradScaler's scale and growth tracker come back with the train state, or the digests differ
    args = [*ON_CUDA, f"ckpt={ckpt}", *PRECISION[precision]]
    ref = cli([*args, f"run_dir={tmp_path / 'ref'}"], data_root, tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    p = cli(
        [*args, f"run_dir={tmp_path / 'run'}", "trainer.max_restarts=1", "fault=crash_at_step", "fault.step=6"],
        data_root,
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    s, r = summary(tmp_path / "run"), summary(tmp_path / "ref")
    assert s["resumed_from"] == 4 and s["params_sha256"] == r["params_sha256"]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_nccl_with_one_process_per_device(strategy, data_root, tmp_path):
    p = cli(
        [
            *ON_CUDA,
            f"strategy={strategy}",
            "strategy.nproc_per_node=1",
            "ckpt=async_dcp_pinned",
            f"run_dir={tmp_path / 'run'}",
        ],
        data_root,
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "backend cpu:gloo,cuda:nccl" in (tmp_path / "run" / "train.log").read_text()
    assert summary(tmp_path / "run")["world_size"] == 1
