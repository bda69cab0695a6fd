"""Data on an S3 API: a real S3-compatible server (moto's standalone server, a dev dependency) in a subprocess,
read through s3fs with credentials and endpoint from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_ENDPOINT_URL: never in the config, so never in the run dir); plain and cached loaders, a kill and an exact
resume, and what goes wrong said in one line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, cli, cli_cmd
from pitstop.audit import audit

pytestmark = pytest.mark.slow
BUCKET = "pitstop-data"


@pytest.fixture(scope="module")
def s3(data_root, tmp_path_factory):
    """An S3 API server on a free port with the digits shards uploaded; the environment points s3fs at it."""
    pytest.importorskip("s3fs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path_factory.mktemp("moto") / "server.log", "w")
    server = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H", "127.0.0.1",
                               "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=2).close()
            break
        except OSError:
            assert server.poll() is None and time.time() < deadline, "moto_server did not start"
            time.sleep(0.2)
    env = {"AWS_ACCESS_KEY_ID": "pitstop-test", "AWS_SECRET_ACCESS_KEY": "pitstop-test-secret",
           "AWS_ENDPOINT_URL": url, "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.mkdir(BUCKET)
        fs.put(str(data_root / "data" / "digits"), f"{BUCKET}/digits", recursive=True)
        yield fs
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.terminate()
        server.wait(10)
        log.close()


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize("loader", ["plain", "cached"])
def test_training_from_s3_killed_and_resumed_is_exact(loader, s3, data_root, tmp_path):
    # Default loader settings (2 workers) and evaluation; the same job from the local shards is the reference.
    job = ["strategy=single", "trainer.max_steps=30", "trainer.batch_size=32", "trainer.eval_every_steps=15",
           "ckpt=sync_save", "ckpt.interval_steps=10", "logger=none", "data.record_sample_ids=true"]
    ref = cli([*job, f"run_dir={tmp_path / 'local'}"], data_root, tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run_dir, remote = tmp_path / "s3", [f"data.root=s3://{BUCKET}/digits", f"run_dir={tmp_path / 's3'}",
                                        f"loader={loader}"]
    if loader == "cached":
        remote.append(f"loader.cache_dir={tmp_path / 'cache'}")
    crashed = cli([*job, *remote, "fault=crash_at_step", "fault.step=13"], data_root, tmp_path)
    assert crashed.returncode != 0 and (run_dir / "checkpoints").is_dir()
    p = cli([*job, *remote], data_root, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    s = summary(run_dir)
    assert s["resumed_from"] == 10 and s["params_sha256"] == summary(tmp_path / "local")["params_sha256"]
    first = audit(str(run_dir))[0]  # (30 steps of 32: epoch 0 cut short by max_steps; nothing twice)
    assert first.repeated == 0 and first.partial
    if loader == "cached":  # the killed attempt downloaded each shard once: the resumed one reads the cache only
        assert s["data"]["bytes_from_source"] == 0 and s["data"]["cache_hits"] > 0
    else:
        assert s["data"]["bytes_from_source"] > 0
    # the credentials live in the environment only: nothing in the run dir holds them
    for path in run_dir.rglob("*"):
        if path.is_file() and path.suffix in (".yaml", ".json", ".jsonl", ".log"):
            assert "pitstop-test-secret" not in path.read_text(errors="replace"), path


def test_s3_mistakes_are_one_line_errors(s3, data_root, tmp_path):
    job = ["debug=tiny", "strategy=single", "trainer.max_steps=3", "logger=none"]
    p = cli([*job, "data.root=s3://no-such-bucket/digits", f"run_dir={tmp_path / 'a'}"], data_root, tmp_path)
    assert p.returncode == 2 and "s3://no-such-bucket/digits/index.json" in p.stderr.strip().splitlines()[-1], p.stderr
    # a shard the index lists but the bucket lost (100 steps of 16: the whole epoch, every shard)
    s3.copy(f"{BUCKET}/digits", f"{BUCKET}/holey", recursive=True)
    s3.rm(f"{BUCKET}/holey/train-000003.tar")
    p = cli([*job, "trainer.max_steps=100", f"data.root=s3://{BUCKET}/holey", f"run_dir={tmp_path / 'b'}"],
            data_root, tmp_path)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode != 0 and "train-000003.tar" in last, p.stderr[-2000:]
    # no credentials in the environment: said so, with the variables to set (and never read from the config)
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"))
    p = subprocess.run(cli_cmd([*job, f"data.root=s3://{BUCKET}/digits", f"run_dir={tmp_path / 'c'}"], data_root,
                               tmp_path), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "credentials" in last and "AWS_ACCESS_KEY_ID" in last, p.stderr[-2000:]
