"""The drawing of a run's time line (:mod:`pitstop.goodput.timeline` reads it): per run (or replica group) two rows
on one wall clock: the steps each attempt reached (with its saves, evaluations, skipped steps, rollbacks,
corruptions found and slow ranks named), and under it where each attempt's time went, each stretch where it
happened. The legend lists only what the picture shows; the attempts' labels are stacked so that none covers
another."""

from __future__ import annotations

from pitstop.goodput.timeline import ORDER, Attempt, Line

# fixed colours, so that pictures compare
COLOURS = {
    "program_start": "#9e9e9e",
    "health": "#80cbc4",
    "init": "#bdbdbd",
    "restore": "#ffb74d",
    "compile": "#8e24aa",
    "compute": "#43a047",
    "data_wait": "#e53935",
    "eval": "#1e88e5",
    "checkpoint": "#fdd835",
    "instability": "#ff6f00",
    "recovery_gap": "#eeeeee",
    "straggler": "#f06292",
    "sdc": "#4a148c",
    "quorum": "#00acc1",
}
NAMES = {
    "program_start": "program start",
    "data_wait": "data wait",
    "eval": "evaluation",
    "recovery_gap": "between attempts",
    "instability": "step skipped (instability)",
    "checkpoint": "checkpoint (blocking)",
}
ENDS = {
    "finished": ("#2e7d32", "finished"),
    "failed": ("#c62828", "failed"),
    "hung": ("#ef6c00", "hung"),
    "preempted": ("#6a1b9a", "preempted"),
    "reformed": ("#6a1b9a", "re-formed without a slow node"),
    "running": ("#c62828", "killed"),
}
BAR = 0.5  # the lane's bar height (y from -BAR/2 to BAR/2); labels stack above it
ROW = 0.55  # one level of labels


def name(what: str) -> str:
    return NAMES.get(what, what.replace("_", " "))


def said(a: Attempt) -> str:
    """An attempt's label: its number, where it resumed, how it ended."""
    how = ENDS.get(a.status, ENDS["running"])[1]
    if a.last_step is not None:
        how += f" at step {a.last_step}" if a.status == "finished" else f" after step {a.last_step}"
    return f"attempt {a.number}" + (f" (from step {a.resumed_from})" if a.resumed_from is not None else "") + f": {how}"


def draw(found: list[Line], path: str) -> str:
    """Draw ``found`` (one panel each) to ``path``; returns it."""
    import matplotlib.pyplot as plt

    fig = figure(found)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figure(found: list[Line]) -> object:
    """The picture of ``found`` (one panel each), laid out: a matplotlib Figure (its caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(11, 1.4 + 3.4 * len(found)), layout="constrained", dpi=110)
    grid = fig.add_gridspec(2 * len(found), 1, height_ratios=[2.0, 1.4] * len(found))
    lanes, markers = [], {}
    for i, line in enumerate(found):
        top = fig.add_subplot(grid[2 * i])
        lane = fig.add_subplot(grid[2 * i + 1], sharex=top)
        markers.update(_steps(top, lane, line))
        lanes.append((lane, _lane(lane, line)))
        top.tick_params(labelbottom=False, labelsize=7)
        lane.set_xlabel("seconds since the job started" if i == len(found) - 1 else "", fontsize=8)
    fig.legend(handles=_legend(found, markers), loc="outside lower center", ncol=5, fontsize=7, frameon=False)
    fig.canvas.draw()
    for lane, labels in lanes:
        _stack(lane, labels)
    fig.canvas.draw()
    return fig


def _steps(top: object, lane: object, line: Line) -> dict[str, object]:
    """The upper row: the steps reached (a resumed attempt goes back to its checkpoint's step) and the marks on them;
    returns the legend's entries for the marks drawn."""
    from matplotlib.lines import Line2D

    used: dict[str, object] = {}
    top.set_title(line.name, fontsize=9, loc="left")
    top.set_ylabel("step", fontsize=8)
    top.plot([t for t, _ in line.steps], [s for _, s in line.steps], ".", color="#212121", markersize=2.5)
    if line.steps:
        used["step"] = Line2D([], [], marker=".", color="#212121", linestyle="none", label="a step")
    marks = [
        (line.saves, "v", "#f9a825", "a save"),
        (line.evals, "o", "#1565c0", "an evaluation"),
        (line.skips, "X", COLOURS["instability"], "a step skipped"),
        (line.rollbacks, "<", "#000000", "rolled back to"),
        (line.sdc, "X", COLOURS["sdc"], "a corruption found"),
    ]
    for points, marker, colour, label in marks:
        if points:
            top.plot([t for t, _ in points], [s for _, s in points], marker, color=colour, markersize=5,
                     linestyle="none")  # fmt: skip
            used[label] = Line2D([], [], marker=marker, color=colour, linestyle="none", label=label)
    last = max((a.end for a in line.attempts), default=0.0)
    for t, s in line.skips:  # (to the left of its mark in the right part of the picture: it stays inside)
        right = t > 0.6 * last
        top.annotate(f"step {s} skipped", (t, s), xytext=(-6 if right else 6, 8), textcoords="offset points",
                     ha="right" if right else "left", fontsize=7, color=COLOURS["instability"])  # fmt: skip
    for t, s, since, rank in line.stragglers:  # (named at step `s`, slow since step `since`)
        began = slow_since(line, t, since)
        for ax in (top, lane):
            ax.axvline(t, color=COLOURS["straggler"], linestyle="--", linewidth=1.2)
            ax.axvspan(began, t, color=COLOURS["straggler"], alpha=0.12, linewidth=0)
        top.annotate(f"rank {rank} named slow at step {s}\n(slow since step {since})", (t, 0.06),
                     xycoords=("data", "axes fraction"), xytext=(-4, 0), textcoords="offset points", ha="right",
                     fontsize=7, color="#ad1457")  # fmt: skip
        used["slow rank"] = Line2D([], [], color=COLOURS["straggler"], linestyle="--", label="a slow rank named")
    for a in line.attempts:
        for h in a.heals:
            top.axvline(h, color=COLOURS["quorum"], linestyle=":", linewidth=1)
            used["heal"] = Line2D([], [], color=COLOURS["quorum"], linestyle=":", label="a heal from a peer")
    top.grid(axis="y", color="#eeeeee")
    return used


def _lane(lane: object, line: Line) -> list[tuple[float, float, object]]:
    """The lower row: each stretch of time where it happened, how each attempt ended; returns the attempts' labels
    (where each starts, where its attempt ends, the text) for :func:`_stack` to place."""
    for what in ORDER:
        spans = [(s.start, s.end - s.start) for s in line.spans if s.what == what and s.end > s.start]
        if spans:
            gap = what == "recovery_gap"
            lane.broken_barh(spans, (-BAR / 2, BAR), facecolors=COLOURS[what], edgecolor="#9e9e9e" if gap else "none",
                             hatch="//" if gap else None, linewidth=0.5 if gap else 0)  # fmt: skip
    labels = []
    for a in line.attempts:
        colour = ENDS.get(a.status, ENDS["running"])[0]
        lane.plot([a.end], [0], marker="|" if a.status == "finished" else "x", color=colour, markersize=14, mew=2)
        text = lane.text(a.start, BAR / 2 + 0.1, said(a), fontsize=7, color=colour, va="bottom", zorder=4,
                         bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.6, "alpha": 0.9})  # fmt: skip
        labels.append((a.start, a.end, text))  # (its white ground hides a higher label's leader behind it)
    lane.set_yticks([])
    lane.set_ylim(-BAR / 2 - 0.15, BAR / 2 + ROW)
    return labels


