"""The OpenTelemetry SDK of one process: where its spans go (OTLP over HTTP), and in what name.

Tracing is off unless an endpoint is configured: `--otlp-endpoint` (LOOMSERVE_OTLP_ENDPOINT),
else the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT. Off, the
SDK is never imported and the gateway and the worker create no spans (gateway/tracing.py,
worker/tick/tracing.py); on, a BatchSpanProcessor exports from its own thread, so neither the
event loop nor the tick loop ever waits for the collector. At exit the spans still queued get
at most SHUTDOWN_SECONDS to leave: a dead or silent collector never holds a stop longer
(what could not be sent is dropped, and counted in the log).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping

GATEWAY_SERVICE = "loomserve-gateway"
WORKER_SERVICE = "loomserve-worker"
TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for traces under a collector's base URL
# How long a stopping process waits for its last spans to reach the collector. The
# exporter's own timeout (OTEL_EXPORTER_OTLP_TRACES_TIMEOUT, 10 s by default, per batch, with
# retries) would hold a stop for tens of seconds against a silent collector, past `serve`'s
# patience (it kills a child --shutdown-timeout + 10 s after SIGTERM); a healthy collector
# takes milliseconds.
SHUTDOWN_SECONDS = 2.0


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


def start_tracing(
    service: str, url: str, shutdown_seconds: float = SHUTDOWN_SECONDS
) -> Callable[[], None]:
    """Install the process's tracer provider, exporting to url as `service`; return what
    flushes and stops it: the spans still queued are sent first, for at most
    shutdown_seconds, and what is left then is dropped and counted in the log."""
    # Imported here: a process without tracing never loads the SDK or the exporter.
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider

    from .span_export import CountingExporter, CountingProcessor, bounded_stop

    # The sampler is the SDK's default unless OTEL_TRACES_SAMPLER says otherwise: parent
    # based, so a client's traceparent that says "not sampled" is honoured. No exit hook of
    # the SDK's own: it would flush again, unbounded, after ours gave up.
    provider = TracerProvider(
        resource=Resource.create({SERVICE_NAME: service}), shutdown_on_exit=False
    )
    exporter = CountingExporter(OTLPSpanExporter(endpoint=url))
    processor = CountingProcessor(exporter)
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)

    def stop() -> None:
        bounded_stop(provider, processor, exporter, url, shutdown_seconds)

    return stop


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
