"""Small inline SVG charts for the HTML report: lines over x, and histograms. No scripts."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT = 600, 260
LEFT, RIGHT, TOP, BOTTOM = 60, 16, 28, 44
PALETTE = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")


@dataclass(frozen=True, slots=True)
class Series:
    """One line: its name in the legend, and its points (None leaves a gap)."""

    name: str
    xs: Sequence[float]
    ys: Sequence[float | None]


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About count round numbers spanning [low, high]."""
    if high <= low:
        high = low + 1.0
    raw = (high - low) / count
    step = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 5, 10):
        if raw <= factor * step:
            step *= factor
            break
    first = math.floor(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 2)]


def _log_ticks(low: float, high: float, count: int = 8) -> list[float]:
    """Powers of two spanning [low, high] (both positive), at most about count of them."""
    first, last = math.floor(math.log2(low)), math.ceil(math.log2(high))
    if last <= first:
        last = first + 1
    stride = max(1, math.ceil((last - first) / count))
    return [2.0**k for k in range(first, last + stride, stride)]


def _fmt(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 or value == int(value) else f"{value:.4g}"


def _frame(title: str, xlabel: str, ylabel: str, body: list[str]) -> str:
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{WIDTH}" '
        f'height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{escape(title)}">'
    )
    labels = [
        f'<text x="{WIDTH / 2}" y="16" text-anchor="middle" class="title">{escape(title)}</text>',
        f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 6}" text-anchor="middle">'
        f"{escape(xlabel)}</text>",
        f'<text x="14" y="{(TOP + HEIGHT - BOTTOM) / 2}" text-anchor="middle" '
        f'transform="rotate(-90 14 {(TOP + HEIGHT - BOTTOM) / 2})">{escape(ylabel)}</text>',
    ]
    return head + "".join(labels) + "".join(body) + "</svg>"


def _axes(x_ticks: list[float], y_ticks: list[float], sx, sy) -> list[str]:
    parts = []
    for y in y_ticks:
        parts.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" '
            'class="grid"/>'
            f'<text x="{LEFT - 4}" y="{sy(y) + 4:.1f}" text-anchor="end">{_fmt(y)}</text>'
        )
    for x in x_ticks:
        parts.append(
            f'<text x="{sx(x):.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">'
            f"{_fmt(x)}</text>"
        )
    parts.append(
        f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{HEIGHT - BOTTOM}" class="axis"/>'
        f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{HEIGHT - BOTTOM}" y2="{HEIGHT - BOTTOM}" '
        'class="axis"/>'
    )
    return parts


def empty(title: str) -> str:
    """A chart frame that says it has no data."""
    body = [
        f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" class="none">no data</text>'
    ]
    return _frame(title, "", "", body)


def line_chart(
    title: str,
    xlabel: str,
    ylabel: str,
    series: Sequence[Series],
    markers: bool = False,
    hline: tuple[float, str] | None = None,
    log_x: bool = False,
) -> str:
    """Lines (with optional point markers and one labelled horizontal line) on shared axes;
    log_x spaces x on a log scale (a search that doubles and bisects geometrically)."""
    points = [(x, y) for s in series for x, y in zip(s.xs, s.ys, strict=False) if y is not None]
    if log_x:
        points = [(x, y) for x, y in points if 0 < x < math.inf]
    if not points:
        return empty(title)
    xs = [x for x, _ in points]
    ys = [y for _, y in points] + ([hline[0]] if hline else [])
    x_ticks = _log_ticks(min(xs), max(xs)) if log_x else _ticks(min(xs), max(xs))
    y_ticks = _ticks(min(0.0, min(ys)), max(ys))
    x0, x1, y0, y1 = x_ticks[0], x_ticks[-1], y_ticks[0], y_ticks[-1]
    scale = math.log if log_x else (lambda x: x)

    def sx(x: float) -> float:
        span = (scale(x1) - scale(x0)) or 1.0
        return LEFT + (scale(x) - scale(x0)) / span * (WIDTH - LEFT - RIGHT)

    def sy(y: float) -> float:
        return HEIGHT - BOTTOM - (y - y0) / ((y1 - y0) or 1.0) * (HEIGHT - TOP - BOTTOM)

    body = _axes(x_ticks, y_ticks, sx, sy)
    if hline:
        level, label = hline
        body.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{sy(level):.1f}" y2="{sy(level):.1f}" '
            f'class="target"/><text x="{WIDTH - RIGHT - 4}" y="{sy(level) - 4:.1f}" '
            f'text-anchor="end">{escape(label)}</text>'
        )
    for i, s in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        runs: list[list[str]] = [[]]
        for x, y in zip(s.xs, s.ys, strict=False):
            if y is None or (log_x and not 0 < x < math.inf):
                runs.append([])
            else:
                runs[-1].append(f"{sx(x):.1f},{sy(y):.1f}")
        for run in runs:
            if len(run) > 1:
                body.append(
                    f'<polyline points="{" ".join(run)}" fill="none" stroke="{color}" '
                    'stroke-width="2"/>'
                )
        if markers or sum(len(r) for r in runs) == 1:
            for x, y in zip(s.xs, s.ys, strict=False):
                if y is not None and not (log_x and not 0 < x < math.inf):
                    body.append(
                        f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3.5" fill="{color}">'
                        f"<title>{escape(s.name)}: {_fmt(x)}, {_fmt(y)}</title></circle>"
                    )
        body.append(
            f'<rect x="{LEFT + 8 + 150 * i}" y="{TOP - 2}" width="10" height="10" '
            f'fill="{color}"/><text x="{LEFT + 22 + 150 * i}" y="{TOP + 7}">'
            f"{escape(s.name)}</text>"
        )
    return _frame(title, xlabel, ylabel, body)


def histogram(
    title: str, xlabel: str, edges: Sequence[float], counts: Sequence[float], color: str
) -> str:
    """Bars over bin edges (len(edges) == len(counts) + 1)."""
    if not counts or len(edges) != len(counts) + 1:
        return empty(title)
    x_ticks = _ticks(edges[0], edges[-1])
    y_ticks = _ticks(0.0, max(max(counts), 1))
    x0, x1, y1 = x_ticks[0], x_ticks[-1], y_ticks[-1]

    def sx(x: float) -> float:
        return LEFT + (x - x0) / ((x1 - x0) or 1.0) * (WIDTH - LEFT - RIGHT)

    def sy(y: float) -> float:
        return HEIGHT - BOTTOM - y / (y1 or 1.0) * (HEIGHT - TOP - BOTTOM)

    body = _axes(x_ticks, y_ticks, sx, sy)
    for low, high, count in zip(edges, edges[1:], counts, strict=False):
        if count:
            body.append(
                f'<rect x="{sx(low):.1f}" y="{sy(count):.1f}" '
                f'width="{max(sx(high) - sx(low) - 1, 1):.1f}" '
                f'height="{sy(0) - sy(count):.1f}" fill="{color}">'
                f"<title>{_fmt(low)}-{_fmt(high)}: {count:g}</title></rect>"
            )
    return _frame(title, xlabel, "count", body)
