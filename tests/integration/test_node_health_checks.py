"""Node health's checks themselves (pitstop.launch.health) on real dirs, a real filesystem's free space, a real matmul
and a real fork of a warm server: a dir that cannot be written, a checkpoint dir without room (the room threshold
raised, and a real 256 KiB tmpfs where this runs as root), a slow matmul against what peers recorded, and the checks run
in a fork as a launcher runs them. (The command's side, a refused node in one line with exit 2 and a matmul an
attempt records, starts processes: tests/system/test_node_health_cli.py.)"""

from __future__ import annotations

import json
import os
import multiprocessing as mp
import subprocess

import pytest
from omegaconf import OmegaConf

from pitstop.launch import health
from pitstop.launch.health import checks


def _cfg(make_cfg, tmp_path, *overrides):
    return make_cfg("ckpt=sync_save", f"run_dir={tmp_path / 'run'}", *overrides)


def test_a_healthy_node_passes_every_check_and_its_matmul_becomes_a_reference(make_cfg, tmp_path):
    cfg = _cfg(make_cfg, tmp_path, "ckpt=async_dcp")
    report = checks(cfg, str(tmp_path / "run"), "n1")
    assert [o.check for o in report.outcomes] == ["dirs", "shm", "memory", "matmul"], report
    assert report.failed is None and report.seconds < 5, report.line()
    assert report.matmul is not None and report.matmul > 0  # (the attempt records it once its setup is done)
    assert "reference none yet" in report.outcomes[-1].said
    assert not (tmp_path / "run").exists()  # (the checks make nothing: a refused job leaves no trace)


def test_a_checkpoint_dir_that_cannot_be_written_fails_dirs_naming_the_key(make_cfg, tmp_path):
    (tmp_path / "blocker").write_text("a file where the dir should be")
    cfg = _cfg(make_cfg, tmp_path, f"ckpt.dir={tmp_path / 'blocker' / 'ckpt'}")
    report = checks(cfg, str(tmp_path / "run"), "n1")
    assert report.line() == (
        f"ckpt.dir {tmp_path / 'blocker' / 'ckpt'} is not writable ({tmp_path / 'blocker'} is not a directory) "
        "(node n1 failed its health check 'dirs')"
    )


