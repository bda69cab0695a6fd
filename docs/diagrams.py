"""MkDocs hook: each ```` ```mermaid ```` flowchart of a page is drawn at build time as an inline SVG, so the site
shows its diagrams offline (Material would fetch mermaid's script from a CDN at view time). The page keeps the
mermaid source (GitHub renders it too); the site gets the drawing.

It reads the flowcharts these pages use: ``flowchart TD`` / ``LR`` (or ``graph``), nodes ``ID`` or ``ID["text"]``
(``<br/>`` breaks a line), edges ``A --> B`` and ``A -->|"text"| B``, chained (``A --> B --> C``). Anything else
fails the build naming the page and the line: a diagram is never shown as its source. The layout is layered, as
mermaid's: each node one layer after the longest path to it, an edge that spans layers bends through them, the
nodes of a layer ordered to keep the edges short.
"""

from __future__ import annotations

import functools
import html
import os
import re
from dataclasses import dataclass, field

FENCE = re.compile(r"^```mermaid[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
NODE = re.compile(r'\s*([A-Za-z_][\w]*)(?:\[\s*(?:"(.*?)"|([^\]"]*?))\s*\])?')
EDGE = re.compile(r'\s*-->\s*(?:\|\s*(?:"(.*?)"|([^|"]*?))\s*\|)?')
FONT, LINE, PAD_X, PAD_Y = 13, 17, 12, 8  # px: text size, line height, box padding
GAP_IN, GAP_ACROSS, GAP_EDGES = 28, 22, 10  # px between layers, between the nodes of a layer, between edges
SLACK = 1.12  # a browser's sans may be wider than the font measured
LABEL = 11  # px: an edge label's text size
SHRINK = 0.8  # the least a diagram is scaled to fit the page


class DiagramError(ValueError):
    pass


@dataclass
class Node:
    key: str
    lines: list[str] = field(default_factory=list)
    dummy: bool = False  # where an edge crosses a layer (with ``lines``: its label)
    layer: int = 0
    w: float = 0.0
    h: float = 0.0
    x: float = 0.0  # centre
    y: float = 0.0
    band: tuple[float, float] = (0.0, 0.0)  # its layer's extent along the flow


def parse(source: str) -> tuple[str, dict[str, Node], list[tuple[str, str, str]]]:
    """(direction TD or LR, the nodes by id in order of appearance, the edges (from, to, label))."""
    rows = [r.strip() for r in source.strip().splitlines() if r.strip() and not r.strip().startswith("%%")]
    head = re.fullmatch(r"(?:flowchart|graph)\s+(TD|TB|LR)", rows[0]) if rows else None
    if head is None:
        raise DiagramError(f"not a flowchart this site draws: {rows[0] if rows else '(empty)'!r}")
    nodes: dict[str, Node] = {}
    edges: list[tuple[str, str, str]] = []

    def node(row: str, at: int) -> tuple[str, int]:
        m = NODE.match(row, at)
        if m is None:
            raise DiagramError(f"no node at {row[at:]!r} in {row!r}")
        key, text = m.group(1), m.group(2) if m.group(2) is not None else m.group(3)
        n = nodes.setdefault(key, Node(key))
        if text is not None or not n.lines:
            n.lines = re.split(r"<br\s*/?>", text if text is not None else key)
        return key, m.end()

    for row in rows[1:]:
        prev, at = node(row, 0)
        while at < len(row):
            m = EDGE.match(row, at)
            if m is None:
                raise DiagramError(f'cannot read {row[at:]!r} in {row!r} (edges: A --> B, A -->|"text"| B)')
            label = m.group(1) if m.group(1) is not None else (m.group(2) or "")
            key, at = node(row, m.end())
            edges.append((prev, key, label))
            prev = key
    return head.group(1).replace("TB", "TD"), nodes, edges


@functools.cache
def _font() -> object:
    import matplotlib
    from PIL import ImageFont

    path = os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "fonts", "ttf", "DejaVuSans.ttf")
    return ImageFont.truetype(path, FONT)


def _width(text: str) -> float:
    """``text``'s width in px, measured in the font the SVG names (matplotlib's copy of DejaVu Sans)."""
    return _font().getlength(text) * SLACK


