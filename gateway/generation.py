"""One request's generation as text: tokens from the worker in, text deltas and a final out.

This is where the gateway owns text: incremental detokenizing, stop strings (which cancel
the request in the worker), finish reasons and usage. The HTTP layer only formats.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog

from loomserve.gateway.client import RequestHandle, WorkerClient
from loomserve.gateway.errors import APIError, server_error
from loomserve.gateway.metrics import GatewayMetrics
from loomserve.gateway.stop import StopMatcher
from loomserve.gateway.tokenizer import IncrementalDetokenizer, Vocab
from loomserve.protocol.messages import Finish, FinishReason, SamplingParams, TokenChunk

log = structlog.get_logger(__name__)

# After a stop string matched, how long to wait for the worker's Finish (for its usage).
FINISH_GRACE_SECONDS = 2.0


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(slots=True)
class TextDelta:
    """New text for the client (never empty)."""

    text: str


@dataclass(slots=True)
class Done:
    """The end: why ("stop" or "length") and the usage."""

    finish_reason: str
    usage: Usage


@dataclass(slots=True)
class Generation:
    """A request the worker accepted; iterate `events()` once, and `close()` when done."""

    request_id: str
    handle: RequestHandle
    client: WorkerClient
    vocab: Vocab
    prompt_len: int
    stops: tuple[str, ...]
    metrics: GatewayMetrics | None
    arrived_at: float  # time.monotonic() when the HTTP request came in
    timeout: float
    finished: bool = False
    _first_token_at: float | None = field(default=None, init=False)
    _last_token_at: float = field(default=0.0, init=False)

    @classmethod
    async def start(
        cls,
        client: WorkerClient,
        vocab: Vocab,
        request_id: str,
        prompt_tokens: list[int],
        params: SamplingParams,
        stops: tuple[str, ...],
        metrics: GatewayMetrics | None,
        arrived_at: float,
    ) -> Generation:
        """Submit to the worker; raises APIError (503 busy or down, 400) before any output."""
        handle = await client.submit(request_id, prompt_tokens, params)
        if metrics is not None:
            metrics.requests_in_flight.inc()
        return cls(
            request_id=request_id,
            handle=handle,
            client=client,
            vocab=vocab,
            prompt_len=len(prompt_tokens),
            stops=stops,
            metrics=metrics,
            arrived_at=arrived_at,
            timeout=client.config.request_timeout,
        )

    async def events(self) -> AsyncIterator[TextDelta | Done]:
        """Text deltas, then one Done; raises APIError if the worker fails or is lost."""
        detokenizer = IncrementalDetokenizer(self.vocab)
        matcher = StopMatcher(self.stops)
        generated = 0
        deadline = self.arrived_at + self.timeout
        finish: Finish | None = None
        try:
            while finish is None:
                async with asyncio.timeout_at(_loop_deadline(deadline)):
                    events = await self.handle.next_events()
                self._observe_tokens(
                    sum(len(e.token_ids) for e in events if isinstance(e, TokenChunk))
                )
                text = ""
                for position, event in enumerate(events):
                    if isinstance(event, APIError):
                        if text:
                            yield TextDelta(text)
                        raise event
                    if isinstance(event, Finish):
                        finish = event
                        break
                    for token_id in event.token_ids:
                        generated += 1
                        match = matcher.push(detokenizer.push_one(token_id))
                        text += match.text
                        if match.matched:
                            if text:
                                yield TextDelta(text)
                            later = events[position + 1 :]
                            finish = next((e for e in later if isinstance(e, Finish)), None)
                            yield await self._stopped_early(generated, finish)
                            return
                if text:
                    yield TextDelta(text)
            if finish.reason == FinishReason.ERROR:
                raise server_error(f"the engine failed the request: {finish.message}")
            match = matcher.push(detokenizer.flush())
            tail = match.text + ("" if match.matched else matcher.flush())
            if tail:
                yield TextDelta(tail)
            reason = "length" if finish.reason == FinishReason.LENGTH else "stop"
            yield self._done(reason, finish, finish.completion_tokens)
        except TimeoutError:
            self._end(client_left=False)
            raise APIError(
                504, "the request took longer than the server's request timeout", code="timeout"
            ) from None
        finally:
            self.close()

    def close(self) -> None:
        """End the request: if it is still running, the client went away, so cancel it."""
        self._end(client_left=True)

    def _end(self, client_left: bool) -> None:
        if self.finished:
            return
        self.finished = True
        if self.metrics is not None:
            self.metrics.requests_in_flight.dec()
        if self.client.is_open(self.handle):
            self.client.cancel(self.handle)
            if client_left:
                log.info("client went away; request cancelled", request_id=self.request_id)
                if self.metrics is not None:
                    self.metrics.client_disconnects.inc()

    async def _stopped_early(self, generated: int, finish: Finish | None) -> Done:
        """A stop string matched: cancel in the worker, and wait briefly for its usage."""
        still_running = self.client.is_open(self.handle)
        self._end(client_left=False)
        if finish is None and still_running:
            try:
                async with asyncio.timeout(FINISH_GRACE_SECONDS):
                    while not isinstance(finish, Finish):
                        finish = await self.handle.next_event()
            except (TimeoutError, APIError):
                self.client.forget(self.handle)
                finish = None
        return self._done("stop", finish, generated)

    def _done(self, reason: str, finish: Finish | None, completion_tokens: int) -> Done:
        cached = finish.cached_tokens if finish is not None else 0
        prompt = finish.prompt_tokens if finish is not None else self.prompt_len
        usage = Usage(prompt, completion_tokens, cached)
        m = self.metrics
        if m is not None:
            m.e2e_request_latency.observe(time.monotonic() - self.arrived_at)
            if finish is not None:
                m.request_queue_time.observe(finish.queue_seconds)
            m.prompt_tokens.inc(usage.prompt_tokens)
            m.generation_tokens.inc(usage.completion_tokens)
            m.request_success.labels(reason).inc()
        return Done(reason, usage)

    def _observe_tokens(self, count: int) -> None:
        if not count:  # a batch of events with only a Finish in it
            return
        now = time.monotonic()
        m = self.metrics
        if m is not None:
            if self._first_token_at is None:
                m.time_to_first_token.observe(now - self.arrived_at)
            else:
                m.inter_token_latency.observe((now - self._last_token_at) / count)
        if self._first_token_at is None:
            self._first_token_at = now
        self._last_token_at = now


def _loop_deadline(monotonic_deadline: float) -> float:
    """asyncio's loop.time() is time.monotonic() on every platform we run on; stay explicit."""
    loop = asyncio.get_running_loop()
    return loop.time() + (monotonic_deadline - time.monotonic())
