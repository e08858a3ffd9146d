"""--find max-rate / max-concurrency: the most load whose SLO attainment meets a target.

A probe runs the load at one value and measures its attainment: the share of its requests
(failed and cut-off ones included) within every --goodput SLO. The search first brackets
the answer (doubling from the start value while probes pass, halving while they fail), then
bisects the bracket until its ends are within the precision, and stops early when the time
budget runs out, reporting the bracket it has. The answer is the highest passing value,
with a Wilson 95 % interval on the attainment measured there.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

MODES = {"max-rate": "request_rate", "max-concurrency": "max_concurrency"}
MIN_RATE = 0.01  # req/s: below this a search gives up finding a passing rate
MAX_DOUBLINGS = 12
BUDGET = "budget"  # the stop reason when --duration runs out, as the result JSON keeps it
STOPPED_WORDS = {BUDGET: "the search's --duration ran out: raise --duration"}
NOT_COUNTED = "cut off by --duration; not counted"  # the console's words, and the report's


@dataclass(frozen=True, slots=True)
class ProbeOutcome:
    """One probe's result: the value tried, how many requests met the SLOs of how many."""

    value: float
    met: int
    total: int
    seconds: float
    point: dict[str, Any] = field(default_factory=dict)  # the run's point for the result JSON
    complete: bool = True  # False: the search's time ran out during it, so it decides nothing
    # Why the probe did not measure the server at its value (honesty.probe_flaw): it fails
    # whatever its attainment, so no answer rests on a rate the server could not sustain.
    flaw: str | None = None

    @property
    def attainment(self) -> float:
        return self.met / self.total if self.total else 0.0

    def passes(self, target: float) -> bool:
        return self.flaw is None and self.attainment >= target


Probe = Callable[[float, int], Awaitable[ProbeOutcome]]
"""Runs the load at a value (the probe's index picks fresh prompts) and measures it."""


@dataclass(slots=True)
class SearchResult:
    """The search's probes and its answer: the bracket [best, worst) it ended with."""

    mode: str
    target: float
    precision: float
    probes: list[ProbeOutcome] = field(default_factory=list)
    best: ProbeOutcome | None = None  # the highest value that passed
    worst: ProbeOutcome | None = None  # the lowest value that failed
    stopped: str = "converged"  # or "budget", or "no passing value", or "never failed"


