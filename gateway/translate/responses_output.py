"""The Responses API's answer: a chat completion as a Response object, chat chunks as its events.

Whole: `whole_response` turns the chat answer into a Response object. Streamed: ResponseEvents
turns the chat chunks into the Responses events, each numbered (`response.created` ...
`response.completed`; its status is "incomplete" at max_output_tokens). ResponseHead holds what
the request decides of either. The request's side, and the routes, are in responses.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from .bridge import named_event
from .responses_schemas import ResponsesNamedTool, ResponsesRequest


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat usage as the Responses API counts it."""
    if usage is None:
        return None
    details = usage.get("prompt_tokens_details") or {}
    reasoning = usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning.get("reasoning_tokens", 0)},
        "total_tokens": usage["total_tokens"],
    }


@dataclass(slots=True)
class ResponseHead:
    """The fields of a Response object that the request decides, and its id."""

    body: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: _new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        incomplete: bool = False,
    ) -> dict[str, Any]:
        """The whole Response object in this state."""
        body = self.body
        text_format = body.text.format if body.text and body.text.format else None
        choice = body.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": body.temperature if body.temperature is not None else 1.0,
            "text": {
                "format": text_format.model_dump(by_alias=True, exclude_none=True)
                if text_format
                else {"type": "text"}
            },
            "tool_choice": choice.model_dump()
            if isinstance(choice, ResponsesNamedTool)
            else choice or "auto",
            "tools": [t.model_dump(exclude_none=False) for t in body.tools or []],
            "top_p": body.top_p if body.top_p is not None else 1.0,
            "truncation": "disabled",
            "usage": usage,
            "user": body.user,
            "metadata": body.metadata or {},
        }


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [part] if status == "completed" or text else [],
    }


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """A reasoning item: the think block's text as reasoning_text content (no summary)."""
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" or text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _part(kind: str, text: str) -> dict[str, Any]:
    """A content part: output_text (with its annotations and logprobs) or reasoning_text."""
    if kind == "output_text":
        return {"type": kind, "text": text, "annotations": [], "logprobs": []}
    return {"type": kind, "text": text}


def whole_response(head: ResponseHead, chat: dict[str, Any]) -> dict[str, Any]:
    """A chat completion as a Response object."""
    choice = chat["choices"][0]
    message = choice["message"]
    incomplete = choice["finish_reason"] == "length"
    item_status = "incomplete" if incomplete else "completed"
    output = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(_new_id("rs"), message["reasoning_content"], item_status))
    if message.get("content"):
        output.append(_message_item(_new_id("msg"), message["content"], item_status))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        output.append(
            _call_item(
                _new_id("fc"), call["id"], function["name"], function["arguments"], item_status
            )
        )
    status = "incomplete" if incomplete else "completed"
    return head.response(status, output, response_usage(chat.get("usage")), incomplete)


@dataclass(slots=True)
class _Item:
    """An output item being streamed."""

    index: int
    id: str
    kind: str  # "message", "reasoning" or "function_call"
    text: str = ""  # the message's or the reasoning's text, or the call's arguments
    call_id: str = ""
    name: str = ""


