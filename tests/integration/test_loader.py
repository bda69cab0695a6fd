"""The shard loader on the real digits shards, with real workers: disjoint coverage, exact position after a
restart, clear errors on bad shards, data workers that die with their trainer (cold ``python -c`` processes).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tarfile

import pytest
import torch

from pitstop.errors import DataError
from pitstop.data.loader.plain import PlainLoader
from recipe.vision import ImageShards


def digits(data_root, root=None, **kw) -> ImageShards:
    return ImageShards(
        root=str(root or data_root / "data" / "digits"),
        name="digits",
        num_classes=10,
        channels=1,
        augment={"pad": 1},
        **kw,
    )


def take(loader: PlainLoader, n: int) -> list[tuple[list[str], torch.Tensor]]:
    keys: list[list[str]] = []
    loader.sample_log = keys.append
    out = []
    batches = iter(loader)
    with contextlib.closing(batches):  # its workers stop now, not when a later test collects it (5 s each)
        for i, (x, y) in enumerate(itertools.islice(batches, n)):
            out.append((keys[i], x.clone()))
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_at_any_batch_continues_bitwise(data_root, workers):
    ds = digits(data_root)
    mk = lambda: PlainLoader(ds, "train", batch_size=50, seed=7, num_workers=workers)  # noqa: E731
    spe = mk().steps_per_epoch()
    total = spe + 5  # crosses an epoch boundary
    reference = take(mk(), total)
    for k in (1, 2, 3, spe - 1, spe, spe + 1):
        first = mk()
        got = take(first, k)
        state = first.state_dict()
        second = mk()
        second.load_state_dict(state)
        got += take(second, total - k)
        assert [g[0] for g in got] == [r[0] for r in reference], f"sample order differs after resume at {k}"
        assert all(torch.equal(g[1], r[1]) for g, r in zip(got, reference)), f"tensors differ after resume at {k}"


def test_epoch_covers_every_sample_once_and_order_depends_on_seed_and_epoch(data_root):
    ds = digits(data_root)
    loader = PlainLoader(ds, "train", batch_size=64, seed=1, num_workers=2)
    spe = loader.steps_per_epoch()
    batches = take(loader, 2 * spe)
    epoch0 = [k for keys, _ in batches[:spe] for k in keys]
    epoch1 = [k for keys, _ in batches[spe:] for k in keys]
    n = ds.index.num_samples("train")
    assert len(epoch0) == len(set(epoch0)) == n and set(epoch0) == set(epoch1)
    assert epoch0 != epoch1  # reshuffled per epoch
    other = [k for keys, _ in take(PlainLoader(ds, "train", batch_size=64, seed=2, num_workers=2), spe) for k in keys]
    assert other != epoch0 and set(other) == set(epoch0)


def test_ranks_and_workers_read_disjoint_shards(data_root):
    ds = digits(data_root)
    seen = []
    for rank in range(2):
        loader = PlainLoader(ds, "train", batch_size=32, seed=3, rank=rank, world_size=2, num_workers=2)
        seen.append({k for keys, _ in take(loader, loader.steps_per_epoch()) for k in keys})
    assert not seen[0] & seen[1]


def test_changed_layout_is_rejected(data_root):
    ds = digits(data_root)
    a = PlainLoader(ds, "train", batch_size=32, seed=3, num_workers=2)
    take(a, 3)
    b = PlainLoader(ds, "train", batch_size=16, seed=3, num_workers=2)
    with pytest.raises(Exception, match="batch_size"):
        b.load_state_dict(a.state_dict())


def copy_digits(data_root, tmp_path):
    dst = tmp_path / "digits"
    shutil.copytree(data_root / "data" / "digits", dst)
    return dst


def reindex(root):
    """Recompute every shard's size and hash in ``root/index.json`` (after editing shards in place)."""
    import hashlib
    import json

    idx = json.loads((root / "index.json").read_text())
    for shards in idx["splits"].values():
        for s in shards:
            data = (root / s["url"]).read_bytes()
            s["bytes"], s["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (root / "index.json").write_text(json.dumps(idx))


def corrupt_one_image(shard_path):
    with tarfile.open(shard_path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    victim = next(m.name for m, _ in members if m.name.endswith(".png"))
    with tarfile.open(shard_path, "w") as tar:
        for m, data in members:
            if m.name == victim:
                data = b"not a png" + data[20:]
                m.size = len(data)
            import io

            tar.addfile(m, io.BytesIO(data))
    return victim.split(".")[0]


def test_corrupt_image_names_shard_and_key_or_is_skipped_and_counted(data_root, tmp_path):
    root = copy_digits(data_root, tmp_path)
    key = corrupt_one_image(root / "train-000003.tar")
    reindex(root)  # a bad image inside a shard that matches its index (e.g. written that way)
    loader = PlainLoader(digits(data_root, root), "train", batch_size=64, seed=0, num_workers=2)
    with pytest.raises(DataError) as err:
        take(loader, loader.steps_per_epoch())
    msg = str(err.value)
    assert "train-000003.tar" in msg and repr(key) in msg and "\n" not in msg and "skip_corrupt" in msg
    loader = PlainLoader(digits(data_root, root, skip_corrupt=True), "train", batch_size=64, seed=0, num_workers=2)
    keys = {k for ks, _ in take(loader, loader.steps_per_epoch()) for k in ks}
    assert loader.stats["skipped_corrupt"] == 1 and key not in keys and len(keys) == 1437


def test_a_corrupt_image_in_the_evaluation_split_stops_the_evaluation_in_one_line(data_root, tmp_path, make_cfg):
    """The fault x phase matrix, read error x evaluation: a bad image in a validation shard, found by the first
    evaluation (debug=tiny evaluates at step 6), names the shard and the sample and says what to do."""
    from conftest import train

    root = copy_digits(data_root, tmp_path)
    val = sorted(root.glob("val-*.tar"))[0]
    key = corrupt_one_image(val)
    reindex(root)
    with pytest.raises(DataError) as err:
        train(make_cfg(f"data.root={root}", "trainer.max_steps=6", "ckpt=none"))
    msg = str(err.value)
    assert val.name in msg and repr(key) in msg and "\n" not in msg and "skip_corrupt" in msg


def test_truncated_shard_names_shard_and_offset(data_root, tmp_path):
    root = copy_digits(data_root, tmp_path)
    shard = root / "train-000001.tar"
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    loader = PlainLoader(digits(data_root, root), "train", batch_size=64, seed=0, num_workers=0)
    with pytest.raises(DataError, match=r"train-000001\.tar.*offset \d+"):
        take(loader, loader.steps_per_epoch())


def test_pipe_urls_are_refused_unless_allowed(data_root, tmp_path):
    import json

    from pitstop.errors import ConfigError

    root = copy_digits(data_root, tmp_path)
    idx = json.loads((root / "index.json").read_text())
    for s in idx["splits"]["train"]:
        s["url"] = f"pipe:cat {root / s['url']}"
    (root / "index.json").write_text(json.dumps(idx))
    with pytest.raises(ConfigError, match=r"pipe:.*loader\.allow_pipe=true"):
        PlainLoader(digits(data_root, root), "train", batch_size=64, seed=0)
    loader = PlainLoader(digits(data_root, root), "train", batch_size=64, seed=0, num_workers=0, allow_pipe=True)
    keys = [k for ks, _ in take(loader, loader.steps_per_epoch()) for k in ks]
    assert len(keys) == len(set(keys)) == 1438


def test_evaluation_batches_are_kept_in_memory_when_they_fit(data_root):
    from pitstop.errors import ConfigError

    ds = digits(data_root)
    kept = PlainLoader(ds, "val", batch_size=64, seed=0, train=False, num_workers=2)
    first = list(kept.iterate_once())
    again = list(kept.iterate_once())  # from memory: the very same tensors, no worker started
    assert len(again) == len(first) == 6 and all(a[0] is b[0] and a[1] == b[1] for a, b in zip(first, again))
    assert sum(len(y) for (_, y), counted in again if counted) == 359
    fewer = list(kept.iterate_once(max_batches=2))  # another pass length: read again
    assert len(fewer) == 2 and fewer[0][0] is not first[0][0] and torch.equal(fewer[0][0][0], first[0][0][0])
    for budget in (0, 1000):  # off, or too small for these batches: every pass reads
        streamed = PlainLoader(ds, "val", batch_size=64, seed=0, train=False, num_workers=2, eval_in_memory=budget)
        a, b = list(streamed.iterate_once()), list(streamed.iterate_once())
        assert a[0][0] is not b[0][0]
        assert all(torch.equal(x[0][0], y[0][0]) and torch.equal(x[0][1], y[0][1]) for x, y in zip(a, first))
    with pytest.raises(ConfigError, match=r"loader\.eval_in_memory=null"):
        PlainLoader(ds, "val", batch_size=64, seed=0, train=False, eval_in_memory=None)
    with pytest.raises(ConfigError, match=r"loader\.eval_in_memory='lots' is not a size"):
        PlainLoader(ds, "val", batch_size=64, seed=0, train=False, eval_in_memory="lots")


@pytest.mark.parametrize("grow_at", [20, 122])
def test_a_shrink_and_a_grow_back_read_every_sample_of_every_epoch_exactly_once(data_root, grow_at):
    # Real loaders with 2 workers each: 2 ranks read 15 batches, their states resume on 1 rank, which reads on to
    # ``grow_at`` and hands over to 2 ranks again, to the end of 4 epochs. 20: shrunk and grown back within epoch 0
    # (the partitions the 2 ranks finished must stay consumed through both hand-overs: once, they were read again);
    # 122: 1 rank leaves one batch of epoch 2, which 2 ranks must share (by whole partitions one got none, and the
    # other's batch was dropped).
    import collections

    ds = digits(data_root)
    mk = lambda rank, world: PlainLoader(ds, "train", batch_size=32, seed=21, rank=rank, world_size=world)  # noqa: E731
    seen: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)

    def read(loaders, n):
        its = []
        for ld in loaders:
            ld.sample_log = lambda keys, ld=ld: seen[ld.epoch].update(keys)
            its.append(iter(ld))
        for _ in range(n):
            for it in its:
                next(it)
        for it in its:
            it.close()
        return [ld.state_dict() for ld in loaders]

    def resume(states, world):
        loaders = [mk(r, world) for r in range(world)]
        for ld in loaders:
            ld.load_state_dict(states[0], peers=states)
        return loaders

    states = read([mk(0, 2), mk(1, 2)], 15)
    states = read(resume(states, 1), grow_at - 15)
    two = resume(states, 2)
    assert two[0].steps_per_epoch() == two[1].steps_per_epoch() > 0
    left = max(0, two[0].steps_per_epoch() - two[0].batches) + sum(
        two[0].steps_per_epoch(e) for e in range(two[0].epoch + 1, 4)
    )
    read(two, left)
    assert sorted(seen) == [0, 1, 2, 3]
    for epoch, counts in seen.items():
        assert len(counts) == 1438 and set(counts.values()) == {1}, (epoch, len(counts), max(counts.values()))


def test_a_shard_mixing_window_mixes_shards_and_resumes_exactly(data_root):
    # loader.shuffle_shards_window=K: each reader takes its shards K at a time and hands out their samples in a
    # seeded permutation, so a batch draws from K shards instead of one or two; still a pure function of (seed,
    # epoch): a resume at any batch continues bitwise, and a resume with another window or world size (what is
    # consumed is known sample by sample) reads the rest of the epoch exactly once.
    import collections

    from pitstop.data.shards import read_shard

    ds = digits(data_root)
    shard_of = {
        smp["__key__"]: s.url
        for s in ds.index.shards("train")
        for smp in read_shard(open(ds.index.resolve(s), "rb").read(), s.url)
    }
    mk = lambda window, workers=2, rank=0, world=1: PlainLoader(  # noqa: E731
        ds,
        "train",
        batch_size=32,
        seed=7,
        num_workers=workers,
        rank=rank,
        world_size=world,
        shuffle_shards_window=window,
    )

    def shards_per_batch(window: int) -> float:
        loader = mk(window)
        got = take(loader, loader.steps_per_epoch())
        assert sorted(k for keys, _ in got for k in keys) == sorted(shard_of)  # the epoch, every sample once
        return sum(len({shard_of[k] for k in keys}) for keys, _ in got) / len(got)

    one, four = shards_per_batch(1), shards_per_batch(4)
    assert one < 1.5 and four > 3.0, (one, four)
    spe = mk(4).steps_per_epoch()
    reference = take(mk(4), spe + 3)
    for k in (1, 7, spe - 1, spe):
        first = mk(4)
        got = take(first, k)
        second = mk(4)
        second.load_state_dict(first.state_dict())
        got += take(second, spe + 3 - k)
        assert [g[0] for g in got] == [r[0] for r in reference], f"sample order differs after resume at {k}"
        assert all(torch.equal(g[1], r[1]) for g, r in zip(got, reference)), f"tensors differ after resume at {k}"
    # 2 ranks with a window of 4 read 5 batches each; 1 rank without a window reads on to the end of the epoch
    ranks = [mk(4, rank=r, world=2) for r in (0, 1)]
    seen = collections.Counter(k for ld in ranks for keys, _ in take(ld, 5) for k in keys)
    states = [ld.state_dict() for ld in ranks]
    rest = mk(1)
    rest.load_state_dict(states[0], peers=states)
    seen.update(k for keys, _ in take(rest, rest.steps_per_epoch()) for k in keys)
    assert set(seen) == set(shard_of) and set(seen.values()) == {1}
