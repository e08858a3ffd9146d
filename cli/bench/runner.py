"""One benchmark run: warm up, release requests on schedule, wait, and watch our own overhead."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from .arrivals import arrival_offsets, follow_schedule
from .client import StreamingClient
from .datasets import BenchRequest
from .records import NOT_SENT, RequestRecord


class WarmupFailed(Exception):
    """Every warm-up request failed: the benchmark would measure nothing but errors."""


@dataclass(frozen=True, slots=True)
class LoadShape:
    """How requests arrive: the knobs a sweep varies."""

    request_rate: float = math.inf  # requests/s; inf sends all at once
    burstiness: float = 1.0  # gamma shape of the gaps; 1.0 is Poisson
    max_concurrency: int | None = None  # requests in flight at most; None: unlimited


@dataclass(slots=True)
class RunResult:
    """The records of one run and what it cost the generator itself."""

    shape: LoadShape
    records: list[RequestRecord]
    duration_s: float  # from the start of the schedule to the last response
    client_cpu_s: float  # CPU time this process spent during the run
    loop_lag_max_ms: float  # worst oversleep of a 10 ms timer: the event loop's own backlog


class LoopLagMonitor:
    """Measures how late a 10 ms timer fires: when it is late, every timestamp is too."""

    interval_s = 0.010

    def __init__(self) -> None:
        self.max_lag_s = 0.0
        self.task: asyncio.Task[None] | None = None

    async def _watch(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.max_lag_s = max(self.max_lag_s, time.perf_counter() - before - self.interval_s)

    def __enter__(self) -> LoopLagMonitor:
        self.task = asyncio.create_task(self._watch())
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.task:
            self.task.cancel()


async def warm_up(
    client: StreamingClient, request: BenchRequest, count: int, max_concurrency: int | None
) -> list[RequestRecord]:
    """Send the first prompt count times, unmeasured; raise if not one of them succeeds."""
    if count < 1:
        return []
    limit = asyncio.Semaphore(max_concurrency or count)
    zero = time.perf_counter()

    async def one(index: int) -> RequestRecord:
        async with limit:
            record = RequestRecord(index=-1 - index, expected_prompt_len=0, max_tokens=0)
            return await client.send(request, record, zero, deadline=math.inf)

    records = await asyncio.gather(*(one(i) for i in range(count)))
    if not any(r.success for r in records):
        first = records[0]
        raise WarmupFailed(f"warm-up request failed ({first.error_kind}): {first.error}")
    return records


async def _tick_progress(bar: tqdm, client: StreamingClient, in_flight: list[int]) -> None:
    """Once a second, show the current output rate (text chunks, ~tokens) in the bar."""
    last_chunks, last_time = client.text_chunks, time.perf_counter()
    while True:
        await asyncio.sleep(1.0)
        now = time.perf_counter()
        rate = (client.text_chunks - last_chunks) / (now - last_time)
        last_chunks, last_time = client.text_chunks, now
        bar.set_postfix_str(f"{rate:.0f} tok/s, {in_flight[0]} in flight")


async def run_load(
    client: StreamingClient,
    requests: Sequence[BenchRequest],
    shape: LoadShape,
    seed: int,
    duration_s: float = math.inf,
    progress: bool = True,
    label: str = "bench",
) -> RunResult:
    """Release each request at its arrival time, at most max_concurrency at once, until done.

    Requests still running when duration_s is up are cut off (recorded as unfinished), and
    those not yet sent never are: the run always ends.
    """
    offsets = [r.due_s for r in requests if r.due_s is not None]
    if len(offsets) != len(requests):  # a trace brings its own schedule; others draw one
        offsets = arrival_offsets(len(requests), shape.request_rate, shape.burstiness, seed)
    records = [
        RequestRecord(
            index=i, expected_prompt_len=r.prompt_len, max_tokens=r.output_len, label=r.label
        )
        for i, r in enumerate(requests)
    ]
    for record, offset in zip(records, offsets, strict=True):
        record.scheduled_s = offset
    limit = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None
    bar = tqdm(
        total=len(requests), desc=label, unit="req", disable=None if progress else True, leave=False
    )
    in_flight = [0]
    # A later turn of a conversation waits for the one before it (multi-turn datasets).
    done = [asyncio.Event() for _ in requests]
    loop = asyncio.get_running_loop()
    cpu_before = time.process_time()
    start = time.perf_counter()
    deadline = start + duration_s
    loop_deadline = loop.time() + duration_s

    async def one(request: BenchRequest, record: RequestRecord) -> None:
        try:
            await _send(request, record)
        finally:
            done[record.index].set()

    async def _send(request: BenchRequest, record: RequestRecord) -> None:
        if request.follows is not None:
            try:
                async with asyncio.timeout_at(loop_deadline):
                    await done[request.follows].wait()
            except TimeoutError:
                record.error_kind = NOT_SENT
                record.error = "the benchmark's duration ran out before its previous turn ended"
                return
        if limit is not None:
            try:
                async with asyncio.timeout_at(loop_deadline):
                    await limit.acquire()
            except TimeoutError:
                record.error_kind = NOT_SENT
                record.error = "the benchmark's duration ran out while it waited for a slot"
                return
        in_flight[0] += 1
        try:
            await client.send(request, record, start, deadline)
        finally:
            in_flight[0] -= 1
            if limit is not None:
                limit.release()
            bar.update(1)

    ticker = asyncio.create_task(_tick_progress(bar, client, in_flight))
    tasks: list[asyncio.Task[None]] = []
    with LoopLagMonitor() as lag:
        async for index, now in follow_schedule(offsets, start, deadline):
            records[index].dispatched_s = now - start
            tasks.append(asyncio.create_task(one(requests[index], records[index])))
        for record in records[len(tasks) :]:
            record.error_kind = NOT_SENT
            record.error = "the benchmark's duration ran out before it was due"
        await asyncio.gather(*tasks)
        end = time.perf_counter()
    ticker.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await ticker
    bar.close()
    return RunResult(
        shape=shape,
        records=records,
        duration_s=min(end, deadline) - start,
        client_cpu_s=time.process_time() - cpu_before,
        loop_lag_max_ms=lag.max_lag_s * 1000.0,
    )
