"""Shard cache eviction with a cache smaller than the data set: loader.cache_policy=future (Belady's MIN: the
shard read furthest ahead goes first) vs lru, side by side in one run.

    python bench/cache_policy.py [--share 0.5] [--epochs 3] [--ranks 2] [--workers 2]

Synthetic 64x64 JPEG shards (64 samples each, written once by recipe.prepare) are served over HTTP by
pitstop.testing.slowstore; ``--ranks`` loaders of this machine (each with ``--workers`` DataLoader workers, stepping in
lockstep like DDP ranks) share one cache dir limited to ``--share`` of the training shards' bytes. Per epoch it
prints the bytes downloaded from the source as a multiple of the data set, and the cache hits and evictions.
Target: with a cache of half the data set, every epoch after the first downloads <= 0.6x the data set with
cache_policy=future (the least possible is 0.5x); LRU's figure beside it. Figures: bench/results/cache_policy.json.
What it leaves out: a real network (the store adds 2 ms per request, no bandwidth cap), several machines, and how
long an epoch takes (only bytes are compared).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

from common import ROOT, compose, ensure_data, save_result

# What bench/results/cache_policy.json's figures are, and the code they measure (read by the docs' results page,
# bench/figures.py, without running this script).
FIGURES = {
    "share": ("%", "the cache's size, as a share of the training shards' bytes", None),
    "epochs": ("", "epochs read per policy", None),
    "ranks": ("", "loaders (ranks) of this machine sharing one cache dir", None),
    "workers": ("", "DataLoader workers per loader", None),
    "future_later_epoch_x": (
        "x",
        "cache_policy=future: bytes from the source in the worst epoch after the first, "
        "over the data set's (0.5 is the least possible with half of it cached)",
        "<= 0.6",
    ),
    "lru_later_epoch_x": ("x", "the same with cache_policy=lru, for comparison", None),
}
MEASURES = ["src/pitstop/data/loader/cache.py", "src/pitstop/data/loader/cached.py", "src/pitstop/data/remote.py"]

SAMPLES = 4160  # (its own data dir: 64 samples per shard)


def loaders(root: str, cache: str, limit: int, policy: str, ranks: int, workers: int, batch: int):
    from pitstop.config.build import build
    from pitstop.data.dataset import build_dataset

    cfg = compose(
        [
            "loader=cached",
            "data=synthetic",
            f"data.root={root}",
            f"loader.cache_dir={cache}",
            f"loader.cache_limit={limit}",
            f"loader.cache_policy={policy}",
            f"loader.num_workers={workers}",
        ]
    )
    data = build_dataset(cfg.data)
    return [
        build(cfg.loader, dataset=data, split="train", train=True, batch_size=batch, seed=0, rank=r, world_size=ranks)
        for r in range(ranks)
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--share", type=float, default=0.5, help="cache_limit as a share of the training shards' bytes")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args()

    from pitstop.testing.slowstore import SlowStore

    name = f"synthetic-64px-{SAMPLES}"
    ensure_data(
        ["data=synthetic", f"data.num_samples={SAMPLES}", "data.image_size=64", "data.prepare.samples_per_shard=64"]
    )
    shards = json.loads((ROOT / "data" / name / "index.json").read_text())["splits"]["train"]
    total = sum(s["bytes"] for s in shards)
    limit = int(a.share * total)
    print(
        f"data: {len(shards)} train shards, {total / 1e6:.1f} MB; cache_limit {limit / 1e6:.1f} MB "
        f"({a.share:g} of it); {a.ranks} rank(s) x {a.workers} worker(s) on this machine, batch {a.batch}"
    )
    results = {}
    with SlowStore(str(ROOT / "data"), latency_ms=2) as srv:
        for policy in ("lru", "future"):
            cache = tempfile.mkdtemp(prefix="pitstop-bench-cache-")
            try:
                ls = loaders(f"{srv.url}/{name}", cache, limit, policy, a.ranks, a.workers, a.batch)
                its = [iter(ld) for ld in ls]
                rows = []
                for _ in range(a.epochs):
                    before = [dict(ld.stats) for ld in ls]
                    for _ in range(ls[0].steps_per_epoch()):
                        for it in its:
                            next(it)
                    delta = {
                        k: sum(ld.stats.get(k, 0) - b.get(k, 0) for ld, b in zip(ls, before))
                        for k in ("bytes_from_source", "cache_hits", "cache_misses", "cache_evictions")
                    }
                    rows.append(delta)
                for it in its:
                    it.close()
                results[policy] = rows
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    print(f"\n{'policy':8} {'epoch':>5} {'x data set from source':>23} {'hits':>6} {'misses':>7} {'evictions':>10}")
    for policy, rows in results.items():
        for e, r in enumerate(rows, 1):
            print(
                f"{policy:8} {e:>5} {r['bytes_from_source'] / total:>23.2f} {r['cache_hits']:>6} "
                f"{r['cache_misses']:>7} {r['cache_evictions']:>10}"
            )
    later = [r["bytes_from_source"] / total for r in results["future"][1:]]
    lru = [r["bytes_from_source"] / total for r in results["lru"][1:]]
    if later:
        print(
            f"\nepochs 2..{a.epochs}, from source per epoch: future {max(later):.2f}x the data set (target <= 0.6), "
            f"lru {max(lru):.2f}x: target {'met' if max(later) <= 0.6 else 'MISSED'}"
        )
        figures = {"share": a.share, "epochs": a.epochs, "ranks": a.ranks, "workers": a.workers}
        figures |= {"future_later_epoch_x": max(later), "lru_later_epoch_x": max(lru)}
        save_result("cache_policy", figures)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
