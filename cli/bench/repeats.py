"""--repeats N: each point run N times, its headline figures as a mean with a 95 % interval.

The interval is Student's t on the runs' values (they are few, and each is already an
average of many requests). `loomserve bench compare` reads these to tell a difference from
noise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

# The figures a reader compares; lower is better for latencies, higher for throughputs.
HEADLINE = (
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "completion_rate",
    "slo_attainment",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
)
HIGHER_IS_BETTER = frozenset(
    {
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "completion_rate",
        "slo_attainment",
    }
)
# Two-sided 97.5 % quantiles of Student's t for 1..30 degrees of freedom (numpy has no ppf).
T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t_quantile(df: int) -> float:
    """The 97.5 % quantile of Student's t with df degrees of freedom (normal beyond 30)."""
    if df < 1:
        return math.inf
    return T_975[df - 1] if df <= len(T_975) else 1.96


def mean_ci(values: Sequence[float]) -> tuple[float, float, float]:
    """Mean and 95 % interval of values; one value has an unbounded interval."""
    data = np.asarray(values, dtype=np.float64)
    mean = float(np.mean(data))
    if len(data) < 2:
        return mean, -math.inf, math.inf
    half = t_quantile(len(data) - 1) * float(np.std(data, ddof=1)) / math.sqrt(len(data))
    return mean, mean - half, mean + half


def headline_values(summary: dict[str, Any]) -> dict[str, float]:
    """The headline figures a summary has (numbers only)."""
    return {
        key: float(summary[key])
        for key in HEADLINE
        if isinstance(summary.get(key), int | float) and math.isfinite(summary[key])
    }


def combine(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """N runs' points as one: the first run's curves, mean figures, intervals, every run."""
    figures: dict[str, dict[str, Any]] = {}
    per_run = [headline_values(p["summary"]) for p in points]
    for key in HEADLINE:
        values = [run[key] for run in per_run if key in run]
        if len(values) != len(points):
            continue  # missing in some run: no honest mean
        mean, low, high = mean_ci(values)
        # Every headline figure is a rate, a share or a time: none below zero.
        figures[key] = {"mean": mean, "ci95": [max(0.0, low), high], "values": values}
    combined = dict(points[0])
    summary = dict(points[0]["summary"])
    summary |= {key: figure["mean"] for key, figure in figures.items()}
    combined["summary"] = summary
    combined["repeats"] = {"n": len(points), "figures": figures}
    combined["runs"] = [{k: v for k, v in p.items() if k != "requests"} for p in points]
    combined["warnings"] = sorted({w for p in points for w in p.get("warnings", [])})
    return combined


def format_repeats(combined: dict[str, Any]) -> str:
    """The headline figures' means and intervals, one per line."""
    repeats = combined["repeats"]
    lines = [f" Mean of {repeats['n']} runs, 95% CI ".center(60, "=")]
    for key, figure in repeats["figures"].items():
        low, high = figure["ci95"]
        lines.append(f"{key:<28} {figure['mean']:>10.2f}  [{low:.2f}, {high:.2f}]")
    lines.append("=" * 60)
    return "\n".join(lines)
