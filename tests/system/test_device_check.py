"""bench/device_check.sh, the script a session runs once on a lent GPU: without one it says what it skipped and
passes (a real bash and a cold interpreter, so a system test)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs for real (minutes)")
def test_the_device_check_script_says_what_it_skipped_and_passes_without_a_gpu(tmp_path):
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run(
        ["bash", str(root / "bench" / "device_check.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": str(tmp_path)},
    )
    assert p.returncode == 0, p.stderr
    rows = [ln for ln in p.stdout.splitlines() if ln.startswith("| ") and "skipped" in ln]
    assert len(rows) == 3 and all("no CUDA device here" in r for r in rows)
