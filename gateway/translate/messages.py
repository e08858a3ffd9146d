"""Anthropic's Messages API, POST /v1/messages and /v1/messages/count_tokens: a translation
to chat and back.

In: `system`, `messages` with text, `tool_use` and `tool_result` blocks, `tools`,
`tool_choice` (auto, any, tool, none), `max_tokens`, `stop_sequences`, `temperature`,
`top_p`, `top_k`, `thinking` (the template's thinking switches), llama.cpp's `grammar`
become one ChatCompletionRequest, run by the chat path. Out: a Message (thinking blocks first when
`thinking` is enabled), or
Anthropic's events (message_start, content_block_start/delta/stop, message_delta,
message_stop). Errors take Anthropic's shape for these paths (errors.py).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from ..api.errors import invalid_request, validation_error
from ..api.response_bodies import streamed_responses
from ..api.schemas import ChatCompletionRequest
from ..serving.chat import ChatServing
from .bridge import (
    named_event,
    renamed,
    run_translated,
)
from .messages_schemas import (
    AnthropicMessage,
    CountTokensRequest,
    MessagesRequest,
)

# Chat's field names in errors, as this API names them.
PARAMS = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
PARTIAL_TRIES = 256  # a cut call's input: how many shorter prefixes to try to parse
ANSWER = "A Message; with `stream`, server-sent events (message_start ... message_stop)"


def thinking_kwargs(thinking: Any) -> dict[str, Any] | None:
    """The chat template's variables for Anthropic's `thinking` (None: the template's
    default); 400 naming the field for what it cannot be."""
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return {"enable_thinking": False, "thinking": False}
    if kind != "enabled":
        raise invalid_request(
            "thinking must be {type: enabled, budget_tokens} or disabled", "thinking"
        )
    budget = thinking.get("budget_tokens")
    if type(budget) is not int or budget < 1:
        raise invalid_request(
            "thinking.budget_tokens must be a positive integer", "thinking.budget_tokens"
        )
    # Seed-OSS's template reads thinking_budget; the others only the switches.
    return {"enable_thinking": True, "thinking": True, "thinking_budget": budget}


def shows_thinking(body: CountTokensRequest) -> bool:
    """Whether the answer carries thinking blocks: only when the request enabled thinking."""
    return isinstance(body.thinking, dict) and body.thinking.get("type") == "enabled"


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages body asks for; 400 for what it cannot be."""
    kwargs = thinking_kwargs(body.thinking)
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text_of(body.system, "system")})
    for position, message in enumerate(body.messages):
        messages += _chat_messages(message, f"messages[{position}]")
    fields: dict[str, Any] = {"model": body.model, "messages": messages}
    if kwargs is not None:
        fields["chat_template_kwargs"] = kwargs
    if body.tools:
        fields["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.input_schema,
                },
            }
            for tool in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        kinds = {"auto": "auto", "any": "required", "none": "none"}
        if choice.type == "tool":
            if not choice.name:
                raise invalid_request(
                    "tool_choice of type tool needs the tool's name", "tool_choice"
                )
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = kinds[choice.type]
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if isinstance(body, MessagesRequest):
        user = (body.metadata or {}).get("user_id")
        fields |= {
            "max_completion_tokens": body.max_tokens,
            "stop": body.stop_sequences,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "user": user if isinstance(user, str) else None,
            "stream": bool(body.stream),
            "grammar": body.grammar,
        }
        if body.stream:
            fields["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise renamed(validation_error(exc.errors()), PARAMS) from exc


def _chat_messages(message: AnthropicMessage, param: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become tool messages (first, as
    they answer the calls before them), tool uses the assistant's tool_calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[str | dict[str, Any]] = []  # text, and a user's images as chat parts
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for position, block in enumerate(message.content):
        where = f"{param}.content[{position}]"
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "image" and message.role == "user":
            texts.append(_image_part(block, where, param))
        elif kind == "tool_use" and message.role == "assistant":
            arguments = block.get("input", {})
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise invalid_request(f"{where}: a tool_use block needs its id and name", param)
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": json.dumps(arguments)},
                }
            )
        elif kind == "tool_result" and message.role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise invalid_request(f"{where}: a tool_result block needs its tool_use_id", param)
            content = _text_of(block.get("content", ""), where)
            if block.get("is_error"):
                content = f"Error: {content}"
            results.append(
                {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}
            )
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thoughts.append(block["thinking"])  # for templates that render an earlier turn's
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise invalid_request(
                f"{where}: blocks of type {kind!r} are not supported in a {message.role} message; "
                "send text, tool_use (assistant) or tool_result (user)",
                param,
            )
    result = list(results)
    if message.role == "assistant":
        result.append(
            {
                "role": "assistant",
                "content": "".join(t for t in texts if isinstance(t, str)) or None,
                "tool_calls": calls or None,
                "reasoning_content": "".join(thoughts) or None,
            }
        )
    elif any(isinstance(text, dict) for text in texts):  # images: chat parts in order
        parts = [{"type": "text", "text": t} if isinstance(t, str) else t for t in texts]
        result.append({"role": "user", "content": parts})
    elif texts or not results:
        result.append({"role": "user", "content": "".join(t for t in texts if isinstance(t, str))})
    return result


