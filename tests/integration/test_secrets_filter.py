"""The secrets filter as pure logic: it finds a credential by name or in a URL's userinfo anywhere in a config, finds
nothing in any option pitstop ships (every group's every option composed with Hydra's own settings), and the
tracker's params leave credentials out and mask URL passwords."""

from __future__ import annotations

import os

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pitstop.config import register
from pitstop.config.credentials import mask
from pitstop.config.secrets import find_secrets, redact

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "conf")  # (the integration tier: composes every option)
GROUPS = sorted(g for g in os.listdir(CONF) if os.path.isdir(os.path.join(CONF, g)) and g != "hydra")


def test_a_credential_is_found_by_name_or_in_a_url_and_named_by_its_key():
    cfg = OmegaConf.create(
        {
            "a": {"storage_options": {"key": "AKIA"}, "label_key": "y", "image_keys": ["png"]},
            "b": {"api_key": "x", "tokens_per_step": None, "root": "https://bob:pw@h/x", "plain": "https://bob@h/x"},
            "c": ["s3://u:p@bucket/x"],
            "hydra": {"overrides": {"task": ["b.root=https\\://bob\\:pw@h/x"]}},
        }
    )
    keys = [line.split(":", 1)[0] for line in find_secrets(cfg)]
    assert keys == ["a.storage_options.key", "b.api_key", "b.root", "c.0", "hydra.overrides.task.0"]


@pytest.mark.parametrize("group", GROUPS)
def test_no_option_pitstop_ships_looks_like_a_secret(group):
    register()
    options = sorted(f[: -len(".yaml")] for f in os.listdir(os.path.join(CONF, group)) if f.endswith(".yaml"))
    with initialize_config_dir(os.path.abspath(CONF), version_base="1.3"):
        for option in options:
            cfg = compose("train", overrides=[f"{group}={option}"], return_hydra_config=True)
            assert find_secrets(cfg) == [], f"{group}={option}"


def test_the_prepare_config_looks_like_no_secret():
    register()
    with initialize_config_dir(os.path.abspath(CONF), version_base="1.3"):
        assert find_secrets(compose("prepare", return_hydra_config=True)) == []


def test_the_trackers_params_leave_credentials_out_and_mask_url_passwords():
    flat = {"logger.tracking_uri": "https://bob:pw@mlflow/x", "ckpt.storage_options.secret": "s", "seed": 0}
    assert redact(flat) == {"logger.tracking_uri": "https://bob:***@mlflow/x", "seed": 0}
    assert mask("data.root=s3://u:p@b/x ckpt.dir=/c") == "data.root=s3://u:***@b/x ckpt.dir=/c"
