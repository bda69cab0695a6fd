"""MkDocs hook: what the site shows that the code already knows is generated at build time, so it cannot drift.

- ``<!-- generated: config-reference -->``: the config reference, from the schemas and conf/
  (``pitstop.config.reference``).
- ``<!-- generated: test-counts -->``: test functions and cases per file and per tier, from
  ``pytest --collect-only`` (all, then ``-m slow``).
- ``<!-- generated: cli -->``: each command's own ``--help``, run at build time (for the Hydra entry points, the
  config groups it composes from).
- ``<!-- generated: benchmarks -->``: every result file in ``bench/results/`` as one table: each figure's value,
  unit, meaning and target (met / missed), as its benchmark script declares them (``FIGURES``, read by
  ``bench/figures.py``), with the command, commit, date and machine once, and marked stale when the code it measures
  (the script and its ``MEASURES``) changed since the result's commit.
- ``{{ fig NAME KEY FORMAT }}`` anywhere: the figure ``KEY`` (dotted; a number indexes a list) of
  ``bench/results/NAME.json``, formatted (e.g. ``.3f``, ``.1%``), linked to its row on the benchmarks page. A figure
  no file backs fails the build: the site prints no figure that a command did not measure.
"""

from __future__ import annotations

import html
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

        markdown = markdown.replace(CONFIG, keys_whole(render(os.path.join(root, "conf"))))
    if COUNTS in markdown:
        markdown = markdown.replace(COUNTS, test_counts(root))
    if CLI in markdown:
        markdown = markdown.replace(CLI, cli(root))
    if BENCHMARKS in markdown:
        markdown = markdown.replace(BENCHMARKS, benchmarks(root))
    here = os.path.dirname(page.file.src_uri)
    return FIGURE.sub(lambda m: figure(root, here, m.group(1), m.group(2), m.group(3)), markdown)


ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj):<code>(~?)([\w.]+)</code>")


def on_page_content(html_text, page, config, files):  # noqa: ANN001, ANN201 - MkDocs' hook signature
    """The API reference's docstrings use Sphinx's roles (``:class:`~pitstop.errors.ConfigError```), which
    mkdocstrings leaves as text: each becomes the code it names (``~``: its last part)."""
    return ROLE.sub(lambda m: f"<code>{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}</code>", html_text)


def key_cell(key: str) -> str:
    """A dotted key as a table's first cell: code that breaks only after a dot (``<wbr>``; the stylesheet,
    ``docs/stylesheets/reference.css``, stops the theme breaking code mid-word)."""
    return f'<code class="key">{".<wbr>".join(html.escape(part) for part in key.split("."))}</code>'


def keys_whole(table: str) -> str:
    """Every table row's first cell, when it is one code span, as a :func:`key_cell`."""
    return re.sub(r"^\| `([^`|]+)` \|", lambda m: f"| {key_cell(m.group(1))} |", table, flags=re.M)


def result(root: str, name: str) -> dict:
    path = os.path.join(root, "bench", "results", f"{name}.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"a page shows a figure of {name}, but {path} is missing: run its benchmark")
    with open(path) as f:
        return json.load(f)


def figure(root: str, here: str, name: str, key: str, spec: str | None) -> str:
    try:  # (a number indexes a list: ``peers.uncapped.ratio.0``)
        value = bench_figures().lookup(result(root, name)["figures"], key)
    except KeyError:
        raise KeyError(f"bench/results/{name}.json has no figure {key!r}") from None
    text = format(value, spec) if spec else str(value)
    return f"{text}<sup>[{name}]({os.path.relpath(PAGE, here or '.')}#{name})</sup>"


def bench_figures():  # noqa: ANN201 - the module bench/figures.py (its declarations' reader)
    import importlib.util

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # (this checkout's, whatever ``root`` is)
    spec = importlib.util.spec_from_file_location("bench_figures", os.path.join(here, "bench", "figures.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_figures"] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def summary_of(root: str, script: str | None) -> str:
    """The first paragraph of a benchmark script's docstring: what it measures."""
    import ast

    if script is None or not os.path.isfile(os.path.join(root, script)):
        return ""
    with open(os.path.join(root, script)) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    return first if first.endswith(".") else f"{first}." if first else ""


def benchmarks(root: str) -> str:
    """One table per result file: each figure's value, unit, meaning and target (met / missed), the command, commit,
    date and machine once, and whether the code it measures changed since (``bench/figures.py``)."""
    bf = bench_figures()
    folder = os.path.join(root, "bench", "results")
    names = sorted(n[:-5] for n in os.listdir(folder) if n.endswith(".json")) if os.path.isdir(folder) else []
    overview = ["| Benchmark | Measured on | Freshness | Targets met | Targets missed |", "|---|---|---|---|---|"]
    parts = []
    for name in names:
        r = result(root, name)
        m, script = r["machine"], bf.script_of(r["command"])
        decl = bf.declared(root, script) if script and os.path.isfile(os.path.join(root, script)) else None
        fresh = bf.freshness(root, r.get("commit"), script, decl.measures) if decl else bf.Freshness("unknown", why=(
            f"its script ({script or 'none named'}) is not in this checkout"))  # fmt: skip
        where = f"{m['cores']} cores ({m['cpu']}), {m['gpu'] or 'no GPU'}, torch {m['torch']}"
        rows, verdicts = [], []
        for key, value in bf.flat(r["figures"]):
            fig = decl.describe(key) if decl else None
            unit, meaning, target = (fig.unit, fig.meaning, fig.target) if fig else ("", "*not described*", None)
            said = bf.verdict(value, target, r["figures"])
            verdicts.append(said)
            mark = {"met": "met", "missed": "**missed**", "no target": ""}.get(said, said)
            aim = bf.shown_target(target, unit) if target else "*no target*"
            amount = bf.with_unit(bf.shown(value, unit), unit)
            rows.append(f"| {key_cell(key)} | {amount} | {meaning} | {aim} | {mark} |")
        state = {"fresh": "fresh", "stale": "**stale**", "unknown": "freshness unknown"}[fresh.state]
        more = len(fresh.changed) - 6
        changed = ", ".join(f"`{c}`" for c in fresh.changed[:6]) + (f" and {more} more" if more > 0 else "")
        why = (
            fresh.why[0].upper()
            + fresh.why[1:]
            + (f": {changed}. Run it again to update its figures" if changed else "")
        )
        title = {"fresh": "Fresh", "stale": "Stale", "unknown": "Freshness unknown"}[fresh.state]
        parts += [
            f"## {name}\n",
            dict(decl.about).get(name) if decl and dict(decl.about).get(name) else summary_of(root, script),
            "",
            f"`{r['command']}` at commit `{r['commit']}` on {r['date']}: {where}.\n",
            f'!!! {"warning" if fresh.state == "stale" else "note"} "{title}"',
            f"    {why}.\n",
            "| Figure | Value | Meaning | Target | Verdict |",
            "|---|--:|---|---|---|",
            *rows,
            "",
        ]
        overview.append(f"| [{name}](#{name}) | {r['date']} | {state} | {verdicts.count('met')} | "
                        f"{verdicts.count('missed')} |")  # fmt: skip
    if not names:
        return "No result file yet: run a benchmark (`python bench/overhead.py`)."
    return "\n".join([*overview, "", *parts])


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
