"""The results page's logic (bench/figures.py): a figure's target met or missed, the declarations a benchmark script
makes of its figures (read without running it), and what counts as a change of the code a result measures. Every
committed result file's figures are described by its script."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from conftest import ROOT


def _figures():
    spec = importlib.util.spec_from_file_location("bench_figures", ROOT / "bench" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_figures"] = module
    spec.loader.exec_module(module)
    return module


bf = _figures()


def test_a_target_is_met_or_missed_against_a_number_another_figure_or_a_multiple_of_one():
    figures = {"goodput": {"ft": 0.66, "ddp": 0.5}, "rate": {"ft": 16.3, "ddp": 17.6}, "text": "x"}
    assert bf.verdict(0.55, "<= 0.6", figures) == "met"
    assert bf.verdict(0.61, "<= 0.6", figures) == "missed"
    assert bf.verdict(0.6, "< 0.6", figures) == "missed"  # (the bound itself: strict)
    assert bf.verdict(0.66, ">= goodput.ddp + 0.15", figures) == "met"
    assert bf.verdict(0.64, ">= goodput.ddp + 0.15", figures) == "missed"
    assert bf.verdict(16.3, ">= 0.9 * rate.ddp", figures) == "met"  # (16.3 >= 15.84)
    assert bf.verdict(15.0, ">= 0.9 * rate.ddp", figures) == "missed"
    assert bf.verdict(-1.5, ">= -2", figures) == "met"
    assert bf.verdict(0, "== 0", figures) == "met" and bf.verdict(1, "== 0", figures) == "missed"
    assert bf.verdict(True, "== true", figures) == "met" and bf.verdict(False, "== true", figures) == "missed"
    assert bf.verdict([1.9, 1.07], ">= 1", figures) == "met"  # (a list: each must meet it)
    assert bf.verdict([1.9, 0.97], ">= 1", figures) == "missed"
    assert bf.verdict(0.3, None, figures) == "no target"
    assert bf.verdict(None, "<= 0.6", figures) == "not measured"  # (the benchmark could not measure it)
    assert bf.verdict(0.7, ">= goodput.nope", figures) == "not measured"
    assert bf.verdict(0.7, ">= text", figures) == "not measured"


def test_targets_read_back_as_the_page_shows_them_and_a_malformed_one_is_refused():
    assert bf.shown_target("<= 0.01", "%") == "≤ 1%"
    assert bf.shown_target(">= goodput.ddp + 0.15", "%") == "≥ `goodput.ddp` + 15 points"
    assert bf.shown_target(">= 0.9 * rate.ddp", "steps/s") == "≥ 0.9 × `rate.ddp`"
    assert bf.shown_target("== true", "") == "= yes"
    assert bf.shown_target(">= -2", "points") == "≥ -2 points" and bf.shown_target("<= 1", "s") == "≤ 1 s"
    assert bf.shown_target(">= 0.99", "x") == "≥ 0.99x"
    assert bf.shown(0.00198, "%") == "0.198%" and bf.shown(1.23456, "x") == "1.235" and bf.shown(True, "") == "yes"
    assert bf.shown(71900, "") == "71,900" and bf.with_unit(bf.shown(12.5, "ms"), "ms") == "12.5 ms"
    for bad in ("about 0.6", "<= ", ">= a + b", "0.6"):
        with pytest.raises(ValueError, match="cannot read the target"):
            bf.parse_target(bad)


def test_a_scripts_declarations_are_read_without_running_it_and_the_first_matching_pattern_describes(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "b.py").write_text(
        '"""What b measures."""\nimport sys\nsys.exit("ran: the declarations must be read, not run")\n'
        "FIGURES = {\n"
        '    "runs.fast.ms": ("ms", "the fast row", "<= 5"),\n'
        '    "runs.*.ms": ("ms", "a row", None),\n'
        '    "peers.*.0.wait": ("%", "epoch 1 of a peer", None),\n'
        "}\n"
        'MEASURES = ["src/b"]\n'
    )
    d = bf.declared(str(tmp_path), "bench/b.py")
    assert d.measures == ("src/b",)
    assert d.describe("runs.fast.ms") == bf.Figure("ms", "the fast row", "<= 5")
    assert d.describe("runs.slow.ms") == bf.Figure("ms", "a row", None)
    assert d.describe("peers.s3.0.wait").meaning == "epoch 1 of a peer"
    assert d.describe("runs.ms") is None and d.describe("runs.slow.ms.x") is None  # (a * is one part, no more)
    (tmp_path / "bench" / "c.py").write_text('FIGURES = {"x": ("s", "a figure", "roughly 3")}\n')
    with pytest.raises(ValueError, match=r"bench/c.py: FIGURES\['x'\]: cannot read the target"):
        bf.declared(str(tmp_path), "bench/c.py")
    (tmp_path / "bench" / "d.py").write_text('FIGURES = {"x": ("s", "no target given")}\n')
    with pytest.raises(ValueError, match="must be"):
        bf.declared(str(tmp_path), "bench/d.py")
    assert bf.script_of("python bench/ckpt.py --only signing --repeats 6") == "bench/ckpt.py"


def test_a_docstring_or_a_figures_declaration_is_no_change_of_code_and_a_statement_is():
    before = '"""Module."""\nX = 1  # a comment\n"""X\'s doc."""\nclass A:\n    """A."""\n    def f(self):\n'
    before += '        """F."""\n        return 1\nFIGURES = {"a": ("s", "old", None)}\n'
    reworded = before.replace("Module.", "Reworded.").replace("F.", "Says more.").replace("old", "new")
    reworded = reworded.replace("# a comment", "# another")
    changed = before.replace("return 1", "return 2")
    assert bf.code_of(reworded, "b.py", bf.DECLARED) == bf.code_of(before, "b.py", bf.DECLARED)
    assert bf.code_of(changed, "b.py", bf.DECLARED) != bf.code_of(before, "b.py", bf.DECLARED)
    # (in another file than the script, FIGURES is code like any other)
    assert bf.code_of(reworded, "m.py") != bf.code_of(before, "m.py")
    assert bf.code_of("a: 1\n", "c.yaml") != bf.code_of("a: 2\n", "c.yaml")


def test_every_figure_of_every_result_file_is_described_by_the_script_that_wrote_it():
    # (a figure the page cannot explain is a figure no reader can use: a new key needs its line in FIGURES)
    undescribed = []
    for path in sorted((ROOT / "bench" / "results").glob("*.json")):
        doc = json.loads(path.read_text())
        script = bf.script_of(doc["command"])
        assert script and (ROOT / script).is_file(), f"{path.name}: its command names no script here: {doc['command']}"
        declared = bf.declared(str(ROOT), script)
        assert declared.measures, f"{script} declares no MEASURES: what code do its figures depend on?"
        for key, _ in bf.flat(doc["figures"]):
            if declared.describe(key) is None:
                undescribed.append(f"{path.name}: {key}")
        for pattern, fig in declared.figures:
            assert fig.unit is not None and fig.meaning, f"{script}: {pattern} has no meaning"
    assert not undescribed, undescribed
