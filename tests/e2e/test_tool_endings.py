"""Tool calls that end: a repeated call ends the reply, a forced single call (or a named one)
ends it when whole, a call cut by max_tokens is a call (never content) unless it was a cut
duplicate (then it is dropped and the reply ends `tool_calls`), a forced call's strings are
bounded, an echo of the system message holding the tools is no answer, and streamed and
non-streamed answers carry the same calls and finish reason.

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
from loomserve.gateway.tools.grammar import MAX_TOOL_STRING_CHARS
from loomserve.gateway.tools.parser import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ToolCallParser,
    parse_reply,
)
from loomserve.gateway.tools.template import system_with_tools
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


def cut_ending(text: str, streamed: bool) -> tuple[str, list[Any], str]:
    """(content, [[name, arguments]], finish_reason) of a reply cut by max_tokens after text."""
    parser = ToolCallParser(HERMES, None)
    events = []
    for piece in text if streamed else [text]:
        events += parser.push(piece)
    events += parser.finish(cut=True)
    content, calls = "", []
    for event in events:
        if isinstance(event, ContentDelta):
            content += event.text
        elif isinstance(event, CallStart):
            calls.append([event.name, ""])
        elif isinstance(event, ArgumentsDelta):
            calls[event.index][1] += event.text
    return content, calls, parser.finish_reason("length")


REPEAT = f"{CALL}\n{CALL}"
DIVERGES = len(CALL) + 1 + CALL.index("Paris")  # where OTHER first differs from CALL


@pytest.mark.parametrize("cut_at", range(len(CALL), len(REPEAT) + 1))
@pytest.mark.parametrize("streamed", [False, True])
def test_a_reply_cut_inside_a_repeated_call_ends_at_its_calls(cut_at: int, streamed: bool) -> None:
    """A reply seen in the wild: a whole call, then the same call again until max_tokens. The cut
    duplicate is no call (never one with empty arguments), and nothing new was lost."""
    assert cut_ending(REPEAT[:cut_at], streamed) == (
        "",
        [["get_time", '{"city": "Paris"}']],
        "tool_calls",
    )


@pytest.mark.parametrize("streamed", [False, True])
def test_a_reply_cut_where_it_said_something_new_ends_by_length_else_at_its_calls(
    streamed: bool,
) -> None:
    paris = ["get_time", '{"city": "Paris"}']
    new_call = f"{CALL}\n{OTHER}"[: DIVERGES + 1]
    assert cut_ending(new_call, streamed) == ("", [paris, ["get_time", '{"city": "R']], "length")
    assert cut_ending(f"{CALL}\nand then", streamed) == ("\nand then", [paris], "length")
    assert cut_ending(CALL[:20], streamed) == ("", [], "length")
    # Cut in a closing marker, or in the next call's opening one: the call is whole.
    assert cut_ending(CALL[:-3], streamed) == ("", [paris], "tool_calls")
    assert cut_ending(f"{CALL}\n<tool_", streamed) == ("", [paris], "tool_calls")


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


def test_a_forced_call_cut_anywhere_in_its_repeat_is_the_one_call(gateway: Proc) -> None:
    """That reply reproduced on the tiny model: `required`, parallel calls allowed. The model writes
    its call, then the same call again (which ends the reply when whole). Cut anywhere after
    the first call, the reply is that call alone, finish `tool_calls`: the cut duplicate is
    never a second call with empty arguments, and the reply lost nothing."""
    _, single, reason, first_tokens = ask(
        gateway, False, tool_choice="required", parallel_tool_calls=False
    )
    assert reason == "tool_calls" and len(single) == 1
    _, calls, reason, all_tokens = ask(gateway, False, tool_choice="required")
    # This model repeats its call: everything after the first call is the duplicate.
    assert (calls, reason) == (single, "tool_calls") and all_tokens > first_tokens + 8
    step = max(1, (all_tokens - first_tokens) // 10)
    for max_tokens in range(first_tokens, all_tokens, step):
        for stream in (False, True):
            content, calls, reason, _ = ask(
                gateway, stream, tool_choice="required", max_tokens=max_tokens
            )
            assert (content, calls, reason) == (None, single, "tool_calls"), (max_tokens, stream)


def test_a_named_choice_is_one_call_even_with_parallel_calls_allowed(gateway: Proc) -> None:
    named = {"type": "function", "function": {"name": "lookup"}}
    single = ask(gateway, False, tool_choice="required", parallel_tool_calls=False)
    for stream in (False, True):
        content, calls, reason, tokens = ask(gateway, stream, tool_choice=named)
        assert (content, calls, reason) == (None, single[1], "tool_calls")
        assert tokens == single[3]  # it ended at its call, not at a repeat of it


FREE_TEXT: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.mark.parametrize("stream", [False, True])
def test_a_string_in_a_forced_call_is_bounded_so_the_call_ends(gateway: Proc, stream: bool) -> None:
    """This model writes `city` on and on (until the context ends, without the cap)."""
    content, calls, reason, _ = ask(
        gateway, stream, tools=[FREE_TEXT], tool_choice="required", parallel_tool_calls=False
    )
    assert reason == "tool_calls", (reason, calls)
    assert content is None and len(calls) == 1
    city = json.loads(calls[0][1])["city"]
    assert 0 < len(city) <= MAX_TOOL_STRING_CHARS


@pytest.mark.parametrize("system", [None, "You are a helpful assistant. Answer in one word."])
@pytest.mark.parametrize("stream", [False, True])
def test_an_echo_of_the_system_message_with_the_tools_is_no_answer(
    gateway: Proc, system: str | None, stream: bool
) -> None:
    """A reply (forced here by a grammar) that copies the system message the tools were
    written into: the request's own system text first, when it has one, then the tools."""
    messages = MESSAGES if system is None else [{"role": "system", "content": system}, *MESSAGES]
    echo = system_with_tools(system or "", [LOOKUP])
    grammar = f"root ::= {json.dumps(echo)}"
    content, calls, reason, _ = ask(
        gateway, stream, messages=messages, max_tokens=400, extra_body={"grammar": grammar}
    )
    assert (content, calls, reason) == (None, [], "stop")
