"""bench/device_check.sh's verdicts: each bench row says whether its target was met, read from the part's log (the
figures below are made up, in the formats bench/ckpt.py and bench/overhead.py print)."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def verdict(tmp_path, rc: int, log: str, kind: str) -> str:
    (tmp_path / "log.txt").write_text(log)
    script = f'PY={sys.executable}; source <(sed -n "/^verdict()/,/^}}/p" bench/device_check.sh); verdict "$@"'
    p = subprocess.run(["bash", "-c", script, "-", str(rc), str(tmp_path / "log.txt"), kind], cwd=ROOT,
                       capture_output=True, text=True)  # fmt: skip
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def test_each_target_is_met_or_missed_with_its_figure(tmp_path):
    rows = "async_dcp                    12.0ms    1.80x\nasync_dcp_pinned              8.0ms    1.20x\n"
    assert verdict(tmp_path, 0, rows, "ckpt") == "target met: async_dcp_pinned blocks 1.2x the copy bound (<= 1.5x)"
    slow = "async_dcp                    12.0ms    1.80x\n"
    assert verdict(tmp_path, 0, slow, "ckpt").startswith("target MISSED: async_dcp blocks 1.8x")
    assert verdict(tmp_path, 0, "ratio (steady) = 0.951   (target", "overhead") == "target MISSED: ratio 0.951 (< 0.97)"
    assert verdict(tmp_path, 0, "ratio (steady) = 0.990   (target", "overhead") == "target met: ratio 0.99 (>= 0.97)"


def test_a_failed_part_or_a_log_without_its_figure_is_never_ok(tmp_path):
    assert verdict(tmp_path, 3, "ratio (steady) = 0.990", "overhead") == "FAILED (rc 3)"
    assert verdict(tmp_path, 0, "", "ckpt").startswith("no figure")
    assert verdict(tmp_path, 0, "", "overhead").startswith("no figure")
