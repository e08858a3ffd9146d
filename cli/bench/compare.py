"""`loomserve bench compare A.json B.json`: B's headline figures as ratios of A's, with noise.

With --repeats on both sides, each ratio of means has a 95 % interval (the delta method, with
Student's t on the smaller side's degrees of freedom); a ratio whose interval holds 1 is
within noise. A sweep is compared point by point at the values both files have; a search by
its answer.

A comparison is only as good as its runs: a run cut off by --duration (requests unfinished or
never sent) measured less than it was asked to, so a point with one gets no verdict; a run
where the server or the generator fell behind is named beside the figures.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .repeats import HEADLINE, HIGHER_IS_BETTER, headline_values, t_quantile
from .search import stopped_words


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
    caveats: tuple[str, ...] = ()  # what makes this point's runs less than they seem


def _runs(point: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs behind a point: each repeat, or the point itself."""
    return point.get("runs") or [point]


def cut_offs(point: dict[str, Any]) -> str | None:
    """Why a point's runs are incomplete (requests cut off by --duration), or None."""
    counts = []
    for run in _runs(point):
        summary = run.get("summary", {})
        cut = int(summary.get("unfinished") or 0) + int(summary.get("not_sent") or 0)
        if not cut and "server_pace" in run:
            cut = int(run["server_pace"].get("cut_off") or 0)
        counts.append((int(summary.get("completed") or 0), cut))
    cut_runs = [(done, cut) for done, cut in counts if cut]
    if not cut_runs:
        return None
    completed = ", ".join(f"{done} of {done + cut}" for done, cut in cut_runs)
    return f"{len(cut_runs)} of {len(counts)} runs cut off by --duration (completed {completed})"


def fell_behind(point: dict[str, Any]) -> list[str]:
    """Who fell behind in a point's runs: the server, the load generator, or neither."""
    runs = _runs(point)
    server = sum(not run.get("server_pace", {}).get("kept_up", True) for run in runs)
    generator = sum(not run.get("generator", {}).get("kept_up", True) for run in runs)
    notes = []
    if server:
        notes.append(f"the server fell behind in {server} of {len(runs)} runs")
    if generator:
        notes.append(f"the load generator fell behind in {generator} of {len(runs)} runs")
    return notes


def point_caveats(side: str, point: dict[str, Any]) -> tuple[str | None, list[str]]:
    """One side's reason to refuse a verdict (None: complete) and its other warnings."""
    incomplete = cut_offs(point)
    notes = [f"{side}: {note}" for note in fell_behind(point)]
    if stopped := point.get("stopped"):  # a search's answer
        notes.append(f"{side}: the search stopped: {stopped_words(stopped)}")
    return (f"{side}: {incomplete}" if incomplete else None), notes


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
        stopped = result["search"].get("stopped")
        point = {"summary": summary, "stopped": None if stopped == "converged" else stopped}
        return {"search answer": point}
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
        a_incomplete, a_notes = point_caveats("A", a_points[name])
        b_incomplete, b_notes = point_caveats("B", b_points[name])
        incomplete = [why for why in (a_incomplete, b_incomplete) if why]
        caveats = tuple(incomplete + a_notes + b_notes)
        a_samples, b_samples = samples(a_points[name]), samples(b_points[name])
        for figure in [k for k in a_samples if k in b_samples]:
            a, b = a_samples[figure], b_samples[figure]
            mean_a, mean_b = float(np.mean(a)), float(np.mean(b))
            ratio = mean_b / mean_a if mean_a else None
            interval = ratio_interval(a, b)
            said = verdict(figure, interval, ratio)
            if incomplete:  # figures of runs that did not finish compare nothing
                said = "no verdict: incomplete runs"
            rows.append(Comparison(name, figure, mean_a, mean_b, ratio, interval, said, caveats))
    return rows


def format_comparison(rows: list[Comparison], a_name: str, b_name: str) -> str:
    """The table `bench compare` prints."""
    lines = [f"A = {a_name}", f"B = {b_name}"]
    header = f"{'figure':<24} {'A':>10} {'B':>10} {'B/A':>7}  {'95% CI':<16} verdict"
    point = None
    for row in rows:
        if row.point != point:
            point = row.point
            lines += ["", f"[{point}]"]
            lines += [f"warning: {caveat}" for caveat in row.caveats]
            lines.append(header)
        ratio = f"{row.ratio:7.3f}" if row.ratio is not None else f"{'n/a':>7}"
        interval = f"[{row.interval[0]:.3f}, {row.interval[1]:.3f}]" if row.interval else "-"
        lines.append(
            f"{row.figure:<24} {row.a:>10.2f} {row.b:>10.2f} {ratio}  {interval:<16} {row.verdict}"
        )
    return "\n".join(lines)
