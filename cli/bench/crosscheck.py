"""The bench's headline figures held against an independent tally of the same run.

The tally comes from tap.py's proxy: the same requests, timed where their bytes crossed it,
parsed by h11 and a separate event splitter. Both sides compute request throughput, output
tokens per second, mean TTFT and mean ITL by the same definitions (vLLM's), so what is left
between them is what each side saw: the proxy hop's delay and the client's own overhead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .tap import Exchange

FIGURES = (  # (the summary's key, what it is)
    ("request_throughput", "request throughput (req/s)"),
    ("output_throughput", "output tokens/s"),
    ("mean_ttft_ms", "mean TTFT (ms)"),
    ("mean_itl_ms", "mean ITL (ms)"),
)
TOLERANCE = 0.05  # the bound on the relative difference


@dataclass(frozen=True, slots=True)
class Agreement:
    """One figure from both sides."""

    key: str
    name: str
    bench: float
    independent: float

    @property
    def difference(self) -> float:
        """The bench's figure relative to the independent one, minus one."""
        return self.bench / self.independent - 1.0 if self.independent else float("inf")

    @property
    def agrees(self) -> bool:
        return abs(self.difference) <= TOLERANCE


def generation_exchanges(
    exchanges: Iterable[Exchange], request_ids: Iterable[str] | None = None
) -> list[Exchange]:
    """The completions and chat requests among exchanges; only request_ids' when given
    (the measured requests of a run, not its warm-ups or the set-up's probes)."""
    wanted = set(request_ids) if request_ids is not None else None
    chosen = []
    for exchange in exchanges:
        if exchange.method != "POST" or not exchange.path.endswith("completions"):
            continue
        if wanted is not None and exchange.request_id not in wanted:
            continue
        chosen.append(exchange)
    return chosen


def independent_figures(exchanges: Sequence[Exchange]) -> dict[str, float]:
    """The four figures from the proxy's view of one run's requests.

    The run lasts from the first request's head to the last response's end; TTFT runs from
    a request's head to its first text event; ITL is the mean gap between text events, over
    every request's gaps together.
    """
    done = [e for e in exchanges if e.complete]
    if not done:
        raise ValueError("the proxy saw no complete streamed response")
    first = min(e.sent_at for e in exchanges)
    last = max(e.ended_at for e in done if e.ended_at is not None)
    duration = last - first
    gaps = sum(e.text_at[-1] - e.text_at[0] for e in done)
    gap_count = sum(len(e.text_at) - 1 for e in done)
    return {
        "completed": float(len(done)),
        "duration": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": sum(e.output_tokens for e in done) / duration,
        "mean_ttft_ms": 1000.0 * sum(e.text_at[0] - e.sent_at for e in done) / len(done),
        "mean_itl_ms": 1000.0 * gaps / gap_count if gap_count else 0.0,
    }


def agreements(summary: Mapping[str, Any], independent: Mapping[str, float]) -> list[Agreement]:
    """Each of FIGURES from the bench's summary beside the independent tally's."""
    return [
        Agreement(key, name, float(summary[key]), float(independent[key])) for key, name in FIGURES
    ]


def format_agreements(rows: Sequence[Agreement]) -> str:
    """A table: figure, bench, independent, difference, within 5 %."""
    lines = [f"{'figure':<28} {'bench':>10} {'proxy':>10} {'diff':>8}  within 5 %"]
    for row in rows:
        verdict = "yes" if row.agrees else "NO"
        lines.append(
            f"{row.name:<28} {row.bench:>10.2f} {row.independent:>10.2f} "
            f"{row.difference:>+8.2%}  {verdict}"
        )
    return "\n".join(lines)
