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

from manual import assert_shows, page_output
from conftest import PY, ROOT, cli

pytestmark = pytest.mark.slow

PAGE = ROOT / "docs" / "own-task.md"


def page_blocks() -> dict[str, str]:
    """The page's code: ``writer`` (the shard-writing snippet), ``module`` (``tabular.py``), each YAML file by the
    path its caption names (```myconf/data/rows.yaml```:), and ``commands`` (the bash block)."""
    import re

    text = PAGE.read_text()
    python = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    out = {"writer": python[0], "module": python[1], "commands": re.findall(r"```bash\n(.*?)```", text, flags=re.S)[0]}
    for path, body in re.findall(r"`(myconf/[\w/.]+\.yaml)`:\s*```yaml\n(.*?)```", text, flags=re.S):
        out[path] = body
    return out


def _user_dir(tmp_path: Path) -> Path:
    """A user's folder as the page leaves it: ``tabular.py`` and ``myconf/{data,model}/*.yaml``, from the page."""
    blocks, user = page_blocks(), tmp_path / "user"
    for path in ("myconf/data/rows.yaml", "myconf/model/mlp.yaml"):
        (user / path).parent.mkdir(parents=True, exist_ok=True)
        (user / path).write_text(blocks[path])
    (user / "tabular.py").write_text(blocks["module"])
    return user


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


def test_the_pages_own_steps_run_as_written_and_train_a_regression(tmp_path):
    # docs/own-task.md, as a reader follows it: its shard writer, its tabular.py and YAML files, then its two commands
    # (its bash block, run by bash in the user's folder with this Python's environment first on PATH)
    import subprocess

    user, blocks = _user_dir(tmp_path), page_blocks()  # (no shards/ made here: the page's writer makes it)
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(PY), os.environ["PATH"]])}
    env.pop("PYTHONPATH", None)  # (the page exports its own)
    wrote = subprocess.run([PY, "-c", blocks["writer"]], cwd=user, env=env, capture_output=True, text=True, timeout=120)
    assert wrote.returncode == 0, wrote.stderr[-2000:]
    commands = blocks["commands"].replace("cd path/to/pitstop", f"cd {ROOT}")
    assert commands != blocks["commands"]  # (the page says where the checkout goes: this test puts this one there)
    ran = subprocess.run(["bash", "-ec", commands], cwd=user, env=env, capture_output=True, text=True, timeout=400)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert_shows(page_output("model=mlp task=regression"), f"{ran.stdout}\n{ran.stderr}", "own-task's train command")
    index = json.loads((user / "rows" / "index.json").read_text())
    assert [sum(s["samples"] for s in index["splits"][k]) for k in ("train", "val")] == [512, 128]
    [summary] = list(user.glob("outputs/runs/**/summary.json"))
    s = json.loads(summary.read_text())
    assert s["final_step"] == 120 and "val_accuracy" not in s["metrics"]
    # it learned: the target is the sum of 4 standard normals, whose mean absolute deviation is about 1.6
    assert s["metrics"]["val_mae"] < 0.5, s["metrics"]


def test_a_sample_the_data_class_cannot_decode_is_refused_by_prepare_naming_shard_and_sample(data_root, tmp_path):
    # the page's data class and YAML, from a user's own folder (PYTHONPATH and hydra.searchpath); a shard with a row of
    # 3 features, not 4: prepare names the shard and the sample, in one line, with no traceback
    user = _user_dir(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user), os.environ.get("PYTHONPATH", "")])}
    common = [f"hydra.searchpath=[file://{user / 'myconf'}]", "data=rows"]
    bad = tmp_path / "bad"
    bad.mkdir()
    write_shards(bad, "train", 2, 16, seed=2, bad=True)
    refused = cli(
        [*common, f"data.root={tmp_path / 'bad-rows'}", f"data.train='{bad}/train-{{000000..000001}}.tar'"],
        data_root, tmp_path, module="recipe.prepare", env=env,
    )  # fmt: skip
    last = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 2 and "train-000001.tar" in last and "'train1-0007'" in last, refused.stderr[-2000:]
    assert "3 features, not 4" in last and "Traceback" not in refused.stderr
