"""Index webdataset shards that already exist (written by ``webdataset.ShardWriter``, tarp, or anything that
writes tars of ``KEY.EXT`` members), wherever they are: a local dir or any URL.

Each shard is streamed once -- its bytes hashed and counted and its members grouped into samples as they go
by, nothing kept in memory -- several shards at a time. Every finished shard is appended to
``index.partial.jsonl`` beside the index (fsynced), so an interrupted run picks up where it stopped; the
index is written last, atomically. Each sample is checked with ``check(shard_url, sample_key, members)``
(e.g. an image and a label in range), so a bad data set fails here, naming the shard and the key, and not
hours into training.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

from pitstop.data.remote import FetchPolicy
from pitstop.data.sources import open_source
from pitstop.data.shards import ShardInfo, split_key, write_index
from pitstop.errors import DataError
from pitstop.fsurl import is_url

log = logging.getLogger("pitstop.data")
PARTIAL = "index.partial.jsonl"
Check = Callable[[str, str, dict[str, bytes]], None]


def expand(pattern: str | Iterable[str], what: str) -> list[str]:
    """A brace pattern (``train-{000000..000146}.tar``, several patterns separated by ``::``) or a list."""
    from braceexpand import braceexpand

    items = [pattern] if isinstance(pattern, str) else list(pattern)
    urls = [u for item in items for part in str(item).split("::") for u in braceexpand(part.strip()) if u]
    if not urls:
        raise DataError(f"{what} names no shards; give a brace pattern like 'dir/train-{{000000..000099}}.tar'")
    if len(set(urls)) != len(urls):
        raise DataError(f"{what} names a shard twice: {next(u for u in urls if urls.count(u) > 1)}")
    return urls


class _Hashing:
    """A read-only stream that hashes and counts what passes through it (for tarfile's streaming mode)."""

    def __init__(self, f):
        self.f, self.sha, self.n = f, hashlib.sha256(), 0

    def read(self, size: int = -1) -> bytes:
        block = self.f.read(size)
        self.sha.update(block)
        self.n += len(block)
        return block

    def drain(self) -> None:  # (tar padding after the last member: part of the file, so of its hash)
        while self.read(1 << 20):
            pass


def index_shard(url: str, check: Check | None, policy: FetchPolicy) -> ShardInfo:
    """Stream one shard: its samples (as :func:`pitstop.data.shards.read_shard` groups them), bytes and sha256."""
    last = ""
    for attempt in range(policy.retries + 1 if is_url(url) else 1):
        try:
            f, done = open_source(url, policy)
        except FileNotFoundError as e:
            raise DataError(f"shard {url} is listed but not found at the source; fix the pattern or the data") from e
        except OSError as e:
            last = f"{type(e).__name__}: {e}"
            time.sleep(policy.backoff * 2**attempt)
            continue
        stream, keys, offset = _Hashing(f), set(), 0
        sample: dict[str, bytes] = {}
        key = None
        try:
            try:
                with tarfile.open(fileobj=stream, mode="r|") as tar:
                    for member in tar:
                        offset = member.offset
                        if not member.isfile():
                            continue
                        k, ext = split_key(member.name)
                        if k != key:
                            if key is not None and check is not None:
                                check(url, key, sample)
                            key, sample = k, {}
                            keys.add(k)  # (a key seen before is merged by read_shard: counted once, like it)
                        payload = tar.extractfile(member)
                        sample[ext] = payload.read() if payload is not None else b""
                if key is not None and check is not None:
                    check(url, key, sample)
                stream.drain()
            finally:
                f.close()
            done()
        except (tarfile.TarError, EOFError) as e:
            raise DataError(
                f"shard {url} is not a readable tar near byte offset {offset}: {e}; rewrite it or drop "
                f"it from the pattern"
            ) from e
        except OSError as e:
            last = f"{type(e).__name__}: {e}"
            time.sleep(policy.backoff * 2**attempt)
            continue
        return ShardInfo(url=url, samples=len(keys), bytes=stream.n, sha256=stream.sha.hexdigest())
    raise DataError(f"cannot read shard {url}: {last} (loader.retries={policy.retries})")


def index_existing(
    out_dir: str,
    splits: dict[str, list[str]],
    meta: dict,
    check: Check | None = None,
    workers: int = 8,
    policy: FetchPolicy = FetchPolicy(),
) -> str:
    """Index ``splits`` (split -> shard URLs) into ``out_dir/index.json``; resumes from ``index.partial.jsonl``."""
    os.makedirs(out_dir, exist_ok=True)
    partial = os.path.join(out_dir, PARTIAL)
    done: dict[str, ShardInfo] = {}
    if os.path.exists(partial):
        with open(partial) as f:
            for line in f:
                try:
                    done[json.loads(line)["url"]] = ShardInfo(**json.loads(line))
                except (ValueError, KeyError, TypeError):
                    continue  # (a line cut short by a kill: that shard is indexed again)
        log.info("resuming: %d shard(s) already indexed in %s", len(done), partial)
    todo = [u for urls in splits.values() for u in urls if u not in done]
    t0, total = time.perf_counter(), 0
    with (
        open(partial, "a") as out,
        ThreadPoolExecutor(max(1, int(workers)), thread_name_prefix="pitstop-index") as pool,
    ):
        for info in pool.map(lambda u: index_shard(u, check, policy), todo):
            out.write(json.dumps(info.__dict__) + "\n")
            out.flush()
            os.fsync(out.fileno())
            done[info.url] = info
            total += info.bytes
    took = time.perf_counter() - t0
    if todo:
        log.info(
            "indexed %d shard(s), %.1f MB in %.1f s (%.1f MB/s)",
            len(todo),
            total / 1e6,
            took,
            total / 1e6 / max(took, 1e-9),
        )
    path = write_index(out_dir, {s: [done[u] for u in urls] for s, urls in splits.items()}, meta)
    os.unlink(partial)
    return path
