"""loader=cached and remote sources, against a real HTTP server (pitstop.testing.slowstore), in-process: one
download per shard per machine, eviction within a limit (what is read furthest ahead first) that spares shards in
use, retries on a flaky store, nothing partial ever kept, clear errors. The kill and the change of world size are in
tests/system/test_cache_kills.py.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import time

import pytest

from pitstop.data.remote import FetchPolicy
from pitstop.errors import ConfigError, DataError
from pitstop.data.loader.cache import ShardCache
from pitstop.data.loader.cached import CachedLoader, parse_size
from pitstop.data.loader.plain import PlainLoader
from pitstop.testing.slowstore import SlowStore
from conftest import cached_tars, shard_refs, shard_requests
from recipe.vision import ImageShards

FAST = FetchPolicy(retries=3, backoff=0.01, timeout=10)


def remote_digits(url: str, **kw) -> ImageShards:
    return ImageShards(root=f"{url}/digits", name="digits", num_classes=10, channels=1, augment={"pad": 1}, **kw)


def cached_digits(url: str, cache_dir, seed: int, **kw) -> CachedLoader:
    """The cached loader of the remote digits' training split: batch 64, 2 workers."""
    return CachedLoader(
        remote_digits(url), "train", batch_size=64, seed=seed, num_workers=2, cache_dir=str(cache_dir), **kw
    )


def index(data_root) -> dict:
    return json.loads((data_root / "data" / "digits" / "index.json").read_text())


def epoch(loader) -> list[tuple[list[str], object]]:
    keys: list[list[str]] = []
    loader.sample_log = keys.append
    out = [(keys[i], x.clone()) for i, (x, _) in enumerate(itertools.islice(iter(loader), loader.steps_per_epoch()))]
    return out


def test_cached_epochs_equal_plain_local_ones_and_epoch2_reads_no_source_bytes(data_root, tmp_path, store):
    local = epoch(
        PlainLoader(
            ImageShards(
                root=str(data_root / "data" / "digits"), name="digits", num_classes=10, channels=1, augment={"pad": 1}
            ),
            "train",
            batch_size=64,
            seed=5,
        )
    )
    total = sum(s["bytes"] for s in index(data_root)["splits"]["train"])
    for e in (1, 2):  # a fresh loader per "epoch 1 of a new job": epoch 2 reads only the cache
        loader = CachedLoader(
            remote_digits(store.url), "train", batch_size=64, seed=5, num_workers=2, cache_dir=str(tmp_path / "cache")
        )
        if e == 1:  # as a job does once it is built: each reader's first shard, and the two its prefetch asks for
            loader.warm()  # as it starts (prefetch_shards=auto), download before the first batch
            names = ShardCache(str(tmp_path / "cache"), None, FAST, "sha256")
            leads = loader.lead_refs(3)
            first = sorted(os.path.basename(names.path(r)) for refs in leads for r in refs)
            deadline = time.monotonic() + 20
            while [p.name for p in cached_tars(tmp_path / "cache")] != first:
                assert time.monotonic() < deadline and [len(refs) for refs in leads] == [3, 3], first
                time.sleep(0.02)
        got = epoch(loader)
        assert [k for k, _ in got] == [k for k, _ in local]
        assert all(x.equal(y) for (_, x), (_, y) in zip(got, local))
        st = loader.stats
        if e == 1:  # (the readers found their first three shards each there: six hits; every shard downloaded once)
            assert (st["cache_misses"], st["cache_hits"], st["bytes_from_source"]) == (8, 6, total)
        else:
            assert (st["cache_misses"], st["cache_hits"], st["bytes_from_source"]) == (0, 8, 0)
    assert set(shard_requests(store).values()) == {1}
    # under a cache limit that cannot keep the first shards beside the readers' prefetch, nothing is fetched ahead
    small = CachedLoader(
        remote_digits(store.url), "train", batch_size=64, seed=6, num_workers=2, cache_dir=str(tmp_path / "small"),
        cache_limit=4 * max(s["bytes"] for s in index(data_root)["splits"]["train"]),
    )  # fmt: skip
    small.warm()
    firsts = {r.url for refs in small.lead_refs(1) for r in refs}
    assert firsts and not small._warm_threads and not cached_tars(tmp_path / "small")
    # one that cannot keep all the lead shards: the first shards only, also when asked again (as the runner does
    # after restoring; the ones after them alone would fit, but not beside the first)
    limit = 8 * sum(r.bytes for refs in small.lead_refs(3) for r in refs) - 1
    first = CachedLoader(remote_digits(store.url), "train", batch_size=64, seed=6, num_workers=2,
                         cache_dir=str(tmp_path / "first"), cache_limit=limit)  # fmt: skip
    first.warm()
    first.warm()
    assert first._warmed == firsts and len(first._warmed) == 2
    for thread in first._warm_threads:  # (not after the store has gone)
        thread.join(20)


