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
    FunctionCall,
    ToolCall,
    Usage,
)
from loomserve.gateway.tool_parser import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ToolCallParser,
    ToolEvent,
    parse_reply,
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
    """The chunks of one streamed response: the role (chat), text deltas, the finish, usage.

    With a tool parser, text becomes content and tool-call deltas; a chunk may then be
    several events, or "" while the parser holds text back.
    """

    request: GenerationRequest
    tool_parser: ToolCallParser | None = None

    def opening(self) -> str | None:
        """Chat streams open with the assistant's role, as OpenAI's do."""
        if not self.request.chat:
            return None
        return self._choice({"delta": {"role": "assistant", "content": ""}}, None)

    def text(self, text: str) -> str:
        if self.tool_parser is not None:
            return "".join(self._tool_event(e) for e in self.tool_parser.push(text))
        if self.request.chat:
            return self._choice({"delta": {"content": text}}, None)
        return self._choice({"text": text}, None)

    def finish(self, reason: str) -> str:
        held = ""
        if self.tool_parser is not None:
            held = "".join(self._tool_event(e) for e in self.tool_parser.finish())
            if self.tool_parser.calls and reason == "stop":
                reason = "tool_calls"
        return held + self._choice({"delta": {}} if self.request.chat else {"text": ""}, reason)

    def _tool_event(self, event: ToolEvent) -> str:
        if isinstance(event, ContentDelta):
            return self._choice({"delta": {"content": event.text}}, None)
        return self._choice({"delta": {"tool_calls": [tool_call_delta(event)]}}, None)

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
        message, reason = _assistant_message(request, text, done.finish_reason)
        chat_choice = ChatChoice(message=message, finish_reason=reason)
        return ChatCompletion(**head, choices=[chat_choice], usage=done.usage)
    choice = CompletionChoice(text=text, finish_reason=done.finish_reason)
    return Completion(**head, choices=[choice], usage=done.usage)


def _assistant_message(
    request: GenerationRequest, text: str, reason: str
) -> tuple[AssistantMessage, Any]:
    """The reply as content and tool calls; finish_reason `tool_calls` when it made some."""
    tools = request.tools
    if tools is None:
        return AssistantMessage(content=text), reason
    content, parsed = parse_reply(tools.format, text, tools.max_calls)
    if not parsed:
        return AssistantMessage(content=content), reason
    calls = [
        ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed
    ]
    message = AssistantMessage(content=content if content.strip() else None, tool_calls=calls)
    return message, "tool_calls" if reason == "stop" else reason


def tool_call_delta(event: CallStart | ArgumentsDelta) -> dict[str, Any]:
    """One tool-call delta as OpenAI streams it: id, type and name first, then arguments."""
    if isinstance(event, CallStart):
        function = {"name": event.name, "arguments": ""}
        return {"index": event.index, "id": event.id, "type": "function", "function": function}
    return {"index": event.index, "function": {"arguments": event.text}}
