"""The site's diagrams and pictures at build time (docs/diagrams.py, docs/pictures.py): each mermaid flowchart of
the docs is drawn as SVG with every node in a box of its own and every edge label shown, a flowchart the drawer
cannot read fails naming its page and line, and the pictures' cache key changes with what made them."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_{name}", DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


diagrams = _module("diagrams")


@pytest.mark.parametrize("page", ["architecture.md"])
def test_each_flowchart_of_a_page_is_drawn_with_no_box_over_another(page):
    blocks = diagrams.FENCE.findall((DOCS / page).read_text())
    assert blocks, f"{page} has no mermaid flowchart"
    for source in blocks:
        _, nodes, edges = diagrams.parse(source)
        svg = diagrams.svg(source)
        boxes = [tuple(float(v) for v in m) for m in re.findall(
            r'<rect x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" height="([\d.]+)" rx="5"', svg)]  # fmt: skip
        assert len(boxes) == len(nodes)  # (a box per node)
        for i, (x, y, w, h) in enumerate(boxes):
            for x2, y2, w2, h2 in boxes[i + 1 :]:
                assert x + w <= x2 or x2 + w2 <= x or y + h <= y2 or y2 + h2 <= y, "two boxes overlap"
        for _, _, label in edges:
            assert not label or f">{label}</text>" in svg
        assert "\n\n" not in svg and "flowchart" not in svg  # (one HTML block; no source left)


def test_a_flowchart_it_cannot_read_fails_naming_the_page_and_line():
    class Page:
        title, file = "x", type("F", (), {"src_uri": "guides/x.md"})

    markdown = "# x\n\ntext\n\n```mermaid\nflowchart TD\n    A -.-> B\n```\n"
    with pytest.raises(diagrams.DiagramError, match=r"guides/x.md:5: .*cannot read ' -\.-> B' in 'A -\.-> B'"):
        diagrams.on_page_markdown(markdown, Page(), {}, None)
    drawn = diagrams.on_page_markdown(markdown.replace("-.->", "-->"), Page(), {}, None)
    assert drawn.startswith('# x\n\ntext\n\n<div class="diagram" style="overflow-x:auto"><svg ') and "```" not in drawn


def test_the_pictures_key_changes_with_what_made_them(tmp_path, monkeypatch):
    pictures = _module("pictures")
    for part in ("src/pkg", "recipe", "conf/fault", "docs"):
        (tmp_path / part).mkdir(parents=True)
    (tmp_path / "src/pkg/a.py").write_text("x = 1\n")
    (tmp_path / "conf/fault/none.yaml").write_text("a: 1\n")
    (tmp_path / "docs/pictures.py").write_text("")
    monkeypatch.setattr(pictures, "ROOT", str(tmp_path))
    monkeypatch.setattr(pictures, "OUT", str(tmp_path / "docs/pictures"))
    key = pictures.key()
    (tmp_path / "src/pkg/__pycache__").mkdir()
    (tmp_path / "src/pkg/__pycache__/a.cpython-311.pyc").write_bytes(b"\0")
    assert pictures.key() == key  # (bytecode is not what made them)
    assert not pictures.up_to_date(key)  # (no pictures yet)
    (tmp_path / "docs/pictures").mkdir()
    for name in pictures.NAMES:
        (tmp_path / f"docs/pictures/{name}.png").write_bytes(b"png")
    (tmp_path / "docs/pictures/.key").write_text(key + "\n")
    assert pictures.up_to_date(key)  # a rebuild runs nothing
    (tmp_path / "conf/fault/none.yaml").write_text("a: 2\n")
    assert pictures.key() != key and not pictures.up_to_date(pictures.key())  # a changed config: drawn again
