"""The worker's spans of a request, made once it has finished (docs/metrics.md, "Tracing").

The loop records the times of a request's phases anyway (arrival, admission, first token,
finish: sched/slots.py); when the request finishes, the loop hands it to this module's thread,
which makes its spans with those times as their start and end. Tracing adds nothing to a tick
but one queue put per finished request, and nothing per token; the spans are made while the
loop is in llama_decode, which releases the GIL. Their parent is the gateway's span of the sequence,
whose W3C context the Generate carried (Generate.trace), so one trace holds both processes.
The SDK's BatchSpanProcessor exports them from its own thread (cli/tracing.py).

server.py imports this module only when tracing is on: off, OpenTelemetry is never loaded.

    worker.request                 arrival (before its images and its sampler) to finish
      worker.image_encode          its images read, tokenized and encoded (libmtmd's thread)
      worker.grammar               compiling the request's grammar into its sampler
      worker.queue                 waiting for a slot
      worker.prefill               admission to the first token: prompt, cached tokens
      worker.decode                first token to finish: tokens generated, drafts accepted
    worker.embed                   an Embed, from its arrival to its vectors
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping

import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ...protocol import Embed, Finish, FinishReason
from ..sched.slots import Request

log = structlog.get_logger(__name__)

NS = 1_000_000_000
_PROPAGATOR = TraceContextTextMapPropagator()


class RequestTracer:
    """Makes finished requests' spans on a thread of its own: the loop only hands them over.

    The loop calls `finished` (and the embedder `embedded`) with what it has at the finish;
    the request is released by then, so nothing changes it any more. `close` makes the
    spans still queued, then stops the thread.
    """

    def __init__(self, model_name: str) -> None:
        self.tracer = trace.get_tracer("loomserve.worker")
        self.model_name = model_name
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="loomserve-tracing", daemon=True)
        self._thread.start()

    def finished(self, request: Request, finish: Finish, now: float) -> None:
        """The spans of `request`, which ended with `finish` at `now` (time.monotonic())."""
        wall_now = time.time_ns()  # the loop's times are monotonic; a span's since the epoch
        self._queue.put(lambda: self._finished(request, finish, now, wall_now))

    def embedded(self, embed: Embed, offered: float, now: float, error: str) -> None:
        """The span of an Embed answered at `now` (the Embedder's on_done)."""
        wall_now = time.time_ns()
        self._queue.put(lambda: self._embedded(embed, offered, now, wall_now, error))

    def close(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (make := self._queue.get()) is not None:
            try:
                make()
            except Exception:  # one request's spans lost, never the thread
                log.exception("could not make a request's spans")

    def _finished(self, request: Request, finish: Finish, now: float, wall_now: int) -> None:
        def ns(moment: float) -> int:
            return wall_now - int((now - moment) * NS)

        end = ns(now)
        built = request.arrived_at - request.sampler_seconds  # the sampler's build began
        arrived = built - request.media_seconds
        gateway, request_id = request.key
        root = self.tracer.start_span(
            "worker.request",
            context=self._parent(request),
            kind=SpanKind.SERVER,
            start_time=ns(arrived),
            attributes={
                "loomserve.request_id": request_id,
                "loomserve.gateway": gateway.decode("utf-8", "replace"),
                "loomserve.tenant": request.tenant,
                "loomserve.priority": request.priority,
                "gen_ai.request.model": self.model_name,
                "gen_ai.response.finish_reasons": [finish.reason],
                "gen_ai.usage.input_tokens": finish.prompt_tokens,
                "gen_ai.usage.output_tokens": finish.completion_tokens,
                "loomserve.usage.cached_tokens": finish.cached_tokens,
                "loomserve.preemptions": request.preemptions,
            },
        )
        within = trace.set_span_in_context(root)
        params = request.params
        if request.media:
            images = {
                "loomserve.images": len(request.media),
                "loomserve.image_tokens": sum(span.n_tokens for span in request.media),
            }
            self._span("worker.image_encode", within, ns(arrived), ns(built), images)
        if params.grammar:
            grammar = {"loomserve.grammar.chars": len(params.grammar)}
            self._span("worker.grammar", within, ns(built), ns(request.arrived_at), grammar)
        admitted, first = request.admitted_at, request.first_token_at
        queued_until = admitted or now  # never admitted: it waited until it was cancelled
        queue = {"loomserve.queue_seconds": finish.queue_seconds}
        self._span("worker.queue", within, ns(request.arrived_at), ns(queued_until), queue)
        if admitted:
            prefill = {
                "gen_ai.usage.input_tokens": finish.prompt_tokens,
                "loomserve.usage.cached_tokens": finish.cached_tokens,
                "loomserve.prefill.computed_tokens": finish.prompt_tokens - finish.cached_tokens,
            }
            self._span("worker.prefill", within, ns(admitted), ns(first or now), prefill)
        if first:
            decode = {
                "gen_ai.usage.output_tokens": finish.completion_tokens,
                "loomserve.decode.drafted_tokens": request.drafted,
                "loomserve.decode.accepted_tokens": request.drafts_accepted,
                "loomserve.grammar": bool(params.grammar),
            }
            self._span("worker.decode", within, ns(first), end, decode)
        if finish.reason == FinishReason.ERROR.value:
            # Failed after it was taken: why, at the moment it failed, as the gateway's spans
            # say it (its code, else the gateway's code for an engine failure).
            refused = {
                "error.type": finish.code or "internal_error",
                "loomserve.error.message": finish.message,
            }
            root.add_event("loomserve.refused", refused, timestamp=end)
            root.set_status(Status(StatusCode.ERROR, finish.message))
        root.end(end_time=end)

    def _embedded(
        self, embed: Embed, offered: float, now: float, wall_now: int, error: str
    ) -> None:
        span = self.tracer.start_span(
            "worker.embed",
            context=_parent(embed.trace, embed.trace_state),
            kind=SpanKind.SERVER,
            start_time=wall_now - int((now - offered) * NS),
            attributes={
                "loomserve.request_id": embed.request_id,
                "gen_ai.request.model": self.model_name,
                "loomserve.embed.inputs": len(embed.inputs),
                "gen_ai.usage.input_tokens": sum(len(tokens) for tokens in embed.inputs),
            },
        )
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=wall_now)

    def _parent(self, request: Request) -> Context | None:
        return _parent(request.trace, request.trace_state)

    def _span(
        self,
        name: str,
        parent: Context,
        start: int,
        end: int,
        attributes: Mapping[str, str | int | float | bool],
    ) -> None:
        span = self.tracer.start_span(name, context=parent, start_time=start, attributes=attributes)
        span.end(end_time=max(start, end))


def _parent(traceparent: str, tracestate: str) -> Context | None:
    """The gateway's span, from the W3C context a message carried; None when it carried
    none (a gateway that does not trace): the worker's spans then start a trace."""
    if not traceparent:
        return None
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    return _PROPAGATOR.extract(carrier)
