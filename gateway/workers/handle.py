"""RequestHandle: one request's side of a worker connection, as the code that runs it reads it.

The worker's replies for a request arrive on its handle (WorkerClient and its OpenRequests put
them there): a future for the first answer (Accepted or Rejected; an Embed's Embeddings), then
a queue of TokenChunk and Finish messages, which end with an error if the worker is lost. The
reader takes them with a deadline: past it, WorkerTimeout (after what came before it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ...protocol.messages import Accepted, Embeddings, Finish, Rejected, TokenChunk
from .errors import WorkerClientError, WorkerTimeout

RequestEvent = TokenChunk | Finish


@dataclass(slots=True)
class RequestHandle:
    """One request in the worker: its confirmation, then its tokens and its Finish."""

    request_id: str
    deadline: float  # time.monotonic() past which waiting for output raises WorkerTimeout
    # Accepted or Rejected; for an Embed, its Embeddings or Rejected
    accepted: asyncio.Future[Accepted | Rejected | Embeddings]
    events: asyncio.Queue[RequestEvent | WorkerClientError] = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    buffered: int = 0  # tokens in `events` not read yet; bounded by stream_buffer_tokens
    # The reader waits for events now: what piles up meanwhile (a burst after this gateway
    # stalled) waits for the event loop, not for a client that stopped reading.
    reading: bool = False
    closed: bool = False  # the worker's connection routes nothing more here (close())
    # Puts WorkerTimeout in `events` at the deadline; armed when the reader first waits. One
    # timer for the request, not one for each wait: a wait a token, it was a fiftieth of the
    # gateway's CPU per streamed token.
    _deadline_timer: asyncio.TimerHandle | None = None

    async def next_event(self) -> RequestEvent:
        """The next TokenChunk or Finish; raises WorkerLost or WorkerTimeout."""
        event = await self._get()
        if isinstance(event, WorkerClientError):
            raise event
        self._taken(event)
        return event

    async def next_events(self) -> list[RequestEvent]:
        """Everything that arrived since the last call, waiting for at least one event.

        Taking the whole backlog at once keeps a reader that fell behind from looping
        without ever yielding to the event loop (and so from missing its client's disconnect).
        An error comes last in the queue: the events before it are handed out first, and
        the next call raises it.
        """
        events = [await self.next_event()]
        while not self.events.empty():
            event = self.events.get_nowait()
            if isinstance(event, WorkerClientError):
                self.events.put_nowait(event)  # nothing follows an error: order is kept
                break
            self._taken(event)
            events.append(event)
        return events

    def _taken(self, event: RequestEvent) -> None:
        if isinstance(event, TokenChunk):
            self.buffered -= len(event.token_ids)

    async def _get(self) -> RequestEvent | WorkerClientError:
        if self._deadline_timer is None and not self.closed:
            self._deadline_timer = _call_at_monotonic(self.deadline, self._expire)
        self.reading = True
        try:
            return await self.events.get()
        finally:
            self.reading = False

    def _expire(self) -> None:
        # The error comes after what came before the deadline, and nothing after it: what the
        # worker sends later is not routed here (closed), as after a lost worker's.
        self._deadline_timer = None
        self.closed = True
        self.events.put_nowait(
            WorkerTimeout("the request took longer than the server's request timeout")
        )

    def close(self) -> None:
        """No more events will come (the connection routes none here): the deadline is off.
        What is queued stays to be read."""
        self.closed = True
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None


def _call_at_monotonic(deadline: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
    loop = asyncio.get_running_loop()
    # loop.time() is time.monotonic() on every platform we run on; stay explicit.
    return loop.call_at(loop.time() + (deadline - time.monotonic()), callback)
