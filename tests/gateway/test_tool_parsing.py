"""Tool calls without a server: the parser on each format, a call's JSON read as it comes, format
detection, template probes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loomserve.gateway.generate.assembly import TextAssembly
from loomserve.gateway.text.chat_template import CHATML_TEMPLATE, ChatTemplate
from loomserve.gateway.text.grammar import grammar_error
from loomserve.gateway.text.tokenizer import Vocab
from loomserve.gateway.tools.call_object import CallObject, as_call
from loomserve.gateway.tools.checks import MarkerPieces
from loomserve.gateway.tools.format import GENERIC, HERMES, JSON, LLAMA3, MISTRAL, ToolFormat
from loomserve.gateway.tools.grammar import MAX_TOOL_STRING_CHARS, ToolGrammarError, tool_grammar
from loomserve.gateway.tools.parser import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ToolCallParser,
    parse_reply,
)
from loomserve.gateway.tools.template import TemplateTools
from loomserve.protocol.limits import MAX_GUIDANCE_GRAMMAR_BYTES
from tests.grammars import grammar_accepts


def streamed(fmt: ToolFormat, text: str, max_calls: int | None = None, step: int = 1):
    """(content, [(name, arguments)]) from feeding text `step` characters at a time."""
    parser = ToolCallParser(fmt, max_calls)
    events = []
    for i in range(0, len(text), step):
        events += parser.push(text[i : i + step])
    events += parser.finish()
    content, calls = "", []
    for event in events:
        if isinstance(event, ContentDelta):
            content += event.text
        elif isinstance(event, CallStart):
            assert event.index == len(calls)
            calls.append([event.name, ""])
        else:
            assert isinstance(event, ArgumentsDelta)
            calls[event.index][1] += event.text
    return content, [tuple(call) for call in calls]


CASES = [
    (
        HERMES,
        'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1]}}\n'
        '</tool_call>\n<tool_call>{"arguments": {"x": 1}, "name": "g"}</tool_call> Done.',
        "Sure. Done.",
        [("get_weather", '{"city": "Paris", "n": [1]}'), ("g", '{"x": 1}')],
    ),
    (HERMES, "a < b, and <tool_ca", "a < b, and <tool_ca", []),
    (HERMES, "bad <tool_call>hello</tool_call> end", "bad <tool_call>hello</tool_call> end", []),
    (
        MISTRAL,
        '[TOOL_CALLS][{"name": "a", "arguments": {"q": "}\\"{"}}, '
        '{"name": "b", "arguments": "{\\"k\\": 2}"}]',
        "",
        [("a", '{"q": "}\\"{"}'), ("b", '{"k": 2}')],
    ),
    (LLAMA3, '  {"name": "f", "parameters": {"a": 1}}', "", [("f", '{"a": 1}')]),
    (LLAMA3, '<|python_tag|>{"name": "f", "parameters": {}}', "", [("f", "{}")]),
    (LLAMA3, 'hello {"name": "f"}', 'hello {"name": "f"}', []),
    (JSON, '{"not": "a call"} rest', '{"not": "a call"} rest', []),
    (
        JSON,
        '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]',
        "",
        [
            ("f", "{}"),
            ("g", "{}"),
        ],
    ),
    # Cut short by max_tokens: the call keeps what it had.
    (GENERIC, '<tool_call>{"name": "f", "arguments": {"a": "cut', "", [("f", '{"a": "cut')]),
    (GENERIC, '<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_parser_reads_each_format_whole_and_streamed(
    fmt: ToolFormat, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    whole_content, whole_calls = parse_reply(fmt, text, None)
    assert whole_content == content
    assert [(c.name, c.arguments) for c in whole_calls] == calls
    for step in (1, 3, 7):
        assert streamed(fmt, text, step=step) == (content, calls)


def test_a_call_is_announced_before_its_arguments_end() -> None:
    parser = ToolCallParser(HERMES)
    events = parser.push('<tool_call>{"name": "get_weather", "arguments": {"city": "Par')
    assert isinstance(events[0], CallStart) and events[0].name == "get_weather"
    assert events[0].id.startswith("call_")
    assert events[1:] == [ArgumentsDelta(0, '{"city": "Par')]
    assert parser.push('is"}}\n</tool_call>') == [ArgumentsDelta(0, 'is"}')]
    assert parser.finish() == []


def read_object(text: str) -> tuple[CallObject, list[int]]:
    """A CallObject fed text a character at a time, and where it found the arguments begin."""
    obj, found = CallObject(), list[int]()
    for ch in text:
        position = len(obj.text)
        if obj.read(ch) and obj.args_start is None and obj.find_arguments(position):
            found.append(position)
    return obj, found


def test_a_call_object_finds_its_name_and_arguments_as_it_reads() -> None:
    text = '{"name": "get_\\"w\\"", "arguments": {"q": "a,}\\"b", "n": [1, {"x": 2}]}, "k": 1}'
    obj, found = read_object(text)
    start = text.index('{"q"')
    assert found == [start] and obj.name == 'get_"w"' and not obj.args_quoted
    # The arguments end at the top-level comma, not at those inside strings or nested values.
    assert obj.text[obj.args_start : obj.args_end] == '{"q": "a,}\\"b", "n": [1, {"x": 2}]}'
    assert obj.depth == 0 and not obj.in_string
    # Keys in another order, or a name cut short: no arguments found as it reads.
    assert read_object('{"arguments": {}, "name": "f"}')[1] == []
    assert as_call('{"arguments": {"a": 1}, "name": "f"}') == ("f", '{"a": 1}')
    cut, found = read_object('{"name": "f", "argu')
    assert found == [] and cut.cut_name() == "f"
    assert read_object('{"na')[0].cut_name() is None
    quoted, _ = read_object('{"name": "f", "parameters": "{}"}')
    assert quoted.args_quoted and quoted.name == "f"


def test_max_calls_drops_later_calls() -> None:
    text = HERMES.write_calls([("f", {"a": 1}), ("g", {})])
    assert HERMES.parallel and text.count("<tool_call>") == 2
    content, calls = parse_reply(HERMES, text, 1)
    assert content == "" and [c.name for c in calls] == ["f"]


def test_mistral_call_ids_have_nine_characters() -> None:
    _, calls = parse_reply(MISTRAL, MISTRAL.write_calls([("f", {})]), None)
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()


QWEN_LIKE = (
    "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "<tool_call>{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}{{ c.function.name }}{% endfor %}\n{% endfor %}"
)
MISTRAL_LIKE = "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}[TOOL_CALLS]"
LLAMA_LIKE = "{% for m in messages %}<|start_header_id|>{{ m.role }}{% endfor %}ipython"
TOOLS_UNKNOWN = "{% for t in tools or [] %}{{ t | tojson }}{% endfor %}{{ messages[0].content }}"
# Gemma's rule: roles alternate user/assistant, and a system message joins the first user turn.
GEMMA_LIKE = (
    "{% set ns = namespace(first='') %}"
    "{% if messages[0].role == 'system' %}{% set ns.first = messages[0].content + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}{% endif %}"
    "{% for m in loop_messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
    "<turn>{{ m.role }}\n{{ ns.first if loop.first else '' }}{{ m.content }}</turn>\n"
    "{% endfor %}"
)


@pytest.mark.parametrize(
    ("source", "fmt", "renders_tools"),
    [
        (QWEN_LIKE, HERMES, True),
        (MISTRAL_LIKE, MISTRAL, False),
        (LLAMA_LIKE, LLAMA3, False),
        (TOOLS_UNKNOWN, JSON, True),
        (CHATML_TEMPLATE, GENERIC, False),
    ],
)
def test_the_format_comes_from_the_template(
    source: str, fmt: ToolFormat, renders_tools: bool
) -> None:
    tools = TemplateTools.probe(ChatTemplate(source, "<s>", "</s>"))
    assert tools.format is fmt
    assert tools.renders_tools is renders_tools


TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}
HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {}}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {}}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "warm"},
    {"role": "user", "content": "Thanks. And tomorrow?"},
]


def test_a_template_without_tools_gets_them_as_text() -> None:
    """Gemma-like: tools in the system prompt, calls as text, results as one user turn."""
    template = ChatTemplate(GEMMA_LIKE, "<s>", "</s>")
    support = TemplateTools.probe(template)
    assert support.format is GENERIC
    assert not (support.renders_tools or support.renders_calls or support.renders_results)
    assert support.renders_system
    messages, tools = support.prepare(HISTORY, [TOOL])
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    prompt = template.render(messages, tools=tools)
    assert prompt.count('"name": "get_weather"') == 3  # the tool's definition and two calls
    assert "<tools>" in prompt and "Be brief." in prompt
    assert "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm" in prompt
    assert "Thanks. And tomorrow?" in prompt


def test_a_template_with_tools_renders_them_itself() -> None:
    template = ChatTemplate(QWEN_LIKE, "<s>", "</s>")
    support = TemplateTools.probe(template)
    assert support.renders_calls
    messages, tools = support.prepare(HISTORY, [TOOL])
    assert tools == [TOOL]
    tool_messages = [m for m in messages if m["role"] == "tool"]
    assert [m["name"] for m in tool_messages] == ["get_weather", "get_weather"]
    assert "get_weather" in template.render(messages, tools=tools)


def test_grammar_from_schemas_compiles_for_every_format(tiny_model_path: Path) -> None:
    vocab = Vocab(tiny_model_path)
    schema = {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}},
        "$defs": {"Item": {"type": "object", "properties": {"k": {"type": "boolean"}}}},
    }
    calls = [("f", {"items": [{"k": True}, {}]}), ("g", {})]
    for fmt in (HERMES, GENERIC, MISTRAL, LLAMA3, JSON):
        grammar = tool_grammar(fmt, [("f", schema), ("g", None)], parallel=True)
        assert grammar.count("start:") == 1
        assert grammar_error(grammar) is None
        written = fmt.write_calls(calls)
        assert grammar_accepts(vocab, grammar, written), fmt.name
        # The $ref is followed: an item that is not an object is refused.
        wrong = written.replace('{"k": true}', "7")
        assert wrong != written and not grammar_accepts(vocab, grammar, wrong), fmt.name
    with pytest.raises(ToolGrammarError):
        tool_grammar(HERMES, [("f", {"type": "string", "maxLength": 10**7})], parallel=False)


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL])
def test_a_tool_grammar_over_the_size_limit_stops_growing_at_the_limit(fmt: ToolFormat):
    """128 functions of 800 properties each: refused once the rules written so far pass the
    limit (about a fifth of the way), not after writing 4.8 MB."""
    properties = {f"p{j}": {"type": "string"} for j in range(800)}
    schema = {"type": "object", "properties": properties}
    functions: list[tuple[str, dict[str, Any] | None]] = [(f"t{i}", schema) for i in range(128)]
    with pytest.raises(ToolGrammarError, match=str(MAX_GUIDANCE_GRAMMAR_BYTES)) as refused:
        tool_grammar(fmt, functions, parallel=True)
    written = int(str(refused.value).split("with the first ")[1].split(" ")[0])
    assert 0 < written < 64
    # Just under the limit it is written whole.
    grammar = tool_grammar(fmt, functions[: written - 1], parallel=True)
    assert len(grammar.encode()) <= MAX_GUIDANCE_GRAMMAR_BYTES


def test_a_forced_calls_strings_are_bounded(tiny_model_path: Path) -> None:
    """A string without maxLength holds at most MAX_TOOL_STRING_CHARS characters (beyond its
    minLength); a schema's own maxLength and an enum stay as they are."""
    vocab = Vocab(tiny_model_path)
    schema = {
        "type": "object",
        "properties": {
            "free": {"type": "string"},
            "long": {"type": "string", "minLength": 2},
            "short": {"type": "string", "maxLength": 3},
            "kind": {"enum": ["a char* b"]},
        },
        "required": ["free", "long", "short", "kind"],
    }
    grammar = tool_grammar(HERMES, [("f", schema)], parallel=False)

    def call(free: str, long: str, short: str) -> str:
        arguments = {"free": free, "long": long, "short": short, "kind": "a char* b"}
        return HERMES.write_calls([("f", arguments)])

    most = MAX_TOOL_STRING_CHARS
    assert grammar_accepts(vocab, grammar, call("a" * most, "b" * (most + 2), "ccc"))
    assert not grammar_accepts(vocab, grammar, call("a" * (most + 1), "bb", "c"))
    assert not grammar_accepts(vocab, grammar, call("a", "b" * (most + 3), "c"))
    assert not grammar_accepts(vocab, grammar, call("a", "bb", "cccc"))
    assert schema["properties"]["free"] == {"type": "string"}  # the request's own is untouched


CONTROL_MARKER_PIECES = {0: b"", 1: b"Hello", 2: b"[", 3: b"", 4: b"{}"}


class ControlMarkerVocab:
    """A vocabulary in which Mistral's [TOOL_CALLS] is one control token (id 3), as in
    Mistral's own: its piece is empty, as llama.cpp renders control tokens."""

    n_tokens = len(CONTROL_MARKER_PIECES)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return [3] if text == "[TOOL_CALLS]" else [2, 4]

    def piece(self, token_id: int) -> bytes:
        return CONTROL_MARKER_PIECES[token_id]


def test_marker_pieces_serve_text_assembly_like_the_vocabulary() -> None:
    """A request with tools on such a model assembles its text from MarkerPieces, which
    must answer everything TextAssembly asks of a vocabulary (n_tokens too)."""
    pieces = MarkerPieces(ControlMarkerVocab(), MISTRAL).pieces()
    assert isinstance(pieces, MarkerPieces)  # the marker is a control token
    assert pieces.n_tokens == ControlMarkerVocab.n_tokens
    text = TextAssembly(pieces, (), prompt_len=1)
    assert text.push([1, 3, 4]) == "Hello[TOOL_CALLS]{}"
