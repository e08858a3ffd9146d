"""Request tracing's cost: the same load with tracing off and on, side by side.

Each round starts `loomserve serve` (one worker, one gateway) twice, once without an OTLP
endpoint and once exporting every request's spans to an OTLP/HTTP receiver in this process
(the one tests/e2e/test_tracing.py runs), and runs the same `loomserve bench` load against
each; the order alternates so the machine's noise falls on both alike. It prints output
tokens/s, TTFT and TPOT medians, and the spans the receiver got.

    python -m benchmarks.bench_tracing                   # the tiny test model
    python -m benchmarks.bench_tracing --model x.gguf --rounds 3 --num-prompts 64
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_replicas import SetUp, bench, free_port, serve, wait_ready
from loomserve.cli.default_model import resolve_model
from tests.e2e.test_tracing import Receiver, receiving
from tests.tiny_model import write_tiny_model

ONE_WORKER = SetUp("1 worker", workers=1, threads=2, slots=8)


def worker_spans_cost(requests: int = 2000) -> tuple[float, float]:
    """Microseconds the tick loop spends on one finished request's spans (RequestTracer's
    `finished`: a hand-over), and those its tracing thread spends making them (five spans
    into a BatchSpanProcessor whose exporter drops them)."""
    import time

    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from loomserve.protocol import Finish, SamplingParams
    from loomserve.worker.sched.slots import Request
    from loomserve.worker.tick.tracing import RequestTracer

    class Dropped(SpanExporter):
        def export(self, spans):  # type: ignore[no-untyped-def]
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropped()))
    trace.set_tracer_provider(provider)
    tracer = RequestTracer("tiny")
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    params = SamplingParams(grammar='root ::= "a"')
    now = time.monotonic()
    finish = Finish("r", "stop", 64, 64, 0, 0.001)
    made = [
        Request((b"gw", f"r{i}"), [1] * 64, params, arrived_at=now - 1.0) for i in range(requests)
    ]
    for request in made:
        request.admitted_at, request.first_token_at = now - 0.9, now - 0.5
        request.trace = traceparent
    started = time.perf_counter()
    for request in made:
        tracer.finished(request, finish, now)
    handed = time.perf_counter() - started
    tracer.close(timeout=600)
    done = time.perf_counter() - started
    provider.shutdown()
    return handed / requests * 1e6, done / requests * 1e6


@contextlib.contextmanager
def tracing_to(receiver: Receiver | None) -> Iterator[None]:
    """serve's children inherit the environment: OTEL_EXPORTER_OTLP_ENDPOINT turns it on."""
    if receiver is None:
        yield
        return
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.url
    try:
        yield
    finally:
        del os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"]


@click.command()
@click.option("--model", default=None, help="GGUF model; default: the tiny test model.")
@click.option("--rounds", type=int, default=3, help="Alternating rounds per setting.")
@click.option("--num-prompts", type=int, default=48, help="Requests per run.")
@click.option("--max-concurrency", type=int, default=8, help="Requests in flight at once.")
@click.option("--input-len", type=int, default=64, help="Prompt tokens.")
@click.option("--output-len", type=int, default=64, help="Tokens generated per request.")
def main(
    model: str | None,
    rounds: int,
    num_prompts: int,
    max_concurrency: int,
    input_len: int,
    output_len: int,
) -> None:
    """Run the comparison and print a table (medians over the rounds)."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-tracing-"))
    model_path = resolve_model(model) if model else write_tiny_model(workdir / "tiny.gguf")
    load = {
        "dataset": "random",
        "input-len": str(input_len),
        "output-len": str(output_len),
        "num-prompts": str(num_prompts),
        "max-concurrency": str(max_concurrency),
        "num-warmups": "2",
    }
    results: dict[str, list[dict]] = {"off": [], "on": []}
    spans = 0
    with receiving() as receiver:
        for round_index in range(rounds):
            order = ("off", "on") if round_index % 2 == 0 else ("on", "off")
            for setting in order:
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                with tracing_to(receiver if setting == "on" else None):
                    process = serve(model_path, ONE_WORKER, port, workdir / "serve.log")
                try:
                    wait_ready(url, 1)
                    name = f"{round_index}-{setting}.json"
                    summary = bench(url, workdir / name, load)
                    results[setting].append(summary)
                finally:
                    process.terminate()
                    process.wait(60)
                print(
                    f"round {round_index + 1} tracing {setting}: "
                    f"{summary['output_throughput']:.1f} tok/s, failed {summary['failed']}",
                    flush=True,
                )
        spans = len(receiver.spans)

    def median(setting: str, key: str) -> float:
        return statistics.median(summary[key] for summary in results[setting])

    print(f"\nmodel {model_path.name}, {os.cpu_count()} cores, {rounds} rounds, {load}")
    print("| tracing | output tok/s | TTFT p50 ms | TPOT p50 ms | failed |")
    print("|---|---:|---:|---:|---:|")
    for setting in ("off", "on"):
        print(
            f"| {setting} | {median(setting, 'output_throughput'):.1f} "
            f"| {median(setting, 'median_ttft_ms'):.1f} | {median(setting, 'median_tpot_ms'):.2f} "
            f"| {sum(s['failed'] for s in results[setting])} |"
        )
    ratio = median("on", "output_throughput") / median("off", "output_throughput")
    print(f"throughput, on / off: {ratio:.3f}; spans received: {spans}")
    loop, thread = worker_spans_cost()
    print(f"one finished request's spans: {loop:.1f} µs in the loop, {thread:.0f} µs in all")


if __name__ == "__main__":
    main()
