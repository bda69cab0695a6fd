"""Node health from the command (pitstop's launcher in its own process, ``cli``): a node that fails its check is
refused in one line, exit 2, before any attempt starts; an attempt that sets up records its node's matmul as the next
check's reference. The checks themselves, in-process: tests/integration/test_node_health_checks.py."""

from __future__ import annotations

import os

import pytest

from conftest import cli
from pitstop.launch import health

pytestmark = pytest.mark.slow


def test_a_command_on_a_node_that_fails_its_check_stops_in_one_line(data_root, tmp_path):
    run = tmp_path / "run"
    args = ["debug=tiny", "ckpt=sync_save", "trainer.max_restarts=1", f"run_dir={run}"]
    p = cli([*args, "fault=bad_node", "fault.node=n7", "fault.how=unwritable"], data_root, tmp_path,
            env=dict(os.environ, PITSTOP_NODE_NAME="n7"))  # fmt: skip
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == (
        f"error: ckpt.dir {run}/checkpoints is not writable (fault=bad_node: unwritable (injected)) (node n7 failed "
        "its health check 'dirs'); the job has no other node (strategy.nnodes=1): fix the node and run again"
    )
    assert not (run / "goodput.json").exists() and not (run / "checkpoints").exists()  # (no attempt started)


def test_an_attempt_that_sets_up_records_its_nodes_matmul_as_the_next_checks_reference(data_root, tmp_path):
    run = tmp_path / "run"
    args = ["debug=tiny", "trainer.max_steps=2", "trainer.max_restarts=1", f"run_dir={run}"]
    env = dict(os.environ, PITSTOP_NODE_NAME="n7")
    for _ in range(2):  # (the second check compares against the first's record)
        p = cli(args, data_root, tmp_path, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
    (first,) = health.timings(str(run))["n7"][:1]
    assert len(health.timings(str(run))["n7"]) == 2 and first > 0
    said = p.stdout + p.stderr  # (the second launch's check line names the first's timing as its reference)
    assert "node n7 is healthy" in said and f"(reference {first * 1e3:.2f} ms)" in said, said[-3000:]
