"""The gateway's tracing hooks (gateway/tracing.py): off, they make no span and read none,
even inside a recording span; on, their spans join the current trace and their W3C context is
what a Generate carries; an error answer puts its code and message on the request's span.
And a process with tracing off never loads the SDK."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from loomserve.gateway import tracing
from loomserve.gateway.api.errors import install_handlers, invalid_request
from loomserve.gateway.http.tracing import TracingMiddleware, refusal
from loomserve.gateway.workers.errors import WorkerLost
from tests.otel_spans import kept_spans

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    with kept_spans() as exporter:
        yield exporter
    tracing.disable()


def test_off_the_hooks_make_no_span_even_inside_a_recording_one(spans) -> None:
    tracing.disable()
    with trace.get_tracer("test").start_as_current_span("client"):
        assert tracing.extract({"traceparent": TRACEPARENT}) is None
        assert tracing.current() is None  # so nothing annotates the client's span
        span = tracing.start_span("gateway.generation")
        assert span is None
        with tracing.use(span):
            tracing.annotate(span, {"a": 1})
        tracing.end(span, {"b": 2}, error="no")
        assert tracing.context_of(span) == ("", "")
    assert [s.name for s in spans.get_finished_spans()] == ["client"]


def test_on_spans_join_the_clients_trace_and_carry_it_on(spans) -> None:
    tracing.enable()
    parent = tracing.extract({"traceparent": TRACEPARENT, "tracestate": "vendor=opaque"})
    request = tracing.start_span("POST /v1/completions", parent=parent, kind="SERVER")
    assert request is not None
    with tracing.use(request):
        assert tracing.current() is request
        generation = tracing.start_span("gateway.generation", kind="CLIENT")
    traceparent, tracestate = tracing.context_of(generation)
    assert generation is not None
    assert traceparent == f"00-{TRACE_ID}-{generation.get_span_context().span_id:016x}-01"
    assert tracestate == "vendor=opaque"  # the client's, passed on as W3C asks
    tracing.end(generation, {"loomserve.worker": "tcp://w"}, error="lost")
    tracing.end(request)
    made = {s.name: s for s in spans.get_finished_spans()}
    assert made["gateway.generation"].parent.span_id == request.get_span_context().span_id
    assert made["gateway.generation"].status.status_code.name == "ERROR"
    assert made["gateway.generation"].attributes["loomserve.worker"] == "tcp://w"


def test_a_malformed_traceparent_starts_a_new_trace(spans) -> None:
    tracing.enable()
    span = tracing.start_span("r", parent=tracing.extract({"traceparent": "00-zz-yy-01"}))
    tracing.end(span)
    (made,) = spans.get_finished_spans()
    assert made.parent is None


def test_a_process_without_tracing_never_loads_the_sdk() -> None:
    code = (
        "import sys\n"
        "import loomserve.cli.main, loomserve.gateway.http.app, loomserve.worker.server\n"
        "loaded = [m for m in sys.modules if m.startswith(('opentelemetry.sdk', "
        "'opentelemetry.exporter', 'loomserve.worker.tick.tracing'))]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _app() -> FastAPI:
    """Routes that answer as the gateway's do: an error in OpenAI's shape, under
    /v1/messages in Anthropic's, a worker's failure after it took the request, and a 200."""
    app = FastAPI()
    install_handlers(app)

    @app.post("/v1/completions")
    async def completions() -> dict[str, str]:
        raise WorkerLost("the gateway is shutting down; retry the request")

    @app.post("/v1/messages")
    async def messages() -> dict[str, str]:
        raise invalid_request("max_tokens: must be at least 1", "max_tokens")

    @app.get("/v1/models")
    async def models() -> dict[str, str]:
        return {"object": "list"}

    app.add_middleware(TracingMiddleware)
    return app


def test_an_error_answer_says_why_in_the_request_span(spans) -> None:
    tracing.enable()
    with TestClient(_app()) as client:
        assert client.post("/v1/completions").status_code == 503
        assert client.post("/v1/messages").status_code == 400
        assert client.get("/v1/models").status_code == 200
    made = {s.name: s for s in spans.get_finished_spans()}
    [cut] = made["POST /v1/completions"].events
    assert cut.name == "loomserve.refused"
    assert cut.attributes == {
        "error.type": "worker_unavailable",
        "loomserve.error.message": "the gateway is shutting down; retry the request",
    }
    [refused] = made["POST /v1/messages"].events  # Anthropic's shape: its error type
    assert refused.attributes == {
        "error.type": "invalid_request_error",
        "loomserve.error.message": "max_tokens: must be at least 1",
    }
    assert not made["GET /v1/models"].events


def test_a_refusal_without_an_error_body_is_named_by_its_status() -> None:
    assert refusal(413, b"too large") == {"error.type": "413", "loomserve.error.message": ""}
    assert refusal(404, b'{"error": {"message": "no", "type": "not_found_error"}}') == {
        "error.type": "not_found_error",
        "loomserve.error.message": "no",
    }
