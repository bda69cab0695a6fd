"""A bad node of an elastic job, on one machine: two nodes' agents (pitstop's launcher, strategy.nnodes=1:2) told apart
by PITSTOP_NODE_NAME. fault=bad_node makes every attempt on node b fail at start: after its second failed attempt
node b is excluded (RUN_DIR/nodes.json), its agent stops and its launcher exits EXCLUDED_EXIT in one line; node a's
agent re-forms the job without it and finishes, every sample read once.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import pytest

from conftest import cli_cmd, popen_cmd, read_jsonl

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_node_whose_attempts_fail_twice_is_excluded_and_the_job_goes_on_without_it(data_root, tmp_path):
    from pitstop.audit import audit
    from pitstop.resilience.node_book import EXCLUDED_EXIT

    run_dir, port = tmp_path / "run", free_port()
    args = [
        "strategy=ddp",
        "strategy.nproc_per_node=1",
        "strategy.nnodes=1:2",
        f"strategy.rdzv_endpoint=127.0.0.1:{port}",
        "strategy.last_call_seconds=10",  # (b may start seconds after a on a busy machine: the job forms at 2)
        "strategy.max_restarts=3",
        "strategy.cpu_threads=1",
        "strategy.timeout=60",
        "debug=tiny",
        "trainer.max_steps=20",
        "ckpt=sync_save",
        "ckpt.interval_steps=10",
        "data.record_sample_ids=true",
        f"run_dir={run_dir}",
        "fault=bad_node",
        "fault.node=b",
    ]
    agents = {}
    for name in ("a", "b"):
        with open(tmp_path / f"agent_{name}.log", "w") as out:
            cmd = cli_cmd([*args, f"paths.cache_dir={tmp_path / ('cache_' + name)}"], data_root, tmp_path)
            env = dict(os.environ, PITSTOP_NODE_NAME=name)
            agents[name] = popen_cmd(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        if name == "a":
            # a first, so that its agent hosts the rendezvous store (on one machine torch lets whichever agent binds
            # first host it, and b's leaves with b): its launch line, then as long as test_nodes.py's agents wait
            deadline = time.monotonic() + 60
            while "launching 1 ranks" not in (tmp_path / "agent_a.log").read_text(errors="replace"):
                assert time.monotonic() < deadline and agents["a"].poll() is None, (
                    tmp_path / "agent_a.log"
                ).read_text()
                time.sleep(0.05)
            time.sleep(1.5)
    try:
        codes = {name: p.wait(240) for name, p in agents.items()}
    finally:
        for p in agents.values():
            if p.poll() is None:
                p.kill()
    said = {name: (tmp_path / f"agent_{name}.log").read_text(errors="replace") for name in agents}
    assert codes == {"a": 0, "b": EXCLUDED_EXIT}, said["a"][-3000:] + said["b"][-3000:]
    line = (
        "error: node b is not used: attempts failed on it twice (the last: RuntimeError: fault=bad_node: node b fails "
        "every attempt at start); the job goes on without it (1 node(s) left, strategy.nnodes=1:2)"
    )
    assert said["b"].strip().splitlines()[-1] == line, said["b"][-3000:]
    book = json.loads((run_dir / "nodes.json").read_text())["nodes"]
    assert set(book) == {"b"} and book["b"]["excluded"]["by"] == "failures" and len(book["b"]["failures"]) == 2
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["world_size"] == 1 and s["final_step"] == 20
    headers = [r for r in read_jsonl(run_dir / "samples.rank0.jsonl") if "attempt" in r]
    assert headers[-1]["world_size"] == 1  # (re-formed without b)
    epochs = audit(str(run_dir))  # (20 steps of 16 samples: part of the first epoch, each sample read once)
    assert [(e.epoch, e.once, e.repeated, e.partial) for e in epochs] == [(0, 320, 0, True)], epochs
