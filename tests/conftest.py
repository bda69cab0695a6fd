"""Shared fixtures: compose the real conf/ with Hydra's compose API, shrink it, train for real."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import warm
from pitstop.config import compose

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several test processes share the cores (make test): one intra-op thread each, as a ddp job's ranks have, instead
    # of each fighting over every core. Set before torch is imported here or in any process started from here.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")
PY = sys.executable


def compose_cfg(overrides: list[str], root: Path, config_name: str = "train"):
    """Compose conf/<config_name>.yaml with overrides; data/outputs under ``root``."""
    return compose(CONF, overrides, str(root), config_name)


def ft_strategy(**keys):
    """A ``strategy=ft`` replica group as ``strategy=ft`` composes it (the schema: the one home of defaults), ``keys``
    changed."""
    from omegaconf import OmegaConf

    from pitstop.config.build import build

    cfg = compose_cfg(["strategy=ft"], Path.cwd())
    for key, value in keys.items():
        OmegaConf.update(cfg, f"strategy.{key}", value)
    return build(cfg.strategy)


@pytest.fixture(scope="session")
def data_root(tmp_path_factory) -> Path:
    """A project-like dir whose data/digits holds the real digits shards (prepared once)."""
    from recipe.prepare import prepare

    root = tmp_path_factory.mktemp("proj")
    cfg = compose_cfg([], root, config_name="prepare")
    prepare(cfg.data)
    return root


def tiny_cfg(data_root: Path, tmp: Path, *overrides: str, debug: str | None = "tiny"):
    """compose(overrides) with debug=tiny, the shared digits shards, outputs and run dir under ``tmp`` (what
    ``make_cfg`` gives a test; a module-scoped fixture calls this with its own dir)."""
    ov = [f"paths.data_dir={data_root / 'data'}", f"paths.output_dir={tmp / 'outputs'}", f"run_dir={tmp / 'run'}"]
    if debug:
        ov.append(f"debug={debug}")
    return compose_cfg([*ov, *overrides], tmp)


@pytest.fixture
def make_cfg(data_root, tmp_path):
    """compose(overrides) -> cfg with debug=tiny, the shared digits shards and a fresh run dir."""

    def make(*overrides: str, debug: str | None = "tiny"):
        return tiny_cfg(data_root, tmp_path, *overrides, debug=debug)

    return make


@pytest.fixture
def store(data_root):
    """A real HTTP store (pitstop.testing.slowstore) serving the digits shards: 5 ms latency, 50 Mbit/s."""
    from pitstop.testing.slowstore import SlowStore

    with SlowStore(str(data_root / "data"), latency_ms=5, mbps=50) as s:
        yield s


def shard_refs(data_root, url: str) -> list:
    """The digits training shards as ``ShardRef`` s at ``url``/digits (their sizes and digests from index.json)."""
    from pitstop.data.remote import ShardRef

    index = json.loads((data_root / "data" / "digits" / "index.json").read_text())
    return [
        ShardRef(f"{url}/digits/{s['url']}", s["bytes"], s["sha256"], s["samples"]) for s in index["splits"]["train"]
    ]


def shard_requests(srv) -> dict[str, int]:
    """path -> how many requests the store served for each .tar shard."""
    return {p: v["requests"] for p, v in srv.stats()["paths"].items() if p.endswith(".tar")}


def cached_tars(cache: Path) -> list[Path]:
    """The shards kept in a cache dir (not its hidden bookkeeping)."""
    return sorted(p for p in cache.iterdir() if not p.name.startswith("."))


def config_options(group: str) -> list[str]:
    """The options of a config group: the YAML files in conf/<group>/."""
    return sorted(p.stem for p in Path(CONF, group).glob("*.yaml"))


def check_run(cfg, summary: dict) -> None:
    """A finished run of ``cfg``: every step logged with a finite loss, a digest, an evaluation, the wall clock."""
    assert summary["final_step"] == cfg.trainer.max_steps
    lines = [r for r in read_jsonl(os.path.join(cfg.run_dir, "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in lines] == list(range(1, cfg.trainer.max_steps + 1))
    assert all(math.isfinite(r["loss"]) and r["fetch_seconds"] >= 0 and r["lr"] > 0 for r in lines)
    assert len(summary["params_sha256"]) == 64
    assert_accuracy_counts(summary["metrics"])
    assert set(summary["wall_clock"]) >= {"compute", "data_wait", "checkpoint", "other", "total"}


def assert_accuracy_counts(metrics: dict) -> None:
    """``val_accuracy`` is what it says: the correct predictions over every sample evaluated (``val_samples``),
    a whole number of them, top-1 never above top-5 (an average of per-batch ratios, a NaN, a metric summed over
    ranks but divided by one rank's samples would not be)."""
    n, acc = metrics["val_samples"], metrics["val_accuracy"]
    correct = acc * n
    assert n >= 1 and n == int(n) and abs(correct - round(correct)) < 1e-6 * n, metrics
    assert 0 <= round(correct) <= n and acc <= metrics.get("val_top5", 1.0), metrics


def train(cfg) -> dict:
    from pitstop.train.runner import Runner

    return Runner(cfg, cfg.run_dir).run()


def refused(cfg) -> str:
    """The one-line ConfigError that training ``cfg`` is refused with."""
    from pitstop.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        train(cfg)
    message = str(e.value)
    assert "\n" not in message, message
    return message


def assert_resumed(got, newest, before, backend: str) -> None:
    """The resume took ``newest``, the last save before the kill; with an async backend also ``before`` (the one
    earlier): that save may still be staging or writing when a kill comes a few steps later on a loaded
    machine, and it never counts then. The bitwise checks after the resume are the same either way."""
    allowed = (newest, before) if backend.startswith("async") else (newest,)
    assert got in allowed, f"resumed from {got}, expected one of {allowed} ({backend})"


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def step_losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "loss" in r]


