"""A new task is a data class, a model and two YAML files (docs/own-task.md): a tabular regression, nothing of it an
image, brought as a user would. Its module and YAML live outside pitstop (``PYTHONPATH`` and ``hydra.searchpath``),
its shards are written with ``webdataset.TarWriter``; ``recipe.prepare`` indexes them (the data class's default
``check`` decodes every sample) and ``recipe.train ... task=regression`` trains on them. The data class takes only
its own keys: the prepare step's (``train``, ``val``, ``prepare``) never reach its constructor."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from conftest import cli

pytestmark = pytest.mark.slow

MODULE = '''
import json

import numpy as np
from torch import nn

from pitstop.data.dataset import ShardedDataset


class Rows(ShardedDataset):
    """Rows of numbers: each sample one JSON member, {"x": [features...], "y": target}."""

    def __init__(self, features, **common):  # (common: root, name and the reading options, for the base class)
        super().__init__(**common)
        self.features = int(features)

    def decode(self, sample, *, train, seed):
        row = json.loads(sample["json"])
        x = np.asarray(row["x"], dtype=np.float32)
        if x.shape != (self.features,):
            raise ValueError(f"{x.size} features, not {self.features}")
        return x, np.float32(row["y"])


class MLP(nn.Sequential):
    def __init__(self, features, hidden=32):
        super().__init__(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 1), nn.Flatten(0))
'''

DATA_YAML = """_target_: tabular.Rows
name: rows
root: ???                 # where recipe.prepare writes index.json
features: 4
train: null               # the shards, for recipe.prepare: a brace pattern
val: null
prepare:
  kind: webdataset        # shards that exist: indexed, each sample checked
  workers: 2
"""

MODEL_YAML = """_target_: tabular.MLP
features: ${data.features}
hidden: 32
"""

WEIGHTS = np.array([0.5, -1.0, 0.25, 2.0], dtype=np.float32)


def write_shards(folder: Path, split: str, shards: int, rows: int, seed: int, bad: bool = False) -> np.ndarray:
    """``shards`` tar shards of ``rows`` rows each, y = x . WEIGHTS + 0.1 noise; returns the targets."""
    import webdataset as wds

    rng, ys = np.random.default_rng(seed), []
    for s in range(shards):
        with wds.TarWriter(str(folder / f"{split}-{s:06d}.tar")) as sink:
            for i in range(rows):
                x = rng.normal(size=4).astype(np.float32)
                y = float(x @ WEIGHTS + 0.1 * rng.normal())
                ys.append(y)
                row = {"x": (x[:3] if bad and s == 1 and i == 7 else x).tolist(), "y": y}
                sink.write({"__key__": f"{split}{s}-{i:04d}", "json": json.dumps(row).encode()})
    return np.array(ys)


def test_a_tabular_regression_from_a_users_own_module_and_yaml_trains_through_recipe_train(data_root, tmp_path):
    user = tmp_path / "user"
    (user / "conf" / "data").mkdir(parents=True)
    (user / "conf" / "model").mkdir()
    (user / "tabular.py").write_text(MODULE)
    (user / "conf" / "data" / "rows.yaml").write_text(DATA_YAML)
    (user / "conf" / "model" / "mlp.yaml").write_text(MODEL_YAML)
    shards = tmp_path / "shards"
    shards.mkdir()
    write_shards(shards, "train", 4, 128, seed=0)
    val_y = write_shards(shards, "val", 1, 128, seed=1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user), os.environ.get("PYTHONPATH", "")])}
    common = [f"hydra.searchpath=[file://{user / 'conf'}]", "data=rows", f"data.root={tmp_path / 'rows'}"]

    prepared = cli(
        [*common, f"data.train='{shards}/train-{{000000..000003}}.tar'", f"data.val={shards}/val-000000.tar"],
        data_root, tmp_path, module="recipe.prepare", env=env,
    )  # fmt: skip
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    index = json.loads((tmp_path / "rows" / "index.json").read_text())
    assert [sum(s["samples"] for s in index["splits"][k]) for k in ("train", "val")] == [512, 128]

    run_dir = tmp_path / "run"
    trained = cli(
        [*common, "model=mlp", "task=regression", "trainer.max_steps=120", "trainer.batch_size=32",
         "trainer.eval_every_steps=60", "logger=none", f"run_dir={run_dir}"],
        data_root, tmp_path, env=env,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["final_step"] == 120 and "val_accuracy" not in s["metrics"]
    # it learned: well under the error of always answering the mean target (about 1.9 here)
    baseline = float(np.abs(val_y - val_y.mean()).mean())
    assert s["metrics"]["val_mae"] < 0.3 * baseline, (s["metrics"], baseline)

    # a sample the data class cannot decode (3 features, not 4): prepare names the shard and the sample
    bad = tmp_path / "bad"
    bad.mkdir()
    write_shards(bad, "train", 2, 16, seed=2, bad=True)
    refused = cli(
        [*common[:2], f"data.root={tmp_path / 'bad-rows'}", f"data.train='{bad}/train-{{000000..000001}}.tar'"],
        data_root, tmp_path, module="recipe.prepare", env=env,
    )  # fmt: skip
    last = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 2 and "train-000001.tar" in last and "'train1-0007'" in last, refused.stderr[-2000:]
    assert "3 features, not 4" in last and "Traceback" not in refused.stderr
