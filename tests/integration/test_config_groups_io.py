"""One test per option of the data and experiment config groups (the other groups are in test_config_groups.py; two
modules, so that the two test processes of make test-fast share them; logger=mlflow, whose logger is a process of
its own, is in tests/system/test_mlflow_logger.py): compose the real conf/, shrink with debug=tiny, train."""

from __future__ import annotations

import pytest

from conftest import check_run, config_options, image_tree, train


def test_data_synthetic(make_cfg, tmp_path):
    from recipe.prepare import prepare

    cfg = make_cfg(
        "data=synthetic",
        "data.num_samples=80",
        "data.image_size=32",
        "data.prepare.samples_per_shard=16",
        f"data.root={tmp_path}/synth",
    )
    prepare(cfg.data)
    check_run(cfg, train(cfg))


def test_data_imagefolder(make_cfg, tmp_path):
    from recipe.prepare import prepare

    src = image_tree(tmp_path / "tree")
    cfg = make_cfg(
        "data=imagefolder",
        f"data.source={src}",
        "data.num_classes=3",
        "data.image_size=16",
        "data.prepare.samples_per_shard=8",
        "data.prepare.val_fraction=0.25",
    )
    prepare(cfg.data)
    summary = train(cfg)
    check_run(cfg, summary)
    # 27 train images, batch 16, partial last batch kept: 2 steps/epoch, so 12 steps = 6 full epochs
    assert summary["data"]["samples"] == 6 * 27 and summary["epoch"] == 5


@pytest.mark.parametrize("name", config_options("experiment"))
def test_experiment_presets_compose(make_cfg, name):
    cfg = make_cfg(f"experiment={name}")
    assert cfg.trainer.max_steps == 12  # debug overlay still applies on top of the experiment
    if name == "digits_resnet18":
        cfg = make_cfg(f"experiment={name}", "trainer.max_steps=3")
        check_run(cfg, train(cfg))
