"""Checkpointing with real processes and real files: exact resume after SIGKILL for every backend,
partial and corrupt checkpoints, retention, unwritable dirs, a full disk, changed configs.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import assert_resumed, final_losses, PY, ROOT, cli, cli_cmd, flatten, popen_cmd, read_jsonl, run_cmd

BACKENDS = ["sync_save", "sync_dcp", "async_dcp", "async_dcp_pinned"]

# 40 steps of 64 with 2 workers: crosses an epoch boundary (24 steps/epoch); dropout uses the torch RNG.
RUN = [
    "debug=tiny",
    "trainer.max_steps=40",
    "trainer.batch_size=64",
    "loader.num_workers=2",
    "trainer.eval_every_steps=20",
]


def summary(run_dir) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


@pytest.fixture(scope="module")
def reference(data_root, tmp_path_factory):
    """An uninterrupted run: its parameters, its losses, and its synchronous saves of every 5th step (all kept), which
    a checkpoint of the same step must equal tensor for tensor."""
    tmp = tmp_path_factory.mktemp("ref")
    args = [*RUN, f"run_dir={tmp / 'run'}", "ckpt=sync_dcp", "ckpt.interval_steps=5", "ckpt.keep_last_k=0"]
    p = cli(args, data_root, tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    return summary(tmp / "run")["params_sha256"], final_losses(tmp / "run"), tmp / "run" / "checkpoints"


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_sigkill_then_same_command_resumes_bitwise(backend, data_root, tmp_path, reference):
    run_dir = tmp_path / "run"
    # saves at 5, 10, ...: killed at 27, it resumes from 25 (or 20, below), mid-epoch (the loader restarts its workers)
    args = [
        *RUN,
        f"run_dir={run_dir}",
        f"ckpt={backend}",
        "ckpt.interval_steps=5",
        "fault=crash_at_step",
        "fault.step=27",
    ]
    first = cli(args, data_root, tmp_path)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    assert not (run_dir / "summary.json").exists()
    second = cli(args, data_root, tmp_path)  # the very same command
    assert second.returncode == 0, second.stderr[-3000:]
    s = summary(run_dir)
    assert_resumed(s["resumed_from"], 25, 20, backend)  # (seen in CI: the step-25 save unfinished at step 27)
    assert s["final_step"] == 40
    ref_sha, ref_losses, _ = reference
    assert s["params_sha256"] == ref_sha
    assert final_losses(run_dir) == ref_losses  # every step, including those after the resume point
    assert s["checkpoint"]["saves"] >= 3 and s["checkpoint"]["failures"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["async_dcp", "async_dcp_pinned"])
def test_sigkill_during_background_staging_and_write(backend, data_root, tmp_path, reference):
    """Killed right after the step-30 save was started (staging / background write under way): an unfinished
    checkpoint never counts, and the same command resumes from step 25 to the same final parameters. (With the
    checkpoint *process* -- async_dcp_pinned -- a save already handed over to it before the kill is written by
    that process, which outlives the trainer: the second command waits for it before restoring, so step 30 is
    complete, marker last, and the resume takes it. The final parameters are the same either way.)"""
    run_dir = tmp_path / "run"
    args = [
        *RUN,
        f"run_dir={run_dir}",
        f"ckpt={backend}",
        "ckpt.interval_steps=5",
        "ckpt.throttle_mbps=0.5",
        "fault=crash_at_step",
        "fault.step=30",
    ]
    assert cli(args, data_root, tmp_path).returncode == -signal.SIGKILL
    finished = (run_dir / "checkpoints" / "step_00000030" / ".metadata").exists()
    assert not finished or backend == "async_dcp_pinned"  # a thread writer dies with the trainer
    second = cli(args, data_root, tmp_path, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    s = summary(run_dir)
    log = (run_dir / "train.log").read_text()  # (the second command waited for the first one's writer to finish)
    waited = "is still writing its last save" in log and "it finished in" in log
    assert "is still writing its last save" not in log or backend == "async_dcp_pinned"
    assert s["resumed_from"] == (30 if finished or waited else 25), (finished, waited)
    assert s["params_sha256"] == reference[0] and final_losses(run_dir) == reference[1]
    # every checkpoint left (the killed run's, the resumed run's) holds exactly its step's state
    kept = sorted(d for d in (run_dir / "checkpoints").iterdir() if (d / ".metadata").exists())
    assert len(kept) >= 3, kept
    for d in kept:
        saved, sync = checkpoint_tensors(d), checkpoint_tensors(reference[2] / d.name)
        assert sorted(saved) == sorted(sync) and not [k for k in sync if saved[k] != sync[k]], d.name


def checkpoint_tensors(path: Path) -> dict:
    """Every entry of a DCP checkpoint, flattened: path -> bytes of a tensor, or the value itself."""
    import torch

    from pitstop.ckpt.formats import to_torch_save

    out_file = path.parent / f"{path.name}.pt"
    to_torch_save(str(path), str(out_file))
    return flatten(
        torch.load(out_file, weights_only=True), lambda t: (t.dtype, tuple(t.shape), t.contiguous().numpy().tobytes())
    )


def runner_at_step_one(cfg):
    from pitstop.train.runner import Runner
    from pitstop.train.state import Batches

    r = Runner(cfg, cfg.run_dir)
    r.setup()
    r.restore()
    r.batches = Batches(r.loader, r.watchdog)
    one_step(r)
    return r


def one_step(r) -> None:
    r.train_step(r.batches)
    r.progress.step += 1


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["async_dcp", "async_dcp_pinned"])
def test_a_background_staged_checkpoint_of_a_batchnorm_model_is_the_synchronous_one_bitwise(
    backend, make_cfg, tmp_path
):
    """ResNet-18's BatchNorm statistics change in the next step's forward while its parameters and AdamW state
    are still being copied in the background: every saved tensor must still be the saved step's, so each
    checkpoint equals, tensor by tensor and bit for bit, the synchronous save of the same step.

    The background copy is held back until the next forward has run (a task queued ahead of it on the
    stager's thread, released by a forward hook), so the test does not depend on which thread wins."""
    import threading

    overrides = ("model=resnet18", "optim=adamw", "ckpt.interval_steps=1", "ckpt.keep_last_k=0", "trainer.max_steps=50")
    ref = runner_at_step_one(make_cfg(*overrides, "ckpt=sync_dcp", f"run_dir={tmp_path / 'sync'}"))
    r = runner_at_step_one(make_cfg(*overrides, f"ckpt={backend}", f"run_dir={tmp_path / 'staged'}"))
    forward_done = threading.Event()
    r.model.register_forward_hook(lambda *_: forward_done.set())
    for _ in range(3):
        assert ref.ckpt.maybe_save(ref.target, ref.step).started == ref.step
        one_step(ref)
        forward_done.clear()
        r.ckpt.stager._pool.submit(forward_done.wait, 60)  # the copy starts only after the next forward
        assert r.ckpt.maybe_save(r.target, r.step).started == r.step
        one_step(r)
    for x in (ref, r):
        x.ckpt.close()
        x.close()
    for step in (1, 2, 3):
        name = f"checkpoints/step_{step:08d}"
        sync, staged = checkpoint_tensors(tmp_path / "sync" / name), checkpoint_tensors(tmp_path / "staged" / name)
        assert sorted(staged) == sorted(sync)
        assert any("running_mean" in k for k in sync) and any("exp_avg_sq" in k for k in sync)
        differ = [k for k in sync if staged[k] != sync[k]]
        assert not differ, f"step {step}: {len(differ)} entries differ from the synchronous save, e.g. {differ[:3]}"


@pytest.mark.slow
def test_a_killed_checkpoint_process_fails_only_its_save_and_the_next_save_works(make_cfg, tmp_path):
    """SIGKILL to the checkpoint process while it writes (throttled to 20 MB/s): that save is counted as failed
    and never committed, and the next save starts a new checkpoint process and commits."""
    import os

    from torch.distributed.checkpoint import _async_process_executor as executor

    from pitstop.ckpt import layout

    r = runner_at_step_one(
        make_cfg(
            "model=resnet18",
            "optim=adamw",
            "ckpt=async_dcp_pinned",
            "ckpt.interval_steps=1",
            "ckpt.keep_last_k=0",
            "ckpt.on_error=warn",
            "ckpt.throttle_mbps=20",
            "trainer.max_steps=50",
        )
    )
    ckpt_dir = tmp_path / "run" / "checkpoints"
    try:
        r.ckpt._warmup[0].result(timeout=120)  # the checkpoint process is up (a save before is a thread's)
        assert r.ckpt.maybe_save(r.target, r.step).started == 1
        writer = executor._CHECKPOINT_PROCESS._save_process
        deadline = time.time() + 60
        while not partial_write_in_progress(ckpt_dir) and time.time() < deadline:
            time.sleep(0.05)
        assert partial_write_in_progress(ckpt_dir), "the write never started"
        os.kill(writer.pid, signal.SIGKILL)
        r.ckpt.wait()
        assert r.ckpt.failures == 1 and not layout.is_complete(str(ckpt_dir / "step_00000001"))
        one_step(r)
        assert r.ckpt.maybe_save(r.target, r.step).started == 2
        r.ckpt.wait()
        assert executor._CHECKPOINT_PROCESS._save_process.pid != writer.pid
        assert r.ckpt.failures == 1
        assert [p for p in sorted(ckpt_dir.iterdir()) if layout.is_complete(str(p))] == [ckpt_dir / "step_00000002"]
    finally:
        r.ckpt.close()
        r.close()


def wait_for(pred, timeout: float, proc) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.01)
    return False


