"""The docs site shows a benchmark's figure only from its result file (docs/hooks.py): formatted, linked to the
file's row, and a figure no file backs fails the build."""

from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import ROOT


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_figure_comes_from_its_result_file_or_the_build_fails(tmp_path):
    hooks = _hooks()
    (tmp_path / "bench" / "results").mkdir(parents=True)
    doc = {"name": "overhead", "command": "python bench/overhead.py", "commit": "abc1234", "date": "2026-12-04",
           "machine": {"cores": 2, "cpu": "x", "gpu": None, "torch": "2.14.1"},
           "figures": {"main": {"ratio_steady": 0.98765}, "ratio": [1.5, 2.25]}}  # fmt: skip
    (tmp_path / "bench" / "results" / "overhead.json").write_text(json.dumps(doc))
    root = str(tmp_path)
    shown = hooks.FIGURE.sub(
        lambda m: hooks.figure(root, "guides", *m.groups()), "ratio {{ fig overhead main.ratio_steady .3f }}"
    )
    assert shown == "ratio 0.988<sup>[overhead](../reference/benchmarks.md#overhead)</sup>"
    assert hooks.figure(root, "", "overhead", "ratio.1", ".1f").startswith("2.2<sup>")  # (a list's item, by index)
    with pytest.raises(KeyError, match="has no figure 'ratio.2'"):
        hooks.figure(root, "", "overhead", "ratio.2", None)
    with pytest.raises(KeyError, match="has no figure 'main.nope'"):
        hooks.figure(root, "guides", "overhead", "main.nope", None)
    with pytest.raises(FileNotFoundError, match="run its benchmark"):
        hooks.figure(root, "guides", "ckpt", "x", None)
    page = hooks.benchmarks(root)
    assert "`python bench/overhead.py` at commit `abc1234` on 2026-12-04: 2 cores (x), no GPU" in page
    # (no script here to say what the figures are, nor any git history: said, not failed)
    assert '| <code class="key">main.<wbr>ratio_steady</code> | 0.9877 | *not described* | *no target* |  |' in page
    assert "Freshness unknown" in page and "Its script (bench/overhead.py) is not in this checkout" in page


def test_no_page_prints_a_measured_ratio_by_hand():
    # (a benchmark's ratio typed into a page, "1.71x", goes stale as the code changes: each comes through {{ fig }},
    # from its result file; a target is written with its comparison, ">= 0.95x", and is no measured figure)
    import re

    bare = re.compile(r"(?<![\w.])\d+\.\d+x\b")
    found = []
    for page in [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        text = re.sub(r"\{\{.*?\}\}", "FIG", text)
        for m in bare.finditer(text):
            if not re.search(r"(>=|<=|[<>≤≥])\s*$", text[max(0, m.start() - 4) : m.start()]):
                found.append(f"{page.relative_to(ROOT)}: {m.group()}")
    assert not found, found
