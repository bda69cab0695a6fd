"""The local checkpoint tier (ckpt.local) with real processes: a killed run resumes from the newest complete
checkpoint of either tier, exactly; a local tier that is gone, corrupt, full or read-only falls back to the
durable tier (or is switched off) with a clear line, and never commits a partial save.
"""

from __future__ import annotations

import json
import re
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import assert_resumed, cli
from pitstop.resilience.node_book import node_name

RUN = [
    "debug=tiny",
    "trainer.max_steps=40",
    "trainer.batch_size=64",
    "loader.num_workers=2",
    "trainer.eval_every_steps=20",
]


def local_args(shm: Path, every: int = 3) -> list[str]:
    return [f"ckpt.local.dir={shm}", f"ckpt.local.interval_steps={every}"]


def summary(run_dir) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def restored_local(run_dir: Path, newest: int, every: int, backend: str) -> int:
    """The local-tier step the run restored (see ``assert_resumed``)."""
    m = re.search(r"\(step (\d+), local tier\)", (Path(run_dir) / "train.log").read_text())
    assert m, "no restore from the local tier in train.log"
    assert_resumed(int(m.group(1)), newest, newest - every, backend)
    return int(m.group(1))


def local_steps(shm: Path) -> list[str]:
    return sorted(p.name for p in shm.glob("*/step_*"))


@contextmanager
def tmpfs(path: Path, options: str):
    """A real tmpfs at ``path`` (the test is skipped where mounting one needs privileges it does not have)."""
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)


@pytest.fixture(scope="module")
def reference(data_root, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    p = cli([*RUN, f"run_dir={tmp / 'run'}", "ckpt=none"], data_root, tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    return summary(tmp / "run")["params_sha256"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sync_save", "async_dcp"])
def test_a_killed_run_resumes_from_the_local_tier_exactly(backend, data_root, tmp_path, reference):
    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    args = [
        *RUN,
        f"run_dir={run_dir}",
        f"ckpt={backend}",
        "ckpt.interval_steps=20",
        *local_args(shm),
        "fault=crash_at_step",
        "fault.step=35",
    ]
    assert cli(args, data_root, tmp_path).returncode != 0
    # kept 2, older ones purged; the purge runs in a background thread after each commit, so the crash two steps
    # after the save of 33 can come before it removed 27 (seen under a third xdist worker): at most one more
    steps = local_steps(shm)
    assert steps[-2:] == ["step_00000030", "step_00000033"] and steps[:-2] in ([], ["step_00000027"]), steps
    p = cli(args, data_root, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    step = restored_local(run_dir, 33, 3, backend)
    assert summary(run_dir)["params_sha256"] == reference and summary(run_dir)["resumed_from"] == step


@pytest.mark.slow
def test_a_local_tier_that_is_gone_or_corrupt_falls_back(data_root, tmp_path, reference):
    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    args = [
        *RUN,
        f"run_dir={run_dir}",
        "ckpt=sync_dcp",
        "ckpt.interval_steps=20",
        *local_args(shm),
        "fault=crash_at_step",
        "fault.step=35",
    ]
    assert cli(args, data_root, tmp_path).returncode != 0
    newest = next(shm.glob("*/step_00000033"))
    for f in newest.glob("*.distcp"):
        f.write_bytes(b"garbage")  # corrupt: the older local one (30) is used
    # then the node is lost at step 36 (fault=lose_node: its local tier cleared, its process killed): no local tier
    lose = ["fault=lose_node", f"fault.node={node_name()}", "fault.step=36"]
    p = cli([*args[:-2], *lose], data_root, tmp_path)
    assert p.returncode != 0
    log = (run_dir / "train.log").read_text()
    assert "step_00000033 is corrupt, not loaded" in log and "is truncated" in log and "(step 30, local tier)" in log
    assert "the local checkpoint tier of node" in log and f"node {node_name()} lost at step 36" in log
    assert not list(shm.glob("*/step_*"))
    p = cli([*args[:-2], *lose], data_root, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "(step 20, durable tier)" in (run_dir / "train.log").read_text()
    assert summary(run_dir)["params_sha256"] == reference


@pytest.mark.slow
def test_a_full_local_tier_fails_its_saves_but_not_the_run(data_root, tmp_path):
    with tmpfs(tmp_path / "shm", "size=1200k") as shm:
        run_dir = tmp_path / "run"
        p = cli(
            [
                *RUN,
                f"run_dir={run_dir}",
                "trainer.max_steps=12",
                "ckpt=sync_dcp",
                "ckpt.interval_steps=10",
                f"ckpt.local.dir={shm}",
                "ckpt.local.interval_steps=2",
                "ckpt.local.keep_last_k=3",
            ],
            data_root,
            tmp_path,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        c = summary(run_dir)["checkpoint"]
        assert c["saves"] == 2 and c["failures"] == 0 and c["local_failures"] >= 1
        assert "local-tier checkpoint at step" in (run_dir / "train.log").read_text()
        assert "the durable tier is unaffected" in (run_dir / "train.log").read_text()
        for d in shm.glob("*/step_*"):  # whatever is left is complete
            assert (d / ".metadata").exists(), d


@pytest.mark.slow
def test_a_read_only_local_tier_is_switched_off_with_a_warning(data_root, tmp_path):
    with tmpfs(tmp_path / "shm", "ro,size=1m") as shm:
        run_dir = tmp_path / "run"
        p = cli(
            [
                *RUN,
                f"run_dir={run_dir}",
                "trainer.max_steps=6",
                "ckpt=sync_save",
                "ckpt.interval_steps=3",
                *local_args(shm, 2),
            ],
            data_root,
            tmp_path,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        log = (run_dir / "train.log").read_text()
        assert "local checkpoint tier off: ckpt.local.dir" in log and "is not writable" in log
        assert summary(run_dir)["checkpoint"]["saves"] == 2 and "local_saves" not in summary(run_dir)["checkpoint"]


@pytest.mark.slow
def test_ddp_resumes_from_the_local_tier_exactly(data_root, tmp_path):
    common = [
        "debug=tiny",
        "trainer.max_steps=24",
        "trainer.batch_size=32",
        "loader.num_workers=1",
        "trainer.eval_every_steps=12",
        "strategy=ddp",
        "ckpt=async_dcp",
        "ckpt.interval_steps=10",
    ]
    ref = tmp_path / "ref"
    assert cli([*common, f"run_dir={ref}", "ckpt=none"], data_root, tmp_path).returncode == 0
    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    args = [*common, f"run_dir={run_dir}", *local_args(shm, 4), "fault=crash_at_step", "fault.step=18", "fault.rank=1"]
    assert cli(args, data_root, tmp_path).returncode != 0
    p = cli(args, data_root, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    restored_local(run_dir, 16, 4, "async_dcp")
    assert summary(run_dir)["params_sha256"] == summary(ref)["params_sha256"]
