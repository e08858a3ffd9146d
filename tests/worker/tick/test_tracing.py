"""The worker's spans of a request (tick/tracing.py), on the real engine in-process: none at
all with tracing off, and with it on one finished request's five, children of the gateway's
span its Generate named, in order, with their attributes."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from loomserve.protocol import FinishReason, Generate, SamplingParams
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine
from loomserve.worker.tick.faults import ENV_VAR
from loomserve.worker.tick.loop import TickLoop
from loomserve.worker.tick.tracing import RequestTracer
from tests.otel_spans import kept_spans
from tests.worker.engine.test_engine import GW, Collector, drain

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT}-01"
GRAMMAR = "start: /[a-c]{3}/"  # Lark, as the gateway writes grammars for llguidance


@pytest.fixture(scope="module")
def config(tiny_model_path: Path) -> WorkerConfig:
    return WorkerConfig(model_path=tiny_model_path, slots=2, ctx_size=256, threads=1)


@pytest.fixture(scope="module")
def engine(config: WorkerConfig) -> Iterator[Engine]:
    engine = Engine(config)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    with kept_spans() as exporter:
        yield exporter


def generate(request_id: str, grammar: str | None = None) -> Generate:
    params = SamplingParams(max_tokens=6, temperature=0.0, grammar=grammar)
    return Generate(request_id, [1, 40, 41, 42], params, tenant="t1", trace=TRACEPARENT)


def test_tracing_off_makes_no_span(engine, config, spans) -> None:
    spans.clear()
    loop = TickLoop(engine, config, collector := Collector())  # no tracer: off
    loop.inbox.submit(GW, generate("off", GRAMMAR))
    drain(loop)
    assert collector.finishes()["off"].completion_tokens >= 1
    assert spans.get_finished_spans() == ()


def test_a_finished_request_has_its_spans_under_the_gateways(engine, config, spans) -> None:
    spans.clear()
    tracer = RequestTracer("tiny")
    loop = TickLoop(engine, config, collector := Collector(), tracer=tracer)
    loop.inbox.submit(GW, generate("on", GRAMMAR))
    drain(loop)
    tracer.close()  # its thread has made every span handed to it
    finish = collector.finishes()["on"]
    made = {span.name: span for span in spans.get_finished_spans()}
    assert set(made) == {
        "worker.request",
        "worker.grammar",
        "worker.queue",
        "worker.prefill",
        "worker.decode",
    }
    root = made["worker.request"]
    assert root.parent is not None and f"{root.parent.span_id:016x}" == PARENT
    for span in made.values():
        assert f"{span.context.trace_id:032x}" == TRACE_ID
        if span is not root:
            assert span.parent is not None and span.parent.span_id == root.context.span_id
    assert root.attributes["loomserve.request_id"] == "on"
    assert root.attributes["loomserve.tenant"] == "t1"
    assert root.attributes["gen_ai.request.model"] == "tiny"
    assert list(root.attributes["gen_ai.response.finish_reasons"]) == [finish.reason]
    assert root.attributes["gen_ai.usage.output_tokens"] == finish.completion_tokens
    assert made["worker.prefill"].attributes["gen_ai.usage.input_tokens"] == 4
    assert (
        made["worker.decode"].attributes["gen_ai.usage.output_tokens"] == finish.completion_tokens
    )
    assert made["worker.grammar"].attributes["loomserve.grammar.chars"] == len(GRAMMAR)
    order = [made[n] for n in ("worker.grammar", "worker.queue", "worker.prefill", "worker.decode")]
    for before, after in itertools.pairwise(order):
        assert before.end_time <= after.start_time, (before.name, after.name)
    assert root.start_time <= order[0].start_time and order[-1].end_time <= root.end_time


def test_a_request_cancelled_in_the_queue_has_no_prefill_or_decode(engine, config, spans) -> None:
    spans.clear()
    one_slot = WorkerConfig(model_path=config.model_path, slots=1, ctx_size=256, threads=1)
    tracer = RequestTracer("tiny")
    loop = TickLoop(engine, one_slot, collector := Collector(), tracer=tracer)
    loop.inbox.submit(GW, generate("first"))
    loop.inbox.submit(GW, generate("second"))
    loop.tick(block=False)  # the first takes the one slot; the second waits
    loop.inbox.abort(GW, "second")
    drain(loop)
    tracer.close()
    assert collector.finishes()["second"].reason == FinishReason.CANCELLED
    second = [
        s
        for s in spans.get_finished_spans()
        if s.attributes.get("loomserve.request_id") == "second"
    ]
    assert len(second) == 1  # its worker.request; its children carry no request id
    children = [
        s.name
        for s in spans.get_finished_spans()
        if s.parent is not None and s.parent.span_id == second[0].context.span_id
    ]
    assert children == ["worker.queue"]


def test_a_request_failed_after_it_was_taken_says_why_in_its_span(
    engine, config, spans, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forward pass fails (faults.py's injection) and the loop fails the request it
    ran: its worker.request span carries a loomserve.refused event with the failure's code
    and message."""
    spans.clear()
    monkeypatch.setenv(ENV_VAR, "once")
    tracer = RequestTracer("tiny")
    loop = TickLoop(engine, config, collector := Collector(), tracer=tracer)
    loop.inbox.submit(GW, generate("failed"))
    loop.inbox.stop()  # run() returns once the failed request is answered
    loop.run()
    tracer.close()
    finish = collector.finishes()["failed"]
    assert finish.reason == FinishReason.ERROR
    [root] = [
        s
        for s in spans.get_finished_spans()
        if s.attributes.get("loomserve.request_id") == "failed"
    ]
    [event] = root.events
    assert event.name == "loomserve.refused"
    assert event.attributes["error.type"] == (finish.code or "internal_error")
    assert event.attributes["loomserve.error.message"] == finish.message
    assert finish.message == "internal error in the worker's tick"
    assert root.status.status_code.name == "ERROR"


def test_a_request_with_an_image_has_its_encode_span(
    engine, config, spans, tiny_mmproj_path: Path
) -> None:
    from loomserve.worker.engine.media import MediaEncoder
    from tests.tiny_vision_model import TINY_VISION, png_bytes

    spans.clear()
    tracer = RequestTracer("tiny")
    collector = Collector()
    loop: TickLoop | None = None

    def done(gateway, message, encoded, why):
        assert loop is not None
        loop.inbox.encoded(gateway, message, encoded, why)

    media = MediaEncoder(tiny_mmproj_path, engine.model, 1, False, done)
    try:
        loop = TickLoop(engine, config, collector, tracer=tracer, media=media)
        params = SamplingParams(max_tokens=4, temperature=0.0)
        request = Generate(
            "img", [1, 40, 41, 42], params, trace=TRACEPARENT, images=[png_bytes(32, 32)],
            image_at=[2],
        )  # fmt: skip
        loop.inbox.submit(GW, request)
        for _ in range(1000):  # the encoder's answer, then the request to its end
            loop.tick(block=not loop.scheduler.has_work())
            if "img" in collector.finishes():
                break
        tracer.close()
    finally:
        media.close()
    made = {span.name: span for span in spans.get_finished_spans()}
    encode, root = made["worker.image_encode"], made["worker.request"]
    assert encode.attributes["loomserve.images"] == 1
    assert encode.attributes["loomserve.image_tokens"] == TINY_VISION.image_tokens
    assert encode.parent is not None and encode.parent.span_id == root.context.span_id
    assert (
        root.start_time == encode.start_time <= encode.end_time <= made["worker.queue"].start_time
    )
