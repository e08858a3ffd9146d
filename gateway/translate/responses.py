"""OpenAI's Responses API, POST /v1/responses: its routes and its request as a chat request.

In: `input` (a string, or items: messages, `function_call`, `function_call_output`),
`instructions`, function `tools`, `tool_choice`, `text.format`, `max_output_tokens`,
`temperature`, `top_p`, `stream` (and llama.cpp's `grammar`) become one ChatCompletionRequest,
run by the chat path.
Out (responses_output.py): the chat answer becomes a Response object, or its chunks become the
Responses events (`response.created` ... `response.completed`).

Gateways keep no state: `store` true, `previous_response_id`, `conversation` and `background`
are a 400 (a stored response would be on one gateway only, behind a load balancer).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from ..api.errors import APIError, invalid_request, validation_error
from ..api.response_bodies import streamed_responses
from ..api.schemas import ChatCompletionRequest
from ..serving.chat import ChatServing
from .bridge import renamed, run_translated
from .responses_output import (
    ResponseEvents,
    ResponseHead,
    whole_response,
)
from .responses_schemas import (
    ResponsesInputTokensRequest,
    ResponsesNamedTool,
    ResponsesRequest,
)

# Chat's field names in errors, as this API names them.
PARAMS = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "response_format.json_schema": "text.format",
    "messages": "input",
    "reasoning_effort": "reasoning.effort",
}
STATELESS = (
    "gateways keep no state, so that any one behind a load balancer can answer: "
    "send the whole conversation in `input`"
)
ANSWER = (
    "A Response object; with `stream`, server-sent events (response.created ... response.completed)"
)


def chat_request(body: ResponsesInputTokensRequest) -> ChatCompletionRequest:
    """The chat request a Responses body asks for; 400 for what it cannot be."""
    _reject_state(body)
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        for position, item in enumerate(body.input):
            _add_item(messages, item, position)
    if messages and _thought_only(messages[-1]):
        messages.pop()  # thinking with no turn after it: nothing to render it with
    if not any(m["role"] != "system" for m in messages):
        raise invalid_request("the input holds no message to answer", "input")
    fields: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools:
        fields["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude_none=True, exclude={"type"})}
            for tool in body.tools
        ]
    choice = body.tool_choice
    if isinstance(choice, ResponsesNamedTool):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        fields["tool_choice"] = choice
    if body.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = body.parallel_tool_calls
    fields |= _reasoning(body.reasoning)
    text_format = body.text.format if body.text else None
    if text_format is not None and text_format.type == "json_schema":
        schema = {"name": text_format.name or "response", "schema": text_format.schema_}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif text_format is not None and text_format.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    if isinstance(body, ResponsesRequest):
        fields |= {
            "max_completion_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "user": body.safety_identifier or body.user,
            "stream": bool(body.stream),
            "grammar": body.grammar,
        }
        if body.stream:
            fields["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise renamed(validation_error(exc.errors()), PARAMS) from exc


def _reasoning(reasoning: Any) -> dict[str, Any]:
    """`reasoning.effort` as chat's reasoning_effort (the template's thinking switches);
    `summary` is accepted, and the reasoning items carry the whole text instead."""
    if reasoning is None:
        return {}
    if not isinstance(reasoning, dict):
        raise invalid_request("reasoning must be an object", "reasoning")
    effort = reasoning.get("effort")
    return {} if effort is None else {"reasoning_effort": effort}


def _reject_state(body: ResponsesInputTokensRequest) -> None:
    if body.previous_response_id is not None:
        raise invalid_request(
            f"previous_response_id is not supported: {STATELESS}", "previous_response_id"
        )
    if body.conversation is not None:
        raise invalid_request(f"conversation is not supported: {STATELESS}", "conversation")
    if isinstance(body, ResponsesRequest):
        if body.store:
            raise invalid_request(f"store must be false: {STATELESS}", "store")
        if body.background:
            raise invalid_request("background responses are not supported", "background")


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], position: int) -> None:
    """One input item as chat messages; function calls join the assistant turn before them."""
    param = f"input[{position}]"
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise invalid_request(
                f"{param}.role must be user, system, developer or assistant", param
            )
        content = _content_of(item.get("content"), param, images=role == "user")
        last = messages[-1] if messages else None
        if last is not None and _thought_only(last) and role == "assistant":
            last["content"] = content  # the reasoning item before it was this turn's
            return
        if _thought_only(last):
            messages.pop()  # thinking of no turn: nothing to render it with
        messages.append({"role": role, "content": content})
    elif kind == "function_call":
        call = {
            "id": _string(item, "call_id", param),
            "type": "function",
            "function": {
                "name": _string(item, "name", param),
                "arguments": _string(item, "arguments", param),
            },
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        content = output if isinstance(output, str) else _text_of(output, param)
        messages.append(
            {"role": "tool", "tool_call_id": _string(item, "call_id", param), "content": content}
        )
    elif kind == "reasoning":
        # An earlier turn's thinking, for templates that render it (a tool loop's): it joins
        # the assistant turn that follows it.
        parts = [*(item.get("content") or []), *(item.get("summary") or [])]
        text = "".join(
            p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
        if text:
            messages.append({"role": "assistant", "content": None, "reasoning_content": text})
    else:
        raise invalid_request(
            f"{param}: items of type {kind!r} are not supported; send messages, "
            "function_call and function_call_output",
            param,
        )


def _thought_only(message: dict[str, Any] | None) -> bool:
    """Whether a chat message is a reasoning item's turn with nothing else in it yet."""
    return (
        message is not None
        and message["role"] == "assistant"
        and message.get("content") is None
        and not message.get("tool_calls")
    )


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid_request(f"{param}.{key} must be a string", param)
    return value


