"""Tool-call families end to end: the tiny model served with real chat templates (Qwen3-Coder's
XML-ish calls, gpt-oss's Harmony, GLM's arg_key/arg_value, LFM2.5's Python-style calls,
Llama 3.1's built-in tools after <|python_tag|>), its
output forced by a `grammar` to a fixture's exact text, or by tool_choice `required` to the
family's own syntax; the calls come back through /v1/chat/completions, whole and streamed, and
(Qwen3-Coder, GLM, LFM2.5) as function_call items of /v1/responses and tool_use blocks of
/v1/messages.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from tests.procs import Proc, start_gateway, start_worker
from tests.tiny_model import ModelShape, vocabulary, write_tiny_model

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "templates"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",  # gpt-oss's template insists on one
            "parameters": WEATHER,
        },
    },
]
MESSAGES: list[Any] = [{"role": "user", "content": "weather?"}]
# Byte tokens that make invalid UTF-8 out of a random model's output: kept out.
ASCII_ONLY = {
    str(i): -100
    for i, token in enumerate(vocabulary()[0])
    if token.startswith("<0x") and int(token[3:5], 16) >= 0x80
}
# family -> (template file, a reply of text and two calls in its syntax)
FAMILIES = {
    "qwen3_coder": (
        "Qwen3-Coder",
        "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
        "<parameter=days>\n1\n</parameter>\n</function>\n</tool_call>",
    ),
    "harmony": (
        "openai-gpt-oss-120b",
        "Let me look.<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris", "days": 3}<|call|><|start|>assistant<|channel|>commentary '
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome", "days": 1}<|call|>',
    ),
    "glm": (
        "GLM-4.6",
        "Let me look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
        "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n"
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
    ),
    "lfm2": (
        "LFM2.5-8B-A1B",
        "Let me look.<|tool_call_start|>[get_weather(city='Paris', days=3), "
        'get_weather(city="Rome", days=1)]<|tool_call_end|>',
    ),
}
EXPECTED = [{"city": "Paris", "days": 3}, {"city": "Rome", "days": 1}]


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    # Real templates write long system prompts (Qwen3-Coder's: about 1,000 tokens here).
    model = write_tiny_model(
        tmp_path_factory.mktemp("long") / "tiny-llama.gguf", shape=ModelShape(context_length=4096)
    )
    with start_worker(model, slots=2, ctx_size=4096) as worker:
        procs: dict[str, Proc] = {}
        try:
            for family, (template, _) in FAMILIES.items():
                path = TEMPLATES / f"{template}.jinja"
                procs[family] = start_gateway(model, worker.endpoint, chat_template=path)
            llama = TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja"
            procs["llama3"] = start_gateway(model, worker.endpoint, chat_template=llama)
            yield procs
        finally:
            for proc in procs.values():
                proc.stop()


def chat(gateway: Proc, **fields: Any) -> Any:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    defaults = {
        "model": "tiny-llama",
        "messages": MESSAGES,
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 400,
        "logit_bias": ASCII_ONLY,
    }
    return client.chat.completions.create(**{**defaults, **fields})


def streamed(result: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """(content, calls, finish_reason) added up from a stream's chunks, checking that each
    call's first delta brings its id and name, and later ones only arguments."""
    content, calls, finish = "", {}, None
    for chunk in result:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            if part.index not in calls:
                assert part.id and part.type == "function" and part.function.name
                calls[part.index] = {"name": part.function.name, "arguments": ""}
            else:
                assert part.id is None and part.function.name is None
            calls[part.index]["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_familys_calls_come_back_whole_and_streamed(
    gateways: dict[str, Proc], family: str
) -> None:
    grammar = f"root ::= {json.dumps(FAMILIES[family][1])}"
    whole = chat(gateways[family], extra_body={"grammar": grammar})
    message = whole.choices[0].message
    assert message.content.strip() == "Let me look."
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "get_weather"]
    assert [json.loads(c.function.arguments) for c in message.tool_calls] == EXPECTED
    assert whole.choices[0].finish_reason == "tool_calls"
    content, calls, finish = streamed(
        chat(gateways[family], extra_body={"grammar": grammar}, stream=True)
    )
    assert content.strip() == "Let me look." and finish == "tool_calls"
    assert [c["name"] for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c["arguments"]) for c in calls] == EXPECTED


