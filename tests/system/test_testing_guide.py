"""The testing guide's command to run one test file prints what the guide shows (its excerpt, tests/manual.py): a
pytest in a subprocess, in the checkout."""

from __future__ import annotations

import subprocess
import sys

import pytest

from manual import ROOT, assert_shows, page_output


@pytest.mark.slow  # (a pytest in a subprocess: seconds)
def test_running_one_test_file_prints_what_the_testing_guide_shows():
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/unit/test_schedule.py", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:]
    assert_shows(page_output("python -m pytest tests/unit/test_schedule.py"), p.stdout + p.stderr, "one test file")
