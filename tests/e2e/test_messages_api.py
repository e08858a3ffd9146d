"""POST /v1/messages and /v1/messages/count_tokens end to end: a real worker on the tiny model,
driven by the `anthropic` SDK (`messages.create`, `messages.stream`, tool use, count_tokens).

The endpoint is a translation into the chat path: with greedy sampling its text, calls and
token counts must be the chat endpoint's for the same conversation. Errors come in
Anthropic's shape, and the API key is taken from `x-api-key` (as Anthropic's clients send it)
as well as from a bearer token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from jiter import from_json

from loomserve.gateway.translate.messages import tool_input
from tests.procs import Proc, start_gateway, start_worker

MODEL = "tiny-llama"
KEY = "sk-messages-test"
GREEDY: Any = {"temperature": 0}  # this anthropic SDK takes sampling fields as extra_body
LOOKUP_SCHEMA = {
    "type": "object",
    "properties": {"word": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["word"],
    "additionalProperties": False,
}
TOOL: Any = {"name": "lookup", "description": "Look a word up.", "input_schema": LOOKUP_SCHEMA}
CHAT_TOOL: Any = {
    "type": "function",
    "function": {"name": "lookup", "description": "Look a word up.", "parameters": LOOKUP_SCHEMA},
}
QUESTION = "is the sky blue"


@pytest.fixture(scope="module")
def gateway(tiny_model_path: Path) -> Iterator[Proc]:
    with (
        start_worker(tiny_model_path, slots=2, ctx_size=1024) as worker,
        start_gateway(tiny_model_path, worker.endpoint, api_key=[KEY]) as gateway,
    ):
        yield gateway


def client(gateway: Proc, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key=key, max_retries=0)


def prompt_of(usage: Any) -> int:
    """The whole prompt's tokens of an Anthropic usage: those read from the cache included."""
    cached = (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    return int(usage.input_tokens) + cached


def chat(gateway: Proc, **fields: Any) -> Any:
    api = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0)
    return api.chat.completions.create(model=MODEL, temperature=0, **fields)


def test_create_is_the_chat_answer(gateway: Proc) -> None:
    message = client(gateway).messages.create(
        model=MODEL,
        max_tokens=12,
        system="be brief",
        messages=[{"role": "user", "content": QUESTION}],
        extra_body=GREEDY,
    )
    expected = chat(
        gateway,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": QUESTION}],
        max_tokens=12,
    )
    choice = expected.choices[0]
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == MODEL
    text = "".join(block.text for block in message.content if block.type == "text")
    assert text == (choice.message.content or "")
    stop = {"length": "max_tokens", "stop": "end_turn"}[choice.finish_reason]
    assert message.stop_reason == stop
    assert prompt_of(message.usage) == expected.usage.prompt_tokens
    assert message.usage.output_tokens == expected.usage.completion_tokens


def test_stream_gives_the_same_message_as_create(gateway: Proc) -> None:
    fields: Any = {
        "model": MODEL,
        "max_tokens": 10,
        "messages": [{"role": "user", "content": QUESTION}],
        "extra_body": GREEDY,
    }
    whole = client(gateway).messages.create(**fields)
    with client(gateway).messages.stream(**fields) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    whole_text = "".join(block.text for block in whole.content if block.type == "text")
    assert streamed_text == whole_text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert prompt_of(final.usage) == prompt_of(whole.usage)


def test_stream_events_are_anthropics(gateway: Proc) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 6,
        "stream": True,
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
    }
    answer = httpx.post(
        gateway.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30
    )
    assert answer.status_code == 200, answer.text
    names = [
        line[len("event: ") :] for line in answer.text.splitlines() if line.startswith("event:")
    ]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in names and "content_block_delta" in names
    assert names.index("content_block_stop") < names.index("message_delta")


