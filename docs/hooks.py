"""MkDocs hook: what the site shows that the code already knows is generated at build time, so it cannot drift.

- ``<!-- generated: config-reference -->``: the config reference, from the schemas and conf/
  (``pitstop.config.reference``).
- ``<!-- generated: test-counts -->``: test functions and cases per file and per tier, from
  ``pytest --collect-only`` (all, then ``-m slow``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import defaultdict

CONFIG, COUNTS = "<!-- generated: config-reference -->", "<!-- generated: test-counts -->"


def on_page_markdown(markdown, page, config, files):  # noqa: ANN001, ANN201 - MkDocs' hook signature
    root = os.path.dirname(config["config_file_path"])
    if CONFIG in markdown:
        from pitstop.config.reference import render

        markdown = markdown.replace(CONFIG, render(os.path.join(root, "conf")))
    if COUNTS in markdown:
        markdown = markdown.replace(COUNTS, test_counts(root))
    return markdown


def collected(root: str, *args: str) -> list[str]:
    """The node ids ``pytest --collect-only`` finds (``args``: e.g. ``-m slow``)."""
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests", *args],
        cwd=root, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    ids = [ln.strip() for ln in p.stdout.splitlines() if "::" in ln]
    if p.returncode not in (0, 5) or not ids and not args:
        raise RuntimeError(f"pytest --collect-only failed ({p.returncode}): {(p.stdout + p.stderr)[-2000:]}")
    return ids


def test_counts(root: str) -> str:
    ids, slow = collected(root), set(collected(root, "-m", "slow"))
    functions: dict[str, set[str]] = defaultdict(set)
    cases: dict[str, int] = defaultdict(int)
    for node in ids:
        path, _, name = node.partition("::")
        functions[path].add(re.sub(r"\[.*\]$", "", name))
        cases[path] += 1
    rows = ["| Tier | File | Functions | Cases |", "|---|---|---|---|"]
    tiers: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for path in sorted(cases, key=lambda p: (p.split("/")[1], p)):
        tier = path.split("/")[1]
        rows.append(f"| {tier} | `{path.removeprefix('tests/')}` | {len(functions[path])} | {cases[path]} |")
        t = tiers[tier]
        t[0], t[1], t[2] = t[0] + 1, t[1] + len(functions[path]), t[2] + cases[path]
    rows += ["", "| Tier | Files | Functions | Cases |", "|---|---|---|---|"]
    rows += [f"| {tier} | {f} | {fn} | {c} |" for tier, (f, fn, c) in sorted(tiers.items())]
    total = [sum(t[i] for t in tiers.values()) for i in range(3)]
    rows.append(f"| **total** | **{total[0]}** | **{total[1]}** | **{total[2]}** ({len(slow)} slow, "
                f"{len(ids) - len(slow)} not slow) |")  # fmt: skip
    return "\n".join(rows)
