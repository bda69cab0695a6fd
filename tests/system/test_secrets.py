"""Secrets never reach the disk: a credential planted by each route a config value can take (a YAML preset on the
search path, an override, an environment interpolation, Hydra's own ``env_set``, a URL's userinfo in ``data.root``,
``ckpt.dir`` and ``logger.tracking_uri``, a sweep over a preset or a value) stops ``python -m recipe.train`` in one
line naming the key, with exit status 2, before Hydra writes anything: the secret is in no file under the outputs
dir, the run dir or the MLflow store. (Real Hydra, real commands; the check itself is ``pitstop.config.secrets``.)
"""

from __future__ import annotations

import os

import pytest

from conftest import cli

SECRET = "hunter2-s3cr3t"

PRESET = f"""# @package _global_
ckpt:
  storage_options:
    secret: {SECRET}
"""

ROUTES = {
    "yaml preset": (["experiment=leak"], "ckpt.storage_options.secret"),
    "override": ([f"+logger.api_token={SECRET}"], "logger.api_token"),
    "interpolation": (["+ckpt.storage_options.token=${oc.env:PITSTOP_TEST_SECRET}"], "ckpt.storage_options.token"),
    "hydra env_set": (
        [f"+hydra.job.env_set.AWS_SECRET_ACCESS_KEY={SECRET}"],
        "hydra.job.env_set.AWS_SECRET_ACCESS_KEY",
    ),
    "data.root url": ([f"data.root=https://bob:{SECRET}@data.example/digits"], "data.root"),
    "ckpt.dir url": ([f"ckpt.dir=s3://bob:{SECRET}@bucket/run"], "ckpt.dir"),
    "tracking_uri url": ([f"logger.tracking_uri=https://bob:{SECRET}@mlflow.example"], "logger.tracking_uri"),
    "url by interpolation": (["ckpt.dir=https://bob:${oc.env:PITSTOP_TEST_SECRET}@store.example/run"], "ckpt.dir"),
    "sweep over a preset": (["-m", "experiment=digits_resnet18,leak"], "ckpt.storage_options.secret"),
    "sweep over a value": (["-m", f"data.root=/x,https://bob:{SECRET}@h/d"], "data.root"),
}


@pytest.mark.slow
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_planted_secret_stops_the_command_before_anything_is_written(route, data_root, tmp_path):
    search = tmp_path / "conf" / "experiment"
    search.mkdir(parents=True)
    (search / "leak.yaml").write_text(PRESET)
    store = tmp_path / "mlruns"
    args, key = ROUTES[route]
    base = [
        f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
        f"run_dir={tmp_path / 'outputs' / 'run'}",
        "trainer.max_steps=2",
        "logger=mlflow",
        f"logger.tracking_uri=file://{store}",
    ]
    p = cli([*base, *args], data_root, tmp_path, env={**os.environ, "PITSTOP_TEST_SECRET": SECRET}, cold=True)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stderr[-2000:]
    assert lines[-1].startswith(f"error: {key}: ") and "never go" in lines[-1], lines[-1]
    assert SECRET not in p.stderr and SECRET not in p.stdout
    assert not (tmp_path / "outputs").exists() and not store.exists()
    leaked = [f for f in tmp_path.rglob("*") if f.is_file() and SECRET.encode() in f.read_bytes()]
    assert leaked == [search / "leak.yaml"]  # the user's own preset, nothing pitstop or Hydra wrote
