"""loader=cached over a real HTTP server (pitstop.testing.slowstore) with real processes: a killed DDP job
resumes on one rank and consumes each sample exactly once.
"""

from __future__ import annotations

import json

import pytest

from conftest import cli, read_jsonl, shard_requests
from pitstop.audit import audit


@pytest.mark.slow
def test_killed_ddp_job_over_http_resumes_on_one_rank_and_consumes_each_sample_once(data_root, tmp_path, store):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    common = [
        "debug=tiny",
        "trainer.max_steps=40",
        "trainer.batch_size=32",
        "loader=cached",
        "loader.num_workers=1",
        f"loader.cache_dir={cache}",
        f"data.root={store.url}/digits",
        "data.record_sample_ids=true",
        "ckpt=sync_dcp",
        "ckpt.interval_steps=10",
        f"run_dir={run_dir}",
        "fault=crash_at_step",
        "fault.step=13",
    ]
    p = cli([*common, "strategy=ddp"], data_root, tmp_path)
    assert p.returncode != 0 and (run_dir / "checkpoints" / "step_00000010").is_dir()
    p = cli([*common, "strategy=single"], data_root, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["resumed_from"] == 10 and s["world_size"] == 1
    first = audit(str(run_dir))[0]  # python -m pitstop.audit: epoch 0, no sample repeated, none skipped
    assert (first.once, first.repeated, first.missing) == (1438, 0, 0), first
    requests = shard_requests(store)  # both ranks, the restart and the evaluations: one download per shard
    assert requests and set(requests.values()) == {1}
    assert s["data"]["cache_hits"] > 0 and "data_wait_fraction" in s["data"]
    assert any("cache_hits" in r for r in read_jsonl(run_dir / "metrics.jsonl"))
