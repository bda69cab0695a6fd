"""The output excerpts the manual shows (``tests/manual.py``): how one is matched against a run's output, and that
every excerpt is checked by a test that runs its command."""

from __future__ import annotations

import re
from manual import ROOT, excerpt_missing, not_run, page_outputs, readme_commands

RUN = """[2026-12-05 06:55:22,901][pitstop.launch][INFO] - node vm is healthy (0.07 s): 1 dir(s) writable
[2026-12-05 06:55:23,100][pitstop.train][INFO] - step 25/25 loss 0.4132
[2026-12-05 06:55:23,200][rank0][pitstop][INFO] - done: step 25
error: data dir not found: /tmp/x/data/digits
"""


def test_an_excerpt_matches_without_the_log_prefix_with_any_number_and_elided_text():
    assert excerpt_missing("node vm is healthy (0.12 s): 1 dir(s) writable\nstep 100/100 loss 0.0871", RUN) == []
    assert excerpt_missing("[2026-01-01 00:00:00,000][pitstop.train][INFO] - step 1/2 loss 3", RUN) == []
    assert excerpt_missing("error: data dir not found: …/data/digits\n…\n", RUN) == []
    # an aligned column: the spaces before a number change with its width
    assert excerpt_missing("  productive          1.13 s   17.2%", "  productive         14.43 s    7.2%") == []
    assert excerpt_missing("productive 1.13 s", "productive1.13 s") != []  # (a space is not nothing)
    assert excerpt_missing("done: step 25", RUN) == []  # (a rank's line: [time][rank0][logger][LEVEL] - )
    assert excerpt_missing("step 25/25   loss 0.4132", RUN) == []  # (a column as wide as its number: any spaces)


def test_an_excerpt_line_the_run_did_not_print_is_named():
    assert excerpt_missing("node vm is healthy\nstep 25/25 loss 0.4132", RUN) == ["node vm is healthy"]  # (whole line)
    assert excerpt_missing("node vm is sick (0.07 s): 1 dir(s) writable", RUN) != []
    assert excerpt_missing("step 25/25 loss nan", RUN) == ["step 25/25 loss nan"]  # (a number is not any text)


def test_every_excerpt_follows_a_command_that_a_test_runs_and_checks_it_against():
    """An excerpt after a command tests/system/test_readme.py does not run must be checked by the test that runs it:
    that test calls page_output with a part of the command (so no excerpt shown on a page goes unchecked)."""
    outputs = page_outputs()
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    keys = re.findall(r"page_output\(\s*[\"']([^\"']+)[\"']", tests)
    readme = set(readme_commands())  # (own-task.md's commands are not the manual's: its own test runs them)
    for page, cmd, _ in outputs:
        assert cmd, f"{page.name}: an output excerpt with no `python -m` command before it"
        if cmd not in readme or not_run(cmd):
            why = not_run(cmd) or "not a command of the manual's pages"
            assert any(k in cmd for k in keys), (
                f"{page.name}: the excerpt after {cmd!r} is checked by no test (test_readme does not run it: "
                f"{why[:60]}...); call manual.page_output with part of the command in the test that does"
            )