@dataclass(slots=True)
class ResponseEvents:
    """Chat chunks in, Responses events out; every event numbered in `sequence_number`."""

    head: ResponseHead
    _sequence: int = 0
    _items: list[_Item] = field(default_factory=list)
    _open: _Item | None = None
    _calls: dict[int, _Item] = field(default_factory=dict)  # by the chat delta's index
    _finish: str | None = None

    def event(self, kind: str, **payload: Any) -> str:
        body = {"type": kind, "sequence_number": self._sequence, **payload}
        self._sequence += 1
        return named_event(kind, body)

    async def translate(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        """The whole event stream of one response."""
        opening = self.head.response("in_progress", [], None)
        yield self.event("response.created", response=opening)
        yield self.event("response.in_progress", response=opening)
        usage = None
        async for chunk in chunks:
            if "error" in chunk:
                error = chunk["error"]
                yield self.event(
                    "error",
                    code=error.get("code"),
                    message=error.get("message", ""),
                    param=error.get("param"),
                )
                return
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                for text in self._choice(choice):
                    yield text
        for text in self._close():
            yield text
        incomplete = self._finish == "length"
        status = "incomplete" if incomplete else "completed"
        final = self.head.response(
            status, [self._done_item(i) for i in self._items], response_usage(usage), incomplete
        )
        # response.completed even when cut (status "incomplete"), as vLLM sends it: the
        # openai SDK's responses.stream() reads its final response from that event only.
        yield self.event("response.completed", response=final)

    def _choice(self, choice: dict[str, Any]) -> list[str]:
        events: list[str] = []
        delta = choice.get("delta") or {}
        if delta.get("reasoning_content"):
            events += self._text_delta("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text_delta("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            item = self._calls.get(call["index"])
            if item is None:
                events += self._close()
                item = self._start("function_call", _new_id("fc"))
                item.call_id, item.name = call["id"], call["function"]["name"]
                self._calls[call["index"]] = item
                events.append(self._added(item))
            arguments = call["function"].get("arguments") or ""
            if arguments:
                item.text += arguments
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=item.id,
                        output_index=item.index,
                        delta=arguments,
                    )
                )
        if choice.get("finish_reason"):
            self._finish = choice["finish_reason"]
        return events

    def _text_delta(self, kind: str, text: str) -> list[str]:
        """Text for the open message or reasoning item, opening it first when needed."""
        events: list[str] = []
        item = self._open
        part_kind = "output_text" if kind == "message" else "reasoning_text"
        if item is None or item.kind != kind:
            events += self._close()
            item = self._start(kind, _new_id("msg" if kind == "message" else "rs"))
            events.append(self._added(item))
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=item.id,
                    output_index=item.index,
                    content_index=0,
                    part=_part(part_kind, ""),
                )
            )
        item.text += text
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        events.append(
            self.event(
                f"response.{part_kind}.delta",
                item_id=item.id,
                output_index=item.index,
                content_index=0,
                delta=text,
                **extra,
            )
        )
        return events

    def _start(self, kind: str, item_id: str) -> _Item:
        item = _Item(len(self._items), item_id, kind)
        self._items.append(item)
        self._open = item
        return item

    def _added(self, item: _Item) -> str:
        if item.kind == "message":
            shape = _message_item(item.id, "", "in_progress")
        elif item.kind == "reasoning":
            shape = _reasoning_item(item.id, "", "in_progress")
        else:
            shape = _call_item(item.id, item.call_id, item.name, "", "in_progress")
        return self.event("response.output_item.added", output_index=item.index, item=shape)

    def _done_item(self, item: _Item) -> dict[str, Any]:
        status = "incomplete" if self._finish == "length" else "completed"
        if item.kind == "message":
            return _message_item(item.id, item.text, status)
        if item.kind == "reasoning":
            return _reasoning_item(item.id, item.text, status)
        return _call_item(item.id, item.call_id, item.name, item.text, status)

    def _close(self) -> list[str]:
        """The events that end the open item."""
        item, self._open = self._open, None
        if item is None:
            return []
        where = {"item_id": item.id, "output_index": item.index}
        events = []
        if item.kind == "message":
            part = {"type": "output_text", "text": item.text, "annotations": [], "logprobs": []}
            events.append(
                self.event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=item.text,
                    logprobs=[],
                )
            )
            events.append(
                self.event("response.content_part.done", **where, content_index=0, part=part)
            )
        elif item.kind == "reasoning":
            events.append(
                self.event("response.reasoning_text.done", **where, content_index=0, text=item.text)
            )
            part = _part("reasoning_text", item.text)
            events.append(
                self.event("response.content_part.done", **where, content_index=0, part=part)
            )
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item.name,
                    arguments=item.text,
                )
            )
        done = self._done_item(item)
        events.append(self.event("response.output_item.done", output_index=item.index, item=done))
        return events
