"""The contract between the framework and a recipe's data: shards + a per-sample decoder."""

from __future__ import annotations

import copy
from functools import cached_property
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pitstop.data.shards import ShardIndex
from pitstop.errors import ConfigError, DataError

if TYPE_CHECKING:
    from omegaconf import DictConfig

# Keys of a ``data`` config that say how the shards are made, not how they are read: only ``recipe.prepare`` reads
# them, and the data class is built without them (:func:`build_dataset`).
PREPARE_KEYS = frozenset({"prepare", "train", "val", "source", "num_samples"})


class ShardedDataset:
    """A data set stored as shards under ``root`` (a local dir or a URL).

    A subclass (in a recipe, or a user's module) must implement :meth:`decode`, and may implement :meth:`collate`,
    :meth:`on_device`, :meth:`check` and :meth:`fingerprint`; the framework plans, reads and batches. Its
    constructor takes the keys of its ``data`` YAML except :data:`PREPARE_KEYS`: its own, and the common ones of
    :meth:`__init__`. ``decode`` and ``collate`` run in
    DataLoader workers, so a subclass must be picklable.
    """

    prepare_hint = "python -m recipe.prepare"
    storage_options: dict = {}  # fsspec options to reach a remote root (loader.storage_options): see reaching()

    def __init__(self, root: str, name: str = "", skip_corrupt: bool = False, record_sample_ids: bool = False):
        """The keys every data set has: where its shards' index is (``root``), its name (run names use it), and two
        reading options. A subclass takes its own keys and hands these on: ``__init__(self, mine, **common)``."""
        self.root, self.name = str(root), str(name)
        self.skip_corrupt = bool(skip_corrupt)
        self.record_sample_ids = bool(record_sample_ids)

    def reaching(self, options: Mapping[str, Any]) -> ShardedDataset:
        """This data set read with the fsspec ``options`` (``loader.storage_options``: an S3 API's endpoint, say):
        itself where they are its own, else a copy that reads its index with them (this object is left as it is)."""
        if not options or dict(options) == self.storage_options:
            return self
        other = copy.copy(self)
        other.__dict__.pop("index", None)  # (not read yet with these options: it may be remote too)
        other.storage_options = dict(options)
        return other

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

    def check(self, url: str, key: str, sample: dict) -> None:
        """While ``recipe.prepare`` indexes shards that exist (``prepare.kind: webdataset``): raise ``DataError``
        naming the shard and the sample if this sample cannot be trained on. Default: it must decode."""
        try:
            self.decode(sample, train=False, seed=0)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - any decoding failure is this sample's fault, named in one line
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise DataError(f"shard {url}, sample {key!r}: {type(e).__name__}: {first}") from None

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


def build_dataset(node: DictConfig | Mapping[str, Any]) -> ShardedDataset:
    """The data class of a ``data`` config node, built from its keys except :data:`PREPARE_KEYS`."""
    from omegaconf import DictConfig, OmegaConf

    from pitstop.config.build import build

    spec = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    target = spec.get("_target_")
    data = build({k: v for k, v in spec.items() if k not in PREPARE_KEYS}, _convert_="partial")
    if not isinstance(data, ShardedDataset):
        raise ConfigError(
            f"data._target_={target} is a {type(data).__name__}, not a pitstop.data.dataset.ShardedDataset: "
            f"subclass it (docs/own-task.md)"
        )
    return data
