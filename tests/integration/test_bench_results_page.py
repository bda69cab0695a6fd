"""The benchmark results page (docs/hooks.py, bench/figures.py): each figure with its unit, meaning and target (met
or missed), and a result older than the code it measures marked stale. On a real git repository: a change of code to
the script or to a path it MEASURES makes it stale, a docstring or a figure's meaning does not, and without the
history (a shallow clone, no git) the page says "unknown" instead of failing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from conftest import ROOT

spec = importlib.util.spec_from_file_location("bench_figures", ROOT / "bench" / "figures.py")
bf = importlib.util.module_from_spec(spec)
sys.modules["bench_figures"] = bf
spec.loader.exec_module(bf)


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPT = '''"""What b measures."""

FIGURES = {"ms": ("ms", "a step", "<= 5")}
MEASURES = ["src/pkg"]


def measure():
    return 1
'''
MODULE = '''"""The code b measures."""


def step():
    """One step."""
    return 2
'''


def git(repo, *args: str) -> str:
    p = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def commit(repo, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "--short", "HEAD")


def test_a_result_is_stale_once_the_code_it_measures_changes_and_not_for_a_docstring(tmp_path):
    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    (repo / "src" / "pkg").mkdir(parents=True)
    (repo / "bench" / "b.py").write_text(SCRIPT)
    (repo / "src" / "pkg" / "m.py").write_text(MODULE)
    (repo / "src" / "other.py").write_text("X = 1\n")
    git(repo, "init", "-q")
    measured = commit(repo, "the code measured")

    def now():
        return bf.freshness(str(repo), measured, "bench/b.py", bf.declared(str(repo), "bench/b.py").measures)

    assert now().state == "fresh"
    # words only: the docstrings, a figure's meaning, the script's own declarations: the same code, still fresh
    (repo / "src" / "pkg" / "m.py").write_text(MODULE.replace("One step.", "One step, said better."))
    (repo / "bench" / "b.py").write_text(SCRIPT.replace("a step", "one step").replace("What b", "What bench b"))
    commit(repo, "words")
    assert now().state == "fresh", now()
    # code nobody declared it measures: still fresh
    (repo / "src" / "other.py").write_text("X = 2\n")
    commit(repo, "other code")
    assert now().state == "fresh"
    # the code it measures, committed: stale, naming the file
    (repo / "src" / "pkg" / "m.py").write_text(MODULE.replace("return 2", "return 3"))
    commit(repo, "faster")
    stale = now()
    assert stale.state == "stale" and stale.changed == ("src/pkg/m.py",), stale
    assert f"since `{measured}`" in stale.why
    # the script's own code, and a file added under a measured path
    (repo / "bench" / "b.py").write_text(SCRIPT.replace("return 1", "return 0"))
    (repo / "src" / "pkg" / "new.py").write_text("Y = 1\n")
    commit(repo, "more")
    assert set(now().changed) == {"src/pkg/m.py", "bench/b.py", "src/pkg/new.py"}, now()
    # measured with uncommitted changes: compared from the commit it names
    assert bf.freshness(str(repo), f"{measured}+changes", "bench/b.py", ("src/pkg",)).state == "stale"


def test_without_the_history_the_freshness_is_unknown_not_a_failure(tmp_path):
    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    (repo / "bench" / "b.py").write_text(SCRIPT)
    git(repo, "init", "-q")
    measured = commit(repo, "measured")
    (repo / "bench" / "b.py").write_text(SCRIPT.replace("return 1", "return 0"))
    commit(repo, "later")
    # a shallow clone (CI's checkout) has the newest commit only: the result's commit is not there
    shallow = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(shallow)], check=True, timeout=60)
    got = bf.freshness(str(shallow), measured, "bench/b.py", ())
    assert got.state == "unknown" and "shallow" in got.why, got
    # no git at all: a copy of the files
    plain = tmp_path / "plain"
    (plain / "bench").mkdir(parents=True)
    (plain / "bench" / "b.py").write_text(SCRIPT)
    got = bf.freshness(str(plain), measured, "bench/b.py", ())
    assert got.state == "unknown" and "no git history" in got.why, got
    assert bf.freshness(str(repo), None, "bench/b.py", ()).state == "unknown"  # (a result that names no commit)


def test_the_results_page_gives_each_figure_its_unit_meaning_and_target_met_or_missed(tmp_path):
    hooks = _hooks()  # (docs/hooks.py: what MkDocs runs)
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "b.py").write_text(
        '"""What b measures, in one sentence. More."""\n'
        'FIGURES = {"ratio": ("x", "ours over theirs", ">= 0.99"), "share": ("%", "of a step", "<= 0.01"),'
        ' "rows.*.ms": ("ms", "a row\'s step", None)}\nMEASURES = ["src"]\n'
    )
    doc = {"name": "b", "command": "python bench/b.py --fast", "commit": "abc1234", "date": "2026-12-04",
           "machine": {"cores": 2, "cpu": "x", "gpu": None, "torch": "2.14.1"},
           "figures": {"ratio": 0.98, "share": 0.002, "rows": {"one": {"ms": 12.5}}}}  # fmt: skip
    (tmp_path / "bench" / "results" / "b.json").write_text(json.dumps(doc))
    page = hooks.benchmarks(str(tmp_path))
    assert "| [b](#b) | 2026-12-04 | freshness unknown | 1 | 1 |" in page  # (the overview: one met, one missed)
    assert "## b\n\nWhat b measures, in one sentence. More.\n" in page
    assert '| <code class="key">ratio</code> | 0.98x | ours over theirs | ≥ 0.99x | **missed** |' in page
    assert '| <code class="key">share</code> | 0.2% | of a step | ≤ 1% | met |' in page
    assert '| <code class="key">rows.<wbr>one.<wbr>ms</code> | 12.5 ms | a row\'s step | *no target* |  |' in page
    assert "No git history here" in page  # (a folder outside any repository)
