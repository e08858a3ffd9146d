"""DeepSeek V3.2's and V4's tool calls (DSML, gateway/tools/format.py's deepseek_v3_2 and
deepseek_v4): replies as the models write them (each parameter with its `string` attribute)
read whole and a character at a time alike, cut inside a call, and the calls in a
conversation's history as their own templates render them read back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loomserve.gateway.text.chat_template import ChatTemplate
from loomserve.gateway.tools.format import FAMILIES, detect
from loomserve.gateway.tools.template import TemplateTools
from tests.gateway.test_tool_families import NESTED_ARGS, read

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "templates"

CALL = (
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
)
NESTED = (
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Zürich 東京</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="where" string="false">{"near": ["lake", {"depth": 2.5}], '
    '"ok": true}</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
)
TIME = '<｜DSML｜invoke name="get_time">\n</｜DSML｜invoke>\n'

# (family, reply, content, calls)
CASES: list[tuple[str, str, str, list[tuple[str, Any]]]] = [
    (
        "deepseek_v3_2",
        f"Let me look.\n\n<｜DSML｜function_calls>\n{CALL}</｜DSML｜function_calls>",
        "Let me look.\n\n",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    (
        "deepseek_v3_2",
        f"<｜DSML｜function_calls>\n{NESTED}{TIME}</｜DSML｜function_calls>",
        "",
        [("get_weather", NESTED_ARGS), ("get_time", {})],
    ),
    (
        "deepseek_v4",
        f"\n\n<｜DSML｜tool_calls>\n{CALL}{TIME}</｜DSML｜tool_calls>",
        "\n\n",
        [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})],
    ),
    ("deepseek_v4", "No call: <｜DSML｜ is only text.", "No call: <｜DSML｜ is only text.", []),
]


@pytest.mark.parametrize(("family", "reply", "content", "calls"), CASES)
def test_dsml_replies_read_the_same_whole_and_a_character_at_a_time(
    family: str, reply: str, content: str, calls: list[tuple[str, Any]]
) -> None:
    fmt = FAMILIES[family]
    whole = read(fmt, reply)
    assert read(fmt, reply, step=1) == whole
    got_content, got_calls = whole
    assert got_content == content
    assert [(name, json.loads(arguments)) for name, arguments in got_calls] == calls


def test_a_dsml_reply_cut_inside_a_call_keeps_what_was_whole() -> None:
    fmt = FAMILIES["deepseek_v3_2"]
    reply = "Sure. <｜DSML｜function_calls>\n" + CALL[: CALL.index("3</")]
    whole = read(fmt, reply, cut=True)
    assert (
        read(fmt, reply, cut=True, step=1)
        == whole
        == ("Sure. ", [("get_weather", '{"city": "Paris"')])
    )
    # Cut inside the name: no call, and the markers are not content either.
    cut = 'Sure. <｜DSML｜function_calls>\n<｜DSML｜invoke name="get_wea'
    assert read(fmt, cut, cut=True) == ("Sure. ", []) == read(fmt, cut, cut=True, step=1)


@pytest.mark.parametrize(
    ("template", "family"),
    [
        ("deepseek-ai-DeepSeek-V3.2", "deepseek_v3_2"),
        ("deepseek-ai-DeepSeek-V4", "deepseek_v4"),
        ("deepseek-ai-DeepSeek-V4-Flash-0731", "deepseek_v4"),
    ],
)
def test_the_templates_own_history_reads_back(template: str, family: str) -> None:
    """Detected from the template, and a call rendered by the template itself (with its
    `string` attributes) is read back with its values typed."""
    renderer = ChatTemplate((TEMPLATES / f"{template}.jinja").read_text(), "<s>", "</s>")
    probe = TemplateTools.probe(renderer)
    assert probe.format is FAMILIES[family] is detect(renderer.source, True)
    arguments = {"city": "Paris", "days": 3, "where": {"near": ["lake"]}}
    # As the gateway hands a call to a template: the arguments as a mapping (prompts.py).
    call = {"name": "get_weather", "arguments": arguments}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": call}],
        },
    ]
    prompt = renderer.render(messages, add_generation_prompt=False)
    assert 'string="false">3<' in prompt
    _, calls = read(probe.format, prompt[prompt.index("Weather in Paris?") :])
    assert [(name, json.loads(args)) for name, args in calls] == [("get_weather", arguments)]
