"""OpenAI response bodies and server-sent-event chunks, for completions and chat completions."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from loomserve.gateway.errors import APIError
from loomserve.gateway.generation import Usage
from loomserve.gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    Completion,
    CompletionChoice,
)
from loomserve.gateway.schemas import Usage as UsageBody

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

    request_id: str
    created: int
    model: str
    chat: bool
    include_usage: bool

    def opening(self) -> str | None:
        """Chat streams open with the assistant's role, as OpenAI's do."""
        if not self.chat:
            return None
        return self._choice({"delta": {"role": "assistant", "content": ""}}, None)

    def text(self, text: str) -> str:
        if self.chat:
            return self._choice({"delta": {"content": text}}, None)
        return self._choice({"text": text}, None)

    def finish(self, reason: str) -> str:
        return self._choice({"delta": {}} if self.chat else {"text": ""}, reason)

    def usage(self, usage: Usage) -> str:
        return sse({**self._head(), "choices": [], "usage": usage.to_dict()})

    def _choice(self, body: dict[str, Any], reason: str | None) -> str:
        choice = {"index": 0, **body, "logprobs": None, "finish_reason": reason}
        payload = {**self._head(), "choices": [choice]}
        if self.include_usage:
            payload["usage"] = None
        return sse(payload)

    def _head(self) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}


def completion_body(
    request_id: str, created: int, model: str, text: str, reason: str, usage: Usage
) -> Completion:
    """A whole /v1/completions response."""
    choice = CompletionChoice(text=text, finish_reason=reason)
    return Completion(
        id=request_id, created=created, model=model, choices=[choice], usage=_usage(usage)
    )


def chat_body(
    request_id: str, created: int, model: str, text: str, reason: str, usage: Usage
) -> ChatCompletion:
    """A whole /v1/chat/completions response."""
    choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=reason)
    return ChatCompletion(
        id=request_id, created=created, model=model, choices=[choice], usage=_usage(usage)
    )


def _usage(usage: Usage) -> UsageBody:
    return UsageBody.model_validate(usage.to_dict())
