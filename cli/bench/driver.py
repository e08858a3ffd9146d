"""Runs a benchmark's points one after another: each load shape (repeated), or a search's probes.

Each run is summarized and printed the moment it ends, so a long sweep or search shows its
progress point by point. While a run goes on, the server's /metrics is sampled if asked.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .client import StreamingClient
from .datasets import BenchRequest
from .honesty import probe_flaw, server_pace
from .metrics import BenchmarkMetrics, meets_slos, pacing_stats
from .points import PointSettings, summarize_run
from .repeats import combine, format_repeats
from .runner import LoadShape, RunResult, run_load, warm_up
from .scrape import MetricsScraper
from .search import ProbeOutcome, SearchResult, find_limit, format_answer

REPEAT_SEED_STRIDE = 1000  # repeat r of point p draws its prompts with seed + p + 1000·r


@dataclass(frozen=True, slots=True)
class Plan:
    """What to run: the shapes (or a search), how often, and how long each may take."""

    shapes: list[LoadShape]
    seed: int
    duration_s: float  # each run's bound; for a search, the whole search's
    num_warmups: int = 1
    repeats: int = 1
    progress: bool = True
    find: str | None = None  # "max-rate" or "max-concurrency"
    attainment: float = 0.9
    find_precision: float = 0.1


@dataclass(slots=True)
class Outcome:
    """What the runs left: a point per shape (or the search), and the first runs themselves."""

    points: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[BenchmarkMetrics] = field(default_factory=list)  # the first run of each shape
    runs: list[RunResult] = field(default_factory=list)  # the first run of each shape
    search: SearchResult | None = None


def warm_up_request(request: BenchRequest) -> BenchRequest:
    """The first prompt with its words reversed: as long, but no cache hit for the real one."""
    words = request.prompt.split(" ")
    return dataclasses.replace(request, prompt=" ".join(reversed(words)), history=(), due_s=None)


@dataclass
class Driver:
    """Runs a Plan against one server with one client, printing each point as it ends."""

    plan: Plan
    client: StreamingClient
    prompts: Callable[[int], list[BenchRequest]]  # the dataset drawn with a seed
    settings: PointSettings
    echo: Callable[..., None]
    warn: Callable[[str], None]
    scraper: MetricsScraper | None = None

    async def run(self) -> Outcome:
        first = self.prompts(self.plan.seed)
        if self.plan.num_warmups:
            self.echo(f"Warming up with {self.plan.num_warmups} requests...")
            await warm_up(
                self.client,
                warm_up_request(first[0]),
                self.plan.num_warmups,
                self.plan.shapes[0].max_concurrency,
            )
        if self.plan.find:
            return await self._search(first)
        outcome = Outcome()
        shapes = self.plan.shapes
        if all(r.due_s is not None for r in first):  # a trace: its own clock sets the rate
            span = max(r.due_s or 0.0 for r in first)
            rate = len(first) / span if span > 0 else math.inf
            shapes = [dataclasses.replace(s, request_rate=rate) for s in shapes]
        for index, shape in enumerate(shapes):
            if len(shapes) > 1:
                self.echo(f"Sweep point {index + 1} of {len(shapes)}")
            points = []
            for repeat in range(self.plan.repeats):
                seed = self.plan.seed + index + REPEAT_SEED_STRIDE * repeat
                requests = first if seed == self.plan.seed else self.prompts(seed)
                if self.plan.repeats > 1:
                    self.echo(f"Repeat {repeat + 1} of {self.plan.repeats}")
                point, metrics, run = await self.run_point(
                    shape, requests, seed, self.plan.duration_s, self.echo, self.warn
                )
                points.append(point)
                if repeat == 0:
                    outcome.metrics.append(metrics)
                    outcome.runs.append(run)
            if self.plan.repeats > 1:
                combined = combine(points)
                self.echo(format_repeats(combined))
                outcome.points.append(combined)
            else:
                outcome.points.append(points[0])
        return outcome

    async def run_point(
        self,
        shape: LoadShape,
        requests: list[BenchRequest],
        seed: int,
        duration_s: float,
        echo: Callable[..., None],
        warn: Callable[[str], None],
    ) -> tuple[dict[str, Any], BenchmarkMetrics, RunResult]:
        """One run of the requests in this shape, summarized (and printed) as it ends."""
        replay = all(r.due_s is not None for r in requests)
        echo(f"Running {len(requests)} requests: {describe_shape(shape, replay)}")
        arrival_seed = seed - (seed - self.plan.seed) % REPEAT_SEED_STRIDE  # same per repeat
        timeline = None
        if self.scraper is not None:
            async with self.scraper.sampling() as timeline:
                run = await self._load(requests, shape, arrival_seed, duration_s)
        else:
            run = await self._load(requests, shape, arrival_seed, duration_s)
        settings = dataclasses.replace(self.settings, seed=seed)
        point, metrics = summarize_run(run, settings, echo, warn)
        if timeline is not None:
            point["server_metrics"] = timeline.series()
        return point, metrics, run

    async def _load(
        self, requests: list[BenchRequest], shape: LoadShape, seed: int, duration_s: float
    ) -> RunResult:
        return await run_load(
            self.client,
            requests,
            shape,
            seed,
            duration_s=duration_s,
            progress=self.plan.progress,
        )

    async def _search(self, first: list[BenchRequest]) -> Outcome:
        plan, base = self.plan, self.plan.shapes[0]
        deadline = time.monotonic() + plan.duration_s
        outcome = Outcome()
        slos = self.settings.slos_ms

        def quiet(*_: object, **__: object) -> None:
            """A probe's full summary would bury the probe lines: it goes to the JSON only."""

        async def probe(value: float, index: int) -> ProbeOutcome:
            if plan.find == "max-rate":
                shape = dataclasses.replace(base, request_rate=value)
            else:
                shape = dataclasses.replace(base, request_rate=math.inf, max_concurrency=int(value))
            requests = first if index == 0 else self.prompts(plan.seed + index)
            left = deadline - time.monotonic()
            point, metrics, run = await self.run_point(
                shape, requests, plan.seed + index, left, quiet, quiet
            )
            outcome.metrics.append(metrics)
            outcome.runs.append(run)
            met = sum(r.success and meets_slos(r, slos) for r in run.records)
            cut_by_budget = bool(metrics.unfinished or metrics.not_sent) and (
                time.monotonic() >= deadline - 0.05
            )
            pace = server_pace(run.records, shape.request_rate, 0)  # cut-offs: complete
            pacing = pacing_stats(run.records, shape.request_rate)
            return ProbeOutcome(
                value=value,
                met=met,
                total=len(run.records),
                seconds=run.duration_s,
                point=point,
                complete=not cut_by_budget,
                flaw=probe_flaw(run.records, pace, pacing.achieved_rate),
            )

        if plan.find == "max-rate":
            start = base.request_rate if math.isfinite(base.request_rate) else 1.0
        else:
            start = float(base.max_concurrency or 1)
        goal = " ".join(f"{k}:{v:g}" for k, v in slos.items())
        self.echo(
            f"Searching for the {plan.find} where {plan.attainment:.0%} of requests meet "
            f"{goal} (ms), from {start:g}, within {plan.duration_s:g} s"
        )
        search = await find_limit(
            plan.find or "",
            probe,
            start,
            plan.attainment,
            plan.find_precision,
            plan.duration_s,
            self.echo,
        )
        self.echo(format_answer(search))
        outcome.search = search
        return outcome


def describe_shape(shape: LoadShape, replay: bool = False) -> str:
    """The load shape in words, for the line before each run (replay: a trace's own clock)."""
    rate = "inf" if math.isinf(shape.request_rate) else f"{shape.request_rate:.3g} req/s"
    process = "Poisson" if shape.burstiness == 1.0 else f"gamma, burstiness {shape.burstiness:g}"
    if replay:
        process = "the trace's schedule"
    return f"request rate {rate} ({process}), max concurrency {shape.max_concurrency or 'none'}"
