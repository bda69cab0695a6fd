"""The API reference (docs/reference/api.md, rendered by mkdocstrings from the docstrings) covers every contract a
user implements, and each object it names exists and says what it is: read as text, as mkdocstrings reads it (no
import). A method without a docstring would be left off the page (``show_if_no_docstring: false``), so a contract's
methods must each have one."""

from __future__ import annotations

import ast
import re

from conftest import ROOT

PAGE = ROOT / "docs" / "reference" / "api.md"
# what a user implements: the contract of each config group that takes a class of the user's
CONTRACTS = {
    "Task": "pitstop.parts.task.Task",
    "ShardLoader": "pitstop.data.loader.base.ShardLoader",
    "Checkpointer": "pitstop.ckpt.contract.Checkpointer",
    "Strategy": "pitstop.strategy.base.Strategy",
    "Logger": "pitstop.telemetry.logger.base.Logger",
    "Fault": "pitstop.resilience.fault.Fault",
    "Callback": "pitstop.train.summary.Callback",
}
# the functions behind the commands
ENTRY_POINTS = ["recipe.train.train", "pitstop.launch.launcher.run", "pitstop.audit.audit", "pitstop.ckpt.verify.check"]


def directives() -> dict[str, list[str] | None]:
    """Each ``::: dotted.path`` of the page and the ``members:`` it lists (None: all with a docstring)."""
    out: dict[str, list[str] | None] = {}
    current = None
    for line in PAGE.read_text().splitlines():
        m = re.match(r"^::: ([\w.]+)\s*$", line)
        if m:
            current = m.group(1)
            out[current] = None
            continue
        listed = re.match(r"^\s+members: \[(.*)\]\s*$", line)
        if listed and current:
            out[current] = [name.strip() for name in listed.group(1).split(",")]
    return out


def find(path: str) -> ast.AST:
    """The class or function ``path`` names, found in the source the way mkdocstrings (griffe) finds it."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = "/".join(parts[:cut])
        for base in (ROOT / "src", ROOT):
            for file in (base / f"{module}.py", base / module / "__init__.py"):
                if file.is_file():
                    node: ast.AST = ast.parse(file.read_text())
                    for name in parts[cut:]:
                        node = next(
                            (n for n in node.body if getattr(n, "name", None) == name),  # type: ignore[attr-defined]
                            None,
                        )
                        assert node is not None, f"{path}: no {name} in {file.relative_to(ROOT)}"
                    return node
    raise AssertionError(f"{path}: no such module under src/ or the checkout")


def test_every_contract_and_entry_point_is_on_the_page_and_exists_with_a_docstring():
    on_page = directives()
    missing = [path for path in [*CONTRACTS.values(), *ENTRY_POINTS] if path not in on_page]
    assert not missing, f"docs/reference/api.md does not render {missing}"
    for path in on_page:
        node = find(path)
        assert ast.get_docstring(node), f"{path} has no docstring: the reference would show its name alone"
    table = PAGE.read_text().split("::: ", 1)[0]
    for name, path in CONTRACTS.items():  # (the table at the top links each contract to its section)
        assert f"[`{name}`](#{path})" in table, name


def test_each_contract_says_what_an_implementation_must_do_and_documents_every_method():
    on_page = directives()
    for name, path in CONTRACTS.items():
        cls = find(path)
        assert isinstance(cls, ast.ClassDef)
        doc = ast.get_docstring(cls) or ""
        assert len(doc.split()) >= 40, f"{name}'s docstring is too short to say what an implementation must do"
        listed = on_page[path]
        methods = [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        public = [m for m in methods if not m.name.startswith("_") and (listed is None or m.name in listed)]
        assert public, name
        undocumented = [m.name for m in public if not ast.get_docstring(m)]
        assert not undocumented, f"{name}: {undocumented} have no docstring and would be left off the reference"
        if listed is not None:
            assert set(listed) <= {m.name for m in methods}, f"{name}: the page lists members it does not have"
