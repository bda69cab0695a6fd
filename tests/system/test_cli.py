"""The real command line in subprocesses: a run, a -m sweep, run-dir reuse and bad input."""

from __future__ import annotations

import json
import os
import pytest

from conftest import cli


@pytest.mark.slow
def test_train_cli_writes_run_dir(data_root, tmp_path):
    run_dir = tmp_path / "pinned"
    p = cli(["debug=tiny", f"run_dir={run_dir}"], data_root, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == 12 and (run_dir / ".hydra" / "config.yaml").is_file()
    assert (run_dir / "metrics.jsonl").is_file() and (run_dir / "train.log").is_file()
    # The same command again reuses the same dir (resume relies on this).
    p = cli(["debug=tiny", f"run_dir={run_dir}"], data_root, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not (tmp_path / "outputs" / "runs").exists()  # no second, timestamped run dir


@pytest.mark.slow
def test_multirun_sweep_over_two_options(data_root, tmp_path):
    p = cli(["-m", "optim=sgd,adamw", "debug=tiny", "trainer.max_steps=4"], data_root, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    sweeps = list((tmp_path / "outputs" / "multirun").iterdir())
    assert len(sweeps) == 1
    jobs = sorted(d for d in sweeps[0].iterdir() if d.is_dir())
    assert [d.name for d in jobs] == ["0", "1"]
    targets = set()
    for d in jobs:
        assert json.loads((d / "summary.json").read_text())["final_step"] == 4
        targets.add(
            next(
                line for line in (d / ".hydra" / "config.yaml").read_text().splitlines() if "torch.optim." in line
            ).strip()
        )
    assert targets == {"_target_: torch.optim.SGD", "_target_: torch.optim.AdamW"}


@pytest.mark.slow
def test_unknown_option_lists_valid_ones(data_root, tmp_path):
    p = cli(["model=nope", "debug=tiny"], data_root, tmp_path)
    assert p.returncode != 0
    assert "Could not find 'model/nope'" in p.stderr and "cnn" in p.stderr and "resnet18" in p.stderr


def last_line(p) -> str:
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


@pytest.mark.slow
def test_missing_data_dir_is_one_line_with_the_command(data_root, tmp_path):
    p = cli(["debug=tiny", f"data.root={tmp_path}/missing"], data_root, tmp_path)
    assert p.returncode == 2
    line = last_line(p)
    assert line.startswith("error: data dir not found: ") and f"{tmp_path}/missing" in line
    assert "python -m recipe.prepare data=digits" in line and "Traceback" not in p.stderr


@pytest.mark.parametrize(
    "override,expected",
    [
        ("optim.lr=abc", "optim.lr must be a positive number, got 'abc'"),
        ("trainer.batch_size=-4", "trainer.batch_size must be a positive integer, got -4"),
        (
            "trainer.batch_size=many",  # a type: refused by the schema while Hydra composes
            "Error merging override trainer.batch_size=many; "
            "Value 'many' of type 'str' could not be converted to Integer",
        ),
    ],
)
@pytest.mark.slow
def test_bad_values_fail_before_training(data_root, tmp_path, override, expected):
    p = cli(["debug=tiny", override, f"run_dir={tmp_path / 'r'}"], data_root, tmp_path)
    assert p.returncode == 2 and last_line(p) == f"error: {expected}"
    assert not (tmp_path / "r" / "metrics.jsonl").exists()  # failed before the first step


@pytest.mark.slow
def test_prepare_cli_is_idempotent(data_root, tmp_path):
    p = cli([f"data.root={tmp_path}/d"], data_root, tmp_path, module="recipe.prepare")
    assert p.returncode == 0, p.stderr[-2000:]
    index = json.loads((tmp_path / "d" / "index.json").read_text())
    assert (
        sum(s["samples"] for s in index["splits"]["train"]) + sum(s["samples"] for s in index["splits"]["val"]) == 1797
    )
    assert len(index["splits"]["train"]) == 8 and all(len(s["sha256"]) == 64 for s in index["splits"]["train"])
    p = cli([f"data.root={tmp_path}/d"], data_root, tmp_path, module="recipe.prepare")
    assert p.returncode == 0 and "already exist" in p.stdout + p.stderr


@pytest.mark.slow
def test_slurm_launcher_config_composes(data_root, tmp_path):
    p = cli(["hydra/launcher=slurm", "hydra.launcher.partition=gpu", "debug=tiny", "--cfg=hydra"], data_root, tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "SlurmLauncher" in p.stdout and "partition: gpu" in p.stdout and "gpus_per_node: 8" in p.stdout


@pytest.mark.slow
def test_a_slurm_sweep_without_sbatch_stops_in_one_line_before_writing(data_root, tmp_path):
    # (the check is a Hydra callback: raised as an exception, Hydra would only warn and go on to submit)
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {**os.environ, "PATH": str(empty)}
    p = cli(["-m", "hydra/launcher=slurm", "trainer.max_steps=1"], data_root, tmp_path, env=env, cold=True)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1].startswith("error: hydra/launcher=slurm: SLURM is not reachable from here")
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_sweep_through_the_submitit_launcher(data_root, tmp_path):
    # submitit's local executor runs the same code path as SLURM jobs (pickled task, separate processes).
    p = cli(
        [
            "-m",
            "hydra/launcher=submitit_local",
            "hydra.launcher.timeout_min=5",
            "optim=sgd,adamw",
            "debug=tiny",
            "trainer.max_steps=3",
        ],
        data_root,
        tmp_path,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    jobs = sorted(d for d in next((tmp_path / "outputs" / "multirun").iterdir()).iterdir() if d.name.isdigit())
    assert len(jobs) == 2 and all(json.loads((d / "summary.json").read_text())["final_step"] == 3 for d in jobs)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides,expected",
    [
        (
            ["ckpt=async_dcp", "ckpt.checkpointer=bogus"],
            "error: ckpt.checkpointer='bogus': use auto, thread or process",
        ),
        (
            ["ckpt=sync_dcp", "ckpt.format=zip"],
            "error: ckpt.format='zip': use raw (tensor bytes, fastest) or torch_save "
            "(what torch's own FileSystemReader reads)",
        ),
        (
            ["ckpt=sync_dcp", "ckpt.interval_steps=abc"],
            "error: Error merging override ckpt.interval_steps=abc; "
            "Value 'abc' of type 'str' could not be converted to Integer",
        ),
        (["loader.num_workers=-1"], "error: loader.num_workers must be an integer >= 0, got -1"),
        (
            ["strategy=ddp", "strategy.nproc_per_node=0"],
            "error: strategy.nproc_per_node must be a positive integer, got 0",
        ),
        (
            ["fault=crash_at_step", "fault.step=abc"],
            "error: Error merging override fault.step=abc; Value 'abc' of type 'str' could not be converted to Integer",
        ),
        (
            ["fault.step=3"],
            "error: Could not override 'fault.step'; Key 'step' not in 'NoFault'; "
            "see the option's YAML in conf/ for its keys",
        ),
        (
            ["trainer.max_stepz=3"],
            "error: Could not override 'trainer.max_stepz'; Key 'max_stepz' not in 'Trainer'; "
            "see the option's YAML in conf/ for its keys",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2_and_leaves_no_progress(overrides, expected, data_root, tmp_path):
    run_dir = tmp_path / "r"
    p = cli(["debug=tiny", *overrides, f"run_dir={run_dir}"], data_root, tmp_path)
    assert p.returncode == 2 and last_line(p) == expected, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    left = {x.name for x in run_dir.iterdir()} if run_dir.exists() else set()
    assert left <= {".hydra", "train.log"}, left  # nothing a later run would take for progress
