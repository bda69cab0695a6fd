"""Write a data set as webdataset shards + index.json under ``data.root``.

python -m recipe.prepare                                   # UCI digits (the default data)
python -m recipe.prepare data=imagefolder data.source=DIR  # your ImageFolder tree DIR/<class>/<img>
python -m recipe.prepare data=synthetic data.num_samples=4096 data.image_size=224
"""

from __future__ import annotations

import io
import logging
import os
import sys
from typing import Iterator

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf
from PIL import Image

from pitstop.data.shards import INDEX_NAME, write_index, write_split
from pitstop import cli, fsurl
from pitstop.errors import PitstopError

log = logging.getLogger("recipe.prepare")


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _split(n: int, labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A stratified, seeded train/val split of indices."""
    rng = np.random.default_rng(seed)
    train, val = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = int(round(len(idx) * val_fraction))
        val.extend(idx[:k]), train.extend(idx[k:])
    return rng.permutation(np.array(train)), np.sort(np.array(val))


def _samples(indices: np.ndarray, encode) -> Iterator[dict]:
    for i in indices:
        ext, payload, label = encode(int(i))
        yield {"__key__": f"{int(i):07d}", ext: payload, "cls": str(label).encode()}


def digits(cfg: DictConfig) -> tuple[dict, dict]:
    from sklearn.datasets import load_digits

    d = load_digits()
    images = (d.images * (255.0 / 16.0)).round().clip(0, 255).astype(np.uint8)  # 8x8, values 0..16
    train, val = _split(len(images), d.target, cfg.prepare.val_fraction, cfg.prepare.seed)
    encode = lambda i: ("png", _png(images[i]), int(d.target[i]))  # noqa: E731
    meta = {
        "name": "digits",
        "source": "sklearn.datasets.load_digits (UCI ML handwritten digits)",
        "num_classes": 10,
        "classes": [str(c) for c in range(10)],
    }
    return {"train": _samples(train, encode), "val": _samples(val, encode)}, meta


def imagefolder(cfg: DictConfig) -> tuple[dict, dict]:
    src = cfg.source
    if not os.path.isdir(src):
        raise PitstopError(
            f"data.source {src} is not a directory; point it at an ImageFolder tree SOURCE/<class>/<image>"
        )
    classes = sorted(e.name for e in os.scandir(src) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise PitstopError(f"data.source {src} has no class sub-directories (expected SOURCE/<class>/<image>)")
    files, labels = [], []
    for c, name in enumerate(classes):
        for f in sorted(os.listdir(os.path.join(src, name))):
            ext = f.rsplit(".", 1)[-1].lower()
            if ext in ("png", "jpg", "jpeg", "webp", "bmp", "ppm"):
                files.append((os.path.join(src, name, f), "jpg" if ext == "jpeg" else ext)), labels.append(c)
    labels = np.array(labels)
    train, val = _split(len(files), labels, cfg.prepare.val_fraction, cfg.prepare.seed)

    def encode(i: int):
        path, ext = files[i]
        with open(path, "rb") as f:
            return ext, f.read(), int(labels[i])

    meta = {"name": "imagefolder", "source": os.path.abspath(src), "num_classes": len(classes), "classes": classes}
    return {"train": _samples(train, encode), "val": _samples(val, encode)}, meta


def synthetic(cfg: DictConfig) -> tuple[dict, dict]:
    """Seeded random JPEGs with a class-dependent colour tint (learnable, and realistic to decode)."""
    n, size, classes = int(cfg.num_samples), int(cfg.image_size), int(cfg.num_classes)
    labels = np.arange(n) % classes
    tints = np.random.default_rng(cfg.prepare.seed).integers(0, 256, size=(classes, 3))

    def encode(i: int):
        rng = np.random.default_rng([cfg.prepare.seed, i])
        noise = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
        img = ((noise.astype(np.uint16) + tints[labels[i]]) // 2).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=int(cfg.prepare.quality))
        return "jpg", buf.getvalue(), int(labels[i])

    train, val = _split(n, labels, cfg.prepare.val_fraction, cfg.prepare.seed)
    meta = {"name": "synthetic", "num_classes": classes, "image_size": size}
    return {"train": _samples(train, encode), "val": _samples(val, encode)}, meta


BUILDERS = {"digits": digits, "imagefolder": imagefolder, "synthetic": synthetic}


def webdataset(data: DictConfig, storage_options: dict | None = None) -> str:
    """Index shards that already exist (``data.train``/``data.val``: brace patterns or lists, local or URLs)
    into ``data.root/index.json``, checking every sample on the way (the data class's ``check``)."""
    from pitstop.data.dataset import build_dataset
    from pitstop.data.indexer import expand, index_existing
    from pitstop.data.remote import FetchPolicy

    root = str(data.root)
    splits = {}
    for split in ("train", "val"):
        if data.get(split):
            urls = expand(
                OmegaConf.to_object(data[split]) if OmegaConf.is_list(data[split]) else str(data[split]),
                f"data.{split}",
            )
            splits[split] = [u if "://" in u else os.path.abspath(u) for u in urls]
    if "train" not in splits:
        raise PitstopError(
            "data.train is not set: give the training shards, e.g. data.train='DIR/train-{000000..000099}.tar'"
        )
    dataset = build_dataset(data)
    meta = {"name": str(data.get("name") or os.path.basename(root.rstrip("/"))), "source": "existing webdataset shards"}
    if data.get("num_classes") is not None:  # (a classification set's; a regression has none)
        meta["num_classes"] = int(data.num_classes)
    return index_existing(
        root,
        splits,
        meta,
        check=dataset.check,
        workers=int(data.prepare.workers),
        policy=FetchPolicy(storage_options=storage_options or {}),
    )


def prepare(data: DictConfig, force: bool = False, storage_options: dict | None = None) -> str:
    """Build the shards of ``data`` (a ``data`` config node) unless they already exist; return the index path."""
    root = str(data.root)
    existing = data.prepare.kind == "webdataset"  # (shards that exist: indexed, not written)
    if "://" in root:
        raise PitstopError(
            f"data.root {root} is remote: the index is written locally (a read-only source is "
            f"fine); point data.root at a local dir, then copy index.json next to the shards if you like"
            if existing
            else f"data.root {root} is remote; prepare locally, then upload the directory"
        )
    index = os.path.join(root, INDEX_NAME)
    if os.path.isfile(index) and not force:
        log.info("%s already exist: %s (force=true rebuilds)", "index" if existing else "shards", index)
        return index
    if existing:
        path = webdataset(data, storage_options)
        log.info("wrote %s", path)
        return path
    kind = data.prepare.kind
    if kind not in BUILDERS:
        raise PitstopError(f"data.prepare.kind={kind!r} is unknown; use one of {sorted(BUILDERS)}")
    splits, meta = BUILDERS[kind](data)
    per_shard = int(data.prepare.samples_per_shard)
    infos = {name: write_split(root, name, samples, per_shard) for name, samples in splits.items()}
    path = write_index(root, infos, meta)
    log.info(
        "wrote %s: %s",
        path,
        ", ".join(f"{k}: {sum(s.samples for s in v)} samples in {len(v)} shards" for k, v in infos.items()),
    )
    return path


@hydra.main(config_path="../conf", config_name="prepare", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        prepare(
            cfg.data,
            force=bool(cfg.force),
            storage_options=fsurl.storage_options(cfg.get("storage_options"), "storage_options"),
        )
    except PitstopError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    cli.run(main)
