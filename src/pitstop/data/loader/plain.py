"""``loader=plain``: every shard is read from its source (path or URL) each time it is needed, no cache."""

from __future__ import annotations

from pitstop.data.remote import Counters, FetchPolicy, ShardRef, fetch_counted
from pitstop.data.loader.base import ShardLoader, ShardSource


class DirectSource(ShardSource):
    """Fetch (with retries and a size check against the index) straight into memory."""

    def __init__(self, policy: FetchPolicy):
        self.policy = policy
        self.counters = Counters("bytes_from_source", "fetch_retries")

    def read(self, ref: ShardRef) -> bytes:
        return fetch_counted(ref, self.policy, self.counters)

    def take_stats(self) -> dict[str, int]:
        return self.counters.take()


class PlainLoader(ShardLoader):
    kind = "plain"

    def source(self) -> ShardSource:
        return DirectSource(self.policy)