def test_tool_use_and_tool_result_round_trip(gateway: Proc) -> None:
    api = client(gateway)
    first = api.messages.create(
        model=MODEL,
        max_tokens=200,
        messages=[{"role": "user", "content": QUESTION}],
        tools=[TOOL],
        tool_choice={"type": "tool", "name": "lookup", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    assert first.stop_reason == "tool_use", first
    [use] = [block for block in first.content if block.type == "tool_use"]
    assert use.name == "lookup" and use.input["word"] in ("yes", "no")

    with api.messages.stream(
        model=MODEL,
        max_tokens=200,
        messages=[{"role": "user", "content": QUESTION}],
        tools=[TOOL],
        tool_choice={"type": "tool", "name": "lookup", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    ) as stream:
        streamed = stream.get_final_message()
    [streamed_use] = [block for block in streamed.content if block.type == "tool_use"]
    assert streamed_use.input == use.input and streamed.stop_reason == "tool_use"

    history: Any = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "it is"}],
        },
    ]
    second = api.messages.create(
        model=MODEL, max_tokens=8, messages=history, tools=[TOOL], extra_body=GREEDY
    )
    expected = chat(
        gateway,
        messages=[
            {"role": "user", "content": QUESTION},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": use.id,
                        "type": "function",
                        "function": {"name": use.name, "arguments": json.dumps(use.input)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": use.id, "content": "it is"},
        ],
        tools=[CHAT_TOOL],
        max_tokens=8,
    )
    assert prompt_of(second.usage) == expected.usage.prompt_tokens  # the same prompt
    text = "".join(block.text for block in second.content if block.type == "text")
    assert text == (expected.choices[0].message.content or "")
    counted = api.messages.count_tokens(model=MODEL, messages=history, tools=[TOOL])
    assert counted.input_tokens == expected.usage.prompt_tokens


def test_count_tokens_is_the_prompt_of_create(gateway: Proc) -> None:
    messages: Any = [{"role": "user", "content": QUESTION}]
    counted = client(gateway).messages.count_tokens(
        model=MODEL, system="be brief", messages=messages
    )
    message = client(gateway).messages.create(
        model=MODEL, max_tokens=1, system="be brief", messages=messages, extra_body=GREEDY
    )
    assert counted.input_tokens == prompt_of(message.usage) > 0


def test_message_start_carries_the_prompts_tokens(gateway: Proc) -> None:
    """As Anthropic's: clients show the context used from message_start, before any text."""
    messages: Any = [{"role": "user", "content": "what does the start say"}]
    counted = client(gateway).messages.count_tokens(model=MODEL, messages=messages)
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "messages": messages}
    answer = httpx.post(
        gateway.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30
    )
    events = [json.loads(line[6:]) for line in answer.text.splitlines() if line[:6] == "data: "]
    start, delta = events[0], events[-2]
    assert start["type"] == "message_start" and delta["type"] == "message_delta"
    assert start["message"]["usage"]["input_tokens"] == counted.input_tokens > 0
    assert start["message"]["usage"]["output_tokens"] == 0
    assert prompt_of(anthropic.types.Usage(**delta["usage"])) == counted.input_tokens


def test_input_tokens_leave_out_the_cache_reads(gateway: Proc) -> None:
    """Anthropic's usage: input_tokens + cache_read_input_tokens + cache_creation_input_tokens
    is the prompt; a prompt read again from the prefix cache counts its tokens once."""
    messages: Any = [{"role": "user", "content": " ".join(["a long prompt kept in cache"] * 20)}]
    counted = client(gateway).messages.count_tokens(model=MODEL, messages=messages)
    fields: Any = {"model": MODEL, "max_tokens": 2, "messages": messages, "extra_body": GREEDY}
    first = client(gateway).messages.create(**fields)
    again = client(gateway).messages.create(**fields)
    with client(gateway).messages.stream(**fields) as stream:
        streamed = stream.get_final_message()
    for usage in (first.usage, again.usage, streamed.usage):
        assert prompt_of(usage) == counted.input_tokens
    assert again.usage.cache_read_input_tokens
    assert again.usage.input_tokens == counted.input_tokens - again.usage.cache_read_input_tokens
    assert streamed.usage.cache_read_input_tokens


def test_errors_are_anthropics(gateway: Proc) -> None:
    with pytest.raises(anthropic.AuthenticationError) as denied:
        client(gateway, key="wrong").messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert denied.value.status_code == 401
    assert denied.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": denied.value.body["error"]["message"]},
    }
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client(gateway).messages.create(
            model="claude-x", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert unknown.value.body["error"]["type"] == "not_found_error"
    bad = [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),  # it is required
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, ""),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "thinking": {}}, ""),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {}}, ""),
    ]
    for body, needle in bad:
        answer = httpx.post(
            gateway.url + "/v1/messages",
            json={"model": MODEL, **body},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=30,
        )
        assert answer.status_code == 400, answer.text
        error = answer.json()
        assert error["type"] == "error", error
        assert error["error"]["type"] == "invalid_request_error"
        assert needle in error["error"]["message"]


@pytest.mark.parametrize(
    "arguments",
    [
        '{"city": "Paris", "days": [1, 2, {"x": true}], "note": "a \\"quoted\\" word"}',
        '{"a": {"b": {"c": null}}, "d": -12.5e3, "e": ""}',
    ],
)
def test_a_cut_tool_input_reads_as_the_sdk_reads_a_streamed_one(arguments: str) -> None:
    for end in range(len(arguments) + 1):
        cut = arguments[:end]
        try:
            expected = from_json(cut.encode(), partial_mode=True) if cut else {}
        except ValueError:
            expected = {}
        assert tool_input(cut) == (expected if isinstance(expected, dict) else {}), cut
