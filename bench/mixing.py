"""Batch mixing on class-sorted shards: loader.shuffle_shards_window=1 vs K, side by side in one run.

    python bench/mixing.py [--windows 1 4 8] [--train]

The digits training set rewritten by webdataset's own ShardWriter sorted by class (160 samples per shard, as data
sets written one class at a time are), indexed by recipe.prepare data=webdataset. Per window: the mean number of
distinct classes (and shards) per batch of 32 over one epoch, and the epoch's read time (1 rank, 2 workers).
--train also trains the CNN for 4 epochs on each and prints the validation accuracy. Figures: bench/results/mixing.json
(with --train; mixing_read.json without). What it leaves out: one data set and one seed (the accuracies are one run
each), one rank.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, compose, ensure_data, save_result

# What bench/results/mixing.json's figures are, and the code they measure (read by the docs' results page,
# bench/figures.py, without running this script). windows.K: loader.shuffle_shards_window=K.
FIGURES = {
    "batch": ("", "samples per batch", None),
    "epochs_trained": ("", "epochs the CNN was trained for each window (--train)", None),
    "windows.*.classes_per_batch": ("", "distinct classes per batch, mean over an epoch (of 10)", None),
    "windows.*.shards_per_batch": ("", "distinct shards per batch, mean over an epoch", None),
    "windows.*.epoch_read_s": ("s", "the epoch's read time (1 rank, 2 workers)", None),
    "windows.*.val_accuracy": ("%", "validation accuracy after the training (one run each)", None),
}
MEASURES = ["src/pitstop/data/loader/plan.py", "src/pitstop/data/loader/reader.py", "src/pitstop/data/loader/base.py"]


def class_sorted_shards(out: Path) -> None:
    import webdataset as wds

    from pitstop.data.shards import read_shard

    index = json.loads((ROOT / "data" / "digits" / "index.json").read_text())
    for split, per in (("train", 160), ("val", 200)):
        samples = [
            smp
            for s in index["splits"][split]
            for smp in read_shard((ROOT / "data" / "digits" / s["url"]).read_bytes(), s["url"])
        ]
        samples.sort(key=lambda smp: (int(smp["cls"]), smp["__key__"]))
        with wds.ShardWriter(str(out / f"{split}-%04d.tar"), maxcount=per, verbose=0) as w:
            for i, smp in enumerate(samples):
                w.write({"__key__": f"s{i:05d}", "png": smp["png"], "cls": int(smp["cls"])})


def data_args(shards: Path, root: Path) -> list[str]:
    return [
        "data=webdataset",
        f"data.train='{shards}/train-{{0000..0008}}.tar'",
        f"data.val='{shards}/val-{{0000..0001}}.tar'",
        "data.num_classes=10",
        "data.channels=1",
        "data.image_size=8",
        "data.augment.pad=1",
        "data.augment.hflip=false",
        "data.mean=[0.5]",
        "data.std=[0.5]",
        f"data.root={root}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--train", action="store_true")
    a = ap.parse_args()
    from pitstop.config.build import build
    from pitstop.data.dataset import build_dataset
    from recipe.prepare import prepare

    ensure_data()
    with tempfile.TemporaryDirectory() as tmp:
        shards, root = Path(tmp) / "shards", Path(tmp) / "index"
        shards.mkdir()
        class_sorted_shards(shards)
        prepare(compose(data_args(shards, root), config_name="prepare").data)
        print(f"{'window':>6} {'classes/batch':>13} {'shards/batch':>12} {'epoch read s':>12} {'val accuracy':>12}")
        figures: dict = {"batch": 32, "epochs_trained": 4 if a.train else 0, "windows": {}}
        for k in a.windows:
            cfg = compose([*data_args(shards, root), f"loader.shuffle_shards_window={k}"])
            data = build_dataset(cfg.data)
            loader = build(cfg.loader, dataset=data, split="train", train=True, batch_size=32, seed=0)
            keys: list[list[str]] = []
            loader.sample_log = keys.append
            it, labels = iter(loader), []
            t0 = time.perf_counter()
            for _ in range(loader.steps_per_epoch()):
                labels.append(next(it)[1].tolist())
            took = time.perf_counter() - t0
            it.close()
            classes = sum(len(set(b)) for b in labels) / len(labels)
            per_shard = 160
            shards_per = sum(len({int(k[1:]) // per_shard for k in b}) for b in keys) / len(keys)
            acc = "-"
            row = {"classes_per_batch": classes, "shards_per_batch": shards_per, "epoch_read_s": took}
            figures["windows"][str(k)] = row
            if a.train:
                run = Path(tmp) / f"run{k}"
                p = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "recipe.train",
                        *data_args(shards, root),
                        "model=cnn",
                        "trainer.epochs=4",
                        "trainer.batch_size=32",
                        "logger=none",
                        "ckpt=none",
                        f"loader.shuffle_shards_window={k}",
                        f"run_dir={run}",
                    ],
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                )
                assert p.returncode == 0, p.stderr[-2000:]
                row["val_accuracy"] = json.loads((run / "summary.json").read_text())["metrics"]["val_accuracy"]
                acc = f"{row['val_accuracy']:.3f}"
            print(f"{k:>6} {classes:>13.2f} {shards_per:>12.2f} {took:>12.2f} {acc:>12}")
        save_result("mixing" if a.train else "mixing_read", figures)


if __name__ == "__main__":
    main()
