"""Input pipeline from slow remote storage: loader=plain vs loader=cached vs the local-disk ceiling, and pitstop's
cached loader vs MosaicML streaming on an S3 API, each with and without a cap on the link.

    python bench/loader.py [--latency-ms 50] [--mbps 10] [--link-mbps 40] [--samples 6144] [--batch 64]
                           [--peer auto|off|only] [--decode-only] [--setup-s 1.5]

What it measures.  Synthetic 224x224 JPEG shards (>= 200 MB of training shards, written once by recipe.prepare)
are served by pitstop.testing.slowstore: ``--latency-ms`` per request, ``--mbps`` per connection (a network
volume) and, for the main table, ``--link-mbps`` for all connections together (0: no link cap).  A training step
of fixed cost (a sleep, like a GPU step that leaves the CPUs to the loader) follows every batch; it is calibrated
once so the local-disk ceiling is compute-bound: ``--step-factor`` (2) x the time the loader needs to decode a
batch from local disk.  Each pipeline runs two epochs (the cached variants one): samples/s, data-wait fraction
(time blocked building the loader and in next(batch) / wall time), bytes read from the source and cache hits.
Epoch 1 is timed from the loader's construction (building it, its warm-up, its workers' start, the first batch):
a cold epoch pays all of it.  Epoch 2 is timed from its first batch.  The ceiling is the local-disk loader's
faster epoch (its second).  Headline: the cached loader's cold epoch (empty cache), from construction, on the
capped link, / the ceiling.  Rows marked "set-up credited" repeat the cold epoch with ``--setup-s`` untimed
seconds between the loader's construction and its first batch (a job's model build and restore, during which the
cached loader fetches each reader's first shards; "no first shards" does not): shown, not the headline.  One
more cold epoch runs with the link uncapped.
Targets: cached epoch 2 >= 0.9x the ceiling with data-wait <= 5%; cached epoch 1 >= 1.2x plain epoch 1; the
cold epoch from construction >= 0.95x the ceiling.

First, the sample path per core (``--decode-only`` stops there): for the digits (8x8 PNG) and the 224x224 JPEG
training shards, one thread, samples/s of (a) the floor: the image library alone, ``np.asarray(Image.open(...))``
of every sample's image, read into memory first; (b) the recipe's ``decode`` + ``collate`` of the same samples
(augmentation included); (c) the whole loader in the training process (``loader.num_workers=0``: read the shards
from local disk, parse, plan, decode, augment, collate), one epoch. Target: (b) >= 0.75x the floor ((c) adds the
tar parsing and the reader's bookkeeping: shown, no target).

The peer tables (``--peer``): the same images in an S3 API server (moto's), behind the same throttle (the
slowstore as a proxy in front of it), read by pitstop's cached loader through s3fs and by MosaicML streaming
(``StreamingDataset`` over MDS shards of the same samples, with its own local cache and default settings),
with the same workers, batch size, decode function and step cost; epochs 1 (cold, timed from construction) and 2,
each from an empty cache.  Twice: with each connection capped at ``--mbps`` and the link uncapped (pitstop's
reader opens up to 8 connections with ranged parts, streaming one per shard: more connections buy more
bandwidth), then with the link also capped at ``--link-mbps`` (the same bandwidth for both).  They need
``mosaicml-streaming`` (not a pitstop dependency: it pins numpy < 2.2 and pulls transformers; install it
beside, e.g. ``pip install --no-deps --target DIR mosaicml-streaming xxhash zstd python-snappy cramjam brotli
catalogue`` plus transformers and the modules its import asks for, and put DIR on PYTHONPATH).

What it leaves out: a real network (loopback, every byte through a Python proxy on the same CPUs: no jitter, loss
or TLS; the latency is a fixed per-request delay); more than one rank or node (2 workers, one process); a real
step (a sleep: no GPU, no host-to-device copy, no contention for memory bandwidth); the OS page cache (the ceiling
and the cached loader's second epoch read files the kernel likely holds in memory); the peers' tuning (streaming
runs with its defaults, pitstop with its own; sample orders differ); other peers (litdata, webdataset, torchdata
are not measured here).  Full results: bench/results/loader.json (``--decode-only``: loader_decode.json,
``--peer only``: loader_peers.json).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings

from common import ROOT, compose, ensure_data, save_result

# What bench/results/loader.json's figures are, and the code they measure (read by the docs' results page,
# bench/figures.py, without running this script). "The ceiling": the local-disk loader's faster epoch.
FIGURES = {
    "data.shards": ("", "training shards (synthetic 224x224 JPEGs)", None),
    "data.samples": ("", "training samples", None),
    "data.mb": ("MB", "the training shards' size", None),
    "store.latency_ms": ("ms", "the store's delay per request", None),
    "store.mbps_per_connection": ("MB/s", "the store's rate per connection", None),
    "store.link_mbps": ("MB/s", "the cap on all connections together (the main table's)", None),
    "batch": ("", "samples per batch", None),
    "decode_path.*.floor_samples_s": ("samples/s", "the image library alone on one thread (the floor)", None),
    "decode_path.*.decode_samples_s": ("samples/s", "the recipe's decode + collate on one thread", None),
    "decode_path.*.loader_samples_s": ("samples/s", "the whole loader in the training process, one epoch", None),
    "decode_path.*.decode_x": ("x", "decode + collate over the floor", ">= 0.75"),
    "decode_path.*.loader_x": ("x", "the whole loader over the floor (adds tar parsing and bookkeeping)", None),
    "step_ms": ("ms", "the fixed cost of a training step (a sleep), calibrated to the local decode", None),
    "peers.*.link_mbps": ("MB/s", "the link cap of this peer table (none: uncapped)", None),
    "peers.*.pitstop.*.samples_s": ("samples/s", "pitstop's cached loader over the S3 API, epoch 1 then 2", None),
    "peers.*.pitstop.*.wait": ("%", "its data-wait share of the epoch", None),
    "peers.*.pitstop.*.mb_source": ("MB", "its bytes read from the store", None),
    "peers.*.streaming.*.samples_s": ("samples/s", "MosaicML streaming over the same images, epoch 1 then 2", None),
    "peers.*.streaming.*.wait": ("%", "its data-wait share of the epoch", None),
    "peers.*.streaming.*.mb_source": ("MB", "its bytes read from the store", None),
    "peers.*.ratio": ("x", "pitstop's samples/s over streaming's, epoch 1 and epoch 2", ">= 1"),
    "peers.skipped": ("", "why the peer tables were not run", None),
    "ceiling_samples_s": ("samples/s", "the ceiling: the local-disk loader's faster epoch", None),
    "cold_from_construction_x": (
        "x",
        "the cached loader's cold epoch (empty cache, capped link), timed from its "
        "construction, over the ceiling (the headline)",
        ">= 0.95",
    ),
    "warm_epoch_x": ("x", "the cached loader's second epoch over the ceiling", ">= 0.9"),
    "warm_epoch_wait": ("%", "the cached loader's second epoch's data-wait share", "<= 0.05"),
    "cold_vs_plain": ("x", "the cached loader's first epoch over loader=plain's first", ">= 1.2"),
    "cold_prefetch2_x": ("x", "the cold epoch with loader.prefetch_shards=2, over the ceiling", None),
    "cold_one_request_x": ("x", "the cold epoch with loader.download_parts=1, over the ceiling", None),
    "cold_uncapped_from_construction_x": ("x", "the cold epoch with the link uncapped, over the ceiling", None),
    "setup_s": ("s", "untimed set-up between the loader's construction and its first batch (the credited rows)", None),
    "cold_setup_credited_x": (
        "x",
        "the cold epoch after the untimed set-up, over the ceiling (not the headline)",
        None,
    ),
    "cold_setup_credited_no_first_x": ("x", "the same without the first shards fetched during the set-up", None),
    "epochs.*.*.samples_s": (
        "samples/s",
        "samples per second of the epoch (ceiling, plain, cached: epochs 1, 2)",
        None,
    ),
    "epochs.*.*.wait": ("%", "the epoch's data-wait share", None),
    "epochs.*.*.mb_source": ("MB", "bytes read from the store in the epoch", None),
}
MEASURES = ["src/pitstop/data", "src/pitstop/testing/slowstore.py", "recipe/vision.py"]

STREAMING_HINT = (
    "pip install mosaicml-streaming (beside pitstop, see this file's docstring) and moto[server], "
    "s3fs (pip install -e '.[dev]')"
)


def verdict(ok: bool) -> str:
    return "target met" if ok else "target MISSED"


def make_loader(kind: str, root: str, batch: int, cache_dir: str | None = None, *extra: str, warm: bool = True):
    from pitstop.config.build import build
    from pitstop.data.dataset import build_dataset

    cfg = compose(
        [
            f"loader={kind}",
            "data=synthetic",
            f"data.root={root}",
            *([f"loader.cache_dir={cache_dir}"] if cache_dir else []),
            *extra,
        ]
    )
    data = build_dataset(cfg.data)
    loader = build(cfg.loader, dataset=data, split="train", train=True, batch_size=batch, seed=0)
    if warm and hasattr(loader, "warm"):  # (as a job does once the loader is built: pitstop.train.assembly)
        loader.warm()
    return loader


def run(make, epochs: int, step_s: float, setup_s: float = 0.0) -> list[dict]:
    """``epochs`` epochs of the loader ``make()`` builds.  Epoch 1 is timed from before ``make()`` (construction,
    warm-up and the workers' start count as data-wait), unless ``setup_s`` > 0: then ``setup_s`` seconds pass,
    untimed, between construction and the first batch (a job's model build and restore) and epoch 1 is timed
    from there.  Later epochs are timed from their first batch."""
    t_build = time.perf_counter()
    loader = make()
    time.sleep(setup_s)
    it = iter(loader)
    spe = loader.steps_per_epoch()
    out = []
    for e in range(epochs):
        before = dict(loader.stats) if e else {}
        t0 = t_build if e == 0 and not setup_s else time.perf_counter()
        wait, n = (time.perf_counter() - t_build if t0 == t_build else 0.0), 0  # (construction and iter())
        for _ in range(spe):
            a = time.perf_counter()
            x, y = next(it)
            wait += time.perf_counter() - a
            n += len(y)
            if step_s:
                time.sleep(step_s)  # the training step: fixed cost, CPUs left to the loader
        wall = time.perf_counter() - t0
        delta = {k: v - before.get(k, 0) for k, v in loader.stats.items()}
        out.append(
            {
                "samples_s": n / wall,
                "wait": wait / wall,
                "wall": wall,
                "mb_source": delta["bytes_from_source"] / 1e6,
                "hits": delta.get("cache_hits", "-"),
                "misses": delta.get("cache_misses", "-"),
                "timed": "epoch" if e else ("from build" if t0 == t_build else f"after {setup_s:g} s set-up"),
            }
        )
    del it
    return out


def decode_path(name: str, root: str, overrides: list[str], repeats: int = 5) -> dict:
    """Samples/s per core of the image library's decode alone (the floor), the recipe's decode + collate, and the
    whole in-process loader, over the training shards of one data set (best of ``repeats``, one thread)."""
    import glob
    import io

    import numpy as np
    import torch
    from PIL import Image

    from pitstop.config.build import build
    from pitstop.data.dataset import build_dataset
    from pitstop.data.shards import read_shard
    from pitstop.parts.seed import derive_seed

    torch.set_num_threads(1)
    cfg = compose([*overrides, f"data.root={root}", "loader.num_workers=0"])
    data = build_dataset(cfg.data)
    samples = [
        s
        for url in sorted(glob.glob(os.path.join(root, "train-*.tar")))
        for s in read_shard(open(url, "rb").read(), url)
    ]
    ext = data.image_member(samples[0])
    fmt = {"png": ["PNG"], "jpg": ["JPEG"], "jpeg": ["JPEG"]}.get(ext)
    batch = int(cfg.trainer.batch_size)

    def floor() -> None:
        for s in samples:
            np.asarray(Image.open(io.BytesIO(s[ext]), formats=fmt))

    def recipe() -> None:
        for i in range(0, len(samples), batch):
            data.collate(
                [data.decode(s, train=True, seed=derive_seed(0, 0, s["__key__"])) for s in samples[i : i + batch]]
            )

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return len(samples) / min(times)

    loader = build(cfg.loader, dataset=data, split="train", train=True, batch_size=batch, seed=0)
    spe = loader.steps_per_epoch()
    it = iter(loader)

    def whole() -> int:
        return sum(len(next(it)[1]) for _ in range(spe))

    rates = {}
    for _ in range(2):  # alternated, best of both rounds
        for key, fn in (("floor", floor), ("decode", recipe)):
            rates[key] = max(rates.get(key, 0.0), best(fn))
        for _ in range(max(2, repeats // 2)):
            t = time.perf_counter()
            n = whole()
            rates["loader"] = max(rates.get("loader", 0.0), n / (time.perf_counter() - t))
    return {"name": name, "samples": len(samples), **rates}


def print_decode_path(rows: list[dict]) -> None:
    head = f"{'floor/s':>9} {'decode+collate/s':>16} {'x floor':>7} {'loader/s':>9} {'x floor':>7}"
    print(f"{'sample path, 1 core':26} {head}")
    for r in rows:
        d, w = r["decode"] / r["floor"], r["loader"] / r["floor"]
        print(
            f"{r['name']:26} {r['floor']:>9.0f} {r['decode']:>16.0f} {d:>7.2f} {r['loader']:>9.0f} {w:>7.2f}"
            f"  -> decode {d:.2f}x the floor (target >= 0.75x): {verdict(d >= 0.75)}"
        )
    print()


def _r(x: float, digits: int = 3) -> float:
    return round(float(x), digits)


def epoch_figures(r: dict) -> dict:
    return {"samples_s": _r(r["samples_s"], 1), "wait": _r(r["wait"]), "mb_source": _r(r["mb_source"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--mbps", type=float, default=10.0, help="MB/s per connection of the emulated store")
    ap.add_argument(
        "--link-mbps",
        type=float,
        default=40.0,
        help="MB/s of all connections together: the main table's link, and the peers' capped run (0: no cap)",
    )
    ap.add_argument("--samples", type=int, default=6144)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument(
        "--step-factor",
        type=float,
        default=2.0,
        help="step cost = this x the local decode time of a batch (> 1: compute-bound ceiling)",
    )
    ap.add_argument(
        "--peer",
        choices=["auto", "off", "only"],
        default="auto",
        help="MosaicML streaming vs pitstop cached on a throttled S3 API (auto: when installed)",
    )
    ap.add_argument("--decode-only", action="store_true", help="only the per-core sample path (no store, no peers)")
    ap.add_argument(
        "--setup-s",
        type=float,
        default=1.5,
        help="for the rows marked 'set-up credited' only: untimed seconds from building a loader to its first batch "
        "(a job's model build, dynamo import and restore; ~1.7 s in the default job here), during which the cached "
        "loader fetches each reader's first shards (0: no such rows)",
    )
    a = ap.parse_args()

    from pitstop.testing.slowstore import SlowStore

    if a.peer != "off":  # (before the first loader starts its workers' forkserver, which keeps this environment)
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        os.environ.pop("AWS_ENDPOINT_URL", None)
    data_dir = ROOT / "data"
    name = f"synthetic-224px-{a.samples}"
    ensure_data(["data=synthetic", f"data.num_samples={a.samples}", "data.image_size=224"])
    local = str(data_dir / name)
    import json

    shards = json.loads(open(os.path.join(local, "index.json")).read())["splits"]["train"]
    total_mb = sum(s["bytes"] for s in shards) / 1e6
    link = a.link_mbps or None
    link_label = f"link capped at {a.link_mbps:g} MB/s" if link else "link uncapped"
    print(
        f"data: {len(shards)} train shards, {sum(s['samples'] for s in shards)} samples, {total_mb:.0f} MB "
        f"of 224x224 JPEG; store: latency {a.latency_ms:g} ms, {a.mbps:g} MB/s per connection, {link_label}; "
        f"2 workers/rank, batch {a.batch}, {os.cpu_count()} CPUs"
    )
    if total_mb < 200:
        print(f"warning: only {total_mb:.0f} MB; pass a larger --samples")
    figures: dict = {
        "data": {"shards": len(shards), "samples": sum(s["samples"] for s in shards), "mb": _r(total_mb, 1)},
        "store": {"latency_ms": a.latency_ms, "mbps_per_connection": a.mbps, "link_mbps": a.link_mbps or None},
        "batch": a.batch,
    }
    ensure_data(["data=digits"])
    paths = [
        decode_path("digits 8x8 PNG", str(data_dir / "digits"), ["data=digits"]),
        decode_path("synthetic 224x224 JPEG", local, ["data=synthetic", "data.image_size=224"], repeats=2),
    ]
    print_decode_path(paths)
    figures["decode_path"] = {
        key: {
            "floor_samples_s": _r(r["floor"], 1),
            "decode_samples_s": _r(r["decode"], 1),
            "loader_samples_s": _r(r["loader"], 1),
            "decode_x": _r(r["decode"] / r["floor"]),
            "loader_x": _r(r["loader"] / r["floor"]),
        }
        for key, r in zip(("digits", "jpeg224"), paths)
    }
    if a.decode_only:
        save_result("loader_decode", figures)
        return

    # Calibrate the step: decode throughput from local disk with no step at all.
    decode = run(lambda: make_loader("plain", local, a.batch), 1, 0.0)[0]
    step_s = a.step_factor * a.batch / decode["samples_s"]
    figures["step_ms"] = _r(step_s * 1000, 1)
    print(f"local decode-bound: {decode['samples_s']:.0f} samples/s -> fixed step cost {step_s * 1000:.0f} ms/batch\n")

    if a.peer != "off":
        missing = _peer_missing()
        if missing:
            print(f"peer tables skipped: {missing} not installed ({STREAMING_HINT})\n")
            figures["peers"] = {"skipped": f"{missing} not installed"}
        else:
            figures["peers"] = peer(a, local, name, step_s)
    if a.peer == "only":
        save_result("loader_peers", figures)
        return
    rows = []
    cache = tempfile.mkdtemp(prefix="pitstop-bench-cache-")

    def cached_run(root: str, epochs: int, *extra: str, warm: bool = True, setup_s: float = 0.0) -> list[dict]:
        shutil.rmtree(cache, ignore_errors=True)  # (every cached row starts from an empty cache)
        try:
            return run(lambda: make_loader("cached", root, a.batch, cache, *extra, warm=warm), epochs, step_s, setup_s)
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    credited = nofirst = uncapped = None
    try:
        with SlowStore(str(data_dir), latency_ms=a.latency_ms, mbps=a.mbps, link_mbps=link) as srv:
            remote = f"{srv.url}/{name}"
            ceiling = run(lambda: make_loader("plain", local, a.batch), 2, step_s)
            rows += [("local disk (ceiling)", i + 1, r) for i, r in enumerate(ceiling)]
            plain = run(lambda: make_loader("plain", remote, a.batch), 2, step_s)
            rows += [("plain, remote", i + 1, r) for i, r in enumerate(plain)]
            fixed = cached_run(remote, 1, "loader.prefetch_shards=2")
            rows += [("cached, prefetch 2", 1, fixed[0])]
            single = cached_run(remote, 1, "loader.download_parts=1")
            rows += [("cached, 1 request/shard", 1, single[0])]
            cached = cached_run(remote, 2)
            rows += [("cached (auto), remote", i + 1, r) for i, r in enumerate(cached)]
            if a.setup_s:
                credited = cached_run(remote, 1, setup_s=a.setup_s)[0]
                rows += [("cached (auto), set-up credited", 1, credited)]
                nofirst = cached_run(remote, 1, warm=False, setup_s=a.setup_s)[0]
                rows += [("cached, no first shards, set-up credited", 1, nofirst)]
        if link:
            with SlowStore(str(data_dir), latency_ms=a.latency_ms, mbps=a.mbps) as srv:
                uncapped = cached_run(f"{srv.url}/{name}", 1)[0]
                rows += [("cached (auto), link uncapped", 1, uncapped)]
    finally:
        shutil.rmtree(cache, ignore_errors=True)

    ref = max(r["samples_s"] for r in ceiling)
    print(
        f"pipelines: store {a.latency_ms:g} ms, {a.mbps:g} MB/s per connection, {link_label} (unless the row says "
        f"otherwise); epoch 1 timed from the loader's construction unless the row says 'set-up credited'"
    )
    print(
        f"{'pipeline':40} {'epoch':>5} {'timed':>18} {'samples/s':>10} {'x ceiling':>9} {'data-wait':>9} "
        f"{'MB from source':>14} {'hits/misses':>11}"
    )
    for label, e, r in rows:
        print(
            f"{label:40} {e:>5} {r['timed']:>18} {r['samples_s']:>10.0f} {r['samples_s'] / ref:>9.2f} "
            f"{r['wait'] * 100:>8.1f}% {r['mb_source']:>14.0f} {str(r['hits']) + '/' + str(r['misses']):>11}"
        )
    print()
    c2, c1, p1 = cached[1], cached[0], plain[0]
    cold_x, warm_x, vs_plain = c1["samples_s"] / ref, c2["samples_s"] / ref, c1["samples_s"] / p1["samples_s"]
    print(
        f"cold epoch (empty cache), timed from the loader's construction, {link_label}: cached (auto) {cold_x:.2f}x "
        f"the ceiling (target >= 0.95): {verdict(cold_x >= 0.95)}"
    )
    print(
        f"  same, other settings (no target): prefetch 2 {fixed[0]['samples_s'] / ref:.2f}x, 1 request per shard "
        f"{single[0]['samples_s'] / ref:.2f}x"
        + (f", link uncapped {uncapped['samples_s'] / ref:.2f}x" if uncapped else "")
    )
    if credited:
        print(
            f"  not the headline: with {a.setup_s:g} s of untimed set-up before the first batch (set-up credited), "
            f"{credited['samples_s'] / ref:.2f}x; without the first shards fetched during it "
            f"{nofirst['samples_s'] / ref:.2f}x"
        )
    print(
        f"cached epoch 2: {warm_x:.2f}x the ceiling (target >= 0.9), data-wait {c2['wait'] * 100:.1f}% "
        f"(target <= 5%): {verdict(warm_x >= 0.9 and c2['wait'] <= 0.05)}"
    )
    print(f"cached epoch 1 / plain epoch 1: {vs_plain:.2f} (target >= 1.2): {verdict(vs_plain >= 1.2)}")
    figures.update(
        {
            "ceiling_samples_s": _r(ref, 1),
            "cold_from_construction_x": _r(cold_x),
            "warm_epoch_x": _r(warm_x),
            "warm_epoch_wait": _r(c2["wait"]),
            "cold_vs_plain": _r(vs_plain),
            "cold_prefetch2_x": _r(fixed[0]["samples_s"] / ref),
            "cold_one_request_x": _r(single[0]["samples_s"] / ref),
            "cold_uncapped_from_construction_x": _r(uncapped["samples_s"] / ref) if uncapped else None,
            "setup_s": a.setup_s,
            "cold_setup_credited_x": _r(credited["samples_s"] / ref) if credited else None,
            "cold_setup_credited_no_first_x": _r(nofirst["samples_s"] / ref) if nofirst else None,
            "epochs": {
                "ceiling": [epoch_figures(r) for r in ceiling],
                "plain": [epoch_figures(r) for r in plain],
                "cached": [epoch_figures(r) for r in cached],
            },
        }
    )
    save_result("loader", figures)


def _peer_missing() -> str | None:
    import importlib.util
    import sys

    for module in ("streaming", "s3fs", "moto"):
        if importlib.util.find_spec(module) is None:
            return module
    if not os.path.exists(os.path.join(os.path.dirname(sys.executable), "moto_server")):
        return "moto_server"
    return None


def _streaming_dataset(decode_dataset, **kw):
    """MosaicML streaming's dataset over MDS shards of the same samples, decoded by pitstop's own decode."""
    from streaming import StreamingDataset

    from pitstop.parts.seed import derive_seed

    class MDSImages(StreamingDataset):
        def __getitem__(self, i):
            sample = super().__getitem__(i)
            return decode_dataset.decode(
                {"__key__": str(i), "jpg": sample["jpg"], "cls": sample["cls"]},
                train=True,
                seed=derive_seed(0, 0, str(i)),  # (a 63-bit seed, as pitstop's readers give: flips half the time)
            )

    return MDSImages(**kw)


def _write_mds(local: str, out: str, shard_bytes: int) -> int:
    """The training shards' samples as MDS shards of about the same size (raw JPEG and label bytes)."""
    import json
    import tarfile

    from streaming import MDSWriter

    index = json.loads(open(os.path.join(local, "index.json")).read())["splits"]["train"]
    n = 0
    with MDSWriter(out=out, columns={"jpg": "bytes", "cls": "bytes"}, size_limit=shard_bytes) as w:
        for shard in index:
            members: dict[str, dict[str, bytes]] = {}
            with tarfile.open(os.path.join(local, shard["url"])) as tar:
                for m in tar:
                    key, _, ext = m.name.partition(".")
                    members.setdefault(key, {})[ext] = tar.extractfile(m).read()
            for sample in members.values():
                w.write({"jpg": sample["jpg"], "cls": sample["cls"]})
                n += 1
    return n


def _epochs(make, epochs: int, step_s: float, store, endless: bool = False) -> list[dict]:
    """``epochs`` passes over the loader ``make()`` builds, epoch 1 timed from before ``make()`` (its time counts
    as data-wait): samples/s, data-wait, MB through the store.  ``endless``: one endless iterator, its
    ``steps_per_epoch()`` batches per epoch (pitstop's), else one ``iter()`` per epoch, to its end (a DataLoader's)."""
    out = []
    before = sum(p["bytes"] for p in store.stats()["paths"].values())
    t0 = time.perf_counter()
    loader = make()
    wait = time.perf_counter() - t0
    steps = loader.steps_per_epoch() if endless else None
    endless_it = iter(loader) if endless else None
    for e in range(epochs):
        if e:
            before = sum(p["bytes"] for p in store.stats()["paths"].values())
            wait, t0 = 0.0, time.perf_counter()
        n = 0
        it = endless_it or iter(loader)
        for _ in range(steps or 1 << 62):
            a = time.perf_counter()
            try:
                x, y = next(it)
            except StopIteration:
                break
            wait += time.perf_counter() - a
            n += len(y)
            time.sleep(step_s)
        wall = time.perf_counter() - t0
        after = sum(p["bytes"] for p in store.stats()["paths"].values())
        out.append({"samples_s": n / wall, "wait": wait / wall, "mb_source": (after - before) / 1e6, "n": n})
        del it
    return out


def peer(a, local: str, name: str, step_s: float) -> dict:
    """pitstop cached vs MosaicML streaming, same images, same throttled S3 API, same workers/batch/decode/step:
    once with the link uncapped (each connection at ``--mbps``), once with it capped at ``--link-mbps`` too."""
    import json
    import socket
    import subprocess
    import sys

    import s3fs
    from torch.utils.data import DataLoader

    from pitstop.config.build import build
    from pitstop.data.dataset import build_dataset
    from pitstop.testing.slowstore import SlowStore

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    work = tempfile.mkdtemp(prefix="pitstop-bench-peer-")
    links = [("uncapped", None)] + ([("link_capped", a.link_mbps)] if a.link_mbps else [])
    results = {}
    try:
        moto = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": moto}, skip_instance_cache=True)
        fs.mkdir("bench")
        fs.put(local, f"bench/{name}", recursive=True)
        shards = json.loads(open(os.path.join(local, "index.json")).read())["splits"]["train"]
        per_shard = sum(s["bytes"] for s in shards) // len(shards)
        t0 = time.perf_counter()
        samples = _write_mds(local, os.path.join(work, "mds"), per_shard)
        fs.put(os.path.join(work, "mds"), "bench/mds", recursive=True)
        print(
            f"peer: {samples} samples as {len(fs.ls('bench/mds')) - 1} MDS shards of ~{per_shard / 1e6:.0f} MB "
            f"({time.perf_counter() - t0:.0f} s to write and upload), and the same {len(shards)} tar shards, in "
            f"moto's S3 API behind the slowstore (latency {a.latency_ms:g} ms, {a.mbps:g} MB/s per connection)"
        )
        for key, link in links:
            rows = []
            with SlowStore("", latency_ms=a.latency_ms, mbps=a.mbps, upstream=moto, link_mbps=link) as store:
                cfg = compose(
                    [
                        "loader=cached",
                        "data=synthetic",
                        f"data.root=s3://bench/{name}",
                        f"loader.cache_dir={os.path.join(work, f'pitstop-cache-{key}')}",  # (empty: a cold start)
                        f"+loader.storage_options.client_kwargs.endpoint_url={store.url}",
                    ]
                )
                data = build_dataset(cfg.data)

                def pitstop_loader():
                    loader = build(cfg.loader, dataset=data, split="train", train=True, batch_size=a.batch, seed=0)
                    loader.warm()  # (as a job does once the loader is built)
                    return loader

                rows += [
                    ("pitstop cached (s3)", i + 1, r)
                    for i, r in enumerate(_epochs(pitstop_loader, 2, step_s, store, endless=True))
                ]
                os.environ["S3_ENDPOINT_URL"] = store.url

                def streaming_loader():
                    # (torch warns once per worker that pitstop's decoded arrays are read-only: noise here)
                    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                    ds = _streaming_dataset(
                        data,
                        remote="s3://bench/mds",
                        local=os.path.join(work, f"streaming-cache-{key}"),  # (empty: a cold start)
                        batch_size=a.batch,
                        shuffle=True,
                        shuffle_seed=0,
                    )
                    return DataLoader(ds, batch_size=a.batch, num_workers=2, persistent_workers=True)

                rows += [
                    ("mosaicml streaming (s3)", i + 1, r)
                    for i, r in enumerate(_epochs(streaming_loader, 2, step_s, store))
                ]
            what = (
                f"link capped at {link:g} MB/s for all connections together (the same bandwidth for both)"
                if link
                else f"link uncapped: each connection {a.mbps:g} MB/s, so more connections buy more bandwidth "
                "(pitstop: up to 8 per reader with ranged parts; streaming: one per shard)"
            )
            print(f"\npeers, {what}; epoch 1 timed from the loader's construction, from an empty cache")
            print(
                f"{'pipeline':26} {'epoch':>5} {'samples':>7} {'samples/s':>10} {'data-wait':>9} "
                f"{'MB through store':>16}"
            )
            for label, e, r in rows:
                print(
                    f"{label:26} {e:>5} {r['n']:>7} {r['samples_s']:>10.0f} {r['wait'] * 100:>8.1f}% "
                    f"{r['mb_source']:>16.0f}"
                )
            ours = [r for lbl, _, r in rows if lbl.startswith("pitstop")]
            theirs = [r for lbl, _, r in rows if lbl.startswith("mosaic")]
            ratios = [ours[e]["samples_s"] / theirs[e]["samples_s"] for e in (0, 1)]
            for e, ratio in enumerate(ratios):
                print(
                    f"{key.replace('_', ' ')}, epoch {e + 1}: pitstop cached / streaming = {ratio:.2f} "
                    f"(target >= 1): {verdict(ratio >= 1)}"
                )
            results[key] = {
                "link_mbps": link,
                "pitstop": [epoch_figures(r) for r in ours],
                "streaming": [epoch_figures(r) for r in theirs],
                "ratio": [_r(x) for x in ratios],
            }
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    print()
    return results


if __name__ == "__main__":
    main()
