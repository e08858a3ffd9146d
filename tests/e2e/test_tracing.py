"""Request traces across processes: a worker and a gateway on the tiny model export to a real
OTLP/HTTP receiver in this process, and one request's spans from both share the client's
trace and nest: the client's span, the gateway's request span, its sequence's span, the
worker's request span and its phases. An embeddings request's worker span joins its trace too.
A collector that never answers does not hold either process's stop.
"""

from __future__ import annotations

import gzip
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.conftest import LONG_CTX
from tests.procs import Proc, free_port, start_gateway, start_worker, wait_http

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
EMBED_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
# Spans leave each process within a tenth of a second, not the SDK's default 5 s.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    start: int
    end: int
    attributes: dict[str, Any]
    events: tuple[tuple[str, dict[str, Any]], ...] = ()


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


class Receiver:
    """An OTLP/HTTP trace receiver on 127.0.0.1: POST /v1/traces, protobuf bodies."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                receiver.take(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def take(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    with self.lock:
                        self.spans.append(
                            Span(
                                service=resource.get("service.name", ""),
                                name=span.name,
                                trace_id=span.trace_id.hex(),
                                span_id=span.span_id.hex(),
                                parent=span.parent_span_id.hex(),
                                start=span.start_time_unix_nano,
                                end=span.end_time_unix_nano,
                                attributes={a.key: _value(a.value) for a in span.attributes},
                                events=tuple(
                                    (e.name, {a.key: _value(a.value) for a in e.attributes})
                                    for e in span.events
                                ),
                            )
                        )

    def wait_for(self, names: set[str], timeout: float) -> list[Span]:
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                spans = list(self.spans)
            if names <= {s.name for s in spans}:
                return spans
            assert time.monotonic() < deadline, f"spans so far: {sorted(s.name for s in spans)}"
            time.sleep(0.1)


@contextmanager
def receiving() -> Iterator[Receiver]:
    receiver = Receiver()
    thread = threading.Thread(target=receiver.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()


WANTED = {
    "POST /v1/completions",
    "gateway.generation",
    "gateway.route",
    "gateway.stream",
    "worker.request",
    "worker.grammar",
    "worker.queue",
    "worker.prefill",
    "worker.decode",
}


def test_one_requests_spans_share_the_clients_trace_and_nest(tiny_model_path: Path) -> None:
    with ExitStack() as stack:
        receiver = stack.enter_context(receiving())
        traced = {"otlp_endpoint": receiver.url, "env": FAST_EXPORT}
        worker = stack.enter_context(start_worker(tiny_model_path, embeddings=True, **traced))
        gateway = stack.enter_context(start_gateway(tiny_model_path, worker.endpoint, **traced))
        headers = {
            "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01",
            "tracestate": "vendor=opaque",
            "X-Request-Id": "traced-1",
        }
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 12,
            "temperature": 0,
            "stream": True,
            "user": "tenant-a",
            "grammar": "root ::= [a-z ]{5,12}",
        }
        with httpx.stream(
            "POST", gateway.url + "/v1/completions", json=body, headers=headers, timeout=60
        ) as response:
            assert response.status_code == 200, response.read()
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        embedding_trace = {"traceparent": f"00-{EMBED_TRACE_ID}-{CLIENT_SPAN}-01"}
        embedded = httpx.post(
            gateway.url + "/v1/embeddings",
            json={"input": ["one", "two"]},
            headers=embedding_trace,
            timeout=60,
        )
        assert embedded.status_code == 200, embedded.text
        spans = receiver.wait_for(WANTED | {"POST /v1/embeddings", "worker.embed"}, timeout=30)

    embedding = {s.name: s for s in spans if s.trace_id == EMBED_TRACE_ID}
    assert embedding["worker.embed"].parent == embedding["POST /v1/embeddings"].span_id
    assert embedding["worker.embed"].attributes["loomserve.embed.inputs"] == 2
    assert embedding["worker.embed"].service == "loomserve-worker"

    ours = [s for s in spans if s.name in WANTED and s.trace_id != EMBED_TRACE_ID]
    assert {s.trace_id for s in ours} == {TRACE_ID}, "every span joins the client's trace"
    assert len(ours) == len(WANTED), "one of each: no request span twice (FastAPI's own)"
    by_name = {s.name: s for s in ours}
    by_id = {s.span_id: s for s in ours}
    for name in WANTED:
        service = "loomserve-worker" if name.startswith("worker.") else "loomserve-gateway"
        assert by_name[name].service == service, name
        assert by_name[name].start <= by_name[name].end, name

    def parent_of(name: str) -> str:
        parent = by_id.get(by_name[name].parent)
        return parent.name if parent else by_name[name].parent

    # The gateway's request span is the child of the client's; the rest nest under it.
    assert parent_of("POST /v1/completions") == CLIENT_SPAN
    assert parent_of("gateway.generation") == "POST /v1/completions"
    assert parent_of("gateway.route") == "gateway.generation"
    assert parent_of("gateway.stream") == "POST /v1/completions"
    assert parent_of("worker.request") == "gateway.generation"  # across the ZeroMQ hop
    for phase in ("worker.grammar", "worker.queue", "worker.prefill", "worker.decode"):
        assert parent_of(phase) == "worker.request", phase

    request = by_name["POST /v1/completions"].attributes
    assert request["loomserve.request_id"] == "traced-1"
    assert request["http.route"] == "/v1/completions"
    assert request["http.response.status_code"] == 200
    assert request["gen_ai.request.model"]
    assert request["loomserve.tenant"] == "tenant-a"
    assert request["gen_ai.response.finish_reasons"] in (["length"], ["stop"])
    assert request["gen_ai.usage.output_tokens"] >= 1
    prompt_tokens = request["gen_ai.usage.input_tokens"]
    assert prompt_tokens >= 2

    route = by_name["gateway.route"].attributes
    assert route["loomserve.worker"] == worker.endpoint
    assert route["loomserve.reroutes"] == 0

    served = by_name["worker.request"].attributes
    assert served["loomserve.tenant"] == "tenant-a"
    assert served["gen_ai.response.finish_reasons"] == request["gen_ai.response.finish_reasons"]
    assert served["gen_ai.usage.output_tokens"] == request["gen_ai.usage.output_tokens"]
    prefill = by_name["worker.prefill"].attributes
    assert prefill["gen_ai.usage.input_tokens"] == prompt_tokens
    assert 0 <= prefill["loomserve.usage.cached_tokens"] < prompt_tokens
    decode = by_name["worker.decode"].attributes
    assert decode["gen_ai.usage.output_tokens"] == request["gen_ai.usage.output_tokens"]
    assert decode["loomserve.grammar"] is True
    assert "loomserve.decode.accepted_tokens" in decode
    # The worker's phases follow each other.
    queue, pre, dec = (by_name[n] for n in ("worker.queue", "worker.prefill", "worker.decode"))
    assert queue.end <= pre.start <= pre.end <= dec.start <= dec.end


# A collector that takes connections and never answers: each process's exporter hangs in a
# request for its whole timeout. A stop is bounded by cli/tracing.py's SHUTDOWN_SECONDS (2 s;
# a stop took 3 s here), so a third of EXPORT_SECONDS is far above a stop with tracing and
# well below the SDK's own shutdown, which waits 30 s for its exporting thread.
EXPORT_SECONDS = 60


def test_a_silent_collector_does_not_hold_a_stop(tiny_model_path: Path) -> None:
    with ExitStack() as stack:
        listener = stack.enter_context(socket.socket())
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        env = {**FAST_EXPORT, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": str(EXPORT_SECONDS)}
        traced = {"otlp_endpoint": url, "env": env}
        worker = stack.enter_context(start_worker(tiny_model_path, **traced))
        gateway = stack.enter_context(start_gateway(tiny_model_path, worker.endpoint, **traced))
        body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
        response = httpx.post(gateway.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        # Both processes' exporters are in a request the collector will never answer.
        held = [listener.accept()[0] for _ in range(2)]
        for connection in held:
            stack.callback(connection.close)
        for proc in (gateway, worker):
            started = time.monotonic()
            proc.popen.send_signal(signal.SIGTERM)
            try:
                code = proc.popen.wait(EXPORT_SECONDS / 3)
            except subprocess.TimeoutExpired:
                proc.fail(f"{proc.name} still stopping after {time.monotonic() - started:.1f}s")
            assert code == 0, proc.log_tail()
            assert "spans not sent to the collector" in proc.logs(), proc.log_tail()


def test_a_stream_refused_mid_way_says_why_in_its_span(long_model_path: Path) -> None:
    with ExitStack() as stack:
        receiver = stack.enter_context(receiving())
        traced = {"otlp_endpoint": receiver.url, "env": FAST_EXPORT}
        worker = stack.enter_context(
            start_worker(long_model_path, ctx_size=LONG_CTX, slots=1, **traced)
        )
        gateway = stack.enter_context(
            start_gateway(long_model_path, worker.endpoint, shutdown_timeout=1, **traced)
        )
        # Thousands of tokens: still running when the gateway's one-second drain ends.
        body = {"prompt": "once", "max_tokens": LONG_CTX - 16, "ignore_eos": True, "stream": True}
        with httpx.stream(
            "POST", gateway.url + "/v1/completions", json=body, timeout=60
        ) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            gateway.popen.send_signal(signal.SIGTERM)
            last = [line for line in lines if line.startswith("data: ")][-1]
        assert "shutting down" in last, last
        assert gateway.popen.wait(60) == 0, gateway.log_tail()
        [stream] = [
            s for s in receiver.wait_for({"gateway.stream"}, 30) if s.name == "gateway.stream"
        ]
    [(name, why)] = stream.events
    assert name == "loomserve.refused"
    assert why["error.type"] == "worker_unavailable", why
    assert "shutting down" in why["loomserve.error.message"], why


def test_a_request_refused_after_its_span_began_says_why_in_its_span(
    long_model_path: Path,
) -> None:
    """A non-streamed request the worker took, cut when the gateway's drain ran out, and one
    the gateway refused itself: each request span carries a loomserve.refused event."""
    with ExitStack() as stack:
        receiver = stack.enter_context(receiving())
        traced = {"otlp_endpoint": receiver.url, "env": FAST_EXPORT}
        worker = stack.enter_context(
            start_worker(long_model_path, ctx_size=LONG_CTX, slots=1, **traced)
        )
        gateway = stack.enter_context(
            start_gateway(long_model_path, worker.endpoint, shutdown_timeout=1, **traced)
        )
        bad = httpx.post(
            gateway.url + "/v1/completions",
            json={"prompt": "once", "max_tokens": -1},
            headers={"X-Request-Id": "refused-at-once"},
            timeout=30,
        )
        assert bad.status_code == 400, bad.text
        answers: list[httpx.Response] = []
        body = {"prompt": "once", "max_tokens": LONG_CTX - 16, "ignore_eos": True}
        thread = threading.Thread(
            target=lambda: answers.append(
                httpx.post(
                    gateway.url + "/v1/completions",
                    json=body,
                    headers={"X-Request-Id": "cut-mid-way"},
                    timeout=120,
                )
            )
        )
        thread.start()
        deadline = time.monotonic() + 60
        while not _running(gateway.url, "cut-mid-way"):  # the worker has taken it
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.05)
        gateway.popen.send_signal(signal.SIGTERM)
        thread.join(120)
        assert answers and answers[0].status_code == 503, answers and answers[0].text
        assert gateway.popen.wait(60) == 0, gateway.log_tail()
        spans = receiver.wait_for({"POST /v1/completions"}, 30)
        deadline = time.monotonic() + 30
        while len(requests := [s for s in spans if s.name == "POST /v1/completions"]) < 2:
            assert time.monotonic() < deadline, f"request spans: {requests}"
            time.sleep(0.1)
            spans = receiver.wait_for(set(), 0)
    by_id = {s.attributes["loomserve.request_id"]: s for s in requests}
    [(name, why)] = by_id["cut-mid-way"].events
    assert name == "loomserve.refused"
    assert why["error.type"] == "worker_unavailable", why
    assert "shutting down" in why["loomserve.error.message"], why
    [(name, why)] = by_id["refused-at-once"].events
    assert name == "loomserve.refused"
    assert why["error.type"] == "invalid_request", why
    assert "max_tokens" in why["loomserve.error.message"], why


def _running(url: str, request_id: str) -> bool:
    """Whether a worker's slot runs request_id (the gateway's /slots)."""
    for worker in httpx.get(url + "/slots", timeout=10).json()["workers"]:
        for slot in worker.get("slots", []):
            if request_id in (slot.get("request_id") or ""):
                return True
    return False


def test_a_cold_model_load_has_its_own_span(tiny_model_path: Path, other_model_path: Path) -> None:
    with ExitStack() as stack:
        receiver = stack.enter_context(receiving())
        port = free_port()
        args = ["serve", "--model", f"a={tiny_model_path}", "--model", f"b={other_model_path}"]
        args += ["--port", str(port), "--models-max", "1", "--slots", "1", "--ctx-size", "256"]
        args += ["--threads", "1", "--otlp-endpoint", receiver.url]
        serve = stack.enter_context(Proc("serve", args, FAST_EXPORT))
        serve.url = f"http://127.0.0.1:{port}"
        wait_http(serve, "/health")
        body = {"model": "b", "prompt": "Once upon a time", "max_tokens": 2}
        answer = httpx.post(serve.url + "/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text  # b was loaded for it
        spans = receiver.wait_for({"gateway.model_load", "POST /v1/completions"}, 60)
    [load] = [s for s in spans if s.name == "gateway.model_load"]
    [request] = [s for s in spans if s.name == "POST /v1/completions"]
    assert load.attributes["gen_ai.request.model"] == "b"
    assert load.parent == request.span_id and load.trace_id == request.trace_id
    assert request.start <= load.start <= load.end <= request.end