def wilson_interval(met: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial share (95 % by default)."""
    if total == 0:
        return (0.0, 1.0)
    p = met / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))


def converged(low: float, high: float, mode: str, precision: float) -> bool:
    """Whether a bracket is narrow enough: relative for rates, one step for concurrency."""
    if mode == "max-concurrency":
        return high - low <= max(1.0, math.floor(low * precision))
    return high - low <= precision * low


def midpoint(low: float, high: float, mode: str) -> float:
    if mode == "max-concurrency":
        return float((int(low) + int(high)) // 2)
    return math.sqrt(low * high)  # rates span decades: bisect on a log scale


def format_probe(index: int, outcome: ProbeOutcome, target: float, mode: str) -> str:
    """One line per probe, printed as it finishes."""
    unit = "req/s" if mode == "max-rate" else "in flight"
    verdict = "pass" if outcome.passes(target) else "FAIL"
    why = f" ({outcome.flaw})" if outcome.flaw else ""
    return (
        f"probe {index + 1}: {outcome.value:.3g} {unit} -> attainment {outcome.attainment:.1%} "
        f"({outcome.met}/{outcome.total}) {verdict}{why} in {outcome.seconds:.1f} s"
    )


def stopped_words(stopped: str) -> str:
    """Why the search stopped, in words that say what to change."""
    return STOPPED_WORDS.get(stopped, stopped)


async def find_limit(
    mode: str,
    probe: Probe,
    start: float,
    target: float,
    precision: float,
    budget_s: float,
    echo: Callable[[str], None] = print,
) -> SearchResult:
    """Bracket, then bisect, to the highest value whose attainment meets target."""
    if mode not in MODES:
        raise ValueError(f"--find must be one of {sorted(MODES)}, got {mode!r}")
    result = SearchResult(mode=mode, target=target, precision=precision)
    deadline = time.monotonic() + budget_s
    lowest = 1.0 if mode == "max-concurrency" else MIN_RATE

    async def run(value: float) -> ProbeOutcome | None:
        if time.monotonic() >= deadline:
            result.stopped = BUDGET
            return None
        outcome = await probe(value, len(result.probes))
        result.probes.append(outcome)
        if not outcome.complete:
            echo(f"probe {len(result.probes)}: {value:.3g} {NOT_COUNTED}")
            result.stopped = BUDGET
            return None
        echo(format_probe(len(result.probes) - 1, outcome, target, mode))
        if outcome.passes(target):
            if result.best is None or value > result.best.value:
                result.best = outcome
        elif result.worst is None or value < result.worst.value:
            result.worst = outcome
        return outcome

    value = max(start, lowest)
    # Bracket: double while passing, halve while failing.
    for _ in range(MAX_DOUBLINGS):
        outcome = await run(value)
        if outcome is None:
            return result
        passed = outcome.passes(target)
        if passed and result.worst is None:
            value *= 2
        elif not passed and result.best is None:
            if value <= lowest:
                result.stopped = "no passing value"
                return result
            value = max(lowest, value / 2 if mode == "max-rate" else math.floor(value / 2))
        else:
            break
    else:
        result.stopped = "never failed" if result.worst is None else "no passing value"
        return result
    # Bisect.
    while result.best is not None and result.worst is not None:
        low, high = result.best.value, result.worst.value
        if converged(low, high, mode, precision):
            return result
        if await run(midpoint(low, high, mode)) is None:
            return result
    return result


def format_answer(result: SearchResult) -> str:
    """The search's answer in words, with the interval of the attainment behind it."""
    unit = "req/s" if result.mode == "max-rate" else "concurrent requests"
    what = "request rate" if result.mode == "max-rate" else "concurrency"
    goal = f"{result.target:.0%} of requests within every SLO"
    if result.best is None:
        worst = f"{result.worst.value:.3g} {unit}" if result.worst else "the start value"
        flaw = f": {result.worst.flaw}" if result.worst and result.worst.flaw else ""
        return (
            f"No {what} tried meets {goal}: even {worst} fails{flaw} "
            f"({stopped_words(result.stopped)})."
        )
    low, high = wilson_interval(result.best.met, result.best.total)
    line = (
        f"Max {what} meeting {goal}: {result.best.value:.3g} {unit} (attainment "
        f"{result.best.attainment:.1%}, 95% CI {low:.1%}-{high:.1%}, n={result.best.total})"
    )
    if result.worst is not None:
        why = result.worst.flaw or f"{result.worst.attainment:.1%}"
        line += f"; {result.worst.value:.3g} {unit} fails ({why})"
    if result.stopped != "converged":
        line += f" [stopped: {stopped_words(result.stopped)}]"
    return line


def search_dict(result: SearchResult) -> dict[str, Any]:
    """The search for the result JSON: every probe, and the answer with its interval."""

    def probe_dict(outcome: ProbeOutcome) -> dict[str, Any]:
        return {
            "value": outcome.value,
            "met": outcome.met,
            "total": outcome.total,
            "attainment": outcome.attainment,
            # A probe cut off by --duration decides nothing: neither passed nor failed.
            "passed": outcome.passes(result.target) if outcome.complete else None,
            "flaw": outcome.flaw,
            "seconds": outcome.seconds,
            "complete": outcome.complete,
        } | outcome.point

    answer: dict[str, Any] | None = None
    if result.best is not None:
        low, high = wilson_interval(result.best.met, result.best.total)
        answer = {
            "value": result.best.value,
            "attainment": result.best.attainment,
            "attainment_ci95": [low, high],
            "fails_at": result.worst.value if result.worst else None,
        }
    return {
        "mode": result.mode,
        "target_attainment": result.target,
        "precision": result.precision,
        "stopped": result.stopped,
        "answer": answer,
        "probes": [probe_dict(p) for p in result.probes],
    }
