"""Tries: the one owner of a request's retries at the workers.

A sequence (one choice of a generation request) or an embeddings request goes to
MAX_WORKERS_PER_REQUEST workers at most. It goes to another worker when the one picked
could not take it (not connected or not ready, queue full, lost before it confirmed: it
never ran there), or when its worker was lost before the sequence produced any output
(the client has seen nothing of it, so sending it again cannot repeat a token). Any other
outcome is final here; a non-streamed request whose worker is lost later, its client still
waiting for the whole body, runs again whole once (http/app.py, _NonStreamed). The pool
picks the worker (routing policy) and this object keeps the count: which workers the
request went to, and whether it may go to one more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from ...protocol.messages import Embed, ErrorCode, Generate
from ...protocol.prefix_keys import prefix_keys
from .. import tracing
from .client import RequestHandle, WorkerClient
from .errors import (
    WorkerClientError,
    WorkerLost,
    WorkerRejected,
    WorkerUnavailable,
)
from .routing import prefix_key

if TYPE_CHECKING:
    from .pool import ModelWorkers

log = structlog.get_logger(__name__)

MAX_WORKERS_PER_REQUEST = 2  # the first worker, and one other when the first fails it
# Refusals another worker may not share; the others (prompt too long...) any worker repeats.
RETRYABLE_REJECTIONS = frozenset({ErrorCode.QUEUE_FULL, ErrorCode.NOT_READY})


@dataclass(slots=True)
class Tries:
    """The workers one request went to, in order, and the sending that adds to them."""

    pool: ModelWorkers
    limit: int = MAX_WORKERS_PER_REQUEST
    workers: list[str] = field(default_factory=list)  # endpoints, in the order tried
    # Why the latest worker did not serve it: decides the reroute metric's reason.
    _last_failure: WorkerClientError | None = field(default=None, init=False)

    async def submit(
        self, message: Generate | Embed, deadline: float | None = None
    ) -> tuple[WorkerClient, RequestHandle]:
        """Send a Generate to the best worker not tried yet (an Embed: to the one with the
        most headroom), and on to another while the budget lasts; raises the last worker's
        error (or WorkerUnavailable). WorkerClient.submit says what the handle then holds."""
        span = tracing.start_span("gateway.route", {"loomserve.workers_before": len(self.workers)})
        try:
            if isinstance(message, Generate):
                key = prefix_key(message.prompt_tokens)
                keys = prefix_keys(message.prompt_tokens)
                sent = await self._send(key, message, deadline, True, keys)
            else:
                sent = await self._send(None, message, deadline, False)
        except BaseException as exc:
            if span is not None:
                tracing.end(span, self._tried(), error=str(exc) or type(exc).__name__)
            raise
        if span is not None:
            tracing.end(span, {**self._tried(), "loomserve.worker": sent[0].endpoint})
        return sent

    def _tried(self) -> dict[str, tracing.AttributeValue]:
        """For the routing's span: the workers tried so far, how often it was rerouted, why."""
        attributes: dict[str, tracing.AttributeValue] = {
            "loomserve.workers_tried": list(self.workers),
            "loomserve.reroutes": max(0, len(self.workers) - 1),
        }
        if self._last_failure is not None:
            attributes["loomserve.reroute_reason"] = str(self._last_failure)
        return attributes

    async def resend(
        self, generate: Generate, deadline: float, lost: WorkerLost
    ) -> tuple[WorkerClient, RequestHandle]:
        """The sequence's worker was lost before it produced any output: send it to another.

        Raises `lost` itself when the budget is spent or no other worker takes it, so the
        client hears why its request ended, not why the second worker refused.
        """
        self._last_failure = lost
        try:
            client, handle = await self.submit(generate, deadline)
        except WorkerClientError:
            raise lost from None
        log.info(
            "worker lost before the first token; sequence sent to another worker",
            request_id=generate.request_id,
            worker=client.endpoint,
            tried=self.workers,
        )
        return client, handle

    async def _send(
        self,
        key: int | None,
        message: Generate | Embed,
        deadline: float | None,
        generation: bool,
        keys: list[int] | None = None,
    ) -> tuple[WorkerClient, RequestHandle]:
        """Try workers in the pool's order until one serves; `generation`: count the tries in
        the routing metrics and prefix affinity (embeddings leave both alone)."""
        while len(self.workers) < self.limit:
            picked = self.pool.pick(key, exclude=self.workers, keys=keys)
            if picked is None:
                break
            client, choice = picked
            if self.workers and generation:
                lost = self._last_failure is None or isinstance(self._last_failure, WorkerLost)
                self.pool.count_reroute("lost" if lost else "refused")
            self.workers.append(choice.endpoint)
            try:
                result = await client.submit(message, deadline)
            except (WorkerUnavailable, WorkerLost) as exc:
                self._last_failure = exc
                continue
            except WorkerRejected as exc:
                if exc.code not in RETRYABLE_REJECTIONS:
                    raise
                self._last_failure = exc
                continue
            if generation:
                self.pool.routed(choice, key, client)
            return client, result
        if self._last_failure is not None:
            raise self._last_failure
        raise WorkerUnavailable(self.pool.unavailable_reason() or "no worker can take it")
