"""How a process's spans leave it (cli/tracing.py): counted, and stopped within a bound.

Imported only when tracing is on. The SDK's BatchSpanProcessor exports from its own thread;
at exit, its shutdown exports everything still queued, each batch with the exporter's full
timeout and retries, so a dead or silent collector would hold a stop for tens of seconds.
bounded_stop gives it a fixed time and drops the rest, saying how many spans were lost.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import structlog
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

log = structlog.get_logger(__name__)


class CountingExporter(SpanExporter):
    """Wraps the OTLP exporter, counting the spans it sent and those it failed to send."""

    def __init__(self, exporter: SpanExporter) -> None:
        self.exporter = exporter
        self.sent = 0
        self.failed = 0
        self._shut = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = SpanExportResult.FAILURE
        try:
            result = self.exporter.export(spans)
        finally:  # one export at a time (the processor's lock): plain counts suffice
            if result is SpanExportResult.SUCCESS:
                self.sent += len(spans)
            else:
                self.failed += len(spans)
        return result

    def shutdown(self) -> None:
        """Stop the exporter (its retries too); once: bounded_stop and the SDK both call it."""
        if not self._shut:
            self._shut = True
            self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)


class CountingProcessor(BatchSpanProcessor):
    """The SDK's batch processor, counting the spans given to it to export (`ended`)."""

    def __init__(self, exporter: SpanExporter) -> None:
        super().__init__(exporter)
        self.ended = 0
        self._count_lock = threading.Lock()  # spans end on many threads

    def on_end(self, span: ReadableSpan) -> None:
        if span.context and span.context.trace_flags.sampled:
            with self._count_lock:
                self.ended += 1
        super().on_end(span)


def bounded_stop(
    provider: TracerProvider,
    processor: CountingProcessor,
    exporter: CountingExporter,
    url: str,
    seconds: float,
) -> bool:
    """Shut the provider down, sending what is queued for at most `seconds`; True when all
    was sent. The SDK's shutdown runs on a daemon thread that is abandoned (it dies with the
    process) when the time is up; the spans not sent by then are logged as a count."""
    flushing = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
    flushing.start()
    flushing.join(seconds)
    if flushing.is_alive():
        exporter.shutdown()  # no more retries on the abandoned thread: it ends sooner, quietly
    unsent = processor.ended - exporter.sent
    if not flushing.is_alive() and unsent == 0:
        return True
    log.warning(
        "spans not sent to the collector",
        collector=url,
        unsent=unsent,
        failed=exporter.failed,
        timed_out=flushing.is_alive(),
        shutdown_seconds=seconds,
    )
    return False
