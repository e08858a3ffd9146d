"""Checks that keep a run from flattering the server: overload, and prompt-cache hits unasked.

A client that releases requests on time can still face a server that serves a fraction of
them: the send rate then says nothing about capacity. The completion rate does, counted over
the release window shifted by the first requests' latency, so that neither the ramp-up nor
the drain counts.
And a rerun of the same prompts may be answered from the server's prompt cache: its
`cached_tokens` say so, and a dataset that shares nothing on purpose should see few.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from .records import RequestRecord

KEEP_UP_RATIO = 0.9  # completions slower than this share of the offered rate: overloaded
GENERATOR_KEEP_UP_RATIO = 0.95  # sends slower than this share of the asked rate: as PacingStats
MIN_COMPLETIONS = 5  # fewer measure no rate worth a warning
UNINTENDED_CACHE_SHARE = 0.10  # cached prompt tokens above this share are not chance
# Tokens per request any prompt shares with the one before (BOS, a chat template's opening):
# cached by chance, not a rerun.
CHANCE_CACHED_TOKENS = 16
# Datasets whose requests share prompt prefixes on purpose: cache hits are what they measure.
SHARING_DATASETS = frozenset({"shared-prefix", "multi-turn", "trace"})


@dataclass(frozen=True, slots=True)
class ServerPace:
    """How fast the server completed requests against how fast they were offered."""

    offered_rate: float  # requests/s asked for; inf for all at once
    completion_rate: float | None  # completions/s between first and last; None: too few
    completed: int
    cut_off: int  # unfinished or never sent when --duration ran out
    mean_slot_wait_ms: float  # time released requests waited for a --max-concurrency slot

    @property
    def kept_up(self) -> bool:
        """False when the server completed requests clearly slower than they came."""
        if self.cut_off:
            return False
        if math.isinf(self.offered_rate) or self.completion_rate is None:
            return True
        return self.completion_rate >= KEEP_UP_RATIO * self.offered_rate


def completion_rate(records: Sequence[RequestRecord]) -> float | None:
    """Completions per second while requests were being released (None below 5 of either).

    The window is the release window, shifted by the latency the first requests saw (before
    any backlog) and widened by half a gap at each end: a server that keeps up completes
    about one request per release in it, whatever its latency, and a long last answer falls
    outside instead of stretching the measure; a server that falls behind completes at its
    own pace, and the backlog's completions come after the window.
    """
    released = sorted(r.dispatched_s for r in records if r.dispatched_s is not None)
    done = sorted(
        (r for r in records if r.success and r.e2e_s is not None and r.dispatched_s is not None),
        key=lambda r: r.dispatched_s or 0.0,
    )
    if len(released) < MIN_COMPLETIONS or len(done) < MIN_COMPLETIONS:
        return None
    first, last = released[0], released[-1]
    if last <= first:
        return None  # all released at once: no rate was offered
    gap = (last - first) / (len(released) - 1)
    early = done[: max(1, min(10, len(done) // 4))]
    shift = statistics.median(r.start_s + (r.e2e_s or 0.0) - (r.dispatched_s or 0.0) for r in early)
    low, high = first + shift - gap / 2, last + shift + gap / 2
    ends = (r.start_s + (r.e2e_s or 0.0) for r in done)
    return sum(low <= end <= high for end in ends) / (high - low)


def server_pace(records: Sequence[RequestRecord], offered_rate: float, cut_off: int) -> ServerPace:
    """The server's pace in one run (cut_off: requests --duration cut off or never sent)."""
    # Up to when the client took the request up: its own queueing after that is not a slot's.
    waits = [
        (r.start_s if r.taken_up_s is None else r.taken_up_s) - r.dispatched_s
        for r in records
        if r.dispatched_s is not None
    ]
    return ServerPace(
        offered_rate=offered_rate,
        # Released all at once (an infinite rate, a closed loop): no rate to keep up with.
        completion_rate=completion_rate(records) if math.isfinite(offered_rate) else None,
        completed=sum(r.success for r in records),
        cut_off=cut_off,
        mean_slot_wait_ms=1000.0 * sum(waits) / len(waits) if waits else 0.0,
    )


def pace_warning(pace: ServerPace) -> str | None:
    """The overload warning, or None when the server kept up."""
    if pace.kept_up:
        return None
    if pace.completion_rate is not None and math.isfinite(pace.offered_rate):
        why = (
            f"it completed {pace.completion_rate:.2f} req/s of the {pace.offered_rate:.2f} offered"
        )
    else:
        why = "it had not finished when --duration ran out"
    cut = f"; {pace.cut_off} requests were cut off or never sent" if pace.cut_off else ""
    return (
        f"the server fell behind: {why}{cut}. Latencies grow with the backlog: this load is "
        "past its capacity (try a lower --request-rate, or --find max-rate)"
    )


def cache_warning(
    dataset: str, total_input: int, total_cached: int | None, completed: int, seed: int
) -> str | None:
    """A warning when the server served prompt tokens from cache that the dataset did not share."""
    if dataset in SHARING_DATASETS or not total_cached or total_input <= 0:
        return None
    unexplained = total_cached - CHANCE_CACHED_TOKENS * completed
    if unexplained <= UNINTENDED_CACHE_SHARE * total_input:
        return None
    share = total_cached / total_input
    return (
        f"the server reports {total_cached} of {total_input} prompt tokens ({share:.0%}) "
        f"served from its prompt cache, which the {dataset} dataset does not share on purpose: "
        f"was it run before with --seed {seed}? Prefill is cheaper than measured load would "
        "make it; rerun with another --seed (or restart the server) for cold prompts"
    )


def probe_flaw(
    records: Sequence[RequestRecord], pace: ServerPace, sent_rate: float | None
) -> str | None:
    """Why a --find probe at a finite rate measured something other than the server at that
    rate (None: nothing): the server fell behind, the generator did (sent_rate: the rate it
    reached, metrics.PacingStats.achieved_rate), or its requests went out in less time than
    one of them takes, so it was one burst into the slots whatever the rate.
    """
    if math.isinf(pace.offered_rate):
        return None
    released = [r.dispatched_s for r in records if r.dispatched_s is not None]
    latencies = [r.e2e_s for r in records if r.success and r.e2e_s is not None]
    if len(released) >= 2 and latencies:
        window = max(released) - min(released)
        latency = statistics.median(latencies)
        if window < latency:
            return (
                f"its {len(released)} requests went out in {window:.2f} s, less than one "
                f"request's latency ({latency:.2f} s): a burst, not a rate; raise --num-prompts"
            )
    # A late release or two is the generator's noise; a rate short of the one asked is not.
    if sent_rate is not None and sent_rate < GENERATOR_KEEP_UP_RATIO * pace.offered_rate:
        return (
            f"the generator fell behind: it sent {sent_rate:.2f} req/s of the "
            f"{pace.offered_rate:.2f} asked"
        )
    completed = pace.completion_rate
    # Well below: a probe of a few requests loses a whole one's share when a single late
    # answer falls past the window's edge, which is no backlog; more than that is.
    slack = 1.0 / len(released) if released else 0.0
    if completed is not None and completed < (KEEP_UP_RATIO - slack) * pace.offered_rate:
        return (
            f"the server fell behind: it completed {completed:.2f} req/s of the "
            f"{pace.offered_rate:.2f} offered"
        )
    return None