def partial_write_in_progress(ckpt_dir: Path) -> bool:
    """A step dir whose data file has some bytes but which has no commit marker yet."""
    for d in sorted(ckpt_dir.glob("step_*")):
        if (d / ".metadata").exists() or (d / "COMMITTED").exists():
            continue
        files = [f for f in d.iterdir() if f.is_file() and f.name.endswith((".distcp", ".tmp"))]
        if any(f.stat().st_size > 100_000 for f in files):
            return True
    return False


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sync_save", "sync_dcp", "async_dcp"])
def test_sigkill_mid_write_leaves_a_run_that_resumes_exactly(backend, data_root, tmp_path, reference):
    run_dir = tmp_path / "run"
    # ~0.85 MB of state at 0.5 MB/s: each save takes ~1.7 s, long enough to be killed in the middle.
    args = [*RUN, f"run_dir={run_dir}", f"ckpt={backend}", "ckpt.interval_steps=10", "ckpt.throttle_mbps=0.5"]
    proc = popen_cmd(cli_cmd(args, data_root, tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        seen = wait_for(
            lambda: (
                (run_dir / "checkpoints" / "step_00000010").is_dir()
                and partial_write_in_progress(run_dir / "checkpoints")
            ),
            120,
            proc,
        )
        assert seen, f"never saw a write in progress; rc={proc.poll()}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    partial = [
        d.name
        for d in (run_dir / "checkpoints").glob("step_*")
        if not ((d / ".metadata").exists() or (d / "COMMITTED").exists())
    ]
    assert partial, "the kill should have left a partial checkpoint dir"
    second = cli(args, data_root, tmp_path, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "skipping partial checkpoint" in (run_dir / "train.log").read_text()
    s = summary(run_dir)
    assert s["params_sha256"] == reference[0] and final_losses(run_dir) == reference[1]


@pytest.mark.slow
def test_sigkill_in_an_evaluation_then_in_a_restore_and_the_same_command_resumes_bitwise(
    data_root, tmp_path, reference
):
    """The fault x phase matrix, SIGKILL x evaluation and SIGKILL x restore: killed after the first batch of the
    evaluation at step 20, then killed again as the next command's restore starts reading the newest checkpoint (its
    files verified); the same command then resumes from it and ends with the uninterrupted run's parameters."""
    run_dir = tmp_path / "run"
    args = [*RUN, f"run_dir={run_dir}", "ckpt=sync_dcp", "ckpt.interval_steps=8", "ckpt.keep_last_k=0"]
    first = cli([*args, "fault=crash_at_step", "fault.step=20", "fault.phase=eval"], data_root, tmp_path)
    assert first.returncode == -signal.SIGKILL
    log = (run_dir / "train.log").read_text()
    assert "fault injection: SIGKILL (in the evaluation after step 20)" in log
    again = [*args, "fault=crash_at_step", "fault.step=8", "fault.phase=restore"]
    second = cli(again, data_root, tmp_path)
    assert second.returncode == -signal.SIGKILL
    assert (
        "fault injection: SIGKILL (in the restore of a checkpoint of step 8 or later)"
        in (run_dir / "train.log").read_text()
    )
    third = cli(again, data_root, tmp_path)
    assert third.returncode == 0, third.stderr[-3000:]
    s = summary(run_dir)
    assert s["resumed_from"] == 16
    assert s["params_sha256"] == reference[0] and final_losses(run_dir) == reference[1]


@pytest.mark.slow
def test_partial_skipped_and_corrupt_newest_falls_back_to_previous(data_root, tmp_path, reference):
    run_dir = tmp_path / "run"
    args = [
        *RUN,
        f"run_dir={run_dir}",
        "ckpt=sync_dcp",
        "ckpt.interval_steps=8",
        "ckpt.keep_last_k=0",
        "fault=crash_at_step",
        "fault.step=35",
    ]
    assert cli(args, data_root, tmp_path).returncode == -signal.SIGKILL
    ckpts = run_dir / "checkpoints"
    assert sorted(d.name for d in ckpts.iterdir()) == [f"step_{s:08d}" for s in (8, 16, 24, 32)]
    # The newest complete one is corrupt (truncated data file) and a newer partial dir is lying around.
    data = next((ckpts / "step_00000032").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 3])
    (ckpts / "step_00000036").mkdir()
    (ckpts / "step_00000036" / "__0_0.distcp").write_bytes(b"half")
    p = cli(args, data_root, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    log = (run_dir / "train.log").read_text()
    assert "skipping partial checkpoint" in log and "step_00000036" in log
    assert "step_00000032 is corrupt, not loaded" in log and "is truncated" in log
    assert "falling back to step_00000024" in log
    s = summary(run_dir)
    assert s["resumed_from"] == 24
    assert s["params_sha256"] == reference[0] and final_losses(run_dir) == reference[1]


@pytest.mark.slow
def test_retention_keeps_newest_k_complete(data_root, tmp_path):
    run_dir = tmp_path / "run"
    p = cli(
        [*RUN, f"run_dir={run_dir}", "ckpt=async_dcp", "ckpt.interval_steps=5", "ckpt.keep_last_k=2"],
        data_root,
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(d.name for d in (run_dir / "checkpoints").iterdir()) == ["step_00000035", "step_00000040"]
    saves = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "ckpt_block_seconds" in r]
    assert [r["step"] for r in saves] == list(range(5, 45, 5))
    assert all(r["ckpt_total_seconds"] >= 0 and r["ckpt_bytes"] > 100_000 for r in saves)


@pytest.mark.slow
def test_keep_last_one_is_rejected_for_async(data_root, tmp_path):
    p = cli([*RUN, f"run_dir={tmp_path / 'r'}", "ckpt=async_dcp", "ckpt.keep_last_k=1"], data_root, tmp_path)
    assert p.returncode == 2 and "keep_last_k=1 is unsafe" in p.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_unwritable_ckpt_dir_fails_before_the_first_step(data_root, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a dir")
    p = cli([*RUN, f"run_dir={tmp_path / 'r'}", "ckpt=sync_dcp", f"ckpt.dir={blocker}/ckpts"], data_root, tmp_path)
    assert p.returncode == 2
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: ckpt.dir {blocker}/ckpts is not writable")
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_changed_seed_or_data_refuses_to_resume_unless_model_only(data_root, tmp_path):
    run_dir = tmp_path / "run"
    base = [*RUN, f"run_dir={run_dir}", "ckpt=sync_save", "ckpt.interval_steps=10"]
    assert cli(base, data_root, tmp_path).returncode == 0
    account = (run_dir / "goodput.json").read_text()
    p = cli([*base, "seed=99"], data_root, tmp_path)
    assert p.returncode == 2
    line = p.stderr.strip().splitlines()[-1]
    assert "seed changed" in line and "step_00000040" in line and "load_model_only" in line
    assert (run_dir / "goodput.json").read_text() == account  # a refused resume is no attempt of the job
    p = cli(
        [
            *base,
            "seed=99",
            "ckpt.load_model_only=true",
            "ckpt.load=40",
            "ckpt.save_last=false",
            "ckpt.interval_steps=1000",
        ],
        data_root,
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "loaded model weights only" in (run_dir / "train.log").read_text()


def mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


@pytest.mark.slow
@pytest.mark.parametrize("on_error", ["warn", "raise"])
def test_full_disk_mid_save_never_commits_and_keeps_older(on_error, data_root, tmp_path):
    disk = tmp_path / "small_disk"
    if not mount_tmpfs(disk, "2m"):  # a real full disk: a 2 MiB tmpfs holds two ~0.85 MB checkpoints
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        run_dir = tmp_path / "run"
        p = cli(
            [
                *RUN,
                f"run_dir={run_dir}",
                "trainer.max_steps=14",
                "ckpt=sync_dcp",
                f"ckpt.dir={disk}",
                "ckpt.interval_steps=4",
                "ckpt.keep_last_k=0",
                "ckpt.save_last=false",
                f"ckpt.on_error={on_error}",
            ],
            data_root,
            tmp_path,
        )
        names = sorted(d.name for d in disk.iterdir() if d.name.startswith("step_"))
        assert names == ["step_00000004", "step_00000008"]  # the failed one was removed, not committed
        assert all((disk / n / ".metadata").exists() for n in names)
        assert "checkpoint at step 12 failed" in (run_dir / "train.log").read_text()
        if on_error == "warn":
            assert p.returncode == 0, p.stderr[-2000:]
            assert summary(run_dir)["checkpoint"]["failures"] == 1
            assert any(r.get("ckpt_failed") == 1.0 for r in read_jsonl(run_dir / "metrics.jsonl"))
        else:
            assert p.returncode == 2 and "checkpoint at step 12 failed" in p.stderr.strip().splitlines()[-1]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


@pytest.mark.slow
@pytest.mark.parametrize("checkpointer", ["process", "auto"])
def test_a_checkpoint_process_without_enough_shared_memory(checkpointer, data_root, tmp_path):
    """The trainer runs with a 16 MiB /dev/shm (its own mount namespace): the checkpoint process's host buffers
    for ResNet-18 + AdamW (~135 MB) do not fit, and writing to them would kill the trainer with SIGBUS.
    ckpt.checkpointer=process stops with one line naming the size needed and what to do; auto says so and
    writes from a thread instead."""
    import shlex

    run_dir = tmp_path / "run"
    cmd = cli_cmd(
        [
            "debug=tiny",
            "model=resnet18",
            "optim=adamw",
            "trainer.max_steps=4",
            f"run_dir={run_dir}",
            "ckpt=async_dcp_pinned",
            "ckpt.interval_steps=2",
            f"ckpt.checkpointer={checkpointer}",
        ],
        data_root,
        tmp_path,
    )
    script = f"mount -t tmpfs -o size=16m tmpfs /dev/shm && exec {shlex.join(cmd)}"
    p = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    if p.returncode != 0 and "mount" in (p.stderr.splitlines() or [""])[0]:
        pytest.skip(f"cannot mount a small /dev/shm here: {p.stderr.strip()[:200]}")
    needs = (
        "ckpt.checkpointer=process needs 128 MiB of shared memory for its host buffers, but /dev/shm has 16 MiB free"
    )
    if checkpointer == "process":
        assert p.returncode == 2, p.stderr[-3000:]
        last = p.stderr.strip().splitlines()[-1]
        assert needs in last and "ckpt.checkpointer=thread" in last
        assert not any((run_dir / "checkpoints").glob("step_*/.metadata"))
    else:
        assert p.returncode == 0, p.stderr[-3000:]
        assert f"{needs}; writing from a thread of this process instead" in (run_dir / "train.log").read_text()
        assert summary(run_dir)["checkpoint"]["saves"] == 2 and summary(run_dir)["checkpoint"]["failures"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sync_save", "async_dcp"])
def test_export_loads_strictly_into_plain_torchvision_resnet18(backend, data_root, tmp_path):
    run_dir = tmp_path / "run"
    p = cli(
        ["debug=tiny", "trainer.max_steps=2", f"run_dir={run_dir}", "experiment=digits_resnet18", f"ckpt={backend}"],
        data_root,
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    out = tmp_path / "resnet18.pt"
    e = run_cmd([PY, "-m", "recipe.export", str(run_dir), str(out), "--dtype", "bfloat16"], 120)
    assert e.returncode == 0, e.stderr[-2000:]
    check = (
        "import sys, torch, torchvision\n"
        "m = torchvision.models.resnet18(num_classes=10)\n"
        f"sd = torch.load({str(out)!r}, weights_only=True)\n"
        "assert all(v.dtype == torch.bfloat16 for v in sd.values() if v.is_floating_point())\n"
        "m.load_state_dict(sd, strict=True)\n"
        "assert not any(k.startswith(('pitstop', 'recipe')) for k in sys.modules)\n"
        "print('ok')\n"
    )
    r = subprocess.run([PY, "-I", "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.slow
def test_export_without_checkpoint_is_one_clear_line(tmp_path):
    e = run_cmd([PY, "-m", "recipe.export", str(tmp_path), str(tmp_path / "o.pt")], 120)
    assert e.returncode == 2 and e.stderr.strip().startswith("error: no complete checkpoint at or under")