def final_losses(run_dir) -> dict[int, float]:
    """step -> loss, the last time each step was computed (steps redone after a crash overwrite)."""
    out: dict[int, float] = {}
    for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")):
        if "loss" in r:
            out[r["step"]] = r["loss"]
    return out


from manual import manual_pages, readme_commands  # noqa: E402,F401  (the manual's pages and commands)


def image_tree(root: Path, classes=("cat", "dog", "eel"), per_class: int = 12) -> Path:
    """An ImageFolder tree ``root/<class>/<i>.{png,jpg}`` of small random images (PNG and JPEG alternating)."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            buf = io.BytesIO()
            fmt, ext = ("JPEG", "jpg") if i % 2 else ("PNG", "png")
            Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(buf, format=fmt)
            (root / c / f"{i}.{ext}").write_bytes(buf.getvalue())
    return root


def cli_cmd(args: list[str], data_root, tmp_path, module: str = "recipe.train") -> list[str]:
    flags = [a for a in args if a.startswith("-")]
    args = [a for a in args if not a.startswith("-")]
    return [
        PY,
        "-m",
        module,
        *flags,
        f"paths.data_dir={data_root / 'data'}",
        f"paths.output_dir={tmp_path / 'outputs'}",
        *args,
    ]


# Every command runs cold (a fresh interpreter) with PITSTOP_TESTS_COLD=1; by default warm (see tests/warm.py).
COLD = bool(os.environ.get("PITSTOP_TESTS_COLD"))
_server: warm.Server | None = None


def warm_server() -> warm.Server:
    """The session's warm server: started on first use, stopped when the session ends."""
    global _server
    if _server is None:
        import tempfile

        _server = warm.Server(Path(tempfile.mkdtemp(prefix="pitstop-warm-")))
    return _server


def pytest_sessionfinish(session, exitstatus):
    if _server is not None:
        _server.close()


def run_cmd(cmd: list[str], timeout: float = 240, env: dict | None = None, cold: bool = False):
    """``subprocess.run(cmd, capture_output=True, text=True)`` from the repo root: a warm process unless ``cold``
    (a fresh interpreter: for what a warm one cannot show, its imports and program start)."""
    if cold or COLD:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return warm.run(warm_server(), cmd, ROOT, env, timeout)


def popen_cmd(cmd: list[str], cold: bool = False, **kwargs):
    """``subprocess.Popen(cmd, text=True, **kwargs)`` from the repo root, warm unless ``cold``."""
    if cold or COLD:
        return subprocess.Popen(cmd, cwd=ROOT, text=True, **kwargs)
    return warm.popen(warm_server(), cmd, ROOT, **kwargs)


def cli(
    args: list[str],
    data_root,
    tmp_path,
    module: str = "recipe.train",
    timeout: int = 240,
    env: dict | None = None,
    cold: bool = False,
):
    """Run an entry point in its own process (data from the shared digits shards, outputs under tmp_path)."""
    return run_cmd(cli_cmd(args, data_root, tmp_path, module), timeout, env, cold)


def flatten(obj, tensor=lambda t: t, prefix: str = "") -> dict:
    """A nested state dict as {"/a/b/0": leaf}, each tensor leaf passed through ``tensor``."""
    import torch

    out: dict = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, tensor, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flatten(v, tensor, f"{prefix}/{i}"))
    else:
        out[prefix] = tensor(obj) if isinstance(obj, torch.Tensor) else obj
    return out
