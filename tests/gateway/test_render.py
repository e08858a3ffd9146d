"""generate/render.py in process: OpenAI's bodies and stream chunks for completions and chats,
echo, and a chat reply's tool calls (whole and streamed)."""

from __future__ import annotations

import json

from loomserve.gateway.api.response_bodies import Usage
from loomserve.gateway.api.schemas import ChatCompletionRequest, CompletionRequest
from loomserve.gateway.generate.assembly import Done, TextDelta
from loomserve.gateway.generate.render import DONE_EVENT, StreamChunks, response_body, sse
from loomserve.gateway.tools.checks import ToolRequest
from loomserve.gateway.tools.format import HERMES
from tests.gateway.scripted import request

USAGE = Usage.of(prompt_tokens=3, completion_tokens=2, cached_tokens=0)
CHAT = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}])
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def payload(event: str) -> dict:
    assert event.startswith("data: ") and event.endswith("\n\n")
    return json.loads(event.removeprefix("data: "))


def with_tools() -> ToolRequest:
    """`auto` tools in the Hermes syntax, as tools/checks.py makes them."""
    return ToolRequest(HERMES, [], choice="auto", parallel=True, grammar=None)


def test_a_completion_body_has_each_choice_in_order_with_echo() -> None:
    body = CompletionRequest(prompt="Hi", echo=True, n=2)
    generation = request(body, n=2)
    generation.id = "cmpl-r"
    done = Done("length", USAGE)
    reply = response_body(generation, [" there", " you"], [done, done], [[], []], USAGE)
    assert reply.id == "cmpl-r" and reply.object == "text_completion"
    assert [(c.index, c.text, c.finish_reason) for c in reply.choices] == [
        (0, "Hi there", "length"),
        (1, "Hi you", "length"),
    ]
    assert reply.usage == USAGE


def test_a_chat_reply_with_a_tool_call_becomes_tool_calls() -> None:
    generation = request(CHAT)
    generation.tools = with_tools()
    reply = response_body(generation, [CALL], [Done("stop", USAGE)], [[]], USAGE)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_chat_chunks_open_with_the_role_and_close_with_the_reason() -> None:
    chunks = StreamChunks(request(CHAT))
    opening = payload(chunks.opening(0))
    assert opening["object"] == "chat.completion.chunk"
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = payload(chunks.text(0, TextDelta("Hello")))
    assert text["choices"][0]["delta"] == {"content": "Hello"}
    end = payload(chunks.finish(0, "length"))
    assert end["choices"][0]["finish_reason"] == "length"
    assert payload(chunks.usage(USAGE))["usage"]["total_tokens"] == 5


def test_a_streamed_tool_call_goes_out_as_deltas_of_its_name_then_arguments() -> None:
    generation = request(CHAT)
    generation.tools = with_tools()
    chunks = StreamChunks(generation)
    events = "".join(chunks.text(0, TextDelta(CALL[i : i + 7])) for i in range(0, len(CALL), 7))
    events += chunks.finish(0, "stop")
    parsed = [json.loads(e) for e in events.split("data: ") if e.strip()]
    deltas = [c["choices"][0]["delta"] for c in parsed if c["choices"][0]["delta"]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"]["name"] == "weather" and calls[0]["type"] == "function"
    arguments = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(arguments) == {"city": "Paris"}
    assert parsed[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_completion_chunks_carry_text_and_the_stream_ends_with_done() -> None:
    chunks = StreamChunks(request(CompletionRequest(prompt="Hi")))
    assert chunks.opening(0) is None  # completions open with their first text
    assert payload(chunks.text(0, TextDelta(" there")))["choices"][0]["text"] == " there"
    assert DONE_EVENT == "data: [DONE]\n\n"
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'