def _stack(lane: object, labels: list[tuple[float, float, object]]) -> None:
    """Stack the attempts' labels in levels so that none covers another: each goes on the lowest level whose labels
    end (with a margin) before it starts; a label that would run past the right edge ends there instead."""
    renderer = lane.figure.canvas.get_renderer()
    to_data = lane.transData.inverted()
    left, right = lane.get_xlim()
    ends: list[float] = []  # per level: where its last label ends
    for start, _, text in labels:
        box = text.get_window_extent(renderer)
        width = (to_data.transform((box.x1, 0))[0] - to_data.transform((box.x0, 0))[0]) * 1.15
        x = max(left, min(start, right - width))
        level = next((k for k, end in enumerate(ends) if end <= x), len(ends))
        ends[level : level + 1] = [x + width]
        text.set_position((x, BAR / 2 + 0.1 + level * ROW))
        if x != start:
            lane.plot([start, start], [BAR / 2, BAR / 2 + 0.1 + level * ROW], color=text.get_color(), linewidth=0.6,
                      zorder=3)  # fmt: skip
    lane.set_ylim(-BAR / 2 - 0.15, BAR / 2 + max(1, len(ends)) * ROW + 0.1)


def _legend(found: list[Line], markers: dict[str, object]) -> list[object]:
    """Only what the picture shows: the kinds of stretch present, the marks drawn, the ends met."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    present = {w for line in found for w in line.present()}
    handles: list[object] = [
        Patch(facecolor=COLOURS[w], label=name(w), hatch="//" if w == "recovery_gap" else None, edgecolor="#9e9e9e")
        for w in ORDER
        if w in present
    ]
    handles += markers.values()
    ends = {a.status if a.status in ENDS else "running" for line in found for a in line.attempts}
    for status in ENDS:
        if status in ends:
            colour, how = ENDS[status]
            handles.append(Line2D([], [], marker="|" if status == "finished" else "x", color=colour, linestyle="none",
                                  markersize=9, mew=2, label=f"an attempt {how}"))  # fmt: skip
    return handles


def slow_since(line: Line, t: float, since: int) -> float:
    """When the rank named at time ``t`` became slow: the time of its first step at or past ``since`` in the
    attempt that named it (a resumed run has some steps twice, the earlier ones in an attempt before)."""
    attempt = next((a for a in line.attempts if a.start <= t <= a.end), None)
    first = attempt.start if attempt else float("-inf")
    return next((u for u, k in line.steps if k >= since and first <= u <= t), t)
