"""The gateway's request spans (docs/metrics.md, "Tracing"): off unless run_gateway enables them.

Off, every function here returns at once and nothing of OpenTelemetry is imported: the cost
is one check of a module global per request and per sequence, never per token. On (cli/
tracing.py installed the SDK's provider), the HTTP request's server span is current while
the route runs (http/tracing.py), and the spans made here are its children: a sequence's
`gateway.generation` (whose W3C context its Generate carries to the worker), the routing
among workers (`gateway.route`) and the stream back (`gateway.stream`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

AttributeValue = str | bool | int | float | Sequence[str] | Sequence[int]
Attributes = Mapping[str, AttributeValue]

_tracer: Tracer | None = None  # None: tracing is off


def enable() -> None:
    """Make spans from now on, with the process's tracer provider (cli/tracing.py's)."""
    global _tracer
    from opentelemetry import trace

    _tracer = trace.get_tracer("loomserve.gateway")


def disable() -> None:
    """Make no more spans (tests)."""
    global _tracer
    _tracer = None


def enabled() -> bool:
    return _tracer is not None


def extract(headers: Mapping[str, str]) -> Context | None:
    """The client's W3C trace context (traceparent, tracestate); None when tracing is off.

    A missing or malformed traceparent gives an empty context: the request's trace starts
    here, as the W3C spec says, and the request itself is served as ever."""
    if _tracer is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(headers)


def start_span(
    name: str,
    attributes: Attributes | None = None,
    parent: Context | None = None,
    kind: str = "INTERNAL",
) -> Span | None:
    """A span, child of `parent` or else of the current span; None when tracing is off."""
    if _tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    return _tracer.start_span(name, context=parent, kind=SpanKind[kind], attributes=attributes)


def current() -> Span | None:
    """The current span (the request's, in a route) when tracing is on and it records."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    span = trace.get_current_span()
    return span if span.is_recording() else None


@contextlib.contextmanager
def use(span: Span | None) -> Iterator[None]:
    """Make span the current one for the block (its children's parent); it stays open."""
    if span is None:
        yield
        return
    from opentelemetry import trace

    with trace.use_span(span, end_on_exit=False):
        yield


def annotate(span: Span | None, attributes: Attributes) -> None:
    if span is not None:
        span.set_attributes(attributes)


def event(span: Span | None, name: str, attributes: Attributes | None = None) -> None:
    """Mark a moment in span's life, with what happened (a refusal's code and reason)."""
    if span is not None:
        span.add_event(name, attributes)


def end(span: Span | None, attributes: Attributes | None = None, error: str = "") -> None:
    """End span, with these attributes; an error marks it failed (the span's status)."""
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if error:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def context_of(span: Span | None) -> tuple[str, str]:
    """span's W3C context (traceparent, tracestate), for a Generate or an Embed to carry to
    the worker; ("", "") without a span."""
    if span is None:
        return "", ""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent", ""), carrier.get("tracestate", "")
