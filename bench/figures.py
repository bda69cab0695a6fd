"""What a result file's figures mean, whether each met its target, and whether the result is older than the code it
measures: the logic of the docs' results page (docs/hooks.py), kept apart from MkDocs so that it can be tested.

Each benchmark script declares, beside the code that measures them, two module-level literals:

- ``FIGURES``: ``{pattern: (unit, meaning, target)}``, one entry per figure of the result files it writes. A pattern
  is a figure's dotted key (as ``{{ fig NAME KEY }}`` names it) where ``*`` stands for any one part
  (``runs.*.*.measured``); the first pattern that matches a key describes it. ``unit``: ``s``, ``ms``, ``x`` (a
  ratio), ``%`` (a fraction, shown as a percentage), ``points`` (percentage points), ``samples/s``, ... or ``""``
  (a count, a setting, a text). ``target``: ``None`` (no target), or a comparison with a number, another figure of
  the same result, or both: ``"<= 0.6"``, ``">= goodput.ddp + 0.15"``, ``"== 0"``, ``"== true"``.
- ``ABOUT`` (optional): ``{result name: sentence}``, what a result measures where the script's docstring's first
  sentence does not say it (a script that writes several results).
- ``MEASURES``: the paths (files, folders, git globs) of the code its figures depend on, besides the script itself:
  a result whose commit is older than a change to any of them is marked stale.

They are read with :mod:`ast` (nothing is imported or run: the page builds without torch's import or a benchmark's
minutes). A change counts as a change of code when a Python file's syntax tree differs without its docstrings (the
declarations above too, in the script itself): editing a docstring or a figure's meaning does not make a result
stale; editing what runs does. Without the history (no git, a shallow clone that lacks the result's commit) the
freshness is "unknown", never a failure.
"""

from __future__ import annotations

import ast
import functools
import operator
import os
import re
import subprocess
from dataclasses import dataclass

DECLARED = ("FIGURES", "MEASURES", "ABOUT")  # the declarations' names in a benchmark script
COMPARE = {">=": operator.ge, "<=": operator.le, "==": operator.eq, "<": operator.lt, ">": operator.gt}
SHOWN_OP = {">=": "≥", "<=": "≤", "==": "=", "<": "<", ">": ">"}


@dataclass(frozen=True)
class Figure:
    """What one declared pattern says of the figures it matches."""

    unit: str
    meaning: str
    target: str | None = None


@dataclass(frozen=True)
class Declared:
    """A benchmark script's declarations: its figures' patterns, in order, and the paths it measures."""

    script: str  # relative to the checkout
    figures: tuple[tuple[str, Figure], ...]
    measures: tuple[str, ...]
    about: tuple[tuple[str, str], ...] = ()

    def describe(self, key: str) -> Figure | None:
        """The first pattern's description that matches ``key``; None if none does."""
        parts = key.split(".")
        for pattern, fig in self.figures:
            want = pattern.split(".")
            if len(want) == len(parts) and all(w in ("*", p) for w, p in zip(want, parts)):
                return fig
        return None


def script_of(command: str) -> str | None:
    """The benchmark script a result's command ran (``python bench/ckpt.py --only signing`` -> ``bench/ckpt.py``)."""
    return next((w for w in command.split() if w.startswith("bench/") and w.endswith(".py")), None)


def declared(root: str, script: str) -> Declared:
    """Read ``script``'s ``FIGURES`` and ``MEASURES`` without running it. A script without them declares nothing
    (every figure shows as not described); a malformed entry is an error naming the script and the entry."""
    path = os.path.join(root, script)
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    values: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in DECLARED:
                values[node.targets[0].id] = ast.literal_eval(node.value)
    figures = []
    for pattern, entry in dict(values.get("FIGURES", {})).items():
        if not (isinstance(entry, tuple) and len(entry) == 3 and all(isinstance(x, str) for x in entry[:2])):
            raise ValueError(f"{script}: FIGURES[{pattern!r}] must be (unit, meaning, target or None), got {entry!r}")
        if entry[2] is not None:
            parse_target(entry[2], f"{script}: FIGURES[{pattern!r}]")
        figures.append((pattern, Figure(*entry)))
    about = tuple(dict(values.get("ABOUT", {})).items())
    return Declared(script, tuple(figures), tuple(values.get("MEASURES", ())), about)