def _image_part(block: dict[str, Any], where: str, param: str) -> dict[str, Any]:
    """An image block as a chat image_url part: a base64 source as a data: URL, a url
    source as it is (the chat path fetches it only from allowed domains)."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise invalid_request(f"{where}: an image block needs its source", param)
    if source.get("type") == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str):
            raise invalid_request(f"{where}: a base64 source needs media_type and data", param)
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise invalid_request(f"{where}: an image source is base64 or url", param)


def _text_of(content: Any, param: str) -> str:
    """Text, or text blocks, as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_request(f"{param} must be text or a list of text blocks", param)
    texts = []
    for block in content:
        if (
            not isinstance(block, dict)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
        ):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise invalid_request(
                f"{param}: blocks of type {kind!r} are not supported; send text", param
            )
        texts.append(block["text"])
    return "".join(texts)


# --- out ----------------------------------------------------------------------------


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    # Anthropic's input_tokens are the prompt's tokens not read from the cache: with
    # cache_read_input_tokens (and cache_creation_input_tokens, none here) they sum to it.
    return {
        "input_tokens": usage["prompt_tokens"] - cached,
        "output_tokens": usage["completion_tokens"],
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use input; a call cut by max_tokens gives what parses of it
    (as the anthropic SDK reads a streamed partial input), else {}."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        value = _partial_object(arguments)
    return value if isinstance(value, dict) else {}


def _partial_object(text: str) -> Any:
    """The longest prefix of an object cut short that parses once closed, a string cut short
    left out (as jiter's partial mode, which the anthropic SDK uses, reads it)."""
    end = len(text)
    for _ in range(PARTIAL_TRIES):
        head = text[:end].rstrip().rstrip(",:").rstrip()
        closers: list[str] = []
        in_string, escaped, string_start, boundary = False, False, 0, 0
        for position, ch in enumerate(head):
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string, string_start = True, position
            elif ch in "{[":
                closers.append("}" if ch == "{" else "]")
            elif ch in "}]" and closers:
                closers.pop()
            if not in_string and ch in "{[,:":
                boundary = position
        if in_string:
            end = string_start  # leave the cut string out
            continue
        try:
            return json.loads(head + "".join(reversed(closers)))
        except json.JSONDecodeError:
            # A value cut short (a number, true...): back to where it started.
            end = min(boundary + 1, len(head) - 1)
            if end <= 0:
                break
    return {}


def whole_message(
    message_id: str, model: str, chat: dict[str, Any], thinking: bool = False
) -> dict[str, Any]:
    """A chat completion as an Anthropic Message; with `thinking`, its reasoning first, as
    a thinking block (unsigned: the signature is empty)."""
    choice = chat["choices"][0]
    reply = choice["message"]
    content: list[dict[str, Any]] = []
    if thinking and reply.get("reasoning_content"):
        content.append(_thinking_block(reply["reasoning_content"]))
    if reply.get("content"):
        content.append({"type": "text", "text": reply["content"]})
    for call in reply.get("tool_calls") or []:
        function = call["function"]
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": function["name"],
                "input": tool_input(function["arguments"]),
            }
        )
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": STOP_REASONS.get(choice["finish_reason"], "end_turn"),
        "stop_sequence": None,
        "usage": _usage(chat.get("usage")),
    }


def _thinking_block(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}


