"""One sequence running in the worker (one choice of a request): its output as text deltas
and a Done, and its metrics.

The text itself is TextAssembly's job (assembly.py); this is the thin async loop around it
that reads the worker's messages, cancels the sequence when a stop string matched or the
client left, and records what the sequence cost. group.py runs the choices of a request.
When its worker is lost before the sequence produced any output, whether the client waits for
the first output (a stream's 200 goes out with it) or reads the events, the sequence is sent
to another worker (the client has seen nothing of it yet): its Tries (retries.py) decide.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import Histogram

from ...protocol.messages import Finish, FinishReason, Generate, TokenChunk
from .. import tracing
from ..metrics import GatewayMetrics
from ..request.generation_request import GenerationRequest
from ..text.tokenizer import Pieces
from ..workers.client import WorkerClient
from ..workers.errors import WorkerClientError, WorkerLost
from ..workers.handle import RequestHandle
from ..workers.pool import ModelWorkers
from ..workers.retries import Tries
from .assembly import (
    Done,
    PromptScores,
    TextAssembly,
    TextDelta,
    finish_failure,
)

if TYPE_CHECKING:
    from opentelemetry.trace import Span

# After a stop string matched, how long to wait for the worker's Finish (for its usage).
FINISH_GRACE_SECONDS = 2.0


@dataclass(slots=True)
class Generation:
    """A sequence the worker accepted; iterate `events()` once, and `close()` when done."""

    request: GenerationRequest
    index: int  # the choice this sequence is
    handle: RequestHandle
    client: WorkerClient  # the worker running it now
    tries: Tries  # the workers it was sent to, and whether it may go to another
    assembly: TextAssembly
    metrics: GatewayMetrics | None
    # Its `gateway.generation` span when tracing is on: the worker's spans are its children.
    span: Span | None = None
    finished: bool = False
    cut_short: bool = False  # cancelled in the worker while it ran: nobody read it to the end
    _first_token_at: float | None = field(default=None, init=False)
    _last_token_at: float = field(default=0.0, init=False)
    _inter_token: Histogram | None = field(default=None, init=False)  # its model's, if any
    _pending: list[TokenChunk | Finish] = field(default_factory=list, init=False)
    _received: bool = field(default=False, init=False)  # the worker sent it some output

    @classmethod
    async def start(
        cls,
        pool: ModelWorkers,
        vocab: Pieces,
        request: GenerationRequest,
        index: int,
        metrics: GatewayMetrics | None,
    ) -> Generation:
        """Submit choice `index`; raises the client's errors if no worker takes it."""
        deadline = request.arrived_at + pool.config.request_timeout
        generate = request.to_worker(index)
        span = tracing.start_span(
            "gateway.generation",
            {"loomserve.choice": index, "loomserve.sequence_id": generate.request_id},
            kind="CLIENT",
        )
        _carry(span, generate)
        tries = Tries(pool)
        try:
            with tracing.use(span):  # the routing's span is its child
                client, handle = await tries.submit(generate, deadline)
        except BaseException as exc:
            tracing.end(span, error=str(exc) or type(exc).__name__)
            raise
        scored = generate.params.prompt_logprobs is not None
        assembly = TextAssembly(
            vocab,
            request.text_matcher(),
            len(generate.prompt_tokens),
            scored_prompt=generate.prompt_tokens if scored else None,
            score_only=request.score_only,
            split=request.reply_split(),
        )
        return cls(request, index, handle, client, tries, assembly, metrics, span)

    async def first_output(self) -> bool:
        """Wait for the worker's first output (the prompt is then in its cache); True then.

        Raises the request's error when it ends before any output, so that a request the
        worker fails or drops (queued, then cancelled) gets its own HTTP status, not a 200.
        """
        if not self._pending:
            self._pending = await self._next_batch()
        first = self._pending[0]
        failure = finish_failure(first) if isinstance(first, Finish) else None
        if failure is not None:  # it ended before any output: failed or dropped
            raise failure
        return True

    async def events(self) -> AsyncIterator[PromptScores | TextDelta | Done]:
        """The prompt's scores when it asked for them, text deltas, then one Done; raises
        WorkerClientError if the worker fails or is lost."""
        assembly = self.assembly
        finish: Finish | None = None
        try:
            while finish is None and not assembly.stopped:
                batch = self._pending or await self._next_batch()
                self._pending = []
                self._observe_tokens(batch)
                delta = TextDelta("")
                for position, event in enumerate(batch):
                    if isinstance(event, Finish):
                        finish = event
                        break
                    if event.prompt_logprobs is not None:
                        assembly.push_prompt(event.prompt_logprobs)
                    before = assembly.generated
                    delta.text += assembly.take(event)
                    delta.reasoning += assembly.take_reasoning()
                    if event.logprobs:
                        delta.logprobs += assembly.logprobs(event, assembly.generated - before)
                    if assembly.stopped:
                        later = batch[position + 1 :]
                        finish = next((e for e in later if isinstance(e, Finish)), None)
                        break
                if scores := assembly.prompt_scores():
                    yield scores
                if delta.text or delta.logprobs or delta.reasoning:
                    yield delta
            if assembly.stopped:
                finish = await self._cancel_after_stop(finish)
            tail, done = assembly.done(finish)
            if scores := assembly.prompt_scores(final=True):  # cut short before it was whole
                yield scores
            reasoning = assembly.take_reasoning()
            if tail or reasoning:
                yield TextDelta(tail, reasoning=reasoning)
            self._record(done, finish)
            yield done
        finally:
            self.close()

    def interrupt(self, error: WorkerClientError) -> None:
        """Make the reader's next wait raise this error (tokens already queued come first)."""
        self.handle.events.put_nowait(error)

    def close(self) -> None:
        """End the sequence; if it still runs in the worker, cancel it there (`cut_short`)."""
        if not self.finished:
            self.finished = True
            if self.client.is_open(self.handle):
                self.client.cancel(self.handle)
                self.cut_short = True
        if self.span is not None:
            span, self.span = self.span, None
            worker, cut_short = self.client.endpoint, self.cut_short
            tracing.end(span, {"loomserve.worker": worker, "loomserve.cut_short": cut_short})

    async def _next_batch(self) -> list[TokenChunk | Finish]:
        """The worker's next events. When the worker is lost before it sent any, the
        sequence goes to another worker (while its Tries allow) and is read from there."""
        while True:
            try:
                batch = await self.handle.next_events()
            except WorkerLost as lost:
                if self._received or self.finished:
                    raise
                generate = self.request.to_worker(self.index)
                _carry(self.span, generate)
                with tracing.use(self.span):
                    self.client, self.handle = await self.tries.resend(
                        generate, self.handle.deadline, lost
                    )
                continue
            self._received = True
            return batch

    async def _cancel_after_stop(self, finish: Finish | None) -> Finish | None:
        """A stop string matched: cancel in the worker, and wait briefly for its Finish."""
        still_running = self.client.is_open(self.handle)
        self.finished = True
        if still_running:
            self.client.cancel(self.handle, FinishReason.STOP)  # not the client's doing
        if finish is not None or not still_running:
            return finish
        try:
            async with asyncio.timeout(FINISH_GRACE_SECONDS):
                while True:
                    event = await self.handle.next_event()
                    if isinstance(event, Finish):
                        return event
        except (TimeoutError, WorkerClientError):
            self.client.forget(self.handle)
            return None

    def _record(self, done: Done, finish: Finish | None) -> None:
        if self.span is not None:
            self.span.set_attributes(_outcome_attributes(done, finish))
        m = self.metrics
        if m is None:
            return
        model = self.request.model
        if finish is not None:
            m.request_queue_time.labels(model).observe(finish.queue_seconds)
        m.prompt_tokens.labels(model).inc(done.usage.prompt_tokens)
        m.generation_tokens.labels(model).inc(done.usage.completion_tokens)
        m.request_success.labels(model, done.finish_reason).inc()

    def _observe_tokens(self, batch: list[TokenChunk | Finish]) -> None:
        count = sum(len(e.token_ids) for e in batch if isinstance(e, TokenChunk))
        if not count:  # a batch with only a Finish in it
            return
        now = time.monotonic()
        m = self.metrics
        if self._first_token_at is None:
            self._first_token_at = now
            if m is not None:
                model = self.request.model
                m.time_to_first_token.labels(model).observe(now - self.request.arrived_at)
                # The model's histogram itself, found once: a labels() lookup each token
                # was a fiftieth of the gateway's CPU per streamed token.
                self._inter_token = m.inter_token_latency.labels(model)
        elif self._inter_token is not None:
            self._inter_token.observe((now - self._last_token_at) / count)
        self._last_token_at = now


def _carry(span: Span | None, generate: Generate) -> None:
    """The worker's spans of this sequence become children of its span."""
    generate.trace, generate.trace_state = tracing.context_of(span)


def _outcome_attributes(done: Done, finish: Finish | None) -> tracing.Attributes:
    usage = done.usage
    attributes: dict[str, tracing.AttributeValue] = {
        "gen_ai.response.finish_reasons": [done.finish_reason],
        "gen_ai.usage.input_tokens": usage.prompt_tokens,
        "gen_ai.usage.output_tokens": usage.completion_tokens,
        "loomserve.usage.cached_tokens": usage.prompt_tokens_details.cached_tokens,
    }
    if finish is not None:
        attributes["loomserve.queue_seconds"] = finish.queue_seconds
    return attributes
