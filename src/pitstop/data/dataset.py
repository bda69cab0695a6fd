"""The contract between the framework and a recipe's data: shards + a per-sample decoder."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from pitstop.data.shards import ShardIndex


class ShardedDataset:
    """A data set stored as shards under ``root`` (a local dir or a URL).

    Subclasses (in recipes) implement :meth:`decode`; the framework plans, reads and batches.
    ``decode`` runs in DataLoader workers, so a subclass must be picklable.
    """

    prepare_hint = "python -m recipe.prepare"
    storage_options: dict = {}  # fsspec options to reach a remote root: set by the loader (loader.storage_options)

    def __init__(self, root: str, skip_corrupt: bool = False, record_sample_ids: bool = False):
        self.root = str(root)
        self.skip_corrupt = bool(skip_corrupt)
        self.record_sample_ids = bool(record_sample_ids)

    @cached_property
    def index(self) -> ShardIndex:
        return ShardIndex.load(self.root, self.prepare_hint, self.storage_options)

    def decode(self, sample: dict, *, train: bool, seed: int) -> tuple:
        """Turn one raw sample (``{"__key__", ext: bytes}``) into tensors; ``seed`` drives augmentation."""
        raise NotImplementedError

    def on_device(self, batch: Any) -> Any:
        """Finish a batch after it reached the device (e.g. uint8 -> normalised float): cheap there, and
        the worker -> trainer -> device transfers carry the compact form. Default: unchanged."""
        return batch

    def fingerprint(self) -> dict:
        """What must not change across a resume."""
        return {"data": self.index.fingerprint()}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("index", None)  # workers reload nothing: they get shard URLs directly
        return state
