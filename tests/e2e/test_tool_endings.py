"""Tool calls that end: a repeated call ends the reply, a forced single call ends it when
whole, a call cut by max_tokens is a call (never content), and streamed and non-streamed
answers carry the same calls and finish reason.

The parser and the stop rules are pure and tested on text; the endings end to end on the
tiny model, through the chat endpoint, over a sweep of max_tokens that cuts calls
everywhere.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from loomserve.gateway.text.stop import StopMatcher
from loomserve.gateway.tools.end import ECHO_CHARS, PromptEcho, ToolCallEnd
from loomserve.gateway.tools.format import HERMES, MISTRAL
from loomserve.gateway.tools.parser import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ToolCallParser,
    parse_reply,
)
from tests.e2e.test_tools import ASCII_ONLY
from tests.procs import Proc, start_gateway, start_worker

CALL = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>'
OTHER = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>'


def streamed(text: str, cut: bool, max_calls: int | None = None) -> tuple[str, list[Any]]:
    """parse_reply's answer, from the text fed one character at a time."""
    parser = ToolCallParser(HERMES, max_calls)
    events = []
    for ch in text:
        events += parser.push(ch)
    events += parser.finish(cut)
    content, calls = "", []
    for event in events:
        if isinstance(event, ContentDelta):
            content += event.text
        elif isinstance(event, CallStart):
            calls.append([event.name, ""])
        elif isinstance(event, ArgumentsDelta):
            calls[event.index][1] += event.text
    return content, calls


def whole(text: str, cut: bool, max_calls: int | None = None) -> tuple[str, list[Any]]:
    content, calls = parse_reply(HERMES, text, max_calls, cut)
    return content, [[c.name, c.arguments] for c in calls]


def test_a_repeated_call_is_dropped() -> None:
    text = f"{CALL}\n{CALL}\n{OTHER}"
    for parse in (whole, streamed):
        content, calls = parse(text, cut=False)
        assert content == ""
        assert calls == [
            ["get_time", '{"city": "Paris"}'],
            ["get_time", '{"city": "Rome"}'],
        ]


@pytest.mark.parametrize("cut_at", range(1, len(CALL) * 2 + 2, 3))
def test_a_cut_reply_gives_the_same_calls_streamed_or_whole_and_no_call_text(cut_at: int) -> None:
    text = ("so " + CALL + "\n" + OTHER)[:cut_at]
    content, calls = whole(text, cut=True)
    assert (content, calls) == streamed(text, cut=True)
    assert "<tool" not in content and "{" not in content
    assert content == "so "[:cut_at]
    for name, arguments in calls:
        assert name == "get_time"
        assert '{"city": "Paris"}'.startswith(arguments) or '{"city": "Rome"}'.startswith(arguments)


def test_a_cut_call_is_a_call_once_its_name_is_whole() -> None:
    assert whole('<tool_call>\n{"name": "get_ti', cut=True) == ("", [])
    assert whole('<tool_call>\n{"name": "get_time", "argu', cut=True) == ("", [["get_time", ""]])
    assert whole('<tool_call>\n{"name": "get_time", "arguments": {"ci', cut=True) == (
        "",
        [["get_time", '{"ci']],
    )
    # Not cut (the model ended there itself): what was no call is content, as before.
    assert whole('<tool_call>\n{"name": "get_ti', cut=False)[0].startswith("<tool_call>")


def test_a_cut_marker_is_not_content() -> None:
    assert whole("hello\n<tool_ca", cut=True) == ("hello\n", [])
    assert whole("hello\n<tool_ca", cut=False) == ("hello\n<tool_ca", [])
    content, calls = parse_reply(MISTRAL, 'ok [TOOL_CALLS][{"name": "f", "argu', None, True)
    assert (content, [c.name for c in calls]) == ("ok ", ["f"])


def ending(max_calls: int | None) -> ToolCallEnd:
    return ToolCallEnd(StopMatcher(()), ToolCallParser(HERMES, max_calls))


def push_all(matcher: Any, text: str) -> tuple[str, bool]:
    sent = ""
    for ch in text:
        match = matcher.push(ch)
        sent += match.text
        if match.matched:
            return sent, True
    return sent + matcher.flush(), False


def test_a_repeated_call_ends_the_reply() -> None:
    sent, matched = push_all(ending(None), f"{CALL}\n{OTHER}\n{CALL}\n{OTHER}")
    assert matched
    assert sent.endswith('"Paris"}}') and sent.count("<tool_call>") == 3
    assert whole(sent, cut=False)[1] == [
        ["get_time", '{"city": "Paris"}'],
        ["get_time", '{"city": "Rome"}'],
    ]


