"""OpenRequests: one worker connection's open requests and /slots queries, and the routing of
the worker's replies to them by request id (or query id).

`submit` sends a request and waits for the worker to confirm it. A Generate stays open until
its Finish; an Embed until its Embeddings (or Rejected). The tokens of a request whose client
stopped reading are bounded by stream_buffer_tokens: past it the request is cancelled in the
worker and its reader gets ReaderTooSlow. When the connection is lost, every open request and
query fails with the same error. Sending is the connection's business (WorkerClient passes
its send); nothing here touches the socket.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from typing import Any

import structlog

from ...protocol.messages import (
    Accepted,
    Cancel,
    Embed,
    Embeddings,
    FinishReason,
    Generate,
    ImageTokens,
    ImageTokensQuery,
    Message,
    Outputs,
    Rejected,
    SlotsQuery,
    SlotsReport,
)
from ..config import GatewayConfig
from .errors import (
    ReaderTooSlow,
    WorkerClientError,
    WorkerRejected,
    WorkerTimeout,
    WorkerUnavailable,
)
from .handle import RequestHandle

log = structlog.get_logger(__name__)


class OpenRequests:
    """The requests and queries (slots, image tokens) sent on one connection that the worker
    has not ended."""

    def __init__(
        self, config: GatewayConfig, endpoint: str, send: Callable[[Message], bool]
    ) -> None:
        self.endpoint = endpoint  # the worker's address, for the errors and the log
        self.request_timeout = config.request_timeout
        self.stream_buffer_tokens = config.stream_buffer_tokens
        self._send = send  # without waiting; False when the worker is not connected
        self.handles: dict[str, RequestHandle] = {}  # by request id
        self.slot_queries: dict[str, asyncio.Future[SlotsReport]] = {}  # by query id
        self.image_queries: dict[str, asyncio.Future[ImageTokens]] = {}  # by query id
        self._sent_since_heartbeat: list[str] = []  # request ids the latest heartbeat cannot count

    def __len__(self) -> int:
        return len(self.handles)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.handles

    @property
    def pending(self) -> int:
        """Open requests sent after the latest heartbeat: its load figures lack them."""
        return sum(request_id in self.handles for request_id in self._sent_since_heartbeat)

    async def submit(self, message: Generate | Embed, deadline: float | None) -> RequestHandle:
        """Send a Generate or an Embed and wait for the worker's first answer to it (as
        WorkerClient.submit says, which checks first that the worker can take it)."""
        request_id = message.request_id
        if request_id in self.handles:
            raise ValueError(f"request id {request_id} is already in use")
        generation = isinstance(message, Generate)  # else the reply is the whole answer
        if deadline is None:
            deadline = time.monotonic() + self.request_timeout
        accepted = asyncio.get_running_loop().create_future()
        handle = RequestHandle(request_id, deadline, accepted)
        self.handles[request_id] = handle
        if not self._send(message):
            self.pop(request_id)
            raise WorkerUnavailable(f"not connected to the worker at {self.endpoint}")
        if generation:  # the worker's next heartbeat may not count it yet
            self._sent_since_heartbeat.append(request_id)
        # A worker that dies fails this future at once (WorkerClient._worker_lost); one that is
        # alive but mid-way through a long tick confirms a Generate after it, so wait for that.
        wait = self.request_timeout if generation else deadline - time.monotonic()
        try:
            async with asyncio.timeout(wait):
                reply = await handle.accepted
        except TimeoutError:
            self.cancel(handle)
            self.pop(request_id)
            if generation:
                raise WorkerUnavailable("the worker did not confirm the request in time") from None
            raise WorkerTimeout("the embeddings took longer than the request timeout") from None
        except asyncio.CancelledError:
            self.cancel(handle)
            if not generation:  # a Generate's Finish still comes, and closes it
                self.pop(request_id)
            raise
        if isinstance(reply, Rejected):
            raise WorkerRejected(reply.code, reply.message)
        return handle

    def heartbeat_came(self) -> None:
        """A heartbeat (or a new ModelInfo) counts everything sent before it."""
        self._sent_since_heartbeat.clear()

    def pop(self, request_id: str) -> RequestHandle | None:
        """Stop routing a request's messages; its handle, if it was open (now closed)."""
        handle = self.handles.pop(request_id, None)
        if handle is not None:
            handle.close()
        return handle

    def cancel(self, handle: RequestHandle, reason: str = FinishReason.CANCELLED) -> None:
        """Ask the worker to stop a request; its Finish still arrives and is routed as usual."""
        if handle.cancelled or handle.request_id not in self.handles:
            return
        handle.cancelled = True
        self._send(Cancel(handle.request_id, reason))

    async def query_slots(self, timeout: float) -> SlotsReport:
        """Ask the worker for its slots (GET /slots) and wait for its SlotsReport.

        Raises WorkerUnavailable when not connected, WorkerTimeout past `timeout`, WorkerLost.
        """
        query_id = secrets.token_hex(8)
        reply: asyncio.Future[SlotsReport] = asyncio.get_running_loop().create_future()
        self.slot_queries[query_id] = reply
        try:
            if not self._send(SlotsQuery(query_id)):
                raise WorkerUnavailable(f"not connected to the worker at {self.endpoint}")
            async with asyncio.timeout(timeout):
                return await reply
        except TimeoutError:
            raise WorkerTimeout(f"the worker did not report its slots in {timeout:g}s") from None
        finally:
            self.slot_queries.pop(query_id, None)

    async def query_image_tokens(self, images: list[bytes], timeout: float) -> ImageTokens:
        """Ask the worker how many positions each image takes (the count endpoints) and wait
        for its ImageTokens: its projector reads and tokenizes them, encoding nothing.

        Raises WorkerUnavailable when not connected, WorkerTimeout past `timeout`, WorkerLost.
        """
        query_id = secrets.token_hex(8)
        reply: asyncio.Future[ImageTokens] = asyncio.get_running_loop().create_future()
        self.image_queries[query_id] = reply
        try:
            if not self._send(ImageTokensQuery(query_id, images)):
                raise WorkerUnavailable(f"not connected to the worker at {self.endpoint}")
            async with asyncio.timeout(timeout):
                return await reply
        except TimeoutError:
            raise WorkerTimeout(f"the worker did not count the images in {timeout:g}s") from None
        finally:
            self.image_queries.pop(query_id, None)

    def route(self, message: Message) -> bool:
        """Hand a reply to the request or query it answers; False for other messages."""
        match message:
            case Outputs():
                self._on_outputs(message)
            case Accepted():
                handle = self.handles.get(message.request_id)
                if handle is not None and not handle.accepted.done():
                    handle.accepted.set_result(message)
            case Rejected() | Embeddings():
                handle = self.pop(message.request_id)
                if handle is not None and not handle.accepted.done():
                    handle.accepted.set_result(message)
            case SlotsReport():
                query = self.slot_queries.get(message.query_id)
                if query is not None and not query.done():
                    query.set_result(message)
            case ImageTokens():
                counted = self.image_queries.get(message.query_id)
                if counted is not None and not counted.done():
                    counted.set_result(message)
            case _:
                return False
        return True

    def fail_all(self, error: WorkerClientError) -> None:
        """End every open request and query with `error` (the connection is gone)."""
        queries: list[asyncio.Future[Any]] = [
            *self.slot_queries.values(),
            *self.image_queries.values(),
        ]
        for query in queries:
            if not query.done():
                query.set_exception(error)
        handles, self.handles = self.handles, {}
        for handle in handles.values():
            if not handle.accepted.done():
                handle.accepted.set_exception(error)
            if not handle.closed:  # a deadline's error came first
                handle.events.put_nowait(error)
            handle.close()

    def _on_outputs(self, outputs: Outputs) -> None:
        limit = self.stream_buffer_tokens
        for chunk in outputs.tokens:
            handle = self.handles.get(chunk.request_id)
            if handle is not None and not handle.closed:
                handle.events.put_nowait(chunk)
                handle.buffered += len(chunk.token_ids)
                if handle.buffered > limit and not handle.reading:
                    self._reader_too_slow(handle, limit)
        for finish in outputs.finishes:
            handle = self.handles.get(finish.request_id)
            if handle is not None:
                if not handle.closed:  # past its deadline, its reader has had its error
                    handle.events.put_nowait(finish)
                self.pop(finish.request_id)

    def _reader_too_slow(self, handle: RequestHandle, limit: int) -> None:
        """Its client stopped reading (its connection is full, so the gateway stopped taking
        tokens): cancel it in the worker rather than hold a slot and buffer its whole output.
        The tokens already here are still handed out, then the error."""
        log.warning(
            "client reads too slowly; request cancelled",
            request_id=handle.request_id,
            buffered_tokens=handle.buffered,
            worker=self.endpoint,
        )
        self.cancel(handle)
        self.pop(handle.request_id)  # its Finish would come after the error: nothing more is read
        handle.events.put_nowait(
            ReaderTooSlow(
                f"the client did not read its output: {handle.buffered} tokens waited in the "
                f"gateway (more than --stream-buffer-tokens {limit}); the request was cancelled"
            )
        )