def test_ranged_parts_read_the_same_batches_and_a_server_without_ranges_gets_one_request(data_root, tmp_path):
    # download_parts=3: each shard arrives as 3 ranged requests at once (written where they belong, verified by
    # sha256), for the cache (a part file) and for plain (in memory); a server that ignores Range headers (200,
    # the whole file) gets one request per shard instead, with no retry counted. Same batches as local files.
    local = epoch(PlainLoader(remote_digits(str(data_root / "data")), "train", batch_size=64, seed=5, num_workers=2))
    for ranges in (True, False):
        with SlowStore(str(data_root / "data"), latency_ms=5, mbps=50, ranges=ranges) as srv:
            cached = cached_digits(srv.url, tmp_path / f"cache{ranges}", 5, download_parts=3)
            plain = PlainLoader(remote_digits(srv.url), "train", batch_size=64, seed=5, num_workers=2, download_parts=3)
            for loader in (cached, plain):
                got = epoch(loader)
                assert [k for k, _ in got] == [k for k, _ in local]
                assert all(x.equal(y) for (_, x), (_, y) in zip(got, local))
                assert loader.stats["fetch_retries"] == 0
            paths = {p: v for p, v in srv.stats()["paths"].items() if p.endswith(".tar")}
        assert len(paths) == 8
        if ranges:  # every request a ranged one, three per whole read (at least one by each loader)
            # (a part whose connection failed before its first byte is asked for again: seen a few times in 20 runs)
            size = {p: (data_root / "data" / p.lstrip("/")).stat().st_size for p in paths}
            reads = {p: v["bytes"] // size[p] for p, v in paths.items()}
            odd = {
                p: v for p, v in paths.items()
                if v["ranged"] != v["requests"] or v["bytes"] % size[p] or reads[p] < 2
                or not 3 * reads[p] <= v["requests"] <= 3 * reads[p] + 1
            }  # fmt: skip
            assert not odd, odd
        else:  # each read got the whole file; a process asks for ranges only until its first answer says no
            # (and downloads that started before that answer): fewer ranged requests than reads
            assert all(v["requests"] > v["ranged"] for v in paths.values())
            ranged = sum(v["ranged"] for v in paths.values())
            assert 0 < ranged < sum(v["requests"] for v in paths.values()) - ranged
    with pytest.raises(ConfigError, match=r"loader.download_parts=0: use auto"):
        PlainLoader(remote_digits(str(data_root / "data")), "train", batch_size=64, seed=5, download_parts=0)


def test_lru_eviction_within_the_limit_never_evicts_a_shard_in_use(data_root, tmp_path, store):
    refs = shard_refs(data_root, store.url)
    size = max(r.bytes for r in refs)
    cache = ShardCache(str(tmp_path / "cache"), 3 * size, FAST)

    def present(i: int) -> bool:
        return os.path.exists(cache.path(refs[i]))

    held = cache.acquire(refs[0])  # in use for the whole time
    for i in range(1, 5):
        time.sleep(0.02)  # distinct mtimes
        cache.read(cache.acquire(refs[i]))
        assert sum(p.stat().st_size for p in cached_tars(tmp_path / "cache")) <= 3 * size
    assert present(0) and present(3) and present(4) and not present(1) and not present(2)
    cache.read(held)  # released
    for i in (0, 3):  # touch 0 and 3: now 4 is the least recently used idle shard
        time.sleep(0.02)
        cache.read(cache.acquire(refs[i]))
    time.sleep(0.02)
    cache.read(cache.acquire(refs[5]))
    assert present(0) and present(3) and present(5) and not present(4)
    st = cache.take_stats()
    assert st["cache_evictions"] == 3 and st["cache_hits"] == 2 and st["cache_misses"] == 6
    # Everything in use and no room: served without being kept, not an error and not a wait.
    tight = ShardCache(str(tmp_path / "tight"), size, FAST)
    held = tight.acquire(refs[0])
    data = tight.acquire(refs[1])
    assert isinstance(data, bytes) and hashlib.sha256(data).hexdigest() == refs[1].sha256
    assert tight.take_stats()["cache_bypass"] == 1 and len(cached_tars(tmp_path / "tight")) == 1
    tight.read(held)


@pytest.mark.parametrize("parts", [1, 3])
def test_flaky_store_is_retried_and_only_verified_shards_are_kept(data_root, tmp_path, parts):
    # Half of all requests fail (every 3rd a 503, every 4th cut short; one counter for all concurrent
    # requests), so one shard (or one ranged part of it) can draw 4 failures in a row: give it 9 attempts.
    with SlowStore(str(data_root / "data"), fail_every=3, truncate_every=4, fault_glob="*.tar") as srv:
        # (3 parts: each part is retried on its own)
        loader = cached_digits(srv.url, tmp_path / "cache", 0, backoff=0.01, retries=8, download_parts=parts)
        keys = [k for ks, _ in epoch(loader) for k in ks]
    assert len(keys) == len(set(keys)) == 1438
    assert loader.stats["fetch_retries"] > 0
    tars = cached_tars(tmp_path / "cache")
    want = {s["sha256"] for s in index(data_root)["splits"]["train"]}
    assert len(tars) == 8 and {hashlib.sha256(p.read_bytes()).hexdigest() for p in tars} == want


@pytest.mark.parametrize("parts", [1, 3])
def test_truncating_store_names_shard_and_offset_and_caches_nothing(data_root, tmp_path, parts):
    with SlowStore(str(data_root / "data"), truncate_every=1, fault_glob="*.tar") as srv:
        for cls, kw in ((CachedLoader, {"cache_dir": str(tmp_path / "cache")}), (PlainLoader, {})):
            loader = cls(
                remote_digits(srv.url), "train", batch_size=64, seed=0, num_workers=0, retries=1, backoff=0.01,
                download_parts=parts, **kw,
            )  # fmt: skip
            with pytest.raises(DataError) as err:
                epoch(loader)
            msg = str(err.value)
            assert msg.startswith(f"cannot read shard {srv.url}/digits/train-0000") and "offset" in msg, msg
            assert "2 attempts" in msg and "\n" not in msg
    assert cached_tars(tmp_path / "cache") == []  # nothing unverified is ever kept
    assert not list((tmp_path / "cache").glob("*.part.*"))


def test_a_shard_that_grew_on_the_store_is_refused_also_in_ranged_parts(data_root, tmp_path):
    # Ranged parts ask for the index's byte count only: a shard longer on the store than the index says must still
    # be named as changed (the store's Content-Range total), without sha256 (verify=size, and plain), not cut
    # to the index's length and read as if it were whole.
    import shutil

    shutil.copytree(data_root / "data" / "digits", tmp_path / "data" / "digits")
    grown = sorted((tmp_path / "data" / "digits").glob("train-*.tar"))[0]
    with open(grown, "ab") as f:
        f.write(bytes(4096))
    with SlowStore(str(tmp_path / "data")) as srv:
        for cls, kw in ((CachedLoader, {"cache_dir": str(tmp_path / "cache"), "verify": "size"}), (PlainLoader, {})):
            loader = cls(
                remote_digits(srv.url), "train", batch_size=64, seed=0, num_workers=0, retries=1, backoff=0.01,
                download_parts=3, **kw,
            )  # fmt: skip
            with pytest.raises(DataError, match=rf"cannot read shard .*{grown.name} after 2 attempts: .*changed shard"):
                epoch(loader)
        assert not [p for p in cached_tars(tmp_path / "cache") if p.name.endswith(grown.name)]  # (others may be)


def test_unreachable_source_is_retried_then_named(data_root, tmp_path):
    srv = SlowStore(str(data_root / "data")).start()
    loader = CachedLoader(
        remote_digits(srv.url),
        "train",
        batch_size=64,
        seed=0,
        num_workers=0,
        cache_dir=str(tmp_path / "cache"),
        retries=2,
        backoff=0.05,
        read_timeout=2,
    )
    srv.stop()  # the index was read; now the "network volume" goes away
    t0 = time.monotonic()
    with pytest.raises(DataError, match=rf"cannot read shard {srv.url}/digits/train-\d+\.tar after 3 attempts"):
        epoch(loader)
    assert time.monotonic() - t0 >= 0.15  # backed off 0.05 + 0.1 s
    with pytest.raises(DataError, match=r"http://127\.0\.0\.1:1/digits/index\.json"):
        remote_digits("http://127.0.0.1:1").index  # noqa: B018 - loading it is the test


def test_bad_cache_settings_are_one_line_errors(data_root, tmp_path, store):
    ds = remote_digits(store.url)
    with pytest.raises(ConfigError, match="loader.cache_limit=1KB is smaller than the largest shard"):
        CachedLoader(ds, "train", batch_size=8, seed=0, cache_dir=str(tmp_path / "c"), cache_limit="1KB")
    with pytest.raises(ConfigError, match="loader.cache_limit='lots' is not a size"):
        parse_size("lots")
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("2MiB") == 2 << 20 and parse_size(None) is None
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match="cannot create loader.cache_dir"):
        CachedLoader(ds, "train", batch_size=8, seed=0, cache_dir=str(tmp_path / "file" / "cache"))


