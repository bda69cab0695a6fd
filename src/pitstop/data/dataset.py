"""The contract between the framework and a recipe's data: shards + a per-sample decoder."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from pitstop.data.shards import ShardIndex


class ShardedDataset:
    """A data set stored as shards under ``root`` (a local dir or a URL).

    Subclasses (in recipes) implement :meth:`decode` (and may implement :meth:`collate`); the framework plans,
    reads and batches. Both run in DataLoader workers, so a subclass must be picklable.
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
        """Turn one raw sample (``{"__key__", ext: bytes}``) into arrays or tensors; ``seed`` (a 63-bit hash of
        run seed, epoch and the sample's key) drives augmentation, so a sample's augmentation does not depend on
        which worker reads it or when."""
        raise NotImplementedError

    def collate(self, items: list) -> Any:
        """A batch from decoded samples. Default: torch's ``default_collate``; a subclass that knows its
        samples' layout can stack them once (no per-sample tensors)."""
        from torch.utils.data import default_collate

        return default_collate(items)

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