def layout(direction: str, nodes: dict[str, Node], edges: list[tuple[str, str, str]]) -> list[list[str]]:
    """Place the nodes (centres, sizes) as dagre does: a node's rank is the longest path to it; between two ranks a
    layer where the edges cross (an edge's label is a node there, so that labels and edges keep apart); an edge
    that spans ranks crosses every layer between. Returns each edge's path (the ids it passes)."""
    for _ in range(len(nodes)):  # longest path from a source (a cycle stops after as many rounds as nodes)
        moved = False
        for a, b, _ in edges:
            if a != b and nodes[b].layer < nodes[a].layer + 2:
                nodes[b].layer, moved = nodes[a].layer + 2, True
        if not moved:
            break
    paths = []
    for i, (a, b, label) in enumerate(edges):
        path = [a]
        for k in range(nodes[a].layer + 1, nodes[b].layer):
            d = nodes.setdefault(f"\0{i}.{k}", Node(f"\0{i}.{k}", dummy=True, layer=k))
            if label and k == nodes[a].layer + 1:
                d.lines = [label]
            path.append(d.key)
        paths.append([*path, b])
    tall = direction == "TD"
    for n in nodes.values():
        if n.lines:
            size = LABEL if n.dummy else FONT
            w = max(_width(t) for t in n.lines) * size / FONT + (8 if n.dummy else 2 * PAD_X)
            h = len(n.lines) * LINE * size / FONT + (2 if n.dummy else 2 * PAD_Y)
            n.w, n.h = w, h
    layers: dict[int, list[str]] = {}
    for key, n in nodes.items():
        layers.setdefault(n.layer, []).append(key)
    keys = [layers[layer] for layer in sorted(layers)]
    before = {k: [p[i - 1] for p in paths for i in range(1, len(p)) if p[i] == k] for k in nodes}
    after = {k: [p[i + 1] for p in paths for i in range(len(p) - 1) if p[i] == k] for k in nodes}
    order = {k: float(i) for row in keys for i, k in enumerate(row)}
    for sweep in range(8):  # barycentres: each node near the nodes its edges come from (then go to), in turn
        near = before if sweep % 2 == 0 else after
        for row in keys[1:] if sweep % 2 == 0 else keys[-2::-1]:
            row.sort(key=lambda k: sum(order[p] for p in near[k]) / len(near[k]) if near[k] else order[k])
            order.update({k: float(i) for i, k in enumerate(row)})
    across = {k: n.w if tall else n.h for k, n in nodes.items()}
    along = {k: n.h if tall else n.w for k, n in nodes.items()}
    pos: dict[str, float] = {}
    for row in keys:  # start: each layer's nodes side by side
        pos.update(zip(row, _spread([0.0] * len(row), [across[k] for k in row], [nodes[k].dummy for k in row])))
    for sweep in range(12):  # then each node towards its neighbours' mean, downwards then upwards, keeping the order
        near = before if sweep % 2 == 0 else after
        for row in keys[1:] if sweep % 2 == 0 else keys[-2::-1]:
            want = [sum(pos[p] for p in near[k]) / len(near[k]) if near[k] else pos[k] for k in row]
            pos.update(zip(row, _spread(want, [across[k] for k in row], [nodes[k].dummy for k in row])))
    low = min(pos[k] - across[k] / 2 for k in nodes)
    at = 0.0
    for row in keys:
        depth = max(along[k] for k in row)
        for k in row:
            n = nodes[k]
            n.x, n.y = (pos[k] - low, at + depth / 2) if tall else (at + depth / 2, pos[k] - low)
            n.band = (at, at + depth)
        at += depth + GAP_IN
    return paths


def _spread(want: list[float], size: list[float], dummy: list[bool]) -> list[float]:
    """Positions as near ``want`` as the order and the gaps between the nodes let them (the mean of packing from
    the left and from the right: both keep the gaps, so their mean does)."""
    sep = [(size[i] + size[i + 1]) / 2 + (GAP_EDGES if dummy[i] or dummy[i + 1] else GAP_ACROSS)
           for i in range(len(want) - 1)]  # fmt: skip
    left, right = list(want), list(want)
    for i in range(1, len(want)):
        left[i] = max(want[i], left[i - 1] + sep[i - 1])
    for i in range(len(want) - 2, -1, -1):
        right[i] = min(want[i], right[i + 1] - sep[i])
    return [(a + b) / 2 for a, b in zip(left, right)]