def parse_target(target: str, where: str = "target") -> tuple[str, str | None, float, float]:
    """``(operator, figure key or None, number, factor)`` of a target: the bound is ``factor * figure + number``
    (``">= goodput.ddp + 0.15"`` -> ``(">=", "goodput.ddp", 0.15, 1.0)``, ``">= 0.9 * rate.ddp"`` -> ``(">=",
    "rate.ddp", 0.0, 0.9)``, ``"<= 0.6"`` -> ``("<=", None, 0.6, 1.0)``); ``true`` and ``false`` are 1 and 0."""
    text = re.sub(r"\b(true|false)\b", lambda m: "1" if m.group() == "true" else "0", target)
    number, key = r"(-?\d+(?:\.\d+)?(?:e-?\d+)?)", r"([A-Za-z_][\w.]*)"
    forms = [  # (pattern, which groups are: number, key, sign of the number, factor)
        (rf"{number}", lambda g: (None, float(g[0]), 1.0)),
        (rf"{key}", lambda g: (g[0], 0.0, 1.0)),
        (rf"{key}\s*([+-])\s*{number}", lambda g: (g[0], float(g[2]) * (-1 if g[1] == "-" else 1), 1.0)),
        (rf"{number}\s*\*\s*{key}", lambda g: (g[1], 0.0, float(g[0]))),
    ]
    m = re.match(r"^\s*(>=|<=|==|<|>)\s*(.*?)\s*$", text)
    for pattern, read in forms if m else []:
        found = re.fullmatch(pattern, m.group(2))
        if found:
            ref, add, factor = read(found.groups())
            return m.group(1), ref, add, factor
    raise ValueError(f"{where}: cannot read the target {target!r} (e.g. '<= 0.6', '>= other.key + 0.15', "
                     f"'>= 0.9 * other.key')")  # fmt: skip


def flat(figures: dict, prefix: str = "") -> list[tuple[str, object]]:
    """Every figure's dotted key and value; a list of tables is indexed (``peers.uncapped.pitstop.0.wait``), a list
    of numbers is one figure."""
    out: list[tuple[str, object]] = []
    for k, v in figures.items():
        if isinstance(v, list) and any(isinstance(x, dict) for x in v):
            v = {str(i): x for i, x in enumerate(v)}
        out += flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]
    return out


def lookup(figures: dict, key: str) -> object:
    """The figure ``key`` (dotted; a number indexes a list) of a result's figures; KeyError if it has none."""
    value: object = figures
    for part in key.split("."):
        if isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            raise KeyError(key)
    return value


def verdict(value: object, target: str | None, figures: dict) -> str:
    """``met``, ``missed`` or ``no target`` for ``value`` against ``target`` (which may name another figure of the
    same result, ``figures``); ``not measured`` where the value (or the figure it is compared with) is missing."""
    if target is None:
        return "no target"
    op, ref, number, factor = parse_target(target)
    bound: float = number
    if ref is not None:
        try:
            other = lookup(figures, ref)
        except KeyError:
            return "not measured"
        if isinstance(other, bool) or not isinstance(other, (int, float)):
            return "not measured"
        bound = factor * other + number
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):  # (each must meet it)
        return "met" if all(verdict(v, target, figures) == "met" for v in value) else "missed"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if isinstance(value, bool):
            return "met" if COMPARE[op](int(value), bound) else "missed"
        return "not measured"
    return "met" if COMPARE[op](value, bound) else "missed"


def shown(value: object, unit: str) -> str:
    """A figure as the page shows it: 4 significant digits, a ``%`` figure (a fraction) as a percentage."""
    if isinstance(value, bool) or value is None:
        return {True: "yes", False: "no", None: "—"}[value]
    if isinstance(value, (int, float)) and unit == "%":
        return f"{value * 100:.3g}%"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int) and abs(value) >= 10000:
        return f"{value:,}"
    if isinstance(value, list):
        return ", ".join(shown(v, unit) for v in value)
    return str(value)


def with_unit(text: str, unit: str) -> str:
    """A shown figure and its unit: ``12.5 ms``, ``1.26x``, ``50%`` (a ``%`` figure shows it already), ``3``."""
    return text if unit in ("", "%") else f"{text}x" if unit == "x" else f"{text} {unit}"


def shown_target(target: str | None, unit: str) -> str:
    """A target as the page shows it (``<= 0.01`` of a ``%`` figure: ``≤ 1%``)."""
    if target is None:
        return ""
    op, ref, number, factor = parse_target(target)
    if re.search(r"\b(true|false)\b", target):
        return f"{SHOWN_OP[op]} {'yes' if number else 'no'}"
    if ref is None:
        return f"{SHOWN_OP[op]} {shown(number, unit) if unit == '%' else with_unit(f'{number:g}', unit)}"
    text = (f"{factor:g} × " if factor != 1 else "") + f"`{ref}`"
    if number:
        size = f"{abs(number) * 100:g} points" if unit == "%" else with_unit(f"{abs(number):g}", unit)  # (of a %)
        text += f" {'+' if number > 0 else '−'} {size}"
    return f"{SHOWN_OP[op]} {text}"


