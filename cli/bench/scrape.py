"""--scrape-metrics: what the server saw during the run, from its Prometheus endpoint.

Once a second the scraper reads the target's `/metrics`, parses it with prometheus-client's
parser, and keeps the few series a reader of a benchmark wants beside it: requests queued
and running, KV-cache use, and the server's own prompt and generation tokens per second.
Each server names them its own way; NAMES knows loomserve's, vLLM's and llama-server's.

A rate is never taken over less than a second: samples closer than that (the one taken when
the run ends, a moment after the last tick) share the rate of the window they close. And a
counter the server only raises when a request ends (loomserve's gateway counts a request's
tokens then) is said to be one: its rates come in lumps at each request's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .client import api_root

# Our series → the sample names each server gives it, in order of preference. Gauges are
# summed over their labels (several workers, several models); counters (the *_total ones)
# become per-second rates between samples.
NAMES: dict[str, tuple[str, ...]] = {
    # loomserve: the worker's own port (--metrics-port) first, then the gateway's copy of
    # each worker's heartbeat (once a second, under `serve` too), then the gateway's count.
    "waiting": (
        "loomserve:num_requests_waiting",
        "loomserve:worker_num_requests_waiting",
        "vllm:num_requests_waiting",
        "llamacpp:requests_deferred",
    ),
    "running": (
        "loomserve:num_requests_running",
        "loomserve:worker_num_requests_running",
        "vllm:num_requests_running",
        "llamacpp:requests_processing",
        "loomserve:requests_in_flight",  # the gateway's, when no worker's gauges are there
    ),
    "kv_cache_usage": (
        "loomserve:kv_cache_usage_perc",
        "loomserve:worker_kv_cache_usage_perc",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",  # vLLM before v0.10
        "llamacpp:kv_cache_usage_ratio",
    ),
    "generation_tokens_per_s": (
        "loomserve:generation_tokens_total",
        "vllm:generation_tokens_total",
        "llamacpp:tokens_predicted_total",
    ),
    "prompt_tokens_per_s": (
        "loomserve:prompt_tokens_total",
        "vllm:prompt_tokens_total",
        "llamacpp:prompt_tokens_total",
    ),
}
RATES = frozenset({"generation_tokens_per_s", "prompt_tokens_per_s"})
MIN_RATE_WINDOW_S = 1.0  # a counter's rise over less is noise (and a tiny divisor)
# Shares, one per worker: averaged over their labels, not summed.
AVERAGED = frozenset({"loomserve:worker_kv_cache_usage_perc"})
# Counters raised only when a request ends, not as tokens are made: the gateway's token
# counts (the worker's own port counts generated tokens each tick, under the same name; a
# gateway's exposition is told apart by its request gauge). loomserve counts prompt tokens
# of finished requests in both.
AT_REQUEST_END = "counted when each request ends, in lumps: not tokens made per second"
# Names only a gateway exposes (model_info from its start, requests_in_flight once a request
# came): kept by parse_sample so that a gateway's exposition is told from a worker's.
GATEWAY_MARKS = frozenset({"loomserve:model_info", "loomserve:requests_in_flight"})
SERVERS = (("loomserve:", "loomserve"), ("vllm:", "vllm"), ("llamacpp:", "llama-server"))


def parse_sample(text: str) -> dict[str, float]:
    """Each known sample name's value (summed over labels) in one /metrics text."""
    wanted = {name for names in NAMES.values() for name in names} | GATEWAY_MARKS
    values: dict[str, float] = {}
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
                counts[sample.name] = counts.get(sample.name, 0) + 1
    for name in AVERAGED & values.keys():
        values[name] /= counts[name]
    return values


def counted_at_request_end(name: str, seen: set[str]) -> bool:
    """Whether this series' counter rises only when a request ends (see AT_REQUEST_END)."""
    if name == "loomserve:prompt_tokens_total":
        return True
    return name == "loomserve:generation_tokens_total" and bool(GATEWAY_MARKS & seen)


def server_kind(names: Iterable[str]) -> str:
    """Whose metric names these are: loomserve, vllm, llama-server, or unknown."""
    names = list(names)
    for prefix, kind in SERVERS:
        if any(name.startswith(prefix) for name in names):
            return kind
    return "unknown"


