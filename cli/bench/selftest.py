"""`loomserve bench --self-test`: how fast can the generator itself go?

It runs the real benchmark loop against the instant server (in its own process on loopback)
and reports the ceiling: requests/s with one-token answers, text chunks/s with long answers,
the client CPU each costs, and how closely a Poisson schedule is kept. Both processes share
this machine's cores, so the numbers are lower bounds on what the client alone could do.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

from .client import StreamingClient
from .datasets import BenchRequest
from .instant_server import MODEL
from .metrics import compute_metrics, pacing_stats
from .runner import LoadShape, RunResult, run_load


@dataclass(frozen=True, slots=True)
class SelfTestResult:
    """The generator's measured ceiling and timekeeping."""

    max_request_rate: float  # requests/s, one-token answers, closed loop
    cpu_us_per_request: float
    max_chunk_rate: float  # text chunks/s, long answers, closed loop
    cpu_us_per_chunk: float
    paced_requested_rate: float
    paced_achieved_rate: float
    paced_max_lag_ms: float
    paced_late: int
    loop_lag_max_ms: float
    failed: int  # requests that failed in any phase: should be 0


def start_instant_server() -> tuple[subprocess.Popen[str], int]:
    """Start the instant server in a child process; return it and its port."""
    process = subprocess.Popen(
        [sys.executable, "-m", "loomserve.cli.bench.instant_server", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("listening on "):
        process.kill()
        raise RuntimeError(f"the instant server did not start: {line!r}")
    return process, int(line.split()[-1])


async def _measure(url: str, scale: float) -> SelfTestResult:
    def prompts(n: int, output_len: int) -> list[BenchRequest]:
        return [BenchRequest("hello " * 8, 8, output_len)] * max(2, round(n * scale))

    client = StreamingClient(url, MODEL, timeout_s=60.0)
    try:
        await run_load(client, prompts(50, 1), LoadShape(max_concurrency=32), 0, progress=False)
        requests = await run_load(
            client, prompts(1000, 1), LoadShape(max_concurrency=32), 0, progress=False
        )
        chunks = await run_load(
            client, prompts(64, 256), LoadShape(max_concurrency=8), 0, progress=False
        )
        paced_rate = 200.0
        paced = await run_load(
            client, prompts(400, 4), LoadShape(request_rate=paced_rate), 0, progress=False
        )
    finally:
        await client.aclose()
    runs = (requests, chunks, paced)

    def done(run: RunResult) -> int:
        return sum(r.success for r in run.records)

    per_request_s = requests.client_cpu_s / max(done(requests), 1)
    chunk_count = sum(r.chunks for r in chunks.records)
    chunk_cpu_s = max(chunks.client_cpu_s - per_request_s * done(chunks), 0.0)
    pacing = pacing_stats(paced.records, paced_rate)
    return SelfTestResult(
        max_request_rate=done(requests) / requests.duration_s,
        cpu_us_per_request=per_request_s * 1e6,
        max_chunk_rate=chunk_count / chunks.duration_s,
        cpu_us_per_chunk=chunk_cpu_s / max(chunk_count, 1) * 1e6,
        paced_requested_rate=paced_rate,
        paced_achieved_rate=pacing.achieved_rate or 0.0,
        paced_max_lag_ms=pacing.max_lag_ms,
        paced_late=pacing.late,
        loop_lag_max_ms=max(run.loop_lag_max_ms for run in runs),
        failed=sum(compute_metrics(run.records, run.duration_s).failed for run in runs),
    )


def format_self_test(result: SelfTestResult) -> str:
    """The self-test as a small table."""
    rows = [
        " Load generator self-test ".center(58, "="),
        f"{'Max request rate (1-token answers, 32 in flight):':<48} "
        f"{result.max_request_rate:.0f} req/s",
        f"{'  client CPU per request:':<48} {result.cpu_us_per_request:.0f} µs",
        f"{'Max chunk rate (256-token answers, 8 in flight):':<48} "
        f"{result.max_chunk_rate:.0f} chunks/s",
        f"{'  client CPU per chunk:':<48} {result.cpu_us_per_chunk:.1f} µs",
        f"{'Poisson pacing, achieved of requested:':<48} "
        f"{result.paced_achieved_rate:.1f} of {result.paced_requested_rate:.0f} req/s",
        f"{'  max send lag / sent > 10 ms late:':<48} "
        f"{result.paced_max_lag_ms:.1f} ms / {result.paced_late}",
        f"{'Event-loop max lag:':<48} {result.loop_lag_max_ms:.1f} ms",
        f"{'Failed requests:':<48} {result.failed}",
        "=" * 58,
        "The instant server shares this machine's cores: these are lower bounds. A benchmark",
        "whose rates stay well below them measures the server, not the client.",
    ]
    return "\n".join(rows)


def run_self_test(echo: Callable[[str], None] = print, scale: float = 1.0) -> dict:
    """Measure the generator against the instant server and print the table; return it."""
    process, port = start_instant_server()
    try:
        echo(f"Instant server on 127.0.0.1:{port} (pid {process.pid}); measuring...")
        result = asyncio.run(_measure(f"http://127.0.0.1:{port}", scale))
    finally:
        process.terminate()
        process.wait(timeout=10)
    echo(format_self_test(result))
    return asdict(result)
