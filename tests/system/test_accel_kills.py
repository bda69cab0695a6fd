"""Accelerator options with real processes: with every option on (bf16, compile, channels_last,
grad_accum_steps), a kill in the middle of an accumulation window resumes bitwise under every strategy and
checkpoint backend; a compiled run resumes an eager checkpoint and back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import cli, read_jsonl

# Every new option on at once; aot_eager compiles through dynamo + AOT autograd like inductor does, without
# inductor's C++ builds (30 s per process on 2 cores; one test below uses inductor itself).
ALL_ON = [
    "trainer.precision=bf16",
    "trainer.compile=true",
    "trainer.compile_backend=aot_eager",
    "trainer.channels_last=true",
    "trainer.grad_accum_steps=2",
]


def summary(run_dir) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


# (strategy, ckpt): every backend once, every strategy at least once; killed after the first micro-batch of
# step 7 (gradients half accumulated, a save of step 4 behind it), restarted by the launcher, bitwise equal.
CASES = [("single", "sync_save"), ("single", "async_dcp_pinned"), ("ddp", "async_dcp"), ("fsdp", "sync_dcp")]

RUN = ["debug=tiny", "ckpt.interval_steps=4", "trainer.eval_every_steps=6", *ALL_ON]


@pytest.fixture(scope="module")
def references(data_root, tmp_path_factory):
    made: dict[str, dict] = {}

    def get(strategy: str) -> dict:
        if strategy not in made:
            tmp = tmp_path_factory.mktemp(f"ref-{strategy}")
            p = cli([*RUN, f"strategy={strategy}", "ckpt=sync_dcp", f"run_dir={tmp / 'run'}"], data_root, tmp)
            assert p.returncode == 0, p.stderr[-3000:]
            made[strategy] = summary(tmp / "run")
        return made[strategy]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("strategy,ckpt", CASES)
def test_all_options_on_killed_mid_accumulation_resume_bitwise(strategy, ckpt, data_root, tmp_path, references):
    run_dir = tmp_path / "run"
    p = cli(
        [
            *RUN,
            f"strategy={strategy}",
            f"ckpt={ckpt}",
            f"run_dir={run_dir}",
            "trainer.max_restarts=1",
            "fault=crash_at_step",
            "fault.step=7",
            "fault.micro_batch=1",
            "data.record_sample_ids=true",
        ],
        data_root,
        tmp_path,
        timeout=400,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    s, ref = summary(run_dir), references(strategy)
    assert s["resumed_from"] == 4 and s["goodput"]["restarts"] == 1 and s["final_step"] == 12
    assert s["params_sha256"] == ref["params_sha256"]
    assert s["samples_seen"] == ref["samples_seen"] == 12 * 2 * 16 * s["world_size"]
    assert s["precision"] == "bf16" and s["goodput"]["totals"]["compile"] > 0  # compile: its own bucket
    # every micro-batch of every step once in the sample log, the redone ones recorded again by the new attempt
    rows = [r for path in run_dir.glob("samples.rank*.jsonl") for r in read_jsonl(path) if "keys" in r]
    assert {(r["step"], r["micro"]) for r in rows} == {(st, m) for st in range(1, 13) for m in (1, 2)}


@pytest.mark.slow
def test_compiled_run_resumes_an_eager_checkpoint_and_back(data_root, tmp_path):
    # inductor itself (what trainer.compile=true uses): parameter names are the eager ones, so checkpoints move
    # freely between the two; compile time is its own ledger bucket and part of the restart cost.
    run_dir = tmp_path / "run"
    base = ["debug=tiny", "ckpt=sync_dcp", "ckpt.interval_steps=4", f"run_dir={run_dir}"]
    for steps, compiled in ((4, False), (8, True), (12, False)):
        p = cli(
            [*base, f"trainer.max_steps={steps}", f"trainer.compile={str(compiled).lower()}"],
            data_root,
            tmp_path,
            timeout=400,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        s = summary(run_dir)
        assert s["final_step"] == steps and s["resumed_from"] == (steps - 4 or None)
        assert (s["goodput"]["totals"]["compile"] > 0) == compiled or steps == 12  # (totals span the attempts)
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(run_dir / "checkpoints" / "step_00000008")).read_metadata().state_dict_metadata
    assert keys and not [k for k in keys if "_orig_mod" in k]
