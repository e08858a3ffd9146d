"""Tool calling end to end: a real worker on the tiny model, driven by the `openai` client.

The tiny model has no chat template, so the first gateway renders tools in the generic format
(the system prompt); the second has a Hermes-style template that renders tools itself. With
`required` or a named tool_choice the grammar makes even this random model write a call, which
must parse into the function's declared schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.procs import Proc, start_gateway, start_worker
from tests.tiny_model import vocabulary

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 0},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string", "enum": ["yes", "no"]}},
                "required": ["word"],
            },
        },
    },
]
MESSAGES: list[Any] = [{"role": "user", "content": "what is the weather in the big city"}]
# A template that renders tools and tool messages itself, Hermes style (as Qwen 2.5's does).
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools> Call them as <tool_call>{json}</tool_call>.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# The random model strings byte tokens into invalid UTF-8, which the grammar counts
# differently from the text it becomes; real models write whole characters. ASCII it is.
ASCII_ONLY = {
    str(i): -100
    for i, token in enumerate(vocabulary()[0])
    if token.startswith("<0x") and int(token[3:5], 16) >= 0x80
}


@pytest.fixture(scope="module")
def gateways(tiny_model_path: Path) -> Iterator[tuple[Proc, Proc]]:
    with (
        start_worker(tiny_model_path, slots=2, ctx_size=1024) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as generic,
        start_gateway(tiny_model_path, worker.endpoint, chat_template=HERMES_TEMPLATE) as hermes,
    ):
        print("logs:", worker.log_path, generic.log_path, hermes.log_path)
        yield generic, hermes


def client(gateway: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


def chat(gateway: Proc, **fields: Any):
    defaults = {
        "model": "tiny-llama",
        "messages": MESSAGES,
        "temperature": 0,
        # No max_tokens: the rest of the context (a max_tokens beyond it is a 400).
        "logit_bias": ASCII_ONLY,
    }
    return client(gateway).chat.completions.create(**{**defaults, **fields})


def schema_of(name: str) -> dict[str, Any]:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def test_required_choice_gives_a_call_in_the_declared_schema(gateways: tuple[Proc, Proc]) -> None:
    for gateway in gateways:
        result = chat(gateway, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        choice = result.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        calls = choice.message.tool_calls
        assert calls is not None and len(calls) == 1, choice.message
        call = calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in ("get_weather", "lookup")
        jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))


def test_parallel_calls_each_parse(gateways: tuple[Proc, Proc]) -> None:
    """Parallel calls are allowed by default; a random model may write them until max_tokens."""
    result = chat(gateways[0], tools=TOOLS, tool_choice="required", max_tokens=120)
    choice = result.choices[0]
    calls = choice.message.tool_calls or []
    assert len(calls) >= 1 and choice.finish_reason in ("tool_calls", "length")
    assert len({call.id for call in calls}) == len(calls)
    if choice.finish_reason == "length":
        calls = calls[:-1]  # the last may be cut short, as OpenAI's are
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))
    if choice.finish_reason == "tool_calls":
        assert choice.message.content is None


def test_named_choice_calls_that_function_once(gateways: tuple[Proc, Proc]) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    result = chat(gateways[0], tools=TOOLS, tool_choice=named, parallel_tool_calls=False)
    calls = result.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1
    assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)


def test_streamed_calls_add_up_to_the_whole_reply(gateways: tuple[Proc, Proc]) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    fields = {"tools": TOOLS, "tool_choice": named, "parallel_tool_calls": False}
    whole = chat(gateways[0], **fields)
    stream = chat(gateways[0], **fields, stream=True)
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        assert not delta.content
        for part in delta.tool_calls or []:
            if part.index not in calls:  # the first delta of a call: id, type and name
                assert part.id and part.type == "function" and part.function.name
                calls[part.index] = {"name": part.function.name, "arguments": ""}
            else:
                assert part.id is None and part.function.name is None
            calls[part.index]["arguments"] += part.function.arguments or ""
    assert finish == "tool_calls"
    expected = [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.choices[0].message.tool_calls or []
    ]
    assert [calls[i] for i in sorted(calls)] == expected


def test_auto_choice_parses_calls_the_model_writes(gateways: tuple[Proc, Proc]) -> None:
    """The model writes text, then a call in its template's syntax (forced here by a grammar)."""
    call = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    grammar = f'root ::= "Let me look. <tool_call>\\n" {json.dumps(call)} "\\n</tool_call>"'
    for stream in (False, True):
        result = chat(gateways[1], tools=TOOLS, extra_body={"grammar": grammar}, stream=stream)
        if stream:
            content, arguments, names, finish = "", "", [], None
            for chunk in result:
                if not chunk.choices:
                    continue
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for part in delta.tool_calls or []:
                    names += [part.function.name] if part.function.name else []
                    arguments += part.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
        else:
            message = result.choices[0].message
            content, finish = message.content, result.choices[0].finish_reason
            names = [c.function.name for c in message.tool_calls or []]
            arguments = "".join(c.function.arguments for c in message.tool_calls or [])
        assert content.strip() == "Let me look."
        assert names == ["get_weather"]
        assert json.loads(arguments) == {"city": "Paris", "unit": "celsius"}
        assert finish == "tool_calls"


def test_tool_messages_round_trip(gateways: tuple[Proc, Proc]) -> None:
    """A call the model made and the tool's answer go back through the template."""
    for gateway in gateways:
        first = chat(gateway, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        message = first.choices[0].message
        assert message.tool_calls
        call = message.tool_calls[0]
        history = [
            *MESSAGES,
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny and warm"},
        ]
        second = chat(gateway, messages=history, tools=TOOLS, max_tokens=8)
        assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
        tokens = httpx.post(
            gateway.url + "/tokenize", json={"content": "sunny and warm" + call.function.name}
        ).json()["tokens"]
        # The call and the answer are part of the prompt.
        assert second.usage.prompt_tokens >= first.usage.prompt_tokens + len(tokens)


def test_none_choice_and_no_tools_write_text(gateways: tuple[Proc, Proc]) -> None:
    result = chat(gateways[0], tools=TOOLS, tool_choice="none", max_tokens=8)
    assert result.choices[0].message.tool_calls is None
    assert result.choices[0].finish_reason in ("stop", "length")
    plain = chat(gateways[0], max_tokens=8)
    # tool_choice none renders no tools: the prompt is the plain one.
    assert result.usage.prompt_tokens == plain.usage.prompt_tokens


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, None),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, None),
    ],
)
def test_bad_tool_requests_get_400(
    gateways: tuple[Proc, Proc], fields: dict[str, Any], param: str | None
) -> None:
    body = {"messages": MESSAGES, "max_tokens": 4, **fields}
    response = httpx.post(gateways[0].url + "/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param:
        assert error["param"] == param, error
