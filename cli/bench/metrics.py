"""Benchmark metrics from request records: pure computation, defined as vLLM's benchmark does.

- TTFT: request on the wire (dialled, or its head written) → first chunk carrying a token.
  ITL: the gaps between such chunks.
- TPOT = (E2E − TTFT) / (output tokens − 1), for requests with more than one output token.
- E2E latency: request on the wire → last event of the stream.
- Throughputs count completed requests and their tokens over the benchmark duration.
- Goodput: completed requests per second that meet every SLO (a one-token answer has TPOT 0).
- Mean, median and std are numpy's; percentiles are numpy's linear interpolation.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .records import NOT_SENT, UNFINISHED, RequestRecord

SLO_METRICS = ("ttft", "tpot", "e2el")
LATE_S = 0.010  # a request released this much after its due time counts as late


@dataclass(frozen=True, slots=True)
class Distribution:
    """Summary statistics of one latency, in milliseconds; None when there were no samples."""

    count: int
    mean_ms: float | None
    median_ms: float | None
    std_ms: float | None
    percentiles_ms: dict[float, float]  # percentile (e.g. 99.0) → value


def distribution(values_s: Sequence[float], percentiles: Sequence[float]) -> Distribution:
    """Mean, median, population std and percentiles of values given in seconds."""
    if not values_s:
        return Distribution(0, None, None, None, {})
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return Distribution(
        count=len(ms),
        mean_ms=float(np.mean(ms)),
        median_ms=float(np.median(ms)),
        std_ms=float(np.std(ms)),
        percentiles_ms={float(p): float(np.percentile(ms, p)) for p in percentiles},
    )


def parse_slos(specs: Iterable[str]) -> dict[str, float]:
    """SLOs in milliseconds from "ttft:500", "tpot:50 e2el:2000" or "ttft:500,tpot:50"."""
    slos: dict[str, float] = {}
    for spec in specs:
        for item in spec.replace(",", " ").split():
            name, sep, value = item.partition(":")
            name = name.strip().lower()
            if not sep or name not in SLO_METRICS:
                raise ValueError(f"bad SLO {item!r}: expected one of {SLO_METRICS} as NAME:MS")
            try:
                slos[name] = float(value)
            except ValueError:
                raise ValueError(f"bad SLO {item!r}: {value!r} is not a number of ms") from None
            if slos[name] < 0:
                raise ValueError(f"bad SLO {item!r}: must not be negative")
    return slos


def tpot_s(record: RequestRecord) -> float | None:
    """Time per output token after the first, or None for answers of one token or fewer."""
    if record.output_tokens <= 1 or record.e2e_s is None or record.ttft_s is None:
        return None
    return (record.e2e_s - record.ttft_s) / (record.output_tokens - 1)


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Whether a completed request is within every SLO (inclusive, as vLLM compares)."""
    values_s = {"ttft": record.ttft_s, "tpot": tpot_s(record) or 0.0, "e2el": record.e2e_s}
    return all((values_s[name] or 0.0) * 1000.0 <= slo for name, slo in slos_ms.items())


def token_times(record: RequestRecord) -> tuple[list[float], float]:
    """Offsets from the benchmark start at which text chunks arrived, and tokens per chunk."""
    if record.ttft_s is None:
        return [], 0.0
    times = np.cumsum([record.start_s + record.ttft_s, *record.itl_s]).tolist()
    return times, record.output_tokens / max(len(times), 1)


