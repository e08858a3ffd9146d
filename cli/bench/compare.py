"""`loomserve bench compare A.json B.json`: B's headline figures as ratios of A's, with noise.

With --repeats on both sides, each ratio of means has a 95 % interval (the delta method, with
Student's t on the smaller side's degrees of freedom); a ratio whose interval holds 1 is
within noise. A sweep is compared point by point at the values both files have; a search by
its answer.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loomserve.cli.bench.repeats import HEADLINE, HIGHER_IS_BETTER, headline_values, t_quantile


@dataclass(frozen=True, slots=True)
class Comparison:
    """One figure of one point in both files."""

    point: str
    figure: str
    a: float
    b: float
    ratio: float | None  # b / a; None when a is 0
    interval: tuple[float, float] | None  # 95 % interval of the ratio; None without repeats
    verdict: str


def load_points(path: Path) -> dict[str, dict[str, Any]]:
    """The comparable points of a result file, by name: "run", "max-concurrency=4", ..."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a result JSON ({exc})") from None
    if not isinstance(result, dict):
        raise ValueError(f"{path}: not a result JSON")
    if "sweep" in result:
        parameter = result["sweep"]["parameter"]
        return {f"{parameter}={_value(p['value'])}": p for p in result["sweep"]["points"]}
    if "search" in result:
        answer = result["search"].get("answer") or {}
        value = answer.get("value")
        summary = {f"{result['search']['mode']}": value} if value is not None else {}
        return {"search answer": {"summary": summary}}
    if "summary" not in result:
        raise ValueError(f"{path}: has no summary, sweep or search")
    return {"run": result}


def _value(value: Any) -> str:
    """A sweep value as its point's name: 4 and 4.0 alike; "inf" as written."""
    return f"{value:g}" if isinstance(value, int | float) else str(value)


def samples(point: dict[str, Any]) -> dict[str, list[float]]:
    """Each figure's values: one per repeat, or the single run's."""
    figures = point.get("repeats", {}).get("figures")
    if figures:
        return {key: list(f["values"]) for key, f in figures.items()}
    values = headline_values(point.get("summary", {}))
    for key, value in point.get("summary", {}).items():  # a search's answer, say
        if key not in values and key not in HEADLINE and isinstance(value, int | float):
            values[key] = float(value)
    return {key: [value] for key, value in values.items()}


def ratio_interval(a: list[float], b: list[float]) -> tuple[float, float] | None:
    """The 95 % interval of mean(b)/mean(a), or None when either side has one value."""
    if len(a) < 2 or len(b) < 2:
        return None
    mean_a, mean_b = float(np.mean(a)), float(np.mean(b))
    if mean_a == 0 or mean_b == 0:
        return None
    ratio = mean_b / mean_a
    relative = np.var(a, ddof=1) / (len(a) * mean_a**2) + np.var(b, ddof=1) / (len(b) * mean_b**2)
    half = t_quantile(min(len(a), len(b)) - 1) * ratio * math.sqrt(float(relative))
    return max(0.0, ratio - half), ratio + half  # a ratio of positive figures


def verdict(figure: str, interval: tuple[float, float] | None, ratio: float | None) -> str:
    if ratio is None:
        return "n/a"
    if interval is None:
        return "no interval (use --repeats)"
    low, high = interval
    if low <= 1.0 <= high:
        return "within noise"
    higher = low > 1.0
    better = higher == (figure in HIGHER_IS_BETTER or not figure.endswith("_ms"))
    return "B better" if better else "B worse"


def compare(a_path: Path, b_path: Path) -> list[Comparison]:
    """Every figure of every point both files have."""
    a_points, b_points = load_points(a_path), load_points(b_path)
    shared = [name for name in a_points if name in b_points]
    if not shared:
        raise ValueError(f"{a_path} and {b_path} have no point in common")
    rows = []
    for name in shared:
        a_samples, b_samples = samples(a_points[name]), samples(b_points[name])
        for figure in [k for k in a_samples if k in b_samples]:
            a, b = a_samples[figure], b_samples[figure]
            mean_a, mean_b = float(np.mean(a)), float(np.mean(b))
            ratio = mean_b / mean_a if mean_a else None
            interval = ratio_interval(a, b)
            rows.append(
                Comparison(
                    name, figure, mean_a, mean_b, ratio, interval, verdict(figure, interval, ratio)
                )
            )
    return rows


def format_comparison(rows: list[Comparison], a_name: str, b_name: str) -> str:
    """The table `bench compare` prints."""
    lines = [f"A = {a_name}", f"B = {b_name}"]
    header = f"{'figure':<24} {'A':>10} {'B':>10} {'B/A':>7}  {'95% CI':<16} verdict"
    point = None
    for row in rows:
        if row.point != point:
            point = row.point
            lines += ["", f"[{point}]", header]
        ratio = f"{row.ratio:7.3f}" if row.ratio is not None else f"{'n/a':>7}"
        interval = f"[{row.interval[0]:.3f}, {row.interval[1]:.3f}]" if row.interval else "-"
        lines.append(
            f"{row.figure:<24} {row.a:>10.2f} {row.b:>10.2f} {ratio}  {interval:<16} {row.verdict}"
        )
    return "\n".join(lines)
