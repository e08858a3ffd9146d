"""A chat reply's tool calls in OpenAI's shapes: the whole message, and the streamed deltas."""

from __future__ import annotations

from typing import Any

from ..api.response_bodies import AssistantMessage
from ..api.schemas import FunctionCall, ToolCall
from .checks import ToolRequest
from .parser import ArgumentsDelta, CallStart, read_reply


def assistant_message(
    tools: ToolRequest | None, text: str, reason: str
) -> tuple[AssistantMessage, Any]:
    """The reply as content and tool calls; finish_reason `tool_calls` when it made some and
    ended at them (or was cut only inside a repeated call)."""
    if tools is None:
        return AssistantMessage(content=text), reason
    parser = tools.parser()
    content, parsed = read_reply(parser, text, cut=reason == "length")
    if not parsed:
        return AssistantMessage(content=content), reason
    calls = [
        ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed
    ]
    message = AssistantMessage(content=content if content.strip() else None, tool_calls=calls)
    return message, parser.finish_reason(reason)


def tool_call_delta(event: CallStart | ArgumentsDelta) -> dict[str, Any]:
    """One tool-call delta as OpenAI streams it: id, type and name first, then arguments."""
    if isinstance(event, CallStart):
        function = {"name": event.name, "arguments": ""}
        return {"index": event.index, "id": event.id, "type": "function", "function": function}
    return {"index": event.index, "function": {"arguments": event.text}}
