"""One finished run as the result JSON records it: summary, pace, warnings, curves.

The result JSON holds every figure the HTML report draws (timelines and histograms too), so
a report can be rebuilt from the JSON alone and a test can compare the two.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from . import report
from .classes import RequestClass, class_dict, class_metrics, format_class_table
from .honesty import cache_warning, pace_warning, server_pace
from .metrics import (
    BenchmarkMetrics,
    compute_metrics,
    meets_slos,
    output_timeline,
    pacing_stats,
    tpot_s,
)
from .records import RequestRecord
from .runner import RunResult

HISTOGRAM_BINS = 30


@dataclass(frozen=True, slots=True)
class PointSettings:
    """What summarizing a run needs to know of the invocation."""

    dataset: str
    seed: int
    slos_ms: dict[str, float]
    percentiles: tuple[float, ...]
    classes: tuple[RequestClass, ...] = ()
    save_detailed: bool = False
    token_counts: str = "estimated"  # how prompts were sized: "server /tokenize" or estimated


def input_source(run: RunResult, token_counts: str) -> str:
    """Where the input token total came from, for the summary line."""
    done = [r for r in run.records if r.success]
    if done and all(r.prompt_tokens is not None for r in done):
        return "server usage"
    return "server /tokenize" if token_counts.startswith("server") else "estimated"


def bucket_for(span_s: float) -> float:
    """A timeline bucket that gives about 40 or more steps in a run of this length."""
    return 1.0 if span_s >= 40 else 0.25 if span_s >= 10 else 0.1


def in_flight_timeline(records: Sequence[RequestRecord], bucket_s: float) -> list[int]:
    """Requests on the wire at the start of each bucket (of those that completed)."""
    spans = [
        (r.start_s, r.start_s + (r.e2e_s if r.e2e_s is not None else 0.0))
        for r in records
        if r.dispatched_s is not None and r.success
    ]
    if not spans:
        return []
    end = max(stop for _, stop in spans)
    ticks = np.arange(0.0, end + bucket_s, bucket_s)
    starts = np.sort([s for s, _ in spans])
    stops = np.sort([e for _, e in spans])
    running = np.searchsorted(starts, ticks, side="right") - np.searchsorted(stops, ticks, "right")
    return [int(n) for n in running]


def histogram(values_ms: Sequence[float]) -> dict[str, list[float]]:
    """Bin edges and counts of a latency, for the report's distribution plots."""
    if not values_ms:
        return {"edges_ms": [], "counts": []}
    counts, edges = np.histogram(np.asarray(values_ms, dtype=np.float64), bins=HISTOGRAM_BINS)
    return {"edges_ms": edges.tolist(), "counts": counts.tolist()}


def distributions(records: Sequence[RequestRecord]) -> dict[str, dict[str, list[float]]]:
    """TTFT, ITL, TPOT and E2E latency histograms of the completed requests."""
    done = [r for r in records if r.success]
    return {
        "ttft": histogram([r.ttft_s * 1000.0 for r in done if r.ttft_s is not None]),
        "itl": histogram([gap * 1000.0 for r in done for gap in r.itl_s]),
        "tpot": histogram([t * 1000.0 for r in done if (t := tpot_s(r)) is not None]),
        "e2el": histogram([r.e2e_s * 1000.0 for r in done if r.e2e_s is not None]),
    }


def attainment(records: Sequence[RequestRecord], slos_ms: dict[str, float]) -> float | None:
    """The share of all requests (failed and cut off ones included) within every SLO."""
    if not slos_ms or not records:
        return None
    return sum(r.success and meets_slos(r, slos_ms) for r in records) / len(records)


def summarize_run(
    run: RunResult,
    settings: PointSettings,
    echo: Callable[..., None],
    warn: Callable[[str], None],
) -> tuple[dict[str, Any], BenchmarkMetrics]:
    """Print one run's summary and warnings now, and return its point for the result JSON."""
    metrics = compute_metrics(run.records, run.duration_s, settings.slos_ms, settings.percentiles)
    pacing = pacing_stats(run.records, run.shape.request_rate)
    pace = server_pace(run.records, run.shape.request_rate, metrics.unfinished + metrics.not_sent)
    source = input_source(run, settings.token_counts)
    echo(report.format_summary(metrics, run, pacing, source, pace))
    server_notes = [
        pace_warning(pace),
        cache_warning(
            settings.dataset,
            metrics.total_input,
            metrics.total_cached,
            metrics.completed,
            settings.seed,
        ),
    ]
    # The server's own shortfalls first: they change what every figure below them means.
    notes = [n for n in server_notes if n] + report.run_warnings(metrics, run, pacing)
    for note in notes:
        warn(note)
    summary = report.summary_dict(metrics)
    summary["slo_attainment"] = attainment(run.records, settings.slos_ms)
    summary["offered_request_rate"] = run.shape.request_rate
    summary["completion_rate"] = pace.completion_rate
    bucket = bucket_for(metrics.duration_s)
    point: dict[str, Any] = {
        "shape": report.shape_dict(run),
        "seed": settings.seed,
        "summary": summary,
        "server_pace": asdict(pace) | {"kept_up": pace.kept_up},
        "generator": report.generator_dict(run, pacing),
        "warnings": notes,
        "timeline": {
            "bucket_s": bucket,
            "output_tokens_per_s": output_timeline(run.records, bucket),
            "in_flight": in_flight_timeline(run.records, bucket),
        },
        "distributions": distributions(run.records),
    }
    if settings.classes:
        rows = class_metrics(run.records, settings.classes, settings.percentiles)
        echo(format_class_table(rows))
        point["classes"] = {row.name: class_dict(row) for row in rows}
    if settings.save_detailed:
        point["requests"] = [report.request_dict(r) for r in run.records]
    return point, metrics
