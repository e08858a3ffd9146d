"""Every choice of one request, as one: started together, refused together, read as one stream.

Each choice is its own sequence in the worker (a Generation). The n choices of one prompt
share its prefill: the first is submitted alone, and the others once the worker has sent its
first output, when the prompt is in that slot's cache and the worker copies it (prefix reuse)
instead of evaluating it n times (unless they score the prompt: completions' echo with
logprobs evaluates each whole, see scheduler.admit). A refusal of any choice (queue full,
...) cancels the ones already taken, and the request is answered as one; so is a client
that goes away.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable

import structlog

from .. import tracing
from ..api.response_bodies import Usage
from ..metrics import GatewayMetrics
from ..request.generation_request import GenerationRequest
from ..text.tokenizer import Pieces
from ..workers.errors import WorkerClientError
from ..workers.pool import ModelWorkers
from .assembly import Done, PromptScores, TextDelta
from .generation import Generation

log = structlog.get_logger(__name__)

ChoiceEvent = tuple[int, PromptScores | TextDelta | Done]  # (choice index, event)


class GenerationGroup:
    """A request the worker took every choice of; iterate `events()` once, `close()` after."""

    def __init__(
        self,
        request: GenerationRequest,
        generations: list[Generation],
        metrics: GatewayMetrics | None,
    ) -> None:
        self.request = request
        self.generations = generations
        self.metrics = metrics
        self.dones: dict[int, Done] = {}
        self._outcome: str | None = None  # "done" or "failed"; None while being read
        self._closed = False
        self._span = tracing.current()  # the HTTP request's span, when tracing is on
        if metrics is not None:
            metrics.requests_in_flight.labels(request.model).inc()

    @classmethod
    async def start(
        cls,
        pool: ModelWorkers,
        vocab: Pieces,
        request: GenerationRequest,
        metrics: GatewayMetrics | None,
    ) -> GenerationGroup:
        """Submit every choice; raises the first refusal (after cancelling the others)."""
        if (span := tracing.current()) is not None:  # off: not even the attributes are built
            span.set_attributes(_request_attributes(request))
        n = request.n
        started: list[Generation] = []
        try:
            firsts = range(0, request.n_choices, n)
            started += await _start_all(pool, vocab, request, firsts, metrics)
            if n > 1:
                await asyncio.gather(*(g.first_output() for g in started))
                copies = (i for i in range(request.n_choices) if i % n)
                started += await _start_all(pool, vocab, request, copies, metrics)
        except BaseException:
            for generation in started:
                generation.close()
            raise
        started.sort(key=lambda g: g.index)
        return cls(request, started, metrics)

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Each choice's text deltas and its Done (after its prompt's scores, when it asked),
        interleaved as the worker produces them.

        Raises WorkerClientError when any choice fails; the others are then cancelled.
        """
        try:
            if len(self.generations) == 1:
                only = self.generations[0]
                async for event in only.events():
                    self._note(only.index, event)
                    yield only.index, event
            else:
                async for index, event in self._merged():
                    self._note(index, event)
                    yield index, event
            self._outcome = "done"
        except WorkerClientError:
            self._outcome = "failed"
            raise
        finally:
            self.close()

    def usage(self) -> Usage:
        """The request's usage: each prompt counted once (as OpenAI counts n choices), the
        tokens of every choice summed."""
        n = self.request.n
        firsts = [done for index, done in self.dones.items() if index % n == 0]
        usage = Usage.of(
            prompt_tokens=sum(d.usage.prompt_tokens for d in firsts),
            completion_tokens=sum(d.usage.completion_tokens for d in self.dones.values()),
            cached_tokens=sum(d.usage.prompt_tokens_details.cached_tokens for d in firsts),
        )
        if self.request.reasoning is None:
            return usage
        details = (d.usage.completion_tokens_details for d in self.dones.values())
        return usage.with_reasoning(sum(d.reasoning_tokens for d in details if d is not None))

    async def first_outputs(self) -> bool:
        """Wait for every choice's first output; raises a choice's error. True then."""
        await asyncio.gather(*(g.first_output() for g in self.generations))
        return True

    def interrupt(self, error: WorkerClientError) -> None:
        """End every choice with this error at its next read (the gateway is shutting down)."""
        for generation in self.generations:
            generation.interrupt(error)

    def close(self) -> None:
        """End the request: choices still running are cancelled in the worker."""
        if self._closed:
            return
        self._closed = True
        for generation in self.generations:
            generation.close()
        if self.metrics is not None:
            model = self.request.model
            self.metrics.requests_in_flight.labels(model).dec()
            if self._outcome == "done":
                latency = time.monotonic() - self.request.arrived_at
                self.metrics.e2e_request_latency.labels(model).observe(latency)
        if self._outcome is None and any(g.cut_short for g in self.generations):
            log.info("client went away; request cancelled")
            if self.metrics is not None:
                self.metrics.client_disconnects.labels(self.request.model).inc()
        if self._span is not None:
            self._annotate_outcome()

    def _annotate_outcome(self) -> None:
        """The request's span gets its finish reasons and usage (tracing only)."""
        usage = self.usage()
        dones = [self.dones[i] for i in sorted(self.dones)]
        tracing.annotate(
            self._span,
            {
                "gen_ai.response.finish_reasons": [d.finish_reason for d in dones],
                "gen_ai.usage.input_tokens": usage.prompt_tokens,
                "gen_ai.usage.output_tokens": usage.completion_tokens,
                "loomserve.usage.cached_tokens": usage.prompt_tokens_details.cached_tokens,
                "loomserve.outcome": self._outcome or "cancelled",
            },
        )

    def _note(self, index: int, event: PromptScores | TextDelta | Done) -> None:
        if isinstance(event, Done):
            self.dones[index] = event

    async def _merged(self) -> AsyncIterator[ChoiceEvent]:
        # Bounded: a client that stops reading stops the pumps, so its tokens wait in each
        # choice's own buffer, where the gateway's bound on them applies (client.py).
        queue: asyncio.Queue[ChoiceEvent | WorkerClientError] = asyncio.Queue(
            maxsize=len(self.generations)
        )

        async def pump(generation: Generation) -> None:
            try:
                async for event in generation.events():
                    await queue.put((generation.index, event))
            except WorkerClientError as failure:
                await queue.put(failure)

        tasks = [asyncio.create_task(pump(g)) for g in self.generations]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if isinstance(item, WorkerClientError):
                    raise item
                if isinstance(item[1], Done):
                    running -= 1
                yield item
        finally:
            for task in tasks:
                task.cancel()


def _request_attributes(request: GenerationRequest) -> tracing.Attributes:
    return {
        "gen_ai.response.id": request.id,
        "gen_ai.request.model": request.model,
        "loomserve.tenant": request.tenant,
        "loomserve.priority": request.priority,
        "loomserve.stream": request.stream,
        "loomserve.choices": request.n_choices,
    }


async def _start_all(
    pool: ModelWorkers,
    vocab: Pieces,
    request: GenerationRequest,
    indices: Iterable[int],
    metrics: GatewayMetrics | None,
) -> list[Generation]:
    """Submit these choices at once; all taken, or the first refusal raised (none kept)."""
    results = await asyncio.gather(
        *(Generation.start(pool, vocab, request, i, metrics) for i in indices),
        return_exceptions=True,
    )
    started = [r for r in results if isinstance(r, Generation)]
    failures = [r for r in results if not isinstance(r, Generation)]
    if failures:
        for generation in started:
            generation.close()
        raise failures[0]
    return started
