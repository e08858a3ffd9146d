"""When each request leaves: Poisson or gamma-distributed arrivals, and a loop that keeps time."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Sequence

import numpy as np


def arrival_offsets(
    num_requests: int, request_rate: float, burstiness: float, seed: int
) -> list[float]:
    """Seconds from the start at which each request is due, as vLLM's benchmark schedules them.

    Gaps are gamma-distributed with shape `burstiness` and mean 1/rate (burstiness 1 is a
    Poisson process; lower is burstier, higher is more even, inf is a fixed gap). The schedule
    is stretched so the last request is due at exactly N/rate: seeds then differ in the
    pattern, not in the offered load. An infinite rate sends everything at once.
    """
    if num_requests < 1:
        return []
    if request_rate <= 0:
        raise ValueError(f"request rate must be positive, got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        scale = 1.0 / (request_rate * burstiness)
        gaps = rng.gamma(shape=burstiness, scale=scale, size=num_requests)
    offsets = np.cumsum(gaps)
    offsets *= (num_requests / request_rate) / offsets[-1]
    return offsets.tolist()


async def follow_schedule(
    offsets: Sequence[float], start: float, deadline: float
) -> AsyncIterator[tuple[int, float]]:
    """Yield (index, perf_counter time) as each request falls due; stop at the deadline.

    The caller compares the yielded time with start + offset to see how late it was.
    """
    for index, offset in enumerate(offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        now = time.perf_counter()
        if now >= deadline:
            return
        yield index, now
