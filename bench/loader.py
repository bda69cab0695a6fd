"""Input pipeline from slow remote storage: loader=plain vs loader=cached vs the local-disk ceiling.

    python bench/loader.py [--latency-ms 50] [--mbps 10] [--link-mbps 40] [--samples 6144] [--batch 64]
                           [--peer auto|off|only] [--decode-only] [--setup-s 1.5]

Synthetic 224x224 JPEG shards (>= 200 MB of training shards, written once by recipe.prepare) are served
by pitstop.testing.slowstore (per-request latency, per-connection bandwidth: a network volume).  A training step of
fixed cost (a sleep, like a GPU step that leaves the CPUs to the loader) follows every batch.  The step cost
is calibrated once so the local-disk ceiling is compute-bound: --step-factor (2) x the time the loader
needs to decode a batch from local disk.  For each pipeline, two epochs: samples/s and data-wait fraction (time
blocked in next(batch) / wall time), plus bytes read from the source and cache hits.
Each loader is built ``--setup-s`` seconds before its first batch, untimed, as in a job (model build, restore): the
cached loader fetches each reader's first shards meanwhile (its first and the two its prefetch asks for as it
starts; the row "no first shards" does not).
Targets: cached epoch 2 >= 0.9x the ceiling with data-wait <= 5%; cached epoch 1 clearly above plain epoch 1.

First, the sample path per core (``--decode-only`` stops there): for the digits (8x8 PNG) and the 224x224 JPEG
training shards, one thread, samples/s of (a) the floor: the image library alone, ``np.asarray(Image.open(...))``
of every sample's image, read into memory first; (b) the recipe's ``decode`` + ``collate`` of the same samples
(augmentation included); (c) the whole loader in the training process (``loader.num_workers=0``: read the shards
from local disk, parse, plan, decode, augment, collate), one epoch. Target: (b) >= 0.75x the floor ((c) adds the
tar parsing and the reader's bookkeeping: shown, no target).

The peer rows (``--peer``): the same images in an S3 API server (moto's), behind the same throttle (the
slowstore as a proxy in front of it), read by pitstop's cached loader through s3fs and by MosaicML streaming
(``StreamingDataset`` over MDS shards of the same samples, with its own local cache and default settings),
with the same workers, batch size, decode function and step cost; epochs 1 (cold) and 2.  They need
``mosaicml-streaming`` (not a pitstop dependency: it pins numpy < 2.2 and pulls transformers; install it
beside, e.g. ``pip install --no-deps --target DIR mosaicml-streaming xxhash zstd python-snappy cramjam brotli
catalogue`` plus transformers, and put DIR on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from common import ROOT, compose, ensure_data

STREAMING_HINT = (
    "pip install mosaicml-streaming (beside pitstop, see this file's docstring) and moto[server], "
    "s3fs (pip install -e '.[dev]')"
)


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


def run(loader, epochs: int, step_s: float, setup_s: float = 0.0) -> list[dict]:
    time.sleep(setup_s)  # (a job builds its model and restores between building the loader and its first batch)
    it = iter(loader)
    spe = loader.steps_per_epoch()
    out = []
    for _ in range(epochs):
        before = dict(loader.stats)
        wait, n, t0 = 0.0, 0, time.perf_counter()
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
            f"  -> decode {'OK' if d >= 0.75 else 'MISSED'} (target >= 0.75x)"
        )
    print()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--mbps", type=float, default=10.0, help="MB/s per connection of the emulated store")
    ap.add_argument("--link-mbps", type=float, default=0.0, help="MB/s of all connections together (0: no cap)")
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
        help="seconds from building a loader to its first batch (a job's model build, dynamo import and restore; "
        "~1.7 s in the default job here), not timed; the cached loader fetches each reader's first shards then",
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
    print(
        f"data: {len(shards)} train shards, {sum(s['samples'] for s in shards)} samples, {total_mb:.0f} MB "
        f"of 224x224 JPEG; store: latency {a.latency_ms:g} ms, {a.mbps:g} MB/s per connection, "
        f"link {f'{a.link_mbps:g} MB/s' if a.link_mbps else 'uncapped'}; "
        f"2 workers/rank, batch {a.batch}, {os.cpu_count()} CPUs"
    )
    if total_mb < 200:
        print(f"warning: only {total_mb:.0f} MB; pass a larger --samples")
    ensure_data(["data=digits"])
    print_decode_path(
        [
            decode_path("digits 8x8 PNG", str(data_dir / "digits"), ["data=digits"]),
            decode_path("synthetic 224x224 JPEG", local, ["data=synthetic", "data.image_size=224"], repeats=2),
        ]
    )
    if a.decode_only:
        return

    # Calibrate the step: decode throughput from local disk with no step at all.
    decode = run(make_loader("plain", local, a.batch), 1, 0.0)[0]
    step_s = a.step_factor * a.batch / decode["samples_s"]
    print(f"local decode-bound: {decode['samples_s']:.0f} samples/s -> fixed step cost {step_s * 1000:.0f} ms/batch\n")

    if a.peer != "off":
        missing = _peer_missing()
        if missing:
            print(f"peer rows skipped: {missing} not installed ({STREAMING_HINT})\n")
        else:
            peer(a, local, name, step_s)
    if a.peer == "only":
        return
    rows = []
    cache = tempfile.mkdtemp(prefix="pitstop-bench-cache-")
    try:
        with SlowStore(str(data_dir), latency_ms=a.latency_ms, mbps=a.mbps, link_mbps=a.link_mbps or None) as srv:
            remote = f"{srv.url}/{name}"
            setup = a.setup_s
            ceiling = run(make_loader("plain", local, a.batch), 2, step_s, setup)
            rows += [("local disk (ceiling)", i + 1, r) for i, r in enumerate(ceiling)]
            plain = run(make_loader("plain", remote, a.batch), 2, step_s, setup)
            rows += [("plain, remote", i + 1, r) for i, r in enumerate(plain)]
            fixed = run(make_loader("cached", remote, a.batch, cache, "loader.prefetch_shards=2"), 1, step_s, setup)
            rows += [("cached, prefetch 2", 1, fixed[0])]
            shutil.rmtree(cache, ignore_errors=True)
            single = run(make_loader("cached", remote, a.batch, cache, "loader.download_parts=1"), 1, step_s, setup)
            rows += [("cached, 1 request/shard", 1, single[0])]
            shutil.rmtree(cache, ignore_errors=True)
            cold = run(make_loader("cached", remote, a.batch, cache, warm=False), 1, step_s, setup)
            rows += [("cached, no first shards", 1, cold[0])]
            shutil.rmtree(cache, ignore_errors=True)
            cached = run(make_loader("cached", remote, a.batch, cache), 2, step_s, setup)
            rows += [("cached (auto), remote", i + 1, r) for i, r in enumerate(cached)]
    finally:
        shutil.rmtree(cache, ignore_errors=True)

    ref = max(r["samples_s"] for r in ceiling)
    print(
        f"{'pipeline':23} {'epoch':>5} {'samples/s':>10} {'x ceiling':>9} {'data-wait':>9} {'MB from source':>14} "
        f"{'hits/misses':>11}"
    )
    for label, e, r in rows:
        print(
            f"{label:23} {e:>5} {r['samples_s']:>10.0f} {r['samples_s'] / ref:>9.2f} {r['wait'] * 100:>8.1f}% "
            f"{r['mb_source']:>14.0f} {str(r['hits']) + '/' + str(r['misses']):>11}"
        )
    print()
    c2, c1, p1 = cached[1], cached[0], plain[0]
    print(
        f"cached epoch 2 / ceiling: {c2['samples_s'] / ref:.2f} (target >= 0.9), data-wait {c2['wait'] * 100:.1f}% "
        f"(target <= 5%)  -> {'OK' if c2['samples_s'] / ref >= 0.9 and c2['wait'] <= 0.05 else 'MISSED'}"
    )
    print(
        f"cached epoch 1 / plain epoch 1: {c1['samples_s'] / p1['samples_s']:.2f} (target: clearly > 1)  -> "
        f"{'OK' if c1['samples_s'] > 1.2 * p1['samples_s'] else 'MISSED'}"
    )
    print(
        f"cold epoch (empty cache) / ceiling: auto {c1['samples_s'] / ref:.2f}, prefetch 2 "
        f"{fixed[0]['samples_s'] / ref:.2f}, 1 request per shard {single[0]['samples_s'] / ref:.2f}, without the "
        f"first shards fetched during the {a.setup_s:g} s set-up {cold[0]['samples_s'] / ref:.2f} (target >= 0.95 "
        f"where the store's bandwidth allows)  -> {'OK' if c1['samples_s'] / ref >= 0.95 else 'MISSED'}"
    )


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


def _epochs(loader, epochs: int, step_s: float, store, steps: int | None = None) -> list[dict]:
    """``epochs`` passes over ``loader``: samples/s, data-wait, MB through the store.  ``steps``: batches per
    epoch of an endless iterator (pitstop's), else one ``iter()`` per epoch, to its end (a DataLoader's)."""
    out = []
    endless = iter(loader) if steps else None
    for _ in range(epochs):
        before = sum(p["bytes"] for p in store.stats()["paths"].values())
        wait, n, t0 = 0.0, 0, time.perf_counter()
        it = endless or iter(loader)
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


def peer(a, local: str, name: str, step_s: float) -> None:
    """pitstop cached vs MosaicML streaming, same images, same throttled S3 API, same workers/batch/decode/step."""
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
        rows = []
        with SlowStore("", latency_ms=a.latency_ms, mbps=a.mbps, upstream=moto, link_mbps=a.link_mbps or None) as store:
            cfg = compose(
                [
                    "loader=cached",
                    "data=synthetic",
                    f"data.root=s3://bench/{name}",
                    f"loader.cache_dir={os.path.join(work, 'pitstop-cache')}",
                    f"+loader.storage_options.client_kwargs.endpoint_url={store.url}",
                ]
            )
            data = build_dataset(cfg.data)
            loader = build(cfg.loader, dataset=data, split="train", train=True, batch_size=a.batch, seed=0)
            rows += [
                ("pitstop cached (s3)", i + 1, r)
                for i, r in enumerate(_epochs(loader, 2, step_s, store, loader.steps_per_epoch()))
            ]
            del loader
            os.environ["S3_ENDPOINT_URL"] = store.url
            ds = _streaming_dataset(
                data,
                remote="s3://bench/mds",
                local=os.path.join(work, "streaming-cache"),
                batch_size=a.batch,
                shuffle=True,
                shuffle_seed=0,
            )
            dl = DataLoader(ds, batch_size=a.batch, num_workers=2, persistent_workers=True)
            rows += [("mosaicml streaming (s3)", i + 1, r) for i, r in enumerate(_epochs(dl, 2, step_s, store))]
            del dl
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'pipeline':26} {'epoch':>5} {'samples':>7} {'samples/s':>10} {'data-wait':>9} {'MB through store':>16}")
    for label, e, r in rows:
        print(f"{label:26} {e:>5} {r['n']:>7} {r['samples_s']:>10.0f} {r['wait'] * 100:>8.1f}% {r['mb_source']:>16.0f}")
    ours, theirs = (
        [r for lbl, _, r in rows if lbl.startswith("pitstop")],
        [r for lbl, _, r in rows if lbl.startswith("mosaic")],
    )
    for e in (0, 1):
        ratio = ours[e]["samples_s"] / theirs[e]["samples_s"]
        print(
            f"epoch {e + 1}: pitstop cached / streaming = {ratio:.2f} (target >= 1)  -> "
            f"{'OK' if ratio >= 1 else 'MISSED'}"
        )
    print()


if __name__ == "__main__":
    main()
