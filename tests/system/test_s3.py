"""Data and checkpoints on an S3 API: a real S3-compatible server (moto's standalone server, a dev dependency) in
a subprocess, reached through s3fs.  Credentials come from the environment only (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY: never in the config, so never in the run dir); the endpoint from the environment
(AWS_ENDPOINT_URL) or from ``loader.storage_options`` / ``ckpt.storage_options``.  Plain and cached loaders,
``ckpt.dir=s3://...`` for every checkpoint format, a kill and an exact resume, and what goes wrong said in one
line.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cached_tars, cli, cli_cmd, run_cmd
from pitstop.audit import audit

pytestmark = pytest.mark.slow

BUCKET = "pitstop-data"


def start_server(log_dir: Path, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """moto's S3 API server on a free port; returns once it accepts connections (no request is made: a server
    that enforces IAM counts every request)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(log_dir / "server.log", "w")
    server = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    log.close()
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            return server, f"http://127.0.0.1:{port}"
        except OSError:
            assert server.poll() is None and time.time() < deadline, "moto_server did not start"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def s3(data_root, tmp_path_factory):
    """An S3 API server on a free port with the digits shards uploaded; the environment points s3fs at it."""
    pytest.importorskip("s3fs")
    server, url = start_server(tmp_path_factory.mktemp("moto"))
    env = {
        "AWS_ACCESS_KEY_ID": "pitstop-test",
        "AWS_SECRET_ACCESS_KEY": "pitstop-test-secret",
        "AWS_ENDPOINT_URL": url,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
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


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


# Default loader settings (2 workers) and evaluation; the same job from local shards is the reference.
JOB = [
    "strategy=single",
    "trainer.max_steps=30",
    "trainer.batch_size=32",
    "trainer.eval_every_steps=15",
    "ckpt.interval_steps=10",
    "logger=none",
    "data.record_sample_ids=true",
]


@pytest.fixture(scope="module")
def reference_run(data_root, tmp_path_factory) -> Path:
    """JOB, uninterrupted, from local shards with local checkpoints (steps 10, 20, 30): its run dir."""
    tmp = tmp_path_factory.mktemp("reference")
    p = cli([*JOB, "ckpt=sync_save", f"run_dir={tmp / 'run'}"], data_root, tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    return tmp / "run"


@pytest.fixture(scope="module")
def reference(reference_run) -> str:
    """The parameters after JOB, uninterrupted."""
    return summary(reference_run)["params_sha256"]


def same_tensors(a: dict, b: dict, where: str = "") -> None:
    """Two saved states hold the same tensors, bit for bit (the train state's JSON aside)."""
    import torch

    assert set(a) == set(b), (where, sorted(set(a) ^ set(b)))
    for k in a:
        if isinstance(a[k], dict):
            same_tensors(a[k], b[k], f"{where}/{k}")
        elif isinstance(a[k], torch.Tensor) and not k.startswith("train."):
            assert torch.equal(a[k], b[k]), f"{where}/{k}"


def assert_no_secret(run_dir: Path) -> None:
    """The credentials live in the environment only: nothing in the run dir holds them."""
    for path in run_dir.rglob("*"):
        if path.is_file() and path.suffix in (".yaml", ".json", ".jsonl", ".log"):
            assert "pitstop-test-secret" not in path.read_text(errors="replace"), path


@pytest.mark.parametrize("loader", ["plain", "cached"])
def test_training_from_s3_killed_and_resumed_is_exact(loader, s3, reference, data_root, tmp_path):
    job = [*JOB, "ckpt=sync_save"]
    run_dir, remote = (
        tmp_path / "s3",
        [f"data.root=s3://{BUCKET}/digits", f"run_dir={tmp_path / 's3'}", f"loader={loader}"],
    )
    if loader == "cached":
        remote.append(f"loader.cache_dir={tmp_path / 'cache'}")
    crashed = cli([*job, *remote, "fault=crash_at_step", "fault.step=13"], data_root, tmp_path)
    assert crashed.returncode != 0 and (run_dir / "checkpoints").is_dir()
    kept = {t.name for t in cached_tars(tmp_path / "cache") if ".part." not in t.name} if loader == "cached" else set()
    p = cli([*job, *remote], data_root, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    s = summary(run_dir)
    assert s["resumed_from"] == 10 and s["params_sha256"] == reference
    first = audit(str(run_dir))[0]  # (30 steps of 32: epoch 0 cut short by max_steps; nothing twice)
    assert first.repeated == 0 and first.partial
    if loader == "cached":  # what the killed attempt downloaded, the resumed one reads from the cache: it downloads
        # only shards the cache did not have (ahead of the kill, or of its own last step, by the readers' prefetch;
        # one still downloading as the run ends is in the cache, not yet in the counters), each once. (The training
        # loader's counters: the evaluation split's shards, read first by the evaluation loader, are not in them.)
        new = [t for t in cached_tars(tmp_path / "cache") if t.name not in kept and "-train-" in t.name]
        assert kept and s["data"]["cache_hits"] > 0
        assert s["data"]["bytes_from_source"] <= sum(t.stat().st_size for t in new)
    else:
        assert s["data"]["bytes_from_source"] > 0
    assert_no_secret(run_dir)


@pytest.mark.parametrize("ckpt", ["sync_save", "async_dcp", "async_dcp_pinned"])
def test_checkpoints_on_s3_killed_and_resumed_are_exact(ckpt, s3, reference, data_root, tmp_path):
    # Shards and checkpoints both in the bucket; the endpoint given as storage options, not in the environment.
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    root, run_dir = f"{BUCKET}/runs/{ckpt}", tmp_path / "run"
    job = [
        *JOB,
        f"ckpt={ckpt}",
        f"ckpt.dir=s3://{root}",
        "ckpt.keep_last_k=2",
        f"data.root=s3://{BUCKET}/digits",
        "loader=cached",
        f"loader.cache_dir={tmp_path / 'cache'}",
        f"run_dir={run_dir}",
        f"+loader.storage_options.client_kwargs.endpoint_url={endpoint}",
        f"+ckpt.storage_options.client_kwargs.endpoint_url={endpoint}",
    ]

    def run(*extra: str) -> subprocess.CompletedProcess:
        return run_cmd(cli_cmd([*job, *extra], data_root, tmp_path), 240, env)

    # killed at step 23: the save of step 10 is durable (a save starts only once the one before it is), that of
    # step 20 may still be uploading (an async save): the resume takes the newest complete one
    crashed = run("fault=crash_at_step", "fault.step=23")
    assert crashed.returncode != 0
    marker = "COMMITTED" if ckpt == "sync_save" else ".metadata"
    s3.invalidate_cache()
    complete = [step for step in (10, 20) if s3.exists(f"{root}/step_{step:08d}/{marker}")]
    assert 10 in complete, s3.find(root)
    # a newer save cut short (its data uploaded, never its marker) is skipped and removed, never loaded
    s3.pipe(f"{root}/step_00000022/__0_0.distcp", b"cut short")
    p = run()
    assert p.returncode == 0, p.stderr[-3000:]
    s = summary(run_dir)
    assert s["resumed_from"] == complete[-1] and s["params_sha256"] == reference
    assert [a.repeated for a in audit(str(run_dir))] == [0]
    s3.invalidate_cache()
    steps = sorted(n.rsplit("/", 1)[-1] for n in s3.ls(root) if "step_" in n)
    assert steps == ["step_00000020", "step_00000030"], steps  # retention (keep 2); the partial one is gone
    assert all(s3.exists(f"{root}/{d}/{marker}") for d in steps)
    assert_no_secret(run_dir)


def test_object_store_errors_while_checkpoints_are_written_and_committed(s3, reference_run, data_root, tmp_path):
    """Object-store errors in the write and the commit of checkpoints on S3 (two slowstores in front of the S3 API,
    for the checkpoint dir only). The outer one cuts every 3rd upload off half-way (no answer) and answers every
    5th request 503: those are retried and every save is whole. The inner one refuses every try of step 20's
    commit marker: that save alone fails, in one log line, and is never loaded. Killed at step 23, the same
    command resumes from step 10 and ends with the uninterrupted run's parameters, every sample once.
    The resume's reads go through 503s and responses cut short. Every checkpoint left holds exactly its step's
    state: tensor for tensor, the uninterrupted run's synchronous save of that step.
    (ckpt=sync_save: its save of step 20 has failed, after the store's retries, before the kill; an async save
    could still be retrying at step 23.)"""
    from pitstop.testing.slowstore import SlowStore

    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    root, run_dir = f"{BUCKET}/runs/flaky", tmp_path / "run"
    marker = f"/{root}/step_00000020/COMMITTED"
    with (
        SlowStore(
            "", fail_every=1, fault_glob=marker, fault_methods="PUT", upstream=os.environ["AWS_ENDPOINT_URL"]
        ) as commit,
        SlowStore("", fail_every=5, drop_upload_every=3, fault_glob=f"/{root}/*", upstream=commit.url) as flaky,
    ):
        job = [
            *JOB,
            "ckpt=sync_save",
            "ckpt.on_error=warn",
            f"ckpt.dir=s3://{root}",
            f"data.root=s3://{BUCKET}/digits",
            f"run_dir={run_dir}",
            f"+loader.storage_options.client_kwargs.endpoint_url={os.environ['AWS_ENDPOINT_URL']}",
            f"+ckpt.storage_options.client_kwargs.endpoint_url={flaky.url}",
        ]
        crashed = run_cmd(cli_cmd([*job, "fault=crash_at_step", "fault.step=23"], data_root, tmp_path), 240, env)
        assert crashed.returncode != 0
        injected = flaky.stats()["injected"]
        assert injected["dropped_uploads"] > 0 and injected["failed"] > 0, injected
        assert commit.stats()["injected"]["failed"] > 1, commit.stats()  # refused on every try
        log = (run_dir / "train.log").read_text()
        failed = [line for line in log.splitlines() if "checkpoint at step 20 failed" in line]
        assert len(failed) == 1 and "COMMITTED" in failed[0] and "Traceback" not in log, log[-3000:]
        s3.invalidate_cache()
        assert s3.exists(f"{root}/step_00000010/COMMITTED") and not s3.exists(f"{root}/step_00000020/COMMITTED")
        commit.fail_every = 0  # the store is well again: the resumed run's save of step 20 commits
        flaky.truncate_every = 4  # and its reads are cut short now and then
        p = run_cmd(cli_cmd(job, data_root, tmp_path), 240, env)
        assert flaky.stats()["injected"]["truncated"] > 0, flaky.stats()["injected"]
    assert p.returncode == 0, p.stderr[-3000:]
    s = summary(run_dir)
    assert s["resumed_from"] == 10 and s["params_sha256"] == summary(reference_run)["params_sha256"]
    assert [a.repeated for a in audit(str(run_dir))] == [0]
    s3.invalidate_cache()
    from pitstop.ckpt.formats import safe_torch_load

    for k in (10, 20, 30):
        with s3.open(f"{root}/step_{k:08d}/state.pt", "rb") as f:
            saved = safe_torch_load(f, "test")
        same_tensors(saved, safe_torch_load(reference_run / "checkpoints" / f"step_{k:08d}" / "state.pt", "ref"))


def test_a_checkpoint_dir_on_s3_that_cannot_be_written_is_a_one_line_error(s3, data_root, tmp_path):
    """A bucket that does not exist (the main server); a key that may only read, and a key the server does not
    know (a second server that enforces IAM): each stops the run before its first step, in one line."""
    import boto3

    job = ["debug=tiny", "strategy=single", "trainer.max_steps=3", "logger=none", "ckpt=sync_save"]
    p = cli([*job, "ckpt.dir=s3://no-such-bucket/ckpts", f"run_dir={tmp_path / 'a'}"], data_root, tmp_path)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "s3://no-such-bucket/ckpts" in last and "bucket does not exist" in last, p.stderr
    # moto enforces IAM after its first 4 requests: the bucket, the user, its read-only policy, its key
    server, url = start_server(tmp_path, {"INITIAL_NO_AUTH_ACTION_COUNT": "4"})
    try:
        admin = dict(
            endpoint_url=url, region_name="us-east-1", aws_access_key_id="admin", aws_secret_access_key="admin"
        )
        boto3.client("s3", **admin).create_bucket(Bucket="read-only")
        iam = boto3.client("iam", **admin)
        iam.create_user(UserName="reader")
        iam.put_user_policy(
            UserName="reader",
            PolicyName="read",
            PolicyDocument=json.dumps(
                {
                    "Version": "2012-10-17",
                    # (AWS names a listing s3:ListBucket; moto 5.2.6 asks for s3:ListObjectsV2: both, read only)
                    "Statement": [
                        {
                            "Effect": "Allow",
                            "Action": ["s3:GetObject", "s3:ListBucket", "s3:ListObjectsV2", "s3:ListObjects"],
                            "Resource": "*",
                        }
                    ],
                }
            ),
        )
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        for name, key_id, secret in [
            ("reader", key["AccessKeyId"], key["SecretAccessKey"]),
            ("unknown", "AKIAUNKNOWN", "pitstop-test-secret"),
        ]:
            env = {**os.environ, "AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": key_id, "AWS_SECRET_ACCESS_KEY": secret}
            p = run_cmd(
                cli_cmd([*job, "ckpt.dir=s3://read-only/ckpts", f"run_dir={tmp_path / name}"], data_root, tmp_path),
                120,
                env,
            )
            last = p.stderr.strip().splitlines()[-1]
            assert p.returncode == 2 and "s3://read-only/ckpts is not writable" in last, (name, p.stderr[-2000:])
            assert "AWS_ACCESS_KEY_ID" in last and not (tmp_path / name / "summary.json").exists(), last
        assert (
            boto3.client(
                "s3",
                **{**admin, "aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": key["SecretAccessKey"]},
            )
            .list_objects_v2(Bucket="read-only")
            .get("KeyCount")
            == 0
        )  # nothing partial was left behind
    finally:
        server.terminate()
        server.wait(10)


def test_credentials_in_storage_options_are_refused_before_anything_is_written(data_root, tmp_path):
    for override in [
        "+ckpt.storage_options.secret=pitstop-test-secret",
        "+loader.storage_options.client_kwargs.aws_secret_access_key=pitstop-test-secret",
        "+ckpt.storage_options={key: pitstop-test-secret}",
    ]:
        p = cli(["debug=tiny", f"run_dir={tmp_path / 'run'}", override], data_root, tmp_path)
        last = p.stderr.strip().splitlines()[-1]
        assert p.returncode == 2 and "credentials never go in the config" in last, p.stderr[-2000:]
        assert not (tmp_path / "run").exists()  # Hydra never got to save the overrides


def test_the_slowstore_in_front_of_s3_throttles_and_fails_requests_and_training_gets_through(s3, data_root, tmp_path):
    """The slowstore as a proxy before the S3 API server: its latency, bandwidth and injected 503s apply to the
    s3:// path as to http:// (the endpoint, given as a storage option, is the slowstore)."""
    from pitstop.testing.slowstore import SlowStore

    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    with SlowStore(
        "", latency_ms=20, mbps=20, fail_every=5, fault_glob="*.tar", upstream=os.environ["AWS_ENDPOINT_URL"]
    ) as store:
        p = run_cmd(
            cli_cmd(
                [
                    "debug=tiny",
                    "strategy=single",
                    "trainer.max_steps=100",
                    "logger=none",
                    f"data.root=s3://{BUCKET}/digits",
                    "loader=cached",
                    f"loader.cache_dir={tmp_path / 'cache'}",
                    f"run_dir={tmp_path / 'run'}",
                    f"+loader.storage_options.client_kwargs.endpoint_url={store.url}",
                ],
                data_root,
                tmp_path,
            ),
            240,
            env,
        )
        stats = store.stats()
    assert p.returncode == 0, p.stderr[-3000:]
    shards = {k: v for k, v in stats["paths"].items() if k.endswith(".tar")}
    # every training shard came through the proxy (100 steps of 16: the whole epoch), some after a 503
    assert sum(k.rsplit("/", 1)[-1].startswith("train-") for k in shards) == 8, sorted(shards)
    assert sum(v["requests"] for v in shards.values()) > len(shards), shards


def test_s3_mistakes_are_one_line_errors(s3, data_root, tmp_path):
    job = ["debug=tiny", "strategy=single", "trainer.max_steps=3", "logger=none"]
    p = cli([*job, "data.root=s3://no-such-bucket/digits", f"run_dir={tmp_path / 'a'}"], data_root, tmp_path)
    assert p.returncode == 2 and "s3://no-such-bucket/digits/index.json" in p.stderr.strip().splitlines()[-1], p.stderr
    # a shard the index lists but the bucket lost (100 steps of 16: the whole epoch, every shard)
    s3.copy(f"{BUCKET}/digits", f"{BUCKET}/holey", recursive=True)
    s3.rm(f"{BUCKET}/holey/train-000003.tar")
    p = cli(
        [*job, "trainer.max_steps=100", f"data.root=s3://{BUCKET}/holey", f"run_dir={tmp_path / 'b'}"],
        data_root,
        tmp_path,
    )
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode != 0 and "train-000003.tar" in last, p.stderr[-2000:]
    # no credentials in the environment: said so, with the variables to set (and never read from the config)
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"))
    p = run_cmd(
        cli_cmd([*job, f"data.root=s3://{BUCKET}/digits", f"run_dir={tmp_path / 'c'}"], data_root, tmp_path), 120, env
    )
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "credentials" in last and "AWS_ACCESS_KEY_ID" in last, p.stderr[-2000:]


def test_a_new_user_trains_on_existing_webdataset_shards_in_s3_with_checkpoints_there(s3, data_root, tmp_path):
    """Issue 13's whole path: class-sorted shards written by webdataset's ShardWriter, uploaded to the bucket;
    ``recipe.prepare data=webdataset`` indexes them in place (a local index); ``loader=cached`` with mixing,
    ``ckpt.dir=s3://...``; killed, run again; ``python -m pitstop.audit`` says every sample exactly once."""
    from test_webdataset import data_args, digits_samples, write_with_webdataset

    local = tmp_path / "wds"
    assert write_with_webdataset(local, "train", digits_samples(data_root, "train"), 160) == 9
    assert write_with_webdataset(local, "val", digits_samples(data_root, "val"), 200) == 2
    s3.put(str(local), f"{BUCKET}/wds", recursive=True)
    data = data_args(f"s3://{BUCKET}/wds", tmp_path / "index")  # (the shards stay in the bucket)
    p = cli(data, data_root, tmp_path, module="recipe.prepare")
    assert p.returncode == 0, p.stderr[-3000:]
    index = json.loads((tmp_path / "index" / "index.json").read_text())
    assert index["splits"]["train"][0]["url"] == f"s3://{BUCKET}/wds/train-0000.tar"
    run_dir, ckpts = tmp_path / "run", f"{BUCKET}/wds-run/checkpoints"
    job = [
        *data,
        "strategy=single",
        "trainer.epochs=1",
        "trainer.batch_size=32",
        "loader=cached",
        f"loader.cache_dir={tmp_path / 'cache'}",
        "loader.shuffle_shards_window=4",
        "ckpt=async_dcp",
        f"ckpt.dir=s3://{ckpts}",
        "ckpt.interval_steps=10",
        "logger=none",
        "data.record_sample_ids=true",
        f"run_dir={run_dir}",
    ]
    assert cli([*job, "fault=crash_at_step", "fault.step=23"], data_root, tmp_path).returncode != 0
    p = cli(job, data_root, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert summary(run_dir)["resumed_from"] in (10, 20)
    assert s3.exists(f"{ckpts}/step_00000045/.metadata")  # the final save (1438 samples / 32: 45 steps)
    p = run_cmd([sys.executable, "-m", "pitstop.audit", str(run_dir)], 120)
    assert p.returncode == 0 and "every sample exactly once" in p.stdout, p.stdout + p.stderr
    assert "1438" in p.stdout.splitlines()[1], p.stdout
