"""``loader=plain``: every shard is read from its source (path or URL) each time it is needed, no cache."""

from __future__ import annotations

from pitstop.data.remote import FetchPolicy, ShardRef, fetch_bytes
from pitstop.loader.base import ShardLoader, ShardSource


class DirectSource(ShardSource):
    """Fetch (with retries and a size check against the index) straight into memory."""

    def __init__(self, policy: FetchPolicy):
        self.policy = policy
        self.stats = {"bytes_from_source": 0, "fetch_retries": 0}

    def read(self, ref: ShardRef) -> bytes:
        data, transferred = fetch_bytes(ref, self.policy, on_retry=lambda _: self._count("fetch_retries"))
        self._count("bytes_from_source", transferred)
        return data

    def _count(self, k: str, n: int = 1) -> None:
        self.stats[k] += n

    def take_stats(self) -> dict[str, int]:
        out, self.stats = self.stats, {k: 0 for k in self.stats}
        return out


class PlainLoader(ShardLoader):
    kind = "plain"

    def source(self) -> ShardSource:
        return DirectSource(self.policy)
