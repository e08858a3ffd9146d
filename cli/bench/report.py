"""What a run leaves behind: the summary table, the result JSON, and the plots."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .honesty import ServerPace
from .metrics import BenchmarkMetrics, Distribution, PacingStats, output_timeline
from .records import RequestRecord
from .runner import RunResult

WIDTH = 50
LATENCIES = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def _row(label: str, value: object) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40} {value!s:<10}".rstrip()


def _percentile_name(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def format_summary(
    metrics: BenchmarkMetrics,
    run: RunResult,
    pacing: PacingStats,
    input_source: str,
    pace: ServerPace | None = None,
) -> str:
    """The end-of-run table, laid out like vLLM's "Serving Benchmark Result"."""
    shape = run.shape
    lines = [" Serving Benchmark Result ".center(WIDTH, "=")]
    lines.append(_row("Successful requests:", metrics.completed))
    lines.append(_row("Failed requests:", metrics.failed))
    lines += [_row(f"  {kind}:", count) for kind, count in metrics.failures.items()]
    if metrics.unfinished or metrics.not_sent:
        lines.append(_row("Cut off by --duration (unfinished):", metrics.unfinished))
        lines.append(_row("Never sent (--duration ran out):", metrics.not_sent))
    if shape.max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", shape.max_concurrency))
    if math.isfinite(shape.request_rate):
        lines.append(_row("Request rate configured (RPS):", float(shape.request_rate)))
    lines.append(_row("Benchmark duration (s):", metrics.duration_s))
    lines.append(_row(f"Total input tokens ({input_source}):", metrics.total_input))
    if metrics.total_cached is not None:
        lines.append(_row("Cached input tokens (server usage):", metrics.total_cached))
    lines.append(_row("Total generated tokens:", metrics.total_output))
    lines.append(_row("Request throughput (req/s):", metrics.request_throughput))
    if pace is not None and math.isfinite(shape.request_rate):
        # Beside the offered rate: a server that falls behind completes fewer than it is sent.
        served = "n/a" if pace.completion_rate is None else f"{pace.completion_rate:.2f}"
        verdict = "" if pace.kept_up else " (FELL BEHIND)"
        lines.append(
            _row(
                "Completion rate while sending (req/s):",
                f"{served} of {shape.request_rate:.2f} offered",
            )
            + verdict
        )
    if pace is not None and shape.max_concurrency is not None:
        lines.append(_row("Mean wait for a concurrency slot (ms):", pace.mean_slot_wait_ms))
    if metrics.request_goodput is not None:
        lines.append(_row("Request goodput (req/s):", metrics.request_goodput))
    lines.append(_row("Output token throughput (tok/s):", metrics.output_throughput))
    lines.append(_row("Peak output token throughput (tok/s):", metrics.peak_output_throughput))
    lines.append(_row("Peak concurrent requests:", metrics.peak_concurrency))
    lines.append(_row("Total Token throughput (tok/s):", metrics.total_token_throughput))
    for key, short, title in LATENCIES:
        dist: Distribution = getattr(metrics, key)
        lines.append(title.center(WIDTH, "-"))
        if dist.count == 0:
            lines.append(_row(f"{short} (ms):", "n/a (no samples)"))
            continue
        lines.append(_row(f"Mean {short} (ms):", dist.mean_ms))
        lines.append(_row(f"Median {short} (ms):", dist.median_ms))
        lines.append(_row(f"Std {short} (ms):", dist.std_ms))
        for p, value in dist.percentiles_ms.items():
            lines.append(_row(f"{_percentile_name(p).upper()} {short} (ms):", value))
    lines.append(" Load generator ".center(WIDTH, "-"))
    if pacing.achieved_rate is not None:
        achieved = f"{pacing.achieved_rate:.2f} of {pacing.requested_rate:.2f}"
        lines.append(_row("Achieved send rate (req/s):", achieved))
    lines.append(_row("Max send lag behind schedule (ms):", pacing.max_lag_ms))
    lines.append(_row("Client CPU (% of one core):", _cpu_percent(run)))
    lines.append(_row("Client event-loop max lag (ms):", run.loop_lag_max_ms))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _cpu_percent(run: RunResult) -> float:
    return 100.0 * run.client_cpu_s / run.duration_s if run.duration_s > 0 else 0.0


