"""Delivering a generation over HTTP: as server-sent events, or collected into one body.

Either way the client's disconnect is watched, and the request is cancelled in the worker
as soon as it is seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import anyio
import structlog
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .. import tracing
from ..api.errors import worker_error
from ..workers.errors import WorkerClientError
from .assembly import Done, PromptScores, TextDelta, TokenLogprob
from .group import GenerationGroup
from .render import DONE_EVENT, StreamChunks, error_event

log = structlog.get_logger(__name__)


async def collect(
    group: GenerationGroup,
) -> tuple[list[str], list[Done], list[list[TokenLogprob]], list[str]]:
    """Each choice's whole text (its answer, with reasoning), Done, logprobs (the prompt's
    first, when it was scored) and thinking, in choice order, for a non-streaming request."""
    n_choices = group.request.n_choices
    parts: list[list[str]] = [[] for _ in range(n_choices)]
    thoughts: list[list[str]] = [[] for _ in range(n_choices)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(n_choices)]
    async for index, event in group.events():
        if isinstance(event, TextDelta):
            parts[index].append(event.text)
            thoughts[index].append(event.reasoning)
            logprobs[index] += event.logprobs
        elif isinstance(event, PromptScores):
            logprobs[index] = event.logprobs + logprobs[index]
    dones = [group.dones[i] for i in range(n_choices)]
    return ["".join(p) for p in parts], dones, logprobs, ["".join(t) for t in thoughts]


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """The result of work, or None if the client disconnects first (work is then cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def event_stream(group: GenerationGroup, chunks: StreamChunks) -> AsyncIterator[str]:
    """The SSE events of a streaming request; a failure ends it with an error event."""
    span = tracing.start_span("gateway.stream")  # the stream back, from its first event
    failed = ""
    try:
        for index in range(group.request.n_choices):
            opening = chunks.opening(index)
            if opening:
                yield opening
        async for index, event in group.events():
            if isinstance(event, TextDelta):
                if piece := chunks.text(index, event):  # "" while tool calls are parsed
                    yield piece
            elif isinstance(event, PromptScores):
                yield chunks.echo(index, event)
            else:
                yield chunks.finish(index, event.finish_reason)
        if chunks.request.include_usage:
            yield chunks.usage(group.usage())
        yield DONE_EVENT
    except WorkerClientError as failure:
        error = worker_error(failure)
        failed = error.message
        log.warning("stream failed", status=error.status, error=error.message)
        # Why the stream was refused mid-way, in the trace: its code and the client's message.
        tracing.event(
            span,
            "loomserve.refused",
            {"error.type": error.code or error.type, "loomserve.error.message": error.message},
        )
        yield error_event(error)
    finally:
        # Also when the client went away: the stream ends then, cut short.
        tracing.end(span, error=failed)


class EventStreamResponse(StreamingResponse):
    """Server-sent events that stop as soon as the client disconnects, whatever the server.

    Starlette only watches for the disconnect on ASGI spec < 2.4; here it is always watched,
    and on_close runs however the stream ends, so the worker's slot is freed within a tick.
    """

    media_type = "text/event-stream"

    def __init__(
        self, content: AsyncIterator[str], on_close: Callable[[], None], prompt_tokens: int = 0
    ) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close
        # The request's prompt tokens, known before its first token (the Messages API's
        # message_start carries them).
        self.prompt_tokens = prompt_tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await _disconnected(receive)
                group.cancel_scope.cancel()
        finally:
            self.on_close()


# A stream's client that stops reading is cut once --stream-buffer-tokens wait in the gateway
# (client.py); but the kernel's send buffer grows to megabytes first (4 MiB on loopback),
# seven thousand plain-text tokens. limit_send_buffer caps it, and asyncio's write buffer
# above it, on a connection that streams, so that the gateway's bound starts counting after
# some tens of KiB, not megabytes.
# Bytes the kernel may hold for a streaming connection (Linux doubles it for its own use):
# a few hundred SSE events, enough to keep a reader that keeps up always fed.
STREAM_SEND_BUFFER = 16 * 1024

# Where each request finds its connection's transport, which ASGI does not hand a route: in
# its scope's "state" (uvicorn copies the protocol's app_state into it for every request).
TRANSPORT_STATE = "loomserve.transport"


def limit_send_buffer(state: Mapping[str, Any]) -> bool:
    """Cap the send buffers of the connection a request's scope["state"] names; whether it
    could (a server other than ours, or a connection without a socket, is left as it is)."""
    transport = state.get(TRANSPORT_STATE)
    if not isinstance(transport, asyncio.Transport):
        return False
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SEND_BUFFER)
    except OSError:
        return False
    # And asyncio's own buffer above the kernel's (64 KiB before uvicorn waits for it to drain).
    transport.set_write_buffer_limits(high=STREAM_SEND_BUFFER)
    return True
