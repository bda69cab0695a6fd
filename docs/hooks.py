"""MkDocs hook: what the site shows that the code already knows is generated at build time, so it cannot drift.

- ``<!-- generated: config-reference -->``: the config reference, from the schemas and conf/
  (``pitstop.config.reference``).
- ``<!-- generated: test-counts -->``: test functions and cases per file and per tier, from
  ``pytest --collect-only`` (all, then ``-m slow``).
- ``<!-- generated: cli -->``: each command's own ``--help``, run at build time (for the Hydra entry points, the
  config groups it composes from).
- ``<!-- generated: benchmarks -->``: every result file in ``bench/results/`` with its command, commit, date and
  machine, and its figures.
- ``{{ fig NAME KEY FORMAT }}`` anywhere: the figure ``KEY`` (dotted; a number indexes a list) of
  ``bench/results/NAME.json``, formatted (e.g. ``.3f``, ``.1%``), linked to its row on the benchmarks page. A figure
  no file backs fails the build: the site prints no figure that a command did not measure.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import defaultdict

import json

CONFIG, COUNTS = "<!-- generated: config-reference -->", "<!-- generated: test-counts -->"
BENCHMARKS, FIGURE = "<!-- generated: benchmarks -->", re.compile(r"\{\{\s*fig\s+(\w+)\s+([\w.]+)(?:\s+(\S+))?\s*\}\}")
PAGE = "reference/benchmarks.md"
CLI = "<!-- generated: cli -->"
COMMANDS = {  # module: what it is for
    "recipe.train": "train (Hydra: `group=option` and `key=value` overrides; `-m` sweeps)",
    "recipe.prepare": "write a data set's shards and index (Hydra, the same `data=` options)",
    "recipe.goodput": "the goodput model, the best checkpoint interval, and a run's time line",
    "recipe.export": "a checkpoint's model weights as a plain state_dict",
    "pitstop.audit": "exactly-once data: every sample of every epoch, counted from the sample logs",
    "pitstop.ckpt.verify": "check checkpoints against their checksum manifests",
}


def on_page_markdown(markdown, page, config, files):  # noqa: ANN001, ANN201 - MkDocs' hook signature
    root = os.path.dirname(config["config_file_path"])
    if CONFIG in markdown:
        from pitstop.config.reference import render

        markdown = markdown.replace(CONFIG, render(os.path.join(root, "conf")))
    if COUNTS in markdown:
        markdown = markdown.replace(COUNTS, test_counts(root))
    if CLI in markdown:
        markdown = markdown.replace(CLI, cli(root))
    if BENCHMARKS in markdown:
        markdown = markdown.replace(BENCHMARKS, benchmarks(root))
    here = os.path.dirname(page.file.src_uri)
    return FIGURE.sub(lambda m: figure(root, here, m.group(1), m.group(2), m.group(3)), markdown)


def result(root: str, name: str) -> dict:
    path = os.path.join(root, "bench", "results", f"{name}.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"a page shows a figure of {name}, but {path} is missing: run its benchmark")
    with open(path) as f:
        return json.load(f)


def figure(root: str, here: str, name: str, key: str, spec: str | None) -> str:
    value: object = result(root, name)["figures"]
    for part in key.split("."):  # (a number indexes a list: ``peers.uncapped.ratio.0``)
        if isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            raise KeyError(f"bench/results/{name}.json has no figure {key!r}")
    text = format(value, spec) if spec else str(value)
    return f"{text}<sup>[{name}]({os.path.relpath(PAGE, here or '.')}#{name})</sup>"


def flat(figures: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for k, v in figures.items():
        out += flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]
    return out


def benchmarks(root: str) -> str:
    parts = []
    folder = os.path.join(root, "bench", "results")
    for name in sorted(n[:-5] for n in os.listdir(folder) if n.endswith(".json")) if os.path.isdir(folder) else []:
        r = result(root, name)
        m = r["machine"]
        where = f"{m['cores']} cores ({m['cpu']}), {m['gpu'] or 'no GPU'}, torch {m['torch']}"
        parts.append(f"## {name}\n\n`{r['command']}` at commit `{r['commit']}` on {r['date']}: {where}.\n")
        parts.append("| figure | value |\n|---|---|")
        for key, value in flat(r["figures"]):
            shown = f"{value:.4g}" if isinstance(value, float) else str(value)
            parts.append(f"| `{key}` | {shown} |")
        parts.append("")
    return "\n".join(parts) or "No result file yet: run a benchmark (`python bench/overhead.py`)."


def cli(root: str) -> str:
    """Each command's ``--help`` as this checkout prints it (Hydra's: only the config groups, not the whole config)."""
    parts = []
    for module, what in COMMANDS.items():
        p = subprocess.run([sys.executable, "-m", module, "--help"], cwd=root, capture_output=True, text=True,
                           timeout=120)  # fmt: skip
        if p.returncode != 0:
            raise RuntimeError(f"python -m {module} --help failed ({p.returncode}): {(p.stdout + p.stderr)[-2000:]}")
        text = p.stdout
        if "== Configuration groups ==" in text:  # (Hydra's help: the groups, then the whole composed config)
            text = text[text.index("== Configuration groups ==") : text.index("== Config ==")].rstrip()
            text = "\n".join(ln for ln in text.splitlines() if not ln.startswith("schema/"))
        parts.append(f"## `python -m {module}`\n\n{what[0].upper()}{what[1:]}.\n\n```text\n{text.rstrip()}\n```\n")
    return "\n".join(parts)


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
