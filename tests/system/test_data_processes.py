"""Data paths that only real processes can show: a trainer killed by SIGKILL takes its data workers with it (while
they start and while they run, with a forked and a spawned fork server); the workers' fork server is a fork of the
trainer before its threads, or a fresh interpreter once it has threads, and serves the same batches either way; four
processes racing for the same shards in one cache download each shard once. The in-process loader and cache tests
are in tests/integration/test_loader.py and test_cache.py.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest

from conftest import cached_tars, shard_refs, shard_requests
from pitstop.data.loader.cache import ShardCache
from pitstop.data.remote import FetchPolicy

pytestmark = pytest.mark.slow

# (a long timeout: a retried request is a second request; under a loaded machine this test once saw two for a shard)
FAST = FetchPolicy(retries=3, backoff=0.01, timeout=60)


KILLED_TRAINER = """
import os, signal, sys, threading
os.setsid()  # its workers share this session: the test finds them by it
if sys.argv[3] == "spawned":  # a thread already running: the workers' fork server is a fresh interpreter
    threading.Thread(target=threading.Event().wait, daemon=True).start()
from pitstop.data.loader.plain import PlainLoader
from recipe.vision import ImageShards
ds = ImageShards(root=sys.argv[1], name="digits", num_classes=10, channels=1)
loader = PlainLoader(ds, "train", batch_size=16, seed=0, num_workers=2)
it = loader._reader(0)          # forks the workers; they are still starting when
if sys.argv[2] == "running":
    next(it)                     # (or: once they are running)
os.kill(os.getpid(), signal.SIGKILL)  # the trainer is killed (kill -9, the OOM killer)
"""


def session_members(sid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":  # (stat fields after the name: state, ppid, pgrp, session)
                out.append(int(d))
    return out


@pytest.mark.parametrize("server", ["forked", "spawned"])
@pytest.mark.parametrize("when", ["starting", "running"])
def test_data_workers_die_with_a_killed_trainer(data_root, when, server):
    # A worker whose trainer died while it was starting used to wait for work forever (torch's own check
    # compares the parent pid with the one it saw at its start), holding the job's stdout and stderr open.
    import subprocess
    import sys
    import time

    p = subprocess.Popen(
        [sys.executable, "-c", KILLED_TRAINER, str(data_root / "data" / "digits"), when, server],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    out, _ = p.communicate(timeout=60)  # returns only once every holder of the pipe (the workers too) is gone
    assert p.returncode == -9, out.decode()[-2000:]
    deadline = time.monotonic() + 10
    while session_members(p.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session_members(p.pid) == []


WORKER_SERVER = """
import hashlib, json, sys, threading
if sys.argv[2] == "spawned":  # a thread already running: the workers' fork server is a fresh interpreter
    threading.Thread(target=threading.Event().wait, daemon=True).start()
from pitstop.data.loader import server
from pitstop.data.loader.plain import PlainLoader
from recipe.vision import ImageShards
ds = ImageShards(root=sys.argv[1], name="digits", num_classes=10, channels=1, augment={"pad": 1})
loader = PlainLoader(ds, "train", batch_size=16, seed=0, num_workers=2)
h = hashlib.sha256()
for _, (x, y) in zip(range(100), loader):  # (more than an epoch: a second set of workers too)
    h.update(x.numpy().tobytes() + y.numpy().tobytes())
with open(f"/proc/{server.parent()}/cmdline", "rb") as f:  # (read once the workers ran: the server is up)
    spawned = ("from multiprocessing." + "forkserver import main").encode() in f.read()  # (not this script)
print(json.dumps({"server": "spawned" if spawned else "forked", "digest": h.hexdigest()}))
"""


def test_workers_fork_server_is_a_fork_of_the_trainer_before_its_threads_and_serves_the_same_batches(data_root):
    # A trainer with no threads yet forks its workers' server (no imports, no CPU); one that has threads
    # spawns a fresh interpreter instead. The batches are the same either way.
    import subprocess
    import sys

    out = {}
    for kind in ("forked", "spawned"):
        p = subprocess.run(
            [sys.executable, "-c", WORKER_SERVER, str(data_root / "data" / "digits"), kind],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        out[kind] = json.loads(p.stdout.strip().splitlines()[-1])
        assert out[kind]["server"] == kind
    assert out["forked"]["digest"] == out["spawned"]["digest"]


def _acquire_all(args) -> list[str]:
    cache_dir, shard_refs, order_seed = args
    cache = ShardCache(cache_dir, None, FAST)
    order = list(range(len(shard_refs)))
    order = order[order_seed:] + order[:order_seed]
    out = [""] * len(shard_refs)
    for i in order:
        out[i] = hashlib.sha256(cache.read(cache.acquire(shard_refs[i]))).hexdigest()
    return out


def test_one_download_per_shard_per_machine_with_concurrent_processes(data_root, tmp_path, store):
    refs = shard_refs(data_root, store.url)
    # (spawn, not fork: a fork beside the pytest process's threads can hang; not forkserver: a plain one
    # started here would stay the fork server of every later test's data workers, none of them preloaded)
    with mp.get_context("spawn").Pool(4) as pool:  # four processes race for the same eight shards
        results = pool.map(_acquire_all, [(str(tmp_path / "cache"), refs, k) for k in range(4)])
    assert all(r == [s.sha256 for s in refs] for r in results)
    assert shard_requests(store) == {f"/digits/{Path(s.url).name}": 1 for s in refs}
    assert len(cached_tars(tmp_path / "cache")) == 8 and not list((tmp_path / "cache").glob("*.part.*"))