# gpt-oss's forced call follows its analysis channel (text/think_grammar.py: the reply starts
# inside the think block), which the random model does not end: Harmony's grammar is checked
# byte for byte in tests/gateway/test_tool_families.py instead.
@pytest.mark.parametrize("family", ["glm", "lfm2", "qwen3_coder"])
def test_a_forced_call_is_written_in_the_familys_syntax(
    gateways: dict[str, Proc], family: str
) -> None:
    """tool_choice `required`: the grammar makes the random model write one call in the
    template's syntax, which parses into the declared schema, whole and streamed alike."""
    fields = {"tool_choice": "required", "parallel_tool_calls": False}
    whole = chat(gateways[family], **fields)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    content, calls, finish = streamed(chat(gateways[family], **fields, stream=True))
    assert not content and finish == "tool_calls"
    assert calls == [{"name": call.function.name, "arguments": call.function.arguments}]


def forced(family: str) -> str:
    """A grammar whose one text is the family's fixture."""
    return f"root ::= {json.dumps(FAMILIES[family][1])}"


RESPONSES_TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "The weather in a city.",
     "parameters": WEATHER},
]  # fmt: skip


@pytest.mark.parametrize("family", ["glm", "lfm2", "qwen3_coder"])
def test_responses_api_returns_a_familys_calls_as_function_call_items(
    gateways: dict[str, Proc], family: str
) -> None:
    """/v1/responses: the text as a message item, then one function_call item per call, whole
    and streamed alike (the streamed arguments' deltas add up to each item's arguments)."""
    client = openai.OpenAI(base_url=gateways[family].url + "/v1", api_key="u", max_retries=0)
    fields: Any = {
        "model": "tiny-llama",
        "input": "weather?",
        "tools": RESPONSES_TOOLS,
        "temperature": 0,
        "max_output_tokens": 400,
        "extra_body": {"grammar": forced(family)},
    }
    whole = client.responses.create(**fields)
    deltas: dict[str, str] = {}
    with client.responses.stream(**fields) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                deltas[event.item_id] = deltas.get(event.item_id, "") + event.delta
        final = stream.get_final_response()
    for response in (whole, final):
        assert response.status == "completed"
        assert response.output_text.strip() == "Let me look."
        calls = [item for item in response.output if item.type == "function_call"]
        assert [c.name for c in calls] == ["get_weather", "get_weather"]
        assert [json.loads(c.arguments) for c in calls] == EXPECTED
        assert all(c.call_id and c.status == "completed" for c in calls)
    streamed_calls = [item for item in final.output if item.type == "function_call"]
    assert [deltas[c.id] for c in streamed_calls] == [c.arguments for c in streamed_calls]


@pytest.mark.parametrize("family", ["glm", "lfm2", "qwen3_coder"])
def test_messages_api_returns_a_familys_calls_as_tool_use_blocks(
    gateways: dict[str, Proc], family: str
) -> None:
    """/v1/messages: a text block, then one tool_use block per call (its input an object),
    stop_reason tool_use, whole and streamed alike."""
    client = anthropic.Anthropic(base_url=gateways[family].url, api_key="u", max_retries=0)
    fields: Any = {
        "model": "tiny-llama",
        "max_tokens": 400,
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"name": "get_weather", "description": "The weather.", "input_schema": WEATHER}],
        "extra_body": {"grammar": forced(family), "temperature": 0},
    }
    whole = client.messages.create(**fields)
    with client.messages.stream(**fields) as stream:
        final = stream.get_final_message()
    for message in (whole, final):
        assert message.stop_reason == "tool_use"
        texts = [block.text for block in message.content if block.type == "text"]
        assert "".join(texts).strip() == "Let me look."
        uses = [block for block in message.content if block.type == "tool_use"]
        assert [u.name for u in uses] == ["get_weather", "get_weather"]
        assert [u.input for u in uses] == EXPECTED
        assert len({u.id for u in uses}) == 2


def test_llama_31s_built_in_tool_call_comes_back_as_a_call(gateways: dict[str, Proc]) -> None:
    """Llama 3.1's template with `builtin_tools`: `<|python_tag|>brave_search.call(...)` is a
    call of brave_search, whole and streamed."""
    text = 'Let me search.<|python_tag|>brave_search.call(query="weather in Paris")'
    fields = {
        "extra_body": {
            "grammar": f"root ::= {json.dumps(text)}",
            "chat_template_kwargs": {"builtin_tools": ["brave_search"]},
        }
    }
    whole = chat(gateways["llama3"], **fields)
    message = whole.choices[0].message
    assert message.content == "Let me search."
    [call] = message.tool_calls
    assert call.function.name == "brave_search"
    assert json.loads(call.function.arguments) == {"query": "weather in Paris"}
    assert whole.choices[0].finish_reason == "tool_calls"
    content, calls, finish = streamed(chat(gateways["llama3"], **fields, stream=True))
    assert content == "Let me search." and finish == "tool_calls"
    assert calls == [{"name": "brave_search", "arguments": call.function.arguments}]