def run_warnings(metrics: BenchmarkMetrics, run: RunResult, pacing: PacingStats) -> list[str]:
    """What makes this run's numbers less than they seem, in words."""
    notes = []
    if not pacing.kept_up:
        achieved = f"{pacing.achieved_rate:.2f}" if pacing.achieved_rate is not None else "n/a"
        notes.append(
            f"the load generator fell behind its schedule: achieved {achieved} of "
            f"{pacing.requested_rate:.2f} req/s, {pacing.late} requests sent more than 10 ms "
            f"late, at worst {pacing.max_lag_ms:.1f} ms; the offered load was lower than asked"
        )
    if run.loop_lag_max_ms > 50.0:
        notes.append(
            f"the client's event loop stalled for up to {run.loop_lag_max_ms:.0f} ms: "
            "latencies include client delay (is the machine overloaded?)"
        )
    if _cpu_percent(run) > 80.0:
        notes.append(
            f"the client used {_cpu_percent(run):.0f}% of a core: it may be the bottleneck "
            "(see `loomserve bench --self-test`)"
        )
    if metrics.usage_missing:
        notes.append(
            f"{metrics.usage_missing} responses carried no usage: their output tokens were "
            "counted from the stream (max_tokens when it ended for length, else one per "
            "token event)"
        )
    if metrics.short_outputs:
        notes.append(
            f"{metrics.short_outputs} requests stopped before max_tokens (does the server "
            "honour ignore_eos?): runs with different output lengths are not comparable"
        )
    if metrics.completed == 0:
        notes.append("no request succeeded: check --base-url, --model and the server's logs")
    return notes


def _distribution_fields(key: str, dist: Distribution) -> dict[str, float | None]:
    fields = {
        f"mean_{key}_ms": dist.mean_ms,
        f"median_{key}_ms": dist.median_ms,
        f"std_{key}_ms": dist.std_ms,
    }
    fields |= {f"{_percentile_name(p)}_{key}_ms": v for p, v in dist.percentiles_ms.items()}
    return fields


def summary_dict(metrics: BenchmarkMetrics) -> dict[str, Any]:
    """The summary with vLLM's key names (mean_ttft_ms, p99_itl_ms, request_goodput, ...)."""
    summary: dict[str, Any] = {
        "completed": metrics.completed,
        "failed": metrics.failed,
        "failures": metrics.failures,
        "unfinished": metrics.unfinished,
        "not_sent": metrics.not_sent,
        "duration": metrics.duration_s,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "total_cached_tokens": metrics.total_cached,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.peak_output_throughput,
        "max_concurrent_requests": metrics.peak_concurrency,
        "usage_missing": metrics.usage_missing,
        "short_outputs": metrics.short_outputs,
    }
    for key, _, _ in LATENCIES:
        summary |= _distribution_fields(key, getattr(metrics, key))
    return summary


def generator_dict(run: RunResult, pacing: PacingStats) -> dict[str, Any]:
    """The generator's own overhead and timekeeping."""
    return asdict(pacing) | {
        "kept_up": pacing.kept_up,
        "client_cpu_s": run.client_cpu_s,
        "client_cpu_percent": _cpu_percent(run),
        "loop_lag_max_ms": run.loop_lag_max_ms,
    }


def request_dict(record: RequestRecord) -> dict[str, Any]:
    """One request, every timing kept (seconds), for --save-detailed."""
    return {
        "index": record.index,
        "request_id": record.request_id,
        "class": record.label,
        "scheduled_s": record.scheduled_s,
        "dispatched_s": record.dispatched_s,
        "taken_up_s": record.taken_up_s,
        "start_s": record.start_s,
        "ttft_s": record.ttft_s,
        "itl_s": record.itl_s,
        "e2e_s": record.e2e_s,
        "prompt_tokens": record.input_tokens,
        "prompt_tokens_from_server": record.prompt_tokens is not None,
        "cached_tokens": record.cached_tokens,
        "output_tokens": record.output_tokens,
        "max_tokens": record.max_tokens,
        "chunks": record.chunks,
        "finish_reason": record.finish_reason,
        "usage_reported": record.usage_reported,
        "error_kind": record.error_kind,
        "error": record.error,
    }