def output_timeline(records: Sequence[RequestRecord], bucket_s: float = 1.0) -> list[float]:
    """Output tokens per second in consecutive buckets from the benchmark start.

    A chunk that carries several tokens (per the server's usage) counts for all of them.
    """
    done = [r for r in records if r.success]
    if not done:
        return []
    end = max(r.start_s + (r.e2e_s or 0.0) for r in done)
    buckets = np.zeros(int(end // bucket_s) + 1)
    for record in done:
        times, weight = token_times(record)
        if times:
            np.add.at(buckets, (np.asarray(times) // bucket_s).astype(int), weight)
    return (buckets / bucket_s).tolist()


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """The most completed requests that were in flight at the same instant."""
    events = sorted(
        event
        for r in records
        if r.success
        for event in ((r.start_s, 1), (r.start_s + (r.e2e_s or 0.0), -1))
    )  # at equal times -1 sorts first: a request ending as another starts does not overlap
    in_flight = peak = 0
    for _, step in events:
        in_flight += step
        peak = max(peak, in_flight)
    return peak


@dataclass(frozen=True, slots=True)
class PacingStats:
    """How well the generator kept the arrival schedule: its own honesty check."""

    requested_rate: float  # requests/s asked for (inf: all at once)
    achieved_rate: float | None  # released requests / time of the last release
    dispatched: int
    max_lag_ms: float
    mean_lag_ms: float
    late: int  # released more than LATE_S after their due time

    @property
    def kept_up(self) -> bool:
        """False when the client, not the server, shaped the offered load."""
        if self.max_lag_ms > 50.0:
            return False
        return not (
            math.isfinite(self.requested_rate)
            and self.achieved_rate is not None
            and self.achieved_rate < 0.95 * self.requested_rate
        )


def pacing_stats(records: Sequence[RequestRecord], requested_rate: float) -> PacingStats:
    """Compare each request's release time with its due time."""
    released = [r.dispatched_s - r.scheduled_s for r in records if r.dispatched_s is not None]
    lags = [max(0.0, lag) for lag in released]
    last = max((r.dispatched_s for r in records if r.dispatched_s is not None), default=0.0)
    achieved = len(released) / last if math.isfinite(requested_rate) and last > 0 else None
    return PacingStats(
        requested_rate=requested_rate,
        achieved_rate=achieved,
        dispatched=len(released),
        max_lag_ms=max(lags, default=0.0) * 1000.0,
        mean_lag_ms=float(np.mean(lags)) * 1000.0 if lags else 0.0,
        late=sum(lag > LATE_S for lag in lags),
    )


@dataclass(frozen=True, slots=True)
class BenchmarkMetrics:
    """The summary of one benchmark run."""

    completed: int
    failed: int  # server-side or transport failures; excludes unfinished and not sent
    failures: dict[str, int]  # failure kind → count
    unfinished: int  # cut off by --duration
    not_sent: int  # never sent because --duration ran out
    total_input: int
    total_output: int
    total_cached: int | None  # prompt tokens served from the server's cache; None: not reported
    duration_s: float
    request_throughput: float
    request_goodput: float | None  # None without SLOs
    output_throughput: float
    total_token_throughput: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    peak_output_throughput: float  # the best one-second bucket, tokens/s
    peak_concurrency: int
    usage_missing: int  # completed requests whose output tokens were counted as stream events
    short_outputs: int  # completed requests that stopped before max_tokens


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    slos_ms: dict[str, float] | None = None,
    percentiles: Sequence[float] = (90.0, 99.0),
) -> BenchmarkMetrics:
    """Everything the summary reports, from the records of one run."""
    done = [r for r in records if r.success]
    kinds = Counter(r.error_kind for r in records if r.error_kind is not None)  # the failed
    unfinished, not_sent = kinds.pop(UNFINISHED, 0), kinds.pop(NOT_SENT, 0)
    total_input = sum(r.input_tokens for r in done)
    total_output = sum(r.output_tokens for r in done)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    goodput = None
    if slos_ms:
        goodput = sum(meets_slos(r, slos_ms) for r in done) * per_s
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    timeline = output_timeline(records)
    return BenchmarkMetrics(
        completed=len(done),
        failed=sum(kinds.values()),
        failures=dict(sorted(kinds.items())),
        unfinished=unfinished,
        not_sent=not_sent,
        total_input=total_input,
        total_output=total_output,
        total_cached=sum(cached) if cached else None,
        duration_s=duration_s,
        request_throughput=len(done) * per_s,
        request_goodput=goodput,
        output_throughput=total_output * per_s,
        total_token_throughput=(total_input + total_output) * per_s,
        ttft=distribution([r.ttft_s for r in done if r.ttft_s is not None], percentiles),
        tpot=distribution([t for r in done if (t := tpot_s(r)) is not None], percentiles),
        itl=distribution([gap for r in done for gap in r.itl_s], percentiles),
        e2el=distribution([r.e2e_s for r in done if r.e2e_s is not None], percentiles),
        peak_output_throughput=max(timeline, default=0.0),
        peak_concurrency=peak_concurrency(records),
        usage_missing=sum(not r.usage_reported for r in done),
        short_outputs=sum(r.output_tokens < r.max_tokens for r in done),
    )