def test_room_for_a_checkpoint_is_the_models_size_then_the_newest_checkpoints(make_cfg, tmp_path):
    run = tmp_path / "run"
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    # 3 x 4 bytes per parameter of the tiny CNN (built on the meta device): this factor asks for more than the disk has
    params = health.estimated_checkpoint_bytes(_cfg(make_cfg, tmp_path))
    assert params and params % 8 == 0  # (4 bytes per parameter, twice: the weights and SGD's momentum, debug=tiny)
    factor = free / params * 2
    report = checks(_cfg(make_cfg, tmp_path, f"trainer.health.room_factor={factor}"), str(run), "n1")
    assert report.failed is not None and report.failed.check == "dirs", report.line()
    assert report.line().startswith("ckpt.dir") and (
        "(the model's parameters and optimizer state, estimated x trainer.health.room_factor" in report.line()
    )
    # a newest complete checkpoint of 1 MiB: its size is the estimate now
    step = run / "checkpoints" / "step_00000005"
    step.mkdir(parents=True)
    (step / "state.pt").write_bytes(b"\0" * 2**20)
    (step / "COMMITTED").write_text("")
    assert health.newest_checkpoint_bytes(str(run / "checkpoints")) == 2**20
    factor = free / 2**20 * 2
    report = checks(_cfg(make_cfg, tmp_path, f"trainer.health.room_factor={factor}"), str(run), "n1")
    assert "the newest checkpoint's size x trainer.health.room_factor" in report.line(), report.line()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_or_read_only_filesystem_fails_dirs(make_cfg, tmp_path):
    # A real 256 KiB tmpfs as ckpt.dir: the tiny CNN's estimated checkpoint does not fit on it; remounted read-only,
    # it cannot be written (root writes through file modes: a read-only mount is what stops it).
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        need = health.estimated_checkpoint_bytes(_cfg(make_cfg, tmp_path))
        assert need > 2**18, need  # (else this test could not fail for the bug it names)
        report = checks(_cfg(make_cfg, tmp_path, f"ckpt.dir={small}"), str(tmp_path / "run"), "n1")
        assert report.failed is not None and report.failed.check == "dirs", report.line()
        assert report.line().startswith(f"ckpt.dir {small} has 0.00 GiB free"), report.line()
        # and read-only: the probe's write fails as a save's would
        subprocess.run(["mount", "-o", "remount,ro", str(small)], check=True)
        report = checks(_cfg(make_cfg, tmp_path, f"ckpt.dir={small}"), str(tmp_path / "run"), "n1")
        assert report.line() == (
            f"ckpt.dir {small} is not writable (Read-only file system) (node n1 failed its health check 'dirs')"
        )
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_a_matmul_far_slower_than_its_peers_fails_and_is_not_recorded(make_cfg, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    # the peers recorded a matmul of 1 microsecond: no CPU here does a 256x256 one in 3 (at ~50 GFLOP/s: 0.7 ms)
    (run / "health.json").write_text(json.dumps({"nodes": {"n2": {"matmul": [1e-6] * 3, "time": 1.0}}}))
    report = checks(_cfg(make_cfg, tmp_path), str(run), "n1")
    assert report.failed is not None and report.failed.check == "matmul", report.line()
    assert "over trainer.health.slow_factor=3 x the reference 0.00 ms" in report.line()
    assert report.matmul is None  # (a slow node's time is no reference for the others)


def test_the_checks_run_in_a_fork_of_a_warm_server_as_a_launcher_runs_them(make_cfg, tmp_path):
    cfg = _cfg(make_cfg, tmp_path)
    report = health.run_checks(mp.get_context("forkserver"), OmegaConf.to_yaml(cfg), str(tmp_path / "run"), "n1")
    assert report.failed is None, report.line()
    assert [o.check for o in report.outcomes] == ["dirs", "memory", "matmul"]


def test_the_bad_node_fault_makes_only_its_nodes_checkpoint_dir_unwritable(make_cfg, tmp_path):
    # (fault=bad_node, how=unwritable: what the launcher's check on that node finds; the command's exit 2 and its
    # one line, with no attempt started, are tests/system/test_node_health_cli.py's)
    cfg = _cfg(make_cfg, tmp_path, "fault=bad_node", "fault.node=n7", "fault.how=unwritable")
    report = checks(cfg, str(tmp_path / "run"), "n7")
    assert report.line() == (
        f"ckpt.dir {tmp_path / 'run'}/checkpoints is not writable (fault=bad_node: unwritable (injected)) "
        "(node n7 failed its health check 'dirs')"
    )
    report = checks(cfg, str(tmp_path / "run"), "n1")  # (another node of the job: its dir is writable)
    assert report.failed is None, report.line()


def test_too_little_free_memory_fails_memory_naming_the_key(make_cfg, tmp_path):
    report = checks(_cfg(make_cfg, tmp_path, "trainer.health.min_free_memory_gb=1000000"), str(tmp_path / "run"), "n1")
    assert report.failed is not None and report.failed.check == "memory", report.line()
    assert "GiB free, trainer.health.min_free_memory_gb=1e+06 (node n1 failed its health check 'memory')" in (
        report.line()
    )


def test_an_unwritable_local_tier_is_a_warning_not_a_failure(make_cfg, tmp_path):
    # (the local tier is optional: a run switches it off with a warning, tests/system/test_ckpt_local_kills.py)
    (tmp_path / "blocker").write_text("a file where the dir should be")
    cfg = _cfg(make_cfg, tmp_path, f"ckpt.local.dir={tmp_path / 'blocker' / 'shm'}")
    report = checks(cfg, str(tmp_path / "run"), "n1")
    assert report.failed is None, report.line()
    assert f"ckpt.local.dir {tmp_path / 'blocker' / 'shm'} is not writable" in report.outcomes[0].said
    assert report.outcomes[0].said.endswith(": the local tier will be off")
