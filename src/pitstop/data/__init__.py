"""Sharded sample storage: webdataset tar shards plus a small JSON index."""

from pitstop.data.shards import ShardIndex, ShardInfo, read_shard, write_split

__all__ = ["ShardIndex", "ShardInfo", "read_shard", "write_split"]
