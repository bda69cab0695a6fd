"""The data class contract (``pitstop.data.dataset``): a data class gets its own keys only, what it must implement is
``decode``, and the default ``check`` of the prepare step names the shard and the sample it cannot decode."""

from __future__ import annotations

import pytest

from pitstop.data.dataset import PREPARE_KEYS, ShardedDataset, build_dataset
from pitstop.errors import ConfigError, DataError


class Numbers(ShardedDataset):
    """A data class as a user writes one: its own keys, no others (no ``**kwargs`` to swallow the prepare step's)."""

    def __init__(self, width, **common):
        super().__init__(**common)
        self.width = int(width)

    def decode(self, sample, *, train, seed):
        values = [float(v) for v in sample["txt"].decode().split(",")]
        if len(values) != self.width:
            raise ValueError(f"{len(values)} values, not {self.width}")
        return values


def test_the_prepare_steps_keys_never_reach_the_data_class():
    own = {"_target_": f"{__name__}.Numbers", "root": "/data/n", "name": "n", "width": 3}
    prep = {"train": "a-{0..3}.tar", "val": None, "prepare": {"kind": "webdataset"}, "source": "/x", "num_samples": 9}
    spec = {**own, **prep}
    assert set(spec) - {"_target_", "root", "name", "width"} == PREPARE_KEYS
    data = build_dataset(spec)
    assert isinstance(data, Numbers) and (data.root, data.name, data.width) == ("/data/n", "n", 3)


def test_a_target_that_is_no_data_class_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^data._target_=collections.OrderedDict is a OrderedDict, not a pitstop"):
        build_dataset({"_target_": "collections.OrderedDict", "root": "/x"})


def test_the_default_check_decodes_and_names_the_shard_and_the_sample():
    data = Numbers(3, root="/data/n")
    data.check("s3://b/train-000001.tar", "k7", {"__key__": "k7", "txt": b"1,2,3"})  # decodes: no error
    with pytest.raises(DataError) as e:
        data.check("s3://b/train-000001.tar", "k8", {"__key__": "k8", "txt": b"1,2"})
    assert str(e.value) == "shard s3://b/train-000001.tar, sample 'k8': ValueError: 2 values, not 3"
    with pytest.raises(DataError, match=r"sample 'k9': KeyError: 'txt'"):
        data.check("s3://b/train-000001.tar", "k9", {"__key__": "k9", "cls": b"1"})


def test_reaching_a_data_set_with_storage_options_copies_it_and_leaves_the_callers_as_it_was():
    # (the loaders and the loop read the data set reached with loader.storage_options: its index comes from the
    # endpoint they name; a loader built on the caller's object no longer changes it behind the caller's back)
    data = Numbers(3, root="s3://bucket/n")
    data.__dict__["index"] = "read without options"  # (as cached_property keeps it)
    options = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}
    reached = data.reaching(options)
    assert reached is not data and reached.storage_options == options and "index" not in reached.__dict__
    assert data.storage_options == {} and data.__dict__["index"] == "read without options"
    assert reached.reaching(dict(options)) is reached and data.reaching({}) is data  # (nothing to change: itself)
    assert (reached.root, reached.width) == (data.root, data.width)
