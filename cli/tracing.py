"""The OpenTelemetry SDK of one process: where its spans go (OTLP over HTTP), and in what name.

Tracing is off unless an endpoint is configured: `--otlp-endpoint` (LOOMSERVE_OTLP_ENDPOINT),
else the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT. Off, the
SDK is never imported and the gateway and the worker create no spans (gateway/tracing.py,
worker/tick/tracing.py); on, a BatchSpanProcessor exports from its own thread, so neither the
event loop nor the tick loop ever waits for the collector.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping

GATEWAY_SERVICE = "loomserve-gateway"
WORKER_SERVICE = "loomserve-worker"
TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for traces under a collector's base URL


def traces_url(option: str | None, env: Mapping[str, str] = os.environ) -> str | None:
    """The OTLP/HTTP URL spans are posted to; None: tracing off.

    --otlp-endpoint is a collector's base URL (http://jaeger:4318), like
    OTEL_EXPORTER_OTLP_ENDPOINT: /v1/traces is added unless it is there already.
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is the whole URL, as the OpenTelemetry spec says.
    OTEL_SDK_DISABLED=true turns tracing off whatever the rest say.
    """
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if option:
        return _with_traces_path(option)
    if whole := env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip():
        return whole
    if base := env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        return _with_traces_path(base)
    return None


def _with_traces_path(base: str) -> str:
    base = base.strip().rstrip("/")
    return base if base.endswith(TRACES_PATH) else base + TRACES_PATH


def start_tracing(service: str, url: str) -> Callable[[], None]:
    """Install the process's tracer provider, exporting to url as `service`; return what
    flushes and stops it (the spans still queued are sent first)."""
    # Imported here: a process without tracing never loads the SDK or the exporter.
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # The sampler is the SDK's default unless OTEL_TRACES_SAMPLER says otherwise: parent
    # based, so a client's traceparent that says "not sampled" is honoured.
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    trace.set_tracer_provider(provider)
    return provider.shutdown


@contextlib.contextmanager
def traced(service: str, url: str | None) -> Iterator[None]:
    """Run the process's work with tracing on when url is set; its spans are flushed after."""
    if url is None:
        yield
        return
    stop = start_tracing(service, url)
    try:
        yield
    finally:
        stop()
