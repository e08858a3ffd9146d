"""The bridge from other APIs to chat: run a translated chat request, read its answer back.

/v1/responses and /v1/messages are translations at the edge. Each turns its body into a
ChatCompletionRequest and runs it through the chat route's own path (one request type, one
tokenizer, one template, one tool parser: ChatServing.generate), then turns the chat answer,
a body or a stream of chunks, into its own shape. The chat stream is read back as the dicts it
carries, so a translator sees exactly what a chat client would.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from ..api.errors import APIError
from ..api.schemas import ChatCompletionRequest
from ..generate.streaming import EventStreamResponse
from ..serving.chat import ChatServing


def named_event(name: str, payload: dict[str, Any]) -> str:
    """One server-sent event with an event name, as the Responses and Messages APIs send."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {data}\n\n"


async def chat_chunks(
    events: AsyncIterable[str | bytes | memoryview],
) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of a chat stream's events ([DONE] left out). The chat stream writes
    str; a response body may in general hold bytes too."""
    async for body in events:
        text = body if isinstance(body, str) else bytes(body).decode()
        for event in text.split("\n\n"):
            if not event.startswith("data: "):
                continue
            data = event[len("data: ") :]
            if data.strip() == "[DONE]":
                continue
            yield json.loads(data)


Translate = Callable[[AsyncIterator[dict[str, Any]]], AsyncIterator[str]]


async def run_translated(
    chat: ChatServing,
    http: Request,
    body: ChatCompletionRequest,
    whole: Callable[[dict[str, Any]], dict[str, Any]],
    stream: Translate,
    params: dict[str, str],
    counted: Callable[[int], None] | None = None,
) -> Response:
    """Run a chat request; answer its body through `whole`, or its stream through `stream`.

    An error's `param` names the chat field: `params` renames it to the caller's API's.
    `counted` is told the prompt's token count before a stream's first event.
    """
    try:
        response = await chat.generate(http, body)
    except APIError as error:
        raise renamed(error, params) from None
    if isinstance(response, EventStreamResponse):
        if counted is not None:
            counted(response.prompt_tokens)
        events = stream(chat_chunks(response.body_iterator))
        return EventStreamResponse(events, on_close=response.on_close)
    if response.status_code != 200:
        return response  # 499: nobody is listening
    return Response(
        json.dumps(whole(json.loads(bytes(response.body))), ensure_ascii=False),
        media_type="application/json",
    )


def renamed(error: APIError, params: dict[str, str]) -> APIError:
    """The error with its chat field name (or the head of its dotted path) renamed."""
    if error.param:
        head, dot, rest = error.param.partition(".")
        if error.param in params:
            error.param = params[error.param]
        elif head in params:
            error.param = params[head] + dot + rest
    return error
