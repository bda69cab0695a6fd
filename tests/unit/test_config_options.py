"""Every config group in conf/ has its documented options, each a commented YAML file (the files only; nothing is
composed). Each option trains in tests/integration/test_config_groups.py.
"""

from __future__ import annotations

from pathlib import Path


from conftest import CONF, config_options


def test_every_group_has_its_documented_options():
    assert config_options("data") == ["digits", "imagefolder", "synthetic", "webdataset"]
    assert config_options("model") == ["cnn", "resnet18", "torchvision"]
    assert config_options("optim") == ["adamw", "sgd"]
    assert {"plain"} <= set(config_options("loader")) and config_options("strategy") == ["ddp", "fsdp", "ft", "single"]
    assert config_options("ckpt") == ["async_dcp", "async_dcp_pinned", "none", "sync_dcp", "sync_save"]
    faults = ["crash_at_step", "during_heal", "during_save", "none", "preempt", "random", "stall"]
    assert config_options("fault") == faults
    assert config_options("logger") == ["mlflow", "none"] and config_options("loader") == ["cached", "plain"]
    for group in ("data", "model", "optim", "loader", "strategy", "ckpt", "fault", "logger", "trainer", "debug"):
        for name in config_options(group):  # small, commented YAML named for its variant
            assert Path(CONF, group, f"{name}.yaml").read_text().lstrip().startswith("#"), (group, name)
    assert Path(CONF, "train.yaml").read_text().startswith("# python -m recipe.train")