# ---- freshness ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Freshness:
    """Whether a result is as new as the code it measures: ``state`` is ``fresh``, ``stale`` or ``unknown``;
    ``changed``: the files whose code changed since the result's commit; ``why``: a sentence for the reader."""

    state: str
    changed: tuple[str, ...] = ()
    why: str = ""


def _git(root: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=60)


def code_of(text: str, path: str, drop: tuple[str, ...] = ()) -> str:
    """The code of a file, for comparing two versions: a Python file's syntax tree without its docstrings (and
    without module-level assignments to ``drop``); any other file as it is."""
    if not path.endswith(".py"):
        return text
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text

    def text_alone(n: ast.AST) -> bool:  # (a docstring: a string standing alone as a statement)
        return isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)

    for node in list(ast.walk(tree)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and text_alone(node.body[0]):
            node.body = node.body[1:] or [ast.Pass()]
        elif isinstance(node, (ast.Module, ast.ClassDef)):  # (and attribute docstrings, after an assignment)
            top = isinstance(node, ast.Module)

            def dropped(n: ast.AST) -> bool:
                return top and isinstance(n, ast.Assign) and any(getattr(t, "id", None) in drop for t in n.targets)

            node.body = [n for n in node.body if not text_alone(n) and not dropped(n)] or [ast.Pass()]
    return ast.dump(tree)


@functools.lru_cache(maxsize=4096)
def _code_at(top: str, base: str, name: str, is_script: bool) -> str | None:
    """The code of ``name`` at commit ``base`` (None: not there). A commit does not change: results measured at one
    commit share the answer."""
    old = _git(top, "show", f"{base}:{name}")
    return code_of(old.stdout, name, DECLARED if is_script else ()) if old.returncode == 0 else None


@functools.lru_cache(maxsize=4096)
def _code_now(here: str, stamp: tuple[int, int], name: str, is_script: bool) -> str:
    """The code of the work tree's file ``here`` as it is at ``stamp`` (its mtime and size)."""
    with open(here) as f:
        return code_of(f.read(), name, DECLARED if is_script else ())


def _code_changed(top: str, base: str, name: str, is_script: bool) -> bool:
    """Whether the code of ``name`` differs between commit ``base`` and the work tree."""
    here = os.path.join(top, name)
    if not os.path.isfile(here):
        return True
    st = os.stat(here)
    return _code_at(top, base, name, is_script) != _code_now(here, (st.st_mtime_ns, st.st_size), name, is_script)


def freshness(root: str, commit: str | None, script: str, measures: tuple[str, ...]) -> Freshness:
    """Compare the code at the result's ``commit`` with this checkout's, for ``script`` and the paths it
    ``measures``. ``commit`` may end in ``+changes`` (measured with uncommitted changes: compared from the commit)."""
    base = (commit or "").removesuffix("+changes")
    if not base:
        return Freshness("unknown", why="the result names no commit")
    try:
        inside = _git(root, "rev-parse", "--is-inside-work-tree")
        if inside.returncode != 0:
            return Freshness("unknown", why="no git history here")
        if _git(root, "cat-file", "-e", f"{base}^{{commit}}").returncode != 0:
            return Freshness("unknown", why=f"commit `{base}` is not in this clone's history (a shallow clone?)")
        paths = [script, *measures]
        diff = _git(root, "diff", "--name-only", "-z", "--no-renames", base, "--", *paths)
        if diff.returncode != 0:
            return Freshness("unknown", why=f"git diff failed: {diff.stderr.strip()[:200]}")
        top = _git(root, "rev-parse", "--show-toplevel").stdout.strip()
        # (relative to the repository's top)
        names = [name for name in diff.stdout.split("\0") if name]  # (-z: a path with a space is one path)
        changed = [name for name in names if _code_changed(top, base, name, name == script)]
    except (OSError, ValueError, subprocess.SubprocessError) as e:  # (ValueError: a file that is not UTF-8)
        return Freshness("unknown", why=f"git could not say ({type(e).__name__})")
    if changed:
        return Freshness("stale", tuple(changed), f"the code it measures changed since `{base}`")
    return Freshness("fresh", why=f"the code it measures is the same as at `{base}`")