def test_full_cache_disk_evicts_idle_shards_and_finishes(data_root, tmp_path, store):
    disk = tmp_path / "small_disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:  # 2 MiB holds two of the ~0.73 MB shards: no limit configured, the disk itself is the limit
        loader = CachedLoader(
            remote_digits(store.url),
            "train",
            batch_size=64,
            seed=0,
            num_workers=0,
            prefetch_shards=1,
            cache_dir=str(disk),
        )
        keys = [k for ks, _ in epoch(loader) for k in ks]
        assert len(keys) == len(set(keys)) == 1438
        assert loader.stats["cache_evictions"] >= 5 and not list(disk.glob("*.part.*"))
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_any_fsspec_url_is_a_source(data_root, tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")  # an fsspec backend that needs no network (s3://, gs://... work alike)
    for p in (data_root / "data" / "digits").iterdir():
        fs.pipe(f"/pitstop-test/digits/{p.name}", p.read_bytes())
    try:
        ds = ImageShards(root="memory://pitstop-test/digits", name="digits", num_classes=10, channels=1)
        loader = CachedLoader(ds, "train", batch_size=64, seed=0, num_workers=0, cache_dir=str(tmp_path / "cache"))
        keys = [k for ks, _ in epoch(loader) for k in ks]
        assert len(keys) == len(set(keys)) == 1438 and loader.stats["cache_misses"] == 8
    finally:
        fs.rm("/pitstop-test", recursive=True)


def test_eviction_takes_the_shard_read_furthest_ahead_and_ignores_readers_that_died(data_root, tmp_path, store):
    # cache_policy=future: each reader publishes its next reads (here: this thread, by hand); eviction takes first
    # what no live reader will read, then what is read furthest ahead; a reader that died no longer counts.
    refs = shard_refs(data_root, store.url)
    size = max(r.bytes for r in refs)
    cache = ShardCache(str(tmp_path / "cache"), 3 * size, FAST)
    present = lambda i: os.path.exists(cache.path(refs[i]))  # noqa: E731
    for i in (0, 1, 2):
        cache.read(cache.acquire(refs[i]))
        time.sleep(0.02)
    cache.publish([refs[i] for i in (3, 0, 2)])  # reading 3 now, then 0, then 2; 1 not again
    cache.read(cache.acquire(refs[3]))
    assert not present(1) and present(0) and present(2)  # (LRU would have taken 0, the least recently used)
    cache.publish([refs[i] for i in (4, 3, 0, 2)])  # 2 is read furthest ahead
    cache.read(cache.acquire(refs[4]))
    assert not present(2) and present(0) and present(3)
    # A reader that died (its process is gone) claimed it would read 4 next: ignored, and its file removed.
    dead = subprocess.Popen(["true"])
    dead.wait()
    ghost = tmp_path / "cache" / ".future" / f"{dead.pid}-1.json"
    ghost.write_text(json.dumps({os.path.basename(cache.path(refs[4])): 0}))
    cache.publish([refs[i] for i in (5, 0, 3)])  # 4: not read again by anyone alive
    cache.read(cache.acquire(refs[5]))
    assert not present(4) and present(0) and present(3) and not ghost.exists()
    assert cache.take_stats()["cache_evictions"] == 3


def test_readers_publish_the_rest_of_the_epoch_and_all_of_the_next(data_root, tmp_path, store):
    loader = CachedLoader(remote_digits(store.url), "train", batch_size=32, seed=3, cache_dir=str(tmp_path / "c"))
    it = iter(loader)
    for _ in range(5):
        next(it)
    futures = [json.loads(p.read_text()) for p in (tmp_path / "c" / ".future").glob("*.json")]
    assert len(futures) == 2  # one per worker (loader.num_workers=2), each its stream's reads
    cache = ShardCache(str(tmp_path / "c"), None, FAST)
    names = {os.path.basename(cache.path(r)) for r in shard_refs(data_root, store.url)}
    assert set().union(*futures) == names  # next epoch reads every shard, so between them they name all
    it.close()
    lru = CachedLoader(
        remote_digits(store.url), "train", batch_size=32, seed=3, cache_dir=str(tmp_path / "l"), cache_policy="lru"
    )
    it = iter(lru)
    next(it)
    it.close()
    assert not list((tmp_path / "l" / ".future").glob("*.json"))  # (lru: nothing to publish)


def test_prefetch_auto_goes_as_deep_as_downloads_need(data_root, tmp_path, store):
    # A store that takes ~0.3 s per shard and a reader that needs ~0.05 s per shard: auto keeps more downloads
    # in flight than the fixed 2 (up to its cap); a reader slower than the downloads keeps one or two ahead.
    from pitstop.data.loader.cached import MAX_DEPTH, CachedSource

    with SlowStore(str(data_root / "data"), latency_ms=300) as slow:
        source = CachedSource(str(tmp_path / "a"), None, FAST, "size", "auto")
        refs = shard_refs(data_root, slow.url)
        assert source.depth == 2  # nothing measured yet
        for k in range(len(refs)):
            source.lookahead(refs[k:])
            source.read(refs[k])
            time.sleep(0.05)
        assert 4 <= source.depth <= MAX_DEPTH, (source._download_s, source._shard_s)
        source.close()
    with SlowStore(str(data_root / "data"), latency_ms=20) as fast:
        source = CachedSource(str(tmp_path / "b"), None, FAST, "size", "auto")
        refs = shard_refs(data_root, fast.url)
        for k in range(len(refs)):
            source.lookahead(refs[k:])
            source.read(refs[k])
            time.sleep(0.3)
        assert source.depth <= 2, (source._download_s, source._shard_s)
        source.close()
    with pytest.raises(ConfigError, match=r"loader\.prefetch_shards='lots'"):
        CachedLoader(
            remote_digits(store.url),
            "train",
            batch_size=32,
            seed=3,
            cache_dir=str(tmp_path / "x"),
            prefetch_shards="lots",
        )
