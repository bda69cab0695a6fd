"""Webdataset tar shards with a JSON index (``index.json``) describing every shard.

A shard is a plain tar file in webdataset layout: each sample is a group of members ``KEY.EXT``
(e.g. ``000123.png`` and ``000123.cls``).  The index lists, per split, each shard's relative URL,
sample count, byte size and sha256, so loaders can plan an epoch (and skip consumed samples) without
opening a shard, and caches can verify what they downloaded.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from dataclasses import asdict, dataclass
from typing import Iterable

from pitstop import fsurl
from pitstop.errors import DataError
from pitstop.telemetry.metrics import write_json_atomic

INDEX_NAME = "index.json"
FORMAT = "pitstop-shards/1"


@dataclass(frozen=True)
class ShardInfo:
    url: str  # relative to the index location, or absolute (path or URL)
    samples: int
    bytes: int
    sha256: str


@dataclass
class ShardIndex:
    root: str  # where the index lives (a local dir or a URL prefix)
    splits: dict[str, list[ShardInfo]]
    meta: dict

    @staticmethod
    def load(
        root: str, prepare_hint: str = "python -m recipe.prepare", storage_options: dict | None = None
    ) -> "ShardIndex":
        """Read ``root/index.json`` from a local dir or any fsspec/HTTP URL (``storage_options``: fsspec's)."""
        import fsspec

        root = str(root).rstrip("/")
        path = f"{root}/{INDEX_NAME}"
        local = "://" not in root
        if local and not os.path.isfile(path):
            what = "data dir" if not os.path.isdir(root) else "shard index"
            raise DataError(
                f"{what} not found: {path if what != 'data dir' else root} — create it with: {prepare_hint}"
            )
        try:
            if path.startswith(("http://", "https://")):
                from pitstop.data.remote import FetchPolicy, ShardRef, fetch_bytes

                raw = json.loads(fetch_bytes(ShardRef(path, 0, "", 0), FetchPolicy(retries=3, timeout=30))[0])
            else:
                with fsspec.open(path, "rb", **(storage_options or {})) as f:
                    raw = json.loads(f.read())
        except DataError as e:
            raise DataError(f"{e} — is data.root right?") from e
        except Exception as e:  # noqa: BLE001 - any transport or JSON error, with what to do about it
            raise DataError(f"cannot read shard index {path}: {e} — {_what_to_do(e, path, prepare_hint)}") from e
        if raw.get("format") != FORMAT:
            raise DataError(
                f"{path} is not a pitstop shard index (format={raw.get('format')!r}); recreate it with: {prepare_hint}"
            )
        splits = {name: [ShardInfo(**s) for s in shards] for name, shards in raw["splits"].items()}
        return ShardIndex(root=root, splits=splits, meta=raw.get("meta", {}))

    def shards(self, split: str) -> list[ShardInfo]:
        if split not in self.splits:
            raise DataError(f"split {split!r} not in {self.root}/{INDEX_NAME} (has: {', '.join(self.splits)})")
        return self.splits[split]

    def resolve(self, shard: ShardInfo) -> str:
        if "://" in shard.url or os.path.isabs(shard.url) or shard.url.startswith("pipe:"):
            return shard.url
        return f"{self.root}/{shard.url}"

    def num_samples(self, split: str) -> int:
        return sum(s.samples for s in self.shards(split))

    def fingerprint(self) -> str:
        """Identifies the data set's content (shard hashes), independent of where it is stored."""
        h = hashlib.sha256()
        for name in sorted(self.splits):
            for s in self.splits[name]:
                h.update(f"{name}:{os.path.basename(s.url)}:{s.samples}:{s.sha256}\n".encode())
        return h.hexdigest()[:16]


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_split(
    out_dir: str, split: str, samples: Iterable[dict[str, bytes | str]], samples_per_shard: int
) -> list[ShardInfo]:
    """Write ``samples`` (dicts with ``__key__`` and ``ext -> bytes``) into tar shards.

    Each shard is written under a temporary name, fsynced and renamed, so a crash never leaves a
    shard that looks complete.  Uses webdataset's ``TarWriter`` for the tar layout.
    """
    import webdataset as wds

    os.makedirs(out_dir, exist_ok=True)
    infos: list[ShardInfo] = []
    writer = None
    count = 0

    def close() -> None:
        nonlocal writer
        if writer is None:
            return
        writer.close()
        name = f"{split}-{len(infos):06d}.tar"
        tmp, final = os.path.join(out_dir, name + ".tmp"), os.path.join(out_dir, name)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        infos.append(ShardInfo(url=name, samples=count, bytes=os.path.getsize(final), sha256=_sha256_file(final)))
        writer = None

    for sample in samples:
        if writer is None:
            name = f"{split}-{len(infos):06d}.tar.tmp"
            writer = wds.TarWriter(os.path.join(out_dir, name))
            count = 0
        writer.write(sample)
        count += 1
        if count == samples_per_shard:
            close()
    close()
    return infos


def _what_to_do(e: Exception, path: str, prepare_hint: str) -> str:
    """The hint for an index that could not be read: credentials, a wrong root, or a bad file."""
    text = f"{type(e).__name__} {e}".lower()
    if fsurl.is_permission_error(e):
        return fsurl.credentials_hint(path)
    if isinstance(e, FileNotFoundError) or "does not exist" in text or "not found" in text:
        return f"is data.root right? (an index is made with: {prepare_hint})"
    return f"recreate it with: {prepare_hint}"


def write_index(out_dir: str, splits: dict[str, list[ShardInfo]], meta: dict) -> str:
    raw = {"format": FORMAT, "meta": meta, "splits": {k: [asdict(s) for s in v] for k, v in splits.items()}}
    path = os.path.join(out_dir, INDEX_NAME)
    write_json_atomic(path, raw, indent=1, sort_keys=False)
    return path


def split_key(name: str) -> tuple[str, str]:
    """webdataset convention: the key is the member path up to the first dot of its basename."""
    dirname, base = os.path.split(name)
    stem, _, ext = base.partition(".")
    return (f"{dirname}/{stem}" if dirname else stem), ext


def read_shard(data: bytes, url: str) -> list[dict]:
    """Parse a whole shard held in memory into samples ``{"__key__", "__offset__", ext: bytes}``.

    Raises :class:`DataError` naming the shard and byte offset if the tar is truncated or corrupt.
    """
    samples: list[dict] = []
    by_key: dict[str, dict] = {}
    offset = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for member in tar:
                offset = member.offset
                if not member.isfile():
                    continue
                key, ext = split_key(member.name)
                f = tar.extractfile(member)
                payload = f.read() if f is not None else b""
                if len(payload) != member.size:
                    raise tarfile.ReadError(f"member {member.name} truncated")
                sample = by_key.get(key)
                if sample is None:
                    sample = by_key[key] = {"__key__": key, "__offset__": member.offset}
                    samples.append(sample)
                sample[ext] = payload
    except (tarfile.TarError, EOFError, OSError) as e:
        raise DataError(f"corrupt or truncated shard {url} near byte offset {offset}: {e}") from e
    return samples