def test_one_allowed_call_ends_the_reply_when_whole() -> None:
    sent, matched = push_all(ending(1), f"{CALL}\n{OTHER}")
    assert matched and sent.endswith('"Paris"}}') and "Rome" not in sent
    sent, matched = push_all(ending(None), f"{CALL}\n{OTHER}")
    assert not matched and sent == f"{CALL}\n{OTHER}"


def test_stop_strings_still_stop_a_reply_with_tools() -> None:
    matcher = ToolCallEnd(StopMatcher(("END",)), ToolCallParser(HERMES, None))
    assert push_all(matcher, "a reply END and more") == ("a reply ", True)


def test_an_echo_of_the_injected_tool_prompt_is_dropped() -> None:
    prompt = "# Tools\n\nYou may call one or more functions to help with the user's request."
    echo = PromptEcho(ending(None), prompt)
    assert push_all(echo, prompt) == ("", True)
    assert push_all(PromptEcho(ending(None), prompt), "# Tools are useful") == (
        "# Tools are useful",
        False,
    )
    short = prompt[: ECHO_CHARS - 1]
    assert push_all(PromptEcho(ending(None), prompt), short) == (short, False)
    # A call straight away is no echo.
    assert push_all(PromptEcho(ending(1), prompt), CALL)[1] is True


# --- end to end on the tiny model ----------------------------------------------------

LOOKUP: Any = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"word": {"type": "string", "enum": ["yes", "no", "maybe so"]}},
            "required": ["word"],
        },
    },
}
MESSAGES: Any = [{"role": "user", "content": "is the sky blue"}]


@pytest.fixture(scope="module")
def gateway(tiny_model_path: Path) -> Iterator[Proc]:
    with (
        start_worker(tiny_model_path, slots=2, ctx_size=1024) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        yield gateway


def ask(gateway: Proc, stream: bool, **fields: Any) -> tuple[str | None, list[Any], str, int]:
    """(content, [[name, arguments]], finish_reason, completion tokens) of one chat answer."""
    api = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    body: Any = {
        "model": "tiny-llama",
        "messages": MESSAGES,
        "tools": [LOOKUP],
        "temperature": 0,
        "logit_bias": ASCII_ONLY,
        **fields,
    }
    if not stream:
        answer = api.chat.completions.create(**body)
        choice = answer.choices[0]
        calls = [[c.function.name, c.function.arguments] for c in choice.message.tool_calls or []]
        # "" and None read the same in a stream (no content delta): compare them as None.
        content = choice.message.content or None
        return content, calls, choice.finish_reason, answer.usage.completion_tokens
    content: str | None = None
    calls = []
    reason, tokens = "", 0
    for chunk in api.chat.completions.create(
        **body, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                content = (content or "") + choice.delta.content
            for call in choice.delta.tool_calls or []:
                if call.index == len(calls):
                    calls.append([call.function.name, ""])
                calls[call.index][1] += call.function.arguments or ""
            if choice.finish_reason:
                reason = choice.finish_reason
    return content, calls, reason, tokens


@pytest.mark.parametrize("parallel", [False, True])
def test_a_forced_call_ends_with_tool_calls(gateway: Proc, parallel: bool) -> None:
    content, calls, reason, tokens = ask(
        gateway, False, tool_choice="required", parallel_tool_calls=parallel
    )
    assert reason == "tool_calls", (content, calls)
    assert content is None
    assert calls and all(name == "lookup" for name, _ in calls)
    for _, arguments in calls:
        assert json.loads(arguments)["word"] in ("yes", "no", "maybe so")
    assert len({arguments for _, arguments in calls}) == len(calls)  # no call twice
    if not parallel:
        assert len(calls) == 1
    assert tokens < 300  # it ended at its calls, far from the context's end


@pytest.mark.parametrize("max_tokens", [3, 6, 9, 12, 15, 18, 24, 32, None])
@pytest.mark.parametrize("parallel", [False, True])
def test_streamed_and_whole_answers_agree_wherever_the_cut(
    gateway: Proc, max_tokens: int | None, parallel: bool
) -> None:
    fields: Any = {
        "tool_choice": "required",
        "parallel_tool_calls": parallel,
        "max_tokens": max_tokens,
    }
    whole_answer = ask(gateway, False, **fields)
    streamed_answer = ask(gateway, True, **fields)
    assert streamed_answer == whole_answer
    content, calls, reason, _ = whole_answer
    assert "<tool" not in (content or "") and '{"name"' not in (content or "")
    if reason == "length":
        assert max_tokens is not None
    else:
        assert reason == "tool_calls" and calls
        for _, arguments in calls:
            json.loads(arguments)
