"""User callbacks as docs/guides/outputs.md shows them: the page's ``my_callbacks.py``, written into a user's folder
as the page says, and the page's command run there in its own process (``python -m`` puts that folder on the path).
The callback sees the run through its read-only view: each new best evaluation is logged as the page's excerpt shows,
and at the end it writes the best one, which must be the best of the evaluations the run itself recorded."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess

import pytest

from conftest import PY, ROOT
from manual import FENCE, assert_shows, page_output, page_outputs

pytestmark = pytest.mark.slow

PAGE = ROOT / "docs" / "guides" / "outputs.md"
KEY = "my_callbacks.BestAccuracy"


def test_the_pages_callback_runs_as_written(data_root, tmp_path):
    code = next(body for info, body in FENCE.findall(PAGE.read_text()) if 'title="my_callbacks.py"' in info)
    command = next(cmd for page, cmd, _ in page_outputs([PAGE]) if cmd and KEY in cmd)
    user = tmp_path / "user"
    user.mkdir()
    (user / "my_callbacks.py").write_text(code)
    (user / "data").symlink_to(data_root / "data")  # (the digits shards, as recipe.prepare leaves them)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RANK", None)
    argv = [PY, *shlex.split(command)[1:]]
    proc = subprocess.run(argv, cwd=user, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert_shows(page_output("my_callbacks.BestAccuracy"), output, command)
    # what it wrote: the best of the evaluations the run recorded, and their step
    (run_dir,) = (user / "outputs" / "runs").iterdir()
    evals = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if "val_accuracy" in ln]
    best = max(evals, key=lambda e: e["val_accuracy"])
    wrote = json.loads((run_dir / "best.json").read_text())
    assert wrote == {"val_accuracy": best["val_accuracy"], "step": best["step"]}
    logged = re.findall(r"new best val_accuracy=([\d.]+) at step (\d+)", output)
    assert logged and logged[-1] == (f"{best['val_accuracy']:.4f}", str(best["step"]))