def _content_of(content: Any, param: str, images: bool) -> str | list[dict[str, Any]]:
    """A message's content for the chat path: its text, or, with images (a user message's
    input_image parts), chat parts: text parts and image_url parts in their order."""
    if not images or not isinstance(content, list):
        return _text_of(content, param)
    if not any(isinstance(part, dict) and part.get("type") == "input_image" for part in content):
        return _text_of(content, param)
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise invalid_request(
                    f"{param}: an input_image part needs its image_url (a data: URL or an "
                    "http(s) one; file_id is not supported)",
                    param,
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": _text_of([part], param)})
    return parts


def _text_of(content: Any, param: str) -> str:
    """A message's content as text: a string, or text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_request(f"{param}.content must be a string or a list of parts", param)
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in (
            "input_text",
            "output_text",
            "text",
        ):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid_request(
                f"{param}: content parts of type {kind!r} are not supported; send text", param
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid_request(f"{param}: a text part needs its text", param)
        texts.append(text)
    return "".join(texts)


def responses_router(chat: ChatServing, **router_options: Any) -> APIRouter:
    """The routes of the Responses API, over the chat path."""
    router = APIRouter(**router_options)

    @router.post(
        "/v1/responses",
        tags=["openai"],
        responses=streamed_responses(ANSWER),
    )
    async def create_response(body: ResponsesRequest, http: Request) -> Response:
        """A response (Responses API): text, function calls, JSON; streams when `stream`.

        Stateless: `store` must be false or absent, `previous_response_id` is not taken.
        """
        request = chat_request(body)
        head = ResponseHead(body, chat.model_name(body.model))
        stream = ResponseEvents(head)
        return await run_translated(
            chat, http, request, lambda whole: whole_response(head, whole), stream.translate, PARAMS
        )

    @router.post("/v1/responses/input_tokens", tags=["openai"])
    async def input_tokens(body: ResponsesInputTokensRequest) -> dict[str, Any]:
        """How many tokens the input (with instructions and tools) takes as a prompt."""
        try:
            tokens = await chat.count_prompt_tokens(chat_request(body))
        except APIError as error:
            raise renamed(error, PARAMS) from None
        return {"object": "response.input_tokens", "input_tokens": tokens}

    return router
