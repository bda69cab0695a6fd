"""Secrets never reach the disk: a credential planted by each route a config value can take (a YAML preset on the
search path, an override, an environment interpolation, Hydra's own ``env_set``, a URL's userinfo in ``data.root``,
``ckpt.dir`` and ``logger.tracking_uri``, a sweep over a preset or a value; and issue 46's: a list item and a dict's
value under a credential-named key, an ``Authorization`` header in storage options, ``${oc.create:...}``, a token in
a URL's query, a preset chosen through ``hydra.sweeper.params``) stops ``python -m recipe.train`` in one line naming
the key, with exit status 2, before Hydra writes anything: the secret is in no file under the outputs dir, the run
dir or the MLflow store. (Real Hydra, real commands; the check itself is ``pitstop.config.secrets``, whose every
route is ``unit/test_secrets_meaning.py``'s: here only what Hydra's parsing, composing and sweeping add.)
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
# (a sweep that chooses the preset above through hydra.sweeper.params: the command line names no leaking option)
SWEEP = """# @package _global_
hydra:
  sweeper:
    params:
      +svc: leak
      seed: 1,2
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
    "sweeper params preset": (["-m", "experiment=sweep"], "ckpt.storage_options.secret"),
    "list item": ([f"+svc.api_keys=[{SECRET}]"], "svc.api_keys"),
    "dict value": ([f"+svc.credentials={{user: u, pass: {SECRET}}}"], "svc.credentials"),
    "storage header": (
        [f"+ckpt.storage_options.client_kwargs={{headers: {{Authorization: 'Bearer {SECRET}'}}}}"],
        "ckpt.storage_options.client_kwargs.headers.Authorization",
    ),
    "oc.create": (["+svc.opts='${oc.create:{user: u, token: ${oc.env:PITSTOP_TEST_SECRET}}}'"], "svc.opts"),
    "url query token": ([f"data.root='https://data.example/digits?access_token={SECRET}'"], "data.root"),
}


@pytest.mark.slow
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_planted_secret_stops_the_command_before_anything_is_written(route, data_root, tmp_path):
    search = tmp_path / "conf" / "experiment"
    search.mkdir(parents=True)
    (search / "leak.yaml").write_text(PRESET)
    (search / "sweep.yaml").write_text(SWEEP)
    (tmp_path / "conf" / "svc").mkdir()
    (tmp_path / "conf" / "svc" / "leak.yaml").write_text(PRESET)
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
    assert sorted(leaked) == [search / "leak.yaml", tmp_path / "conf" / "svc" / "leak.yaml"]  # the user's presets