@dataclass(slots=True)
class MessageEvents:
    """Chat chunks in, Anthropic's stream events out."""

    id: str
    model: str
    thinking: bool = False  # the reasoning goes out as a thinking block (else it is dropped)
    _block: int = -1  # the open block's index; -1 before the first
    _open: str | None = None  # "thinking", "text" or "tool_use"
    _calls: dict[int, int] = field(default_factory=dict)  # chat call index -> block index
    _finish: str | None = None
    # The prompt's tokens, told by the chat path before the first event (run_translated):
    # message_start says them, as Anthropic's does; which the cache held, message_delta says.
    prompt_tokens: int = 0

    def counted(self, prompt_tokens: int) -> None:
        """Told the prompt's token count before the stream starts."""
        self.prompt_tokens = prompt_tokens

    async def translate(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        """The whole event stream of one message."""
        start: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": self.prompt_tokens,
                "output_tokens": 0,
                "cache_read_input_tokens": 0,
                "cache_creation_input_tokens": 0,
            },
        }
        yield named_event("message_start", {"type": "message_start", "message": start})
        usage = None
        async for chunk in chunks:
            if "error" in chunk:
                error = chunk["error"]
                kind = (
                    "overloaded_error" if error.get("type") == "unavailable_error" else "api_error"
                )
                body = {
                    "type": "error",
                    "error": {"type": kind, "message": error.get("message", "")},
                }
                yield named_event("error", body)
                return
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                for text in self._choice(choice):
                    yield text
        for text in self._close():
            yield text
        delta = {
            "stop_reason": STOP_REASONS.get(self._finish or "stop", "end_turn"),
            "stop_sequence": None,
        }
        yield named_event(
            "message_delta", {"type": "message_delta", "delta": delta, "usage": _usage(usage)}
        )
        yield named_event("message_stop", {"type": "message_stop"})

    def _choice(self, choice: dict[str, Any]) -> list[str]:
        events: list[str] = []
        delta = choice.get("delta") or {}
        if self.thinking and delta.get("reasoning_content"):
            if self._open != "thinking":
                events += self._close()
                events.append(self._start(_thinking_block(""), "thinking"))
            thinking = {"type": "thinking_delta", "thinking": delta["reasoning_content"]}
            events.append(self._delta(thinking))
        if delta.get("content"):
            if self._open != "text":
                events += self._close()
                events.append(self._start({"type": "text", "text": ""}, "text"))
            text_delta = {"type": "text_delta", "text": delta["content"]}
            events.append(self._delta(text_delta))
        for call in delta.get("tool_calls") or []:
            if call["index"] not in self._calls:
                events += self._close()
                block = {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": call["function"]["name"],
                    "input": {},
                }
                events.append(self._start(block, "tool_use"))
                self._calls[call["index"]] = self._block
            arguments = call["function"].get("arguments") or ""
            if arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        if choice.get("finish_reason"):
            self._finish = choice["finish_reason"]
        return events

    def _start(self, block: dict[str, Any], kind: str) -> str:
        self._block += 1
        self._open = kind
        body = {"type": "content_block_start", "index": self._block, "content_block": block}
        return named_event("content_block_start", body)

    def _delta(self, delta: dict[str, Any]) -> str:
        body = {"type": "content_block_delta", "index": self._block, "delta": delta}
        return named_event("content_block_delta", body)

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        body = {"type": "content_block_stop", "index": self._block}
        return [named_event("content_block_stop", body)]


def messages_router(chat: ChatServing, **router_options: Any) -> APIRouter:
    """The routes of the Messages API, over the chat path."""
    router = APIRouter(**router_options)

    @router.post(
        "/v1/messages",
        tags=["anthropic"],
        responses=streamed_responses(ANSWER),
    )
    async def create_message(body: MessagesRequest, http: Request) -> Response:
        """A message (Anthropic's Messages API): text, tool use, and thinking when enabled;
        streams when `stream`."""
        request = chat_request(body)
        message_id = f"msg_{uuid.uuid4().hex}"
        model = chat.model_name(body.model)
        thinking = shows_thinking(body)
        stream = MessageEvents(message_id, model, thinking)
        return await run_translated(
            chat,
            http,
            request,
            lambda whole: whole_message(message_id, model, whole, thinking),
            stream.translate,
            PARAMS,
            counted=stream.counted,
        )

    @router.post("/v1/messages/count_tokens", tags=["anthropic"])
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        """How many tokens the messages (with system and tools) take as a prompt."""
        return {"input_tokens": await chat.count_prompt_tokens(chat_request(body))}

    return router
