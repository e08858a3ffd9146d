"""OpenAI response bodies and server-sent-event chunks, for completions and chat completions."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from loomserve.gateway.assembly import Done
from loomserve.gateway.errors import APIError
from loomserve.gateway.request import GenerationRequest
from loomserve.gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    Completion,
    CompletionChoice,
    Usage,
)

DONE_EVENT = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_event(error: APIError) -> str:
    """The event that ends a stream which failed after it started."""
    return sse(error.body())


@dataclass(frozen=True, slots=True)
class StreamChunks:
    """The chunks of one streamed response: the role (chat), text deltas, the finish, usage."""

    request: GenerationRequest

    def opening(self) -> str | None:
        """Chat streams open with the assistant's role, as OpenAI's do."""
        if not self.request.chat:
            return None
        return self._choice({"delta": {"role": "assistant", "content": ""}}, None)

    def text(self, text: str) -> str:
        if self.request.chat:
            return self._choice({"delta": {"content": text}}, None)
        return self._choice({"text": text}, None)

    def finish(self, reason: str) -> str:
        return self._choice({"delta": {}} if self.request.chat else {"text": ""}, reason)

    def usage(self, usage: Usage) -> str:
        return sse({**self._head(), "choices": [], "usage": usage.model_dump()})

    def _choice(self, body: dict[str, Any], reason: str | None) -> str:
        choice = {"index": 0, **body, "logprobs": None, "finish_reason": reason}
        payload = {**self._head(), "choices": [choice]}
        if self.request.include_usage:
            payload["usage"] = None
        return sse(payload)

    def _head(self) -> dict[str, Any]:
        r = self.request
        kind = "chat.completion.chunk" if r.chat else "text_completion"
        return {"id": r.id, "object": kind, "created": r.created, "model": r.model}


def response_body(request: GenerationRequest, text: str, done: Done) -> Completion | ChatCompletion:
    """The whole response of a request that does not stream."""
    head = {"id": request.id, "created": request.created, "model": request.model}
    if request.chat:
        message = AssistantMessage(content=text)
        chat_choice = ChatChoice(message=message, finish_reason=done.finish_reason)
        return ChatCompletion(**head, choices=[chat_choice], usage=done.usage)
    choice = CompletionChoice(text=text, finish_reason=done.finish_reason)
    return Completion(**head, choices=[choice], usage=done.usage)
