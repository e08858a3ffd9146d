"""Command R+'s Action calls (gateway/tools/format.py's command_r_plus): replies as the
model writes them (the list indented, as its template writes it) read whole and a character
at a time alike, cut inside a call, and a call its own template renders reads back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loomserve.gateway.text.chat_template import ChatTemplate
from loomserve.gateway.tools.format import FAMILIES, detect
from tests.gateway.test_tool_families import NESTED_ARGS, read

TEMPLATE = (
    Path(__file__).resolve().parents[1]
    / "data"
    / "templates"
    / "CohereForAI-c4ai-command-r-plus-tool_use.jinja"
)
FMT = FAMILIES["command_r_plus"]

TWO = (
    'I will look.\nAction:\n```json\n[\n    {\n        "tool_name": "get_weather",\n'
    '        "parameters": {\n            "city": "Paris",\n            "days": 3\n        }\n'
    '    },\n    {\n        "tool_name": "get_time",\n        "parameters": {}\n    }\n]```'
)
NESTED = (
    "Action: ```json\n"
    + json.dumps([{"tool_name": "get_weather", "parameters": NESTED_ARGS}], ensure_ascii=False)
    + "```"
)

CASES: list[tuple[str, str, list[tuple[str, Any]]]] = [
    (TWO, "I will look.\n", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    (NESTED, "", [("get_weather", NESTED_ARGS)]),
    ("Just an answer, no Action.", "Just an answer, no Action.", []),
]


@pytest.mark.parametrize(("reply", "content", "calls"), CASES)
def test_action_replies_read_the_same_whole_and_a_character_at_a_time(
    reply: str, content: str, calls: list[tuple[str, Any]]
) -> None:
    whole = read(FMT, reply)
    assert read(FMT, reply, step=1) == whole
    assert whole[0] == content
    assert [(name, json.loads(arguments)) for name, arguments in whole[1]] == calls


def test_a_reply_cut_inside_an_action_keeps_the_call_with_what_it_wrote() -> None:
    cut = TWO[: TWO.index('"city"') + 3]
    partial = '{\n            "ci'  # the arguments' text as it came, as streamed
    assert read(FMT, cut, cut=True) == ("I will look.\n", [("get_weather", partial)])
    assert read(FMT, cut, cut=True, step=1) == read(FMT, cut, cut=True)


def test_the_templates_own_action_reads_back() -> None:
    """Detected from the template; a call it renders in the history (given tools whose
    parameters have the descriptions it requires) is read back."""
    source = TEMPLATE.read_text()
    assert detect(source, renders_tools=False) is FMT
    renderer = ChatTemplate(source, "<s>", "</s>")
    city = {"type": "string", "description": "The city."}
    parameters = {"type": "object", "properties": {"city": city}, "required": ["city"]}
    tool = {"name": "get_weather", "description": "The weather.", "parameters": parameters}
    call = {"name": "get_weather", "arguments": {"city": "Zürich"}}
    messages = [
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": call}],
        },
    ]
    prompt = renderer.render(messages, tools=[{"type": "function", "function": tool}])
    turn = prompt[prompt.index("<|CHATBOT_TOKEN|>") :]
    _, calls = read(FMT, turn)
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [
        ("get_weather", {"city": "Zürich"})
    ]
