"""Where traces go (cli/tracing.py): --otlp-endpoint, else the standard variables, else off;
and a stop never waits long for a dead collector (cli/span_export.py)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest
import structlog
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider

from loomserve.cli.main import main
from loomserve.cli.serve import child_argv
from loomserve.cli.span_export import CountingExporter, CountingProcessor, bounded_stop
from loomserve.cli.tracing import traces_url


def test_off_unless_configured() -> None:
    assert traces_url(None, {}) is None
    assert traces_url("", {}) is None


def test_the_option_is_a_collectors_base_url() -> None:
    assert traces_url("http://jaeger:4318", {}) == "http://jaeger:4318/v1/traces"
    assert traces_url("http://jaeger:4318/", {}) == "http://jaeger:4318/v1/traces"
    assert traces_url("http://c:4318/v1/traces", {}) == "http://c:4318/v1/traces"


def test_the_standard_variables_as_the_spec_reads_them() -> None:
    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert traces_url(None, base) == "http://c:4318/v1/traces"
    whole = {**base, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:9999/custom"}
    assert traces_url(None, whole) == "http://t:9999/custom"  # as is, and before the base
    assert traces_url("http://o:4318", whole) == "http://o:4318/v1/traces"  # the option first


def test_the_sdk_switch_turns_it_off() -> None:
    env = {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert traces_url("http://o:4318", env) is None


def test_serve_passes_the_endpoint_to_every_child() -> None:
    serve_options = [p.name for p in main.commands["serve"].params]
    assert serve_options.count("otlp_endpoint") == 1  # one option, for both kinds of child
    for command in ("worker", "gateway"):
        argv = child_argv(main.commands[command], {"otlp_endpoint": "http://jaeger:4318"})
        assert argv[-2:] == ["--otlp-endpoint", "http://jaeger:4318"], command


# A stop against a collector that never answers, or refuses, is bounded by the shutdown's
# time, not by the exporter's: with an export timeout of EXPORT_SECONDS, the SDK's own
# shutdown holds at least that long; ours gives up after STOP_SECONDS and counts the loss.
EXPORT_SECONDS = 60.0
STOP_SECONDS = 0.5


@contextmanager
def silent_collector() -> Iterator[str]:
    """A 127.0.0.1 port that takes connections (the kernel's backlog) and never reads."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1/traces"


@contextmanager
def refusing_collector() -> Iterator[str]:
    """A 127.0.0.1 port nothing listens on: every connection is refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    yield f"http://127.0.0.1:{port}/v1/traces"


@pytest.mark.parametrize("collector", [silent_collector, refusing_collector])
def test_a_dead_collector_does_not_hold_the_stop(
    collector: Callable[[], AbstractContextManager[str]],
) -> None:
    with collector() as url:
        exporter = CountingExporter(OTLPSpanExporter(endpoint=url, timeout=EXPORT_SECONDS))
        processor = CountingProcessor(exporter)
        provider = TracerProvider(shutdown_on_exit=False)  # not the process's: a local one
        provider.add_span_processor(processor)
        tracer = provider.get_tracer("test")
        for n in range(5):
            tracer.start_span(f"span-{n}").end()
        started = time.monotonic()
        with structlog.testing.capture_logs() as logs:
            assert not bounded_stop(provider, processor, exporter, url, STOP_SECONDS)
        took = time.monotonic() - started
    # The SDK's shutdown alone waits the exporter's whole timeout on a silent collector, and
    # retries a refusing one for 1+2+4+8+16 s (±20 %): a quarter of EXPORT_SECONDS is far
    # from both, and far above STOP_SECONDS however busy the machine.
    assert took < EXPORT_SECONDS / 4
    assert processor.ended == 5 and exporter.sent == 0
    [warning] = [entry for entry in logs if entry["event"] == "spans not sent to the collector"]
    assert warning["unsent"] == 5 and warning["collector"] == url
    assert warning["timed_out"], "it stopped waiting, the export still under way"


def test_a_live_collector_gets_every_span() -> None:
    from tests.e2e.test_tracing import receiving

    with receiving() as receiver:
        url = receiver.url + "/v1/traces"
        exporter = CountingExporter(OTLPSpanExporter(endpoint=url, timeout=EXPORT_SECONDS))
        processor = CountingProcessor(exporter)
        provider = TracerProvider(shutdown_on_exit=False)
        provider.add_span_processor(processor)
        for n in range(5):
            provider.get_tracer("test").start_span(f"span-{n}").end()
        # A generous bound: the receiver is in this process and answers at once.
        assert bounded_stop(provider, processor, exporter, url, seconds=30)
    assert exporter.sent == 5 and sorted(s.name for s in receiver.spans)[0] == "span-0"