def svg(source: str, title: str = "diagram") -> str:
    """The flowchart ``source`` as one line of inline SVG (no blank line: Markdown passes it through as HTML)."""
    direction, nodes, edges = parse(source)
    paths = layout(direction, nodes, edges)
    tall, m = direction == "TD", 10
    width = max(n.x + n.w / 2 for n in nodes.values()) + 2 * m
    height = max(n.y + n.h / 2 for n in nodes.values()) + 2 * m
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="diagram" viewBox="0 0 {width:.0f} {height:.0f}" '
        f'width="{width:.0f}" role="img" aria-label="{html.escape(title)}" style="{_fit(width)}" '
        f'font-family="DejaVu Sans, Verdana, sans-serif" font-size="{FONT}">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>',
    ]
    labels = []
    for path in paths:
        first, last = nodes[path[0]], nodes[path[-1]]
        points = [(first.x, first.y + first.h / 2) if tall else (first.x + first.w / 2, first.y)]
        for k in path[1:-1]:  # (across its layer: in at one side, out at the other)
            n = nodes[k]
            points += [(n.x, n.band[0]), (n.x, n.band[1])] if tall else [(n.band[0], n.y), (n.band[1], n.y)]
            if n.lines:  # (its label, over it)
                x, y, text = n.x + m, n.y + m, html.escape(n.lines[0])
                labels.append(
                    f'<rect x="{x - n.w / 2:.1f}" y="{y - n.h / 2:.1f}" width="{n.w:.1f}" height="{n.h:.1f}" '
                    f'fill="#fff"/><text x="{x:.1f}" y="{y + 4:.1f}" text-anchor="middle" font-size="{LABEL}" '
                    f'fill="#333">{text}</text>'
                )
        points.append((last.x, last.y - last.h / 2) if tall else (last.x - last.w / 2, last.y))
        d = " ".join(f"{'M' if i == 0 else 'L'}{x + m:.1f},{y + m:.1f}" for i, (x, y) in enumerate(points))
        out.append(f'<path d="{d}" fill="none" stroke="#555" stroke-width="1.3" marker-end="url(#arrow)"/>')
    for n in nodes.values():
        if n.dummy:
            continue
        x, y = n.x + m - n.w / 2, n.y + m - n.h / 2
        out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{n.w:.1f}" height="{n.h:.1f}" rx="5" fill="#ede7f6" '
                   'stroke="#7e57c2" stroke-width="1.2"/>')  # fmt: skip
        top = n.y + m - (len(n.lines) - 1) * LINE / 2 + 4.5
        spans = "".join(
            f'<tspan x="{n.x + m:.1f}" y="{top + i * LINE:.1f}">{html.escape(t.strip())}</tspan>'
            for i, t in enumerate(n.lines)
        )
        out.append(f'<text text-anchor="middle" fill="#212121">{spans}</text>')
    return "".join([*out, *labels, "</svg>"])


def _fit(width: float) -> str:
    """The drawing's size on the page: the page's width, never under SHRINK of its own (its text stays legible: a
    wider one scrolls sideways), never over its own."""
    return f"width:100%;min-width:{width * SHRINK:.0f}px;max-width:{width:.0f}px;height:auto"


def on_page_markdown(markdown, page, config, files):  # noqa: ANN001, ANN201 - MkDocs' hook signature
    def drawn(m: re.Match) -> str:
        try:
            picture = svg(m.group(1), page.title or page.file.src_uri)
            return f'<div class="diagram" style="overflow-x:auto">{picture}</div>\n'
        except DiagramError as e:
            line = markdown[: m.start()].count("\n") + 1
            raise DiagramError(f"{page.file.src_uri}:{line}: the mermaid diagram cannot be drawn: {e}") from None

    return FENCE.sub(drawn, markdown)
