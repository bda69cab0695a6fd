"""Every ``python -m recipe.train`` command of the manual (README.md and the guides) composes from the real conf/ and
passes validation, in the fast tier: the system tier runs them for real (tests/system/test_readme.py), except the
few it lists as composed only, which this test still covers."""

from __future__ import annotations

import shlex

import pytest

from conftest import readme_commands, compose_cfg
from pitstop.config import validate


TRAIN = [c for c in readme_commands() if c.startswith("python -m recipe.train")]


def overrides(cmd: str) -> list[str]:
    """The command's overrides as one job: flags and Hydra's own keys dropped, a sweep's first value taken."""
    out = []
    for a in shlex.split(cmd)[3:]:
        if a.startswith("-") or a.startswith("hydra") or "=" not in a:  # (--cfg job: a flag and its value)
            continue
        key, _, value = a.partition("=")
        if "," in value and not value.startswith("["):
            value = value.split(",")[0]
        value = value.replace("HOST0", "127.0.0.1").replace("DIR", "/tmp/images").replace("=K", "=3")
        out.append(f"{key}={'3' if value == 'K' else value}")
    return out


def test_the_readme_has_train_commands():
    assert len(TRAIN) >= 20


@pytest.mark.parametrize("cmd", TRAIN, ids=[c[len("python -m recipe.train") :].strip()[:50] or "-" for c in TRAIN])
def test_every_readme_train_command_composes_and_validates(cmd, tmp_path):
    cfg = compose_cfg([f"paths.data_dir={tmp_path / 'data'}", f"paths.output_dir={tmp_path / 'outputs'}",
                       *overrides(cmd)], tmp_path)  # fmt: skip
    validate(cfg)
