"""Indexing existing webdataset shards (recipe.prepare data=webdataset) against the source's bandwidth.

    python bench/index.py [--mbps 20] [--workers 4]

The synthetic 224px JPEG shards (written once by recipe.prepare) are served by pitstop.testing.slowstore at --mbps
MB/s per connection with 20 ms latency per request; pitstop.data.indexer streams every shard once, --workers
at a time (hashing, counting samples and checking each image and label as they go by). The source's
bandwidth for that many concurrent readers is workers x mbps; the ratio is achieved / that.
Target (issue 13): >= 0.8x.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from common import ROOT, ensure_data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mbps", type=float, default=20.0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=2048)
    a = ap.parse_args()

    from pitstop.data.indexer import index_existing
    from pitstop.testing.slowstore import SlowStore
    from recipe.vision import ImageShards

    name = f"synthetic-224px-{a.samples}"
    ensure_data(["data=synthetic", f"data.num_samples={a.samples}", "data.image_size=224"])
    shards = json.loads((ROOT / "data" / name / "index.json").read_text())["splits"]["train"]
    total = sum(s["bytes"] for s in shards)
    check = ImageShards(root="unused", num_classes=10).check
    with SlowStore(str(ROOT / "data"), latency_ms=20, mbps=a.mbps) as srv, tempfile.TemporaryDirectory() as out:
        urls = [f"{srv.url}/{name}/{s['url']}" for s in shards]
        t0 = time.perf_counter()
        index_existing(out, {"train": urls}, {"name": name}, check=check, workers=a.workers)
        took = time.perf_counter() - t0
        got = json.loads(open(f"{out}/index.json").read())["splits"]["train"]
    assert [(g["samples"], g["sha256"]) for g in got] == [(s["samples"], s["sha256"]) for s in shards]
    ceiling = min(a.workers, len(shards)) * a.mbps
    rate = total / 1e6 / took
    print(
        f"{len(shards)} shards, {total / 1e6:.0f} MB; store {a.mbps:g} MB/s per connection, {a.workers} at a time "
        f"-> source bandwidth {ceiling:.0f} MB/s"
    )
    print(
        f"indexed in {took:.2f} s: {rate:.1f} MB/s = {rate / ceiling:.2f}x the source's bandwidth (target >= 0.8) "
        f"-> {'OK' if rate / ceiling >= 0.8 else 'MISSED'} (sample counts and sha256 equal recipe.prepare's)"
    )


if __name__ == "__main__":
    main()