def shape_dict(run: RunResult) -> dict[str, Any]:
    return asdict(run.shape)


def _finite(value: Any) -> Any:
    """value with every non-finite float spelled as a string, which strict JSON allows."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite(v) for key, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def write_json(path: Path, result: dict[str, Any]) -> None:
    """Write the result file; infinities spelled "inf" so any JSON reader can load it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(result), indent=2, allow_nan=False) + "\n")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(path: Path, records: Sequence[RequestRecord], title: str) -> None:
    """TTFT and ITL histograms and output throughput over time, side by side, as one PNG."""
    plt = _pyplot()
    done = [r for r in records if r.success]
    ttfts = [r.ttft_s * 1000.0 for r in done if r.ttft_s is not None]
    itls = [gap * 1000.0 for r in done for gap in r.itl_s]
    span = max((r.start_s + (r.e2e_s or 0.0) for r in done), default=0.0)
    bucket_s = 1.0 if span >= 40 else 0.25 if span >= 10 else 0.1  # ~40+ steps in any run
    timeline = output_timeline(records, bucket_s)
    fig, (ax_ttft, ax_itl, ax_tput) = plt.subplots(1, 3, figsize=(15, 4.2))
    ax_ttft.hist(ttfts or [0.0], bins=40, color="#4c72b0")
    ax_ttft.set(title="Time to first token", xlabel="ms", ylabel="requests")
    ax_itl.hist(itls or [0.0], bins=60, color="#55a868")
    ax_itl.set(title="Inter-token latency", xlabel="ms", ylabel="gaps")
    ax_itl.set_yscale("log")
    ax_tput.stairs(timeline, [i * bucket_s for i in range(len(timeline) + 1)], color="#c44e52")
    ax_tput.set(
        title=f"Output throughput ({bucket_s:g} s buckets)",
        xlabel="seconds since start",
        ylabel="tokens/s",
    )
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_sweep_table(parameter: str, points: Sequence[tuple[float, dict[str, Any]]]) -> str:
    """One line per sweep point from its summary (the means, under --repeats): the value,
    throughputs, and median/p99 latencies."""
    header = (
        f"{parameter:>16} {'ok':>5} {'fail':>5} {'req/s':>8} {'out tok/s':>10} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'ITL p99':>9}"
    )

    def ms(value: float | None) -> str:
        return f"{value:9.1f}" if value is not None else f"{'n/a':>9}"

    rows = [" Sweep ".center(len(header), "="), header]
    for value, m in points:
        rows.append(
            f"{value:>16g} {m['completed']:>5} {m['failed']:>5} {m['request_throughput']:>8.2f} "
            f"{m['output_throughput']:>10.1f} {ms(m.get('median_ttft_ms'))} "
            f"{ms(m.get('p99_ttft_ms'))} {ms(m.get('median_tpot_ms'))} "
            f"{ms(m.get('p99_tpot_ms'))} {ms(m.get('p99_itl_ms'))}"
        )
    rows.append("=" * len(header))
    return "\n".join(rows)


def plot_sweep(
    path: Path, parameter: str, points: Sequence[tuple[float, BenchmarkMetrics]]
) -> None:
    """Throughput against latency, one marker per sweep point, labelled with its value."""
    plt = _pyplot()
    tput = [m.output_throughput for _, m in points]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, name in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
        median = [getattr(m, key).median_ms or math.nan for _, m in points]
        p99 = [getattr(m, key).percentiles_ms.get(99.0, math.nan) for _, m in points]
        ax.plot(tput, median, "o-", label=f"median {name}")
        ax.plot(tput, p99, "s--", label=f"p99 {name}")
        for (value, _), x, y in zip(points, tput, median, strict=True):
            ax.annotate(f"{value:g}", (x, y), textcoords="offset points", xytext=(4, 4))
        ax.set(xlabel="output throughput (tokens/s)", ylabel=f"{name} (ms)")
        ax.set_title(f"{name} against throughput, labelled by {parameter}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
