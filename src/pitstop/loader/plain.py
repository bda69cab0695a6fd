"""``loader=plain``: every shard is read from its source (path or fsspec URL) each time it is needed."""

from __future__ import annotations

import fsspec

from pitstop.errors import DataError
from pitstop.loader.base import ShardLoader


def read_url(url: str) -> bytes:
    if url.startswith("pipe:"):
        raise DataError(f"refusing shell-command shard URL {url!r}")
    try:
        with fsspec.open(url, "rb") as f:
            return f.read()
    except FileNotFoundError as e:
        raise DataError(f"shard not found: {url} — re-run recipe.prepare for this data dir") from e
    except OSError as e:
        raise DataError(f"cannot read shard {url}: {e}") from e


class PlainLoader(ShardLoader):
    kind = "plain"

    def open_shard(self, url: str) -> bytes:
        return read_url(url)