@dataclass(slots=True)
class Timeline:
    """Samples of one run: seconds since the run's start and the raw values at each."""

    times_s: list[float] = field(default_factory=list)
    samples: list[dict[str, float]] = field(default_factory=list)
    errors: int = 0  # scrapes that failed or did not parse

    def series(self) -> dict[str, Any]:
        """The timelines for the result JSON: each of NAMES's series the server had."""
        seen = {name for sample in self.samples for name in sample}
        out: dict[str, Any] = {
            "server": server_kind(seen),
            "times_s": self.times_s,
            "errors": self.errors,
            "series": {},
            "sources": {},
            "notes": {},
        }
        for key, candidates in NAMES.items():
            name = next((n for n in candidates if n in seen), None)
            if name is None:
                continue
            values = [sample.get(name) for sample in self.samples]
            if key in RATES:
                values = _rates(self.times_s, values)
            out["series"][key] = values
            out["sources"][key] = name
            if key in RATES and counted_at_request_end(name, seen):
                out["notes"][key] = AT_REQUEST_END
        return out


def rate_windows(times: list[float]) -> list[int]:
    """The samples that close a rate window: from the first, each at least MIN_RATE_WINDOW_S
    after the one before; a shorter tail (the sample at the run's end) joins the last window.
    """
    ends = [0]
    for i in range(1, len(times)):
        if times[i] - times[ends[-1]] >= MIN_RATE_WINDOW_S:
            ends.append(i)
    if len(ends) > 1 and ends[-1] != len(times) - 1:
        ends[-1] = len(times) - 1
    return ends


def _rates(times: list[float], totals: list[float | None]) -> list[float | None]:
    """Per-second increase of a counter, each sample given its window's rate (the first
    sample, and samples in no window of a second, have none). A window's rate times its
    samples' gaps adds up to the counter's rise over it."""
    rates: list[float | None] = [None] * len(totals)
    ends = rate_windows(times)
    for start, end in itertools.pairwise(ends):
        before, after = totals[start], totals[end]
        if before is None or after is None or after < before:  # missing, or a restart
            continue
        rate = (after - before) / (times[end] - times[start])
        for i in range(start + 1, end + 1):
            rates[i] = rate
    return rates


class MetricsScraper:
    """Samples a server's /metrics on its own connection while a run goes on."""

    def __init__(self, base_url: str, api_key: str | None, interval_s: float = 1.0) -> None:
        self.url = api_root(base_url) + "/metrics"
        self.interval_s = interval_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(headers=headers, timeout=max(interval_s, 2.0))

    async def unavailable_reason(self) -> str | None:
        """Why the target's metrics cannot be sampled, or None when they can: it must serve
        Prometheus text with at least one series we know."""
        try:
            response = await self.http.get(self.url)
        except httpx.HTTPError as exc:
            return f"GET {self.url} failed: {type(exc).__name__}"
        if response.status_code != 200:
            # llama-cpp-python's server has no /metrics (404); llama-server without --metrics
            # answers 501.
            return f"GET {self.url} answered HTTP {response.status_code}: the server has no metrics"
        try:
            known = await asyncio.to_thread(parse_sample, response.text)
        except ValueError:
            return f"{self.url} is not Prometheus text"
        return None if known else f"{self.url} has none of the series we know"

    async def _sample(self, timeline: Timeline, zero: float) -> None:
        try:
            response = await self.http.get(self.url)
            response.raise_for_status()
            # Parsing a big exposition takes milliseconds: off the loop that times requests.
            values = await asyncio.to_thread(parse_sample, response.text)
        except (httpx.HTTPError, ValueError):
            timeline.errors += 1
            return
        timeline.times_s.append(time.perf_counter() - zero)
        timeline.samples.append(values)

    async def _watch(self, timeline: Timeline, zero: float) -> None:
        next_at = time.perf_counter()
        while True:
            await self._sample(timeline, zero)
            next_at += self.interval_s
            if timeline.times_s:  # a full interval after the last sample: no window under it
                next_at = max(next_at, zero + timeline.times_s[-1] + self.interval_s)
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))

    @contextlib.asynccontextmanager
    async def sampling(self) -> AsyncIterator[Timeline]:
        """Sample every interval while the block runs, and once more at its end."""
        timeline = Timeline()
        zero = time.perf_counter()
        task = asyncio.create_task(self._watch(timeline, zero))
        try:
            yield timeline
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await self._sample(timeline, zero)

    async def aclose(self) -> None:
        await self.http.aclose()
