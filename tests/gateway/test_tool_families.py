"""Every tool-call family of format.py: detected from llama.cpp's real chat templates
(tests/data/templates), its replies parsed whole and one character at a time to the same
result, its history text read back as the same calls, and its forcing grammar accepting
exactly that text."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from loomserve.gateway.config import GatewayConfig
from loomserve.gateway.text.chat_template import ChatTemplate
from loomserve.gateway.text.grammar import grammar_error
from loomserve.gateway.text.tokenizer import Vocab
from loomserve.gateway.tools.format import FAMILIES, PARSER_NAMES, ToolFormat, detect
from loomserve.gateway.tools.framed import tool_parser
from loomserve.gateway.tools.grammar import tool_grammar
from loomserve.gateway.tools.parser import ArgumentsDelta, CallStart, ContentDelta
from loomserve.gateway.tools.template import TemplateTools
from loomserve.protocol.settings import setting_info
from tests.grammars import grammar_accepts

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "templates"

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "where": {"type": "object"},
    },
    "required": ["city"],
}
SCHEMAS: dict[str, Any] = {"get_weather": WEATHER, "get_time": {"type": "object"}}

# Nested JSON and text outside ASCII, as a JSON family writes it.
NESTED = '{"city": "Zürich 東京", "where": {"near": ["lake", {"depth": 2.5}], "ok": true}}'
NESTED_ARGS = json.loads(NESTED)


def _events_to_reply(events: list[Any]) -> tuple[str, list[tuple[str, str]]]:
    content, calls = "", []
    for event in events:
        if isinstance(event, ContentDelta):
            content += event.text
        elif isinstance(event, CallStart):
            assert event.index == len(calls) and event.name and event.id
            calls.append([event.name, ""])
        else:
            assert isinstance(event, ArgumentsDelta)
            calls[event.index][1] += event.text
    return content, [(name, arguments) for name, arguments in calls]


def read(fmt: ToolFormat, text: str, cut: bool = False, step: int | None = None):
    """(content, [(name, arguments text)]): whole, or fed `step` characters at a time."""
    parser = tool_parser(fmt, None, SCHEMAS)
    step = step or max(1, len(text))
    events = []
    for i in range(0, len(text), step):
        events += parser.push(text[i : i + step])
    events += parser.finish(cut)
    return _events_to_reply(events)


# (family, reply, content, calls as (name, arguments)); arguments None: compared as text
# with the cut reply's `partial` below.
CASES: list[tuple[str, str, str, list[tuple[str, Any]]]] = [
    # --- Qwen3-Coder / Qwen3.5 / Nemotron 3: XML-ish arguments, typed by the schema
    (
        "qwen3_coder",
        "<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        "</function>\n</tool_call>",
        "<think>\nThe user wants weather.\n</think>\n\n",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich 東京\n</parameter>\n"
        '<parameter=where>\n{"near": ["lake", {"depth": 2.5}], "ok": true}\n</parameter>\n'
        "<parameter=metric>\nfalse\n</parameter>\n<parameter=note>\n42\n</parameter>\n"
        "</function>\n</tool_call>",
        "",
        [("get_weather", {**NESTED_ARGS, "metric": False, "note": "42"})],
    ),
    (  # Seed-OSS writes Qwen3-Coder's calls in tags of its own
        "qwen3_coder",
        "<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</seed:tool_call>",
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    # --- GLM-4.5/4.6/4.7
    (
        "glm",
        "Let me look.</think><tool_call>get_weather<arg_key>city</arg_key>"
        "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>",
        "Let me look.</think>",
        [("get_weather", {"city": "Paris", "days": 2})],
    ),
    (
        "glm",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "</tool_call>\n<tool_call>get_time\n</tool_call>",
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    (
        "glm",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Zürich 東京</arg_value>\n"
        '<arg_key>where</arg_key>\n<arg_value>{"near": ["lake", {"depth": 2.5}], "ok": true}'
        "</arg_value>\n</tool_call>",
        "",
        [("get_weather", NESTED_ARGS)],
    ),
    # --- MiniMax-M2
    (
        "minimax_m2",
        '<think>Weather.</think>\n\n<minimax:tool_call>\n<invoke name="get_weather">\n'
        '<parameter name="city">Paris</parameter>\n<parameter name="metric">true</parameter>\n'
        "</invoke>\n</minimax:tool_call>",
        "<think>Weather.</think>\n\n",
        [("get_weather", {"city": "Paris", "metric": True})],
    ),
    (
        "minimax_m2",
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
        '</parameter>\n</invoke>\n<invoke name="get_time">\n</invoke>\n</minimax:tool_call>',
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    # --- gpt-oss (Harmony)
    (
        "harmony",
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris"}<|call|>',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (  # the analysis channel first: the reasoning parser's to split off
        "harmony",
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
        "<|call|>",
        "<|channel|>analysis<|message|>Need the weather.",  # the markers around calls go
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "harmony",
        ' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": '
        '"Paris"}<|call|><|start|>assistant<|channel|>commentary to=functions.get_time '
        "<|constrain|>json<|message|>{}<|call|>",
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    (
        "harmony",
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        + NESTED
        + "<|call|>",
        "",
        [("get_weather", NESTED_ARGS)],
    ),
    # --- DeepSeek V3.1
    (
        "deepseek_v3_1",
        "REASONING</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Tokyo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "REASONING</think>",
        [("get_weather", {"city": "Tokyo"})],
    ),
    (
        "deepseek_v3_1",
        "CONTENT<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>'
        '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "CONTENT",
        [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Paris"})],
    ),
    (
        "deepseek_v3_1",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        + NESTED
        + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "",
        [("get_weather", NESTED_ARGS)],
    ),
    # --- DeepSeek V3 / R1
    (
        "deepseek_r1",
        "I'm\nthinking</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        'get_weather\n```json\n{"city": "Paris"}```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "I'm\nthinking</think>",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "deepseek_r1",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
        "get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    # --- Kimi-K2
    (
        "kimi_k2",
        "<think>I'm thinking about this</think><|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        "<|tool_calls_section_end|>",
        "<think>I'm thinking about this</think>",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "kimi_k2",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>'
        "functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|>",
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    (
        "kimi_k2",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        "<|tool_call_argument_begin|>" + NESTED + "<|tool_call_end|><|tool_calls_section_end|>",
        "",
        [("get_weather", NESTED_ARGS)],
    ),
    # --- Mistral Small 3.2, Devstral, Magistral: [TOOL_CALLS]NAME[ARGS]{...}
    (
        "mistral_args",
        '[THINK]I\'m\nthinking[/THINK][TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
        "[THINK]I'm\nthinking[/THINK]",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "mistral_args",
        '[TOOL_CALLS]get_weather[CALL_ID]000000001[ARGS]{"city": "Paris"}'
        "[TOOL_CALLS]get_time[CALL_ID]000000002[ARGS]{}",
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    ("mistral_args", "[TOOL_CALLS]get_weather[ARGS]" + NESTED, "", [("get_weather", NESTED_ARGS)]),
    # --- Mistral Nemo: [TOOL_CALLS][{...}, {...}]
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "123456789"},'
        ' {"name": "get_time", "arguments": {}}]',
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    # --- Llama 3.x
    (
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": ' + NESTED + "}",
        "",
        [("get_weather", NESTED_ARGS)],
    ),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    # --- Granite 3.x
    (
        "granite",
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]',
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    # --- Hermes / Qwen 2.5 / Qwen3 (thinking first) / Granite 4
    (
        "hermes",
        '<think>\nok\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
        + NESTED
        + '}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "<think>\nok\n</think>\n\n",
        [("get_weather", NESTED_ARGS), ("get_time", {})],
    ),
    # --- Phi-4-mini
    (
        "phi4",
        'Sure.<|tool_call|>[{"name": "get_weather", "arguments": '
        + NESTED
        + '}, {"name": "get_time", "arguments": {}}]<|/tool_call|>',
        "Sure.",
        [("get_weather", NESTED_ARGS), ("get_time", {})],
    ),
    # --- Firefunction v2
    (
        "firefunction",
        ' functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]',
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    # --- Command-R7B
    (
        "command_r7b",
        "<|START_THINKING|>I'm\nthinking<|END_THINKING|><|START_ACTION|>[\n"
        '    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}},\n'
        '    {"tool_call_id": "1", "tool_name": "get_time", "parameters": {}}\n]<|END_ACTION|>',
        "<|START_THINKING|>I'm\nthinking<|END_THINKING|>",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    # --- Functionary v3.1 and v3.2
    (
        "functionary_v3_1",
        'Sure.<function=get_weather>{"city": "Paris"}</function><function=get_time>{}</function>',
        "Sure.",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    (
        "functionary_v3_2",
        'all\nLet me check.>>>get_weather\n{"city": "Paris"}>>>get_time\n{}',
        "Let me check.",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    ("functionary_v3_2", "get_weather\n" + NESTED, "", [("get_weather", NESTED_ARGS)]),
    # --- Gemma 4: bare keys, strings between <|"|> markers
    (
        "gemma4",
        "<|channel>thought\nI'm\nthinking<channel|><|tool_call>call:get_weather"
        '{city:<|"|>Paris<|"|>}<tool_call|>',
        "<|channel>thought\nI'm\nthinking<channel|>",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "gemma4",
        'Sure.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>'
        "<|tool_call>call:get_time{}<tool_call|>",
        "Sure.",
        [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})],
    ),
    (
        "gemma4",
        '<|tool_call>call:get_weather{city:<|"|>Zürich 東京<|"|>,where:{near:[<|"|>lake<|"|>,'
        "{depth:2.5}],ok:true}}<tool_call|>",
        "",
        [("get_weather", NESTED_ARGS)],
    ),
    # --- LFM2 / LFM2.5: Python-style calls between markers (strings in either quote)
    (
        "lfm2",
        "<think>I'm\nthinking</think>Sure.<|tool_call_start|>[get_weather(city='Paris', days=2, "
        "metric=True), get_time()]<|tool_call_end|>",
        "<think>I'm\nthinking</think>Sure.",
        [("get_weather", {"city": "Paris", "days": 2, "metric": True}), ("get_time", {})],
    ),
    (  # nested values in Python's and JSON's spelling alike, unicode, escapes
        "lfm2",
        '<|tool_call_start|>[get_weather(city="Zürich 東京", where={"near": ["lake", '
        '{"depth": 2.5}], "ok": true}, note=\'it\\\'s (a) [b]\', n=-1, none=None)]'
        "<|tool_call_end|>",
        "",
        [("get_weather", {**NESTED_ARGS, "note": "it's (a) [b]", "n": -1, "none": None})],
    ),
    (  # what is no call of literal keyword arguments stays content, never run
        "lfm2",
        '<|tool_call_start|>[get_weather(city=os.getenv("HOME"))]<|tool_call_end|> and '
        '<|tool_call_start|>[get_weather("Paris")]<|tool_call_end|>',
        '<|tool_call_start|>[get_weather(city=os.getenv("HOME"))]<|tool_call_end|> and '
        '<|tool_call_start|>[get_weather("Paris")]<|tool_call_end|>',
        [],
    ),
    (  # text after the list is content, even where it reads like a name
        "lfm2",
        "<|tool_call_start|>[get_time()]<|tool_call_end|>Done here",
        "Done here",
        [("get_time", {})],
    ),
    # --- Llama 4 (pythonic): a reply that is a Python list of calls
    (
        "pythonic",
        ' [get_weather(city="Paris", where={"near": ["lake"]}), get_time()]',
        "",
        [("get_weather", {"city": "Paris", "where": {"near": ["lake"]}}), ("get_time", {})],
    ),
    ("pythonic", "[1, 2] are [not(calls)]", "[1, 2] are [not(calls)]", []),
    # --- Llama 3.1's built-in tools after <|python_tag|>: NAME.call(k=v), or code
    (
        "llama3",
        'Let me search.<|python_tag|>brave_search.call(query="weather in Zürich", n=2)',
        "Let me search.",
        [("brave_search", {"query": "weather in Zürich", "n": 2})],
    ),
    (
        "llama3",
        "<|python_tag|>wolfram_alpha.call(query='solve x^2 = 4')",
        "",
        [("wolfram_alpha", {"query": "solve x^2 = 4"})],
    ),
    (  # code_interpreter: the code, a call of `python` (llama.cpp's name)
        "llama3",
        '<|python_tag|>\nimport math\nprint(math.sqrt(2), [x for x in "ab"])\n',
        "",
        [("python", {"code": 'import math\nprint(math.sqrt(2), [x for x in "ab"])'})],
    ),
    (  # a "call" of anything but literal keyword arguments is code too, never run
        "llama3",
        '<|python_tag|>brave_search.call(query=open("/etc/passwd").read())',
        "",
        [("python", {"code": 'brave_search.call(query=open("/etc/passwd").read())'})],
    ),
    ("pythonic", "Text first: [get_time()]", "Text first: [get_time()]", []),
]


KIMI_TWO_CALLS = next(r for f, r, _, calls in CASES if f == "kimi_k2" and len(calls) == 2)


@pytest.mark.parametrize(("family", "reply", "content", "calls"), CASES)
def test_each_family_reads_the_same_whole_and_a_character_at_a_time(
    family: str, reply: str, content: str, calls: list[tuple[str, Any]]
) -> None:
    fmt = FAMILIES[family]
    whole = read(fmt, reply)
    assert read(fmt, reply, step=1) == whole
    got_content, got_calls = whole
    assert got_content == content
    assert [(name, json.loads(arguments)) for name, arguments in got_calls] == calls


# Replies cut by max_tokens inside a call: (family, reply, the arguments text sent so far).
CUT_CASES = [
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n3", '{"city": "Paris"'),
    ("glm", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par", ""),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="ci', ""),
    ("harmony", "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     '{"city": "Pa', '{"city": "Pa'),
    ("deepseek_v3_1", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
     '{"city": "Pa', '{"city": "Pa'),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     '<|tool_call_argument_begin|>{"city": ', '{"city": '),
    ("mistral_args", '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', '{"city": "Pa'),
    ("functionary_v3_1", '<function=get_weather>{"city": "Pa', '{"city": "Pa'),
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Pa', ""),
    ("deepseek_r1", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
     'get_weather\n```json\n{"ci', '{"ci'),
    # Python-style arguments are read whole: those followed by a comma
    ("lfm2", '<|tool_call_start|>[get_weather(city="Paris", where={"a": 1}, days=3',
     '{"city": "Paris", "where": {"a": 1}}'),
]  # fmt: skip


@pytest.mark.parametrize(("family", "reply", "partial"), CUT_CASES)
def test_a_reply_cut_inside_a_call_keeps_the_call_with_what_it_wrote(
    family: str, reply: str, partial: str
) -> None:
    fmt = FAMILIES[family]
    whole = read(fmt, "Sure. " + reply, cut=True)
    assert read(fmt, "Sure. " + reply, cut=True, step=1) == whole
    assert whole == ("Sure. ", [("get_weather", partial)])
    # Cut before the name is whole: no call, and the marker is not content either.
    opener = reply[: reply.index("get_weather")]
    assert read(fmt, "Sure. " + opener + "get_wea", cut=True) == ("Sure. ", [])


def test_text_that_only_looks_like_a_marker_stays_content() -> None:
    for family in ("qwen3_coder", "glm", "kimi_k2", "harmony", "mistral_args"):
        fmt = FAMILIES[family]
        for text in ("a < b and <function", "see <tool_call> here", "[TOOL_CALLS bad"):
            assert read(fmt, text) == (text, []) == read(fmt, text, step=1), (family, text)


def test_a_repeated_framed_call_is_dropped_and_counted() -> None:
    fmt = FAMILIES["qwen3_coder"]
    call = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n"
    parser = tool_parser(fmt, None, SCHEMAS)
    _, calls = _events_to_reply(parser.push(call + call) + parser.finish())
    assert calls == [("get_time", "{}")] and parser.repeats == 1 and parser.whole_calls == 1
    assert parser.finish_reason("stop") == "tool_calls"


def test_parallel_false_keeps_the_first_call() -> None:
    fmt = FAMILIES["kimi_k2"]
    reply = KIMI_TWO_CALLS
    parser = tool_parser(fmt, 1, SCHEMAS)
    _, calls = _events_to_reply(parser.push(reply) + parser.finish())
    assert calls == [("get_weather", '{"city": "Paris"}')]


def test_kimi_calls_keep_the_models_own_ids() -> None:
    parser = tool_parser(FAMILIES["kimi_k2"], None, SCHEMAS)
    starts = [e for e in parser.push(KIMI_TWO_CALLS) if isinstance(e, CallStart)]
    assert [e.id for e in starts] == ["functions.get_weather:0", "functions.get_time:1"]


HISTORY_CALLS = [("get_weather", {"city": "Zürich", "days": 3}), ("get_time", {})]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_history_text_reads_back_as_the_same_calls(family: str) -> None:
    """What template.py writes for a template that cannot render calls is the model's own
    syntax: the parser reads it back."""
    fmt = FAMILIES[family]
    text = fmt.write_calls(HISTORY_CALLS)
    if fmt.starts_in_call:  # the prompt holds the first opener
        text = text.removeprefix(fmt.framed.opens[0]) if fmt.framed else text
    expected = HISTORY_CALLS if fmt.parallel else HISTORY_CALLS[:1]
    content, calls = read(fmt, text)
    assert content.strip() == ""
    assert [(name, json.loads(arguments)) for name, arguments in calls] == expected


def test_each_familys_grammar_forces_its_own_syntax(tiny_model_path: Path) -> None:
    vocab = Vocab(tiny_model_path)
    functions = [("get_weather", WEATHER), ("get_time", None)]
    for family, fmt in FAMILIES.items():
        grammar = tool_grammar(fmt, functions, parallel=True)
        assert grammar_error(grammar) is None, family
        text = fmt.write_calls(HISTORY_CALLS)
        if fmt.starts_in_call and fmt.framed is not None:
            text = text.removeprefix(fmt.framed.opens[0])
        assert grammar_accepts(vocab, grammar, text), family
        assert not grammar_accepts(vocab, grammar, text + "x"), family
        wrong = text.replace("get_weather", "get_wether")
        assert not grammar_accepts(vocab, grammar, wrong), family
        one = tool_grammar(fmt, functions[:1], parallel=False)
        first = fmt.write_calls(HISTORY_CALLS[:1])
        if fmt.starts_in_call and fmt.framed is not None:
            first = first.removeprefix(fmt.framed.opens[0])
        assert grammar_accepts(vocab, one, first), family


def test_xml_grammar_types_values_by_the_schema(tiny_model_path: Path) -> None:
    vocab = Vocab(tiny_model_path)
    fmt = FAMILIES["qwen3_coder"]
    grammar = tool_grammar(fmt, [("get_weather", WEATHER)], parallel=False)
    good = fmt.write_calls([("get_weather", {"city": "Paris", "days": 3})])
    assert grammar_accepts(vocab, grammar, good)
    assert not grammar_accepts(vocab, grammar, good.replace("\n3\n", "\nthree\n"))
    assert not grammar_accepts(vocab, grammar, fmt.write_calls([("get_weather", {"days": 3})]))


@pytest.mark.parametrize("family", ["qwen3_coder", "glm", "minimax_m2", "deepseek_v3_2"])
def test_xml_grammar_takes_a_string_enum_as_written(tiny_model_path: Path, family: str) -> None:
    """An enum of strings is written as text, not JSON, and forced as one of its texts; DSML
    marks each value's type in its key (`string="true"` for text, "false" for JSON)."""
    vocab = Vocab(tiny_model_path)
    fmt = FAMILIES[family]
    schema = {
        "type": "object",
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer"}},
        "required": ["unit", "days"],
    }
    grammar = tool_grammar(fmt, [("get_weather", schema)], parallel=False)
    good = fmt.write_calls([("get_weather", {"unit": "celsius", "days": 3})])
    if family == "deepseek_v3_2":
        assert 'name="unit" string="true">celsius' in good
        assert 'name="days" string="false">3' in good
    assert grammar_accepts(vocab, grammar, good)
    assert not grammar_accepts(vocab, grammar, good.replace("celsius", "kelvin"))
    assert not grammar_accepts(vocab, grammar, good.replace("celsius", '"celsius"'))


# Each family, from the real chat templates llama.cpp ships (tests/data/templates).
DETECTED = {
    "Qwen3-Coder": "qwen3_coder",
    "Qwen3.5-4B": "qwen3_coder",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": "qwen3_coder",
    "GLM-4.6": "glm",
    "GLM-4.7-Flash": "glm",
    "MiniMax-M2": "minimax_m2",
    "openai-gpt-oss-120b": "harmony",
    "deepseek-ai-DeepSeek-V3.1": "deepseek_v3_1",
    "deepseek-ai-DeepSeek-V3.2": "deepseek_v3_2",
    "deepseek-ai-DeepSeek-V4": "deepseek_v4",
    "deepseek-ai-DeepSeek-V4-Flash-0731": "deepseek_v4",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "deepseek_r1",
    "llama-cpp-deepseek-r1": "deepseek_r1",
    "moonshotai-Kimi-K2": "kimi_k2",
    "Kimi-K2-Instruct": "kimi_k2",
    "Kimi-K2-Thinking": "kimi_k2",
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral_args",
    "unsloth-mistral-Devstral-Small-2507": "mistral_args",
    "mistralai-Ministral-3-14B-Reasoning-2512": "mistral_args",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3",
    "meta-llama-Llama-3.2-3B-Instruct": "llama3",
    "ibm-granite-granite-3.3-2B-Instruct": "granite",
    "ibm-granite-granite-4.0": "hermes",
    "fireworks-ai-llama-3-firefunction-v2": "firefunction",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": "command_r7b",
    "meetkai-functionary-medium-v3.1": "functionary_v3_1",
    "meetkai-functionary-medium-v3.2": "functionary_v3_2",
    "google-gemma-4-31B-it": "gemma4",
    "ByteDance-Seed-OSS": "qwen3_coder",
    "google-gemma-2-2b-it": "json",  # tools not rendered: probed, it is "generic"
    "Qwen-Qwen2.5-7B-Instruct": "hermes",
    "Qwen-Qwen3-0.6B": "hermes",
    "Qwen-QwQ-32B": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "hermes",
    "LFM2-8B-A1B": "lfm2",
    "LFM2.5-8B-A1B": "lfm2",
    "LFM2.5-Instruct": "lfm2",
}


@pytest.mark.parametrize(("template", "family"), sorted(DETECTED.items()))
def test_each_family_is_detected_from_its_real_template(template: str, family: str) -> None:
    source = (TEMPLATES / f"{template}.jinja").read_text()
    assert detect(source, renders_tools=True) is FAMILIES[family]


def test_llama_4s_instruction_to_call_in_pythons_syntax_is_detected() -> None:
    """Llama 4's template (not among llama.cpp's) asks for `[func_name1(params_name1=...`."""
    source = (
        "{%- if tools %}You SHOULD NOT include any other text in the response if you call a "
        "function. Format: [func_name1(params_name1=params_value1, params_name2=params_value2"
        "...), func_name2(params)]{%- endif %}"
    )
    assert detect(source, renders_tools=True) is FAMILIES["pythonic"]


def test_a_repeated_python_call_is_dropped_and_a_cut_one_keeps_no_partial_value() -> None:
    fmt = FAMILIES["lfm2"]
    parser = tool_parser(fmt, None, SCHEMAS)
    call = "get_weather(city='Paris')"
    reply = f"<|tool_call_start|>[{call}, {call}]<|tool_call_end|>"
    _, calls = _events_to_reply(parser.push(reply) + parser.finish())
    assert calls == [("get_weather", '{"city": "Paris"}')] and parser.repeats == 1
    assert parser.finish_reason("stop") == "tool_calls"
    cut = "<|tool_call_start|>[get_weather(city='Par"
    assert read(fmt, cut, cut=True) == ("", [("get_weather", "")]) == read(fmt, cut, True, 1)
    # Ended (not cut) before its `)`: no call, the text is content.
    assert read(fmt, cut) == (cut, []) == read(fmt, cut, step=1)


def test_a_cut_built_in_call_keeps_its_whole_keywords_and_cut_code_what_it_wrote() -> None:
    fmt = FAMILIES["llama3"]
    text = '<|python_tag|>brave_search.call(query="rain", count=3, lang="f'
    assert read(fmt, text, cut=True) == ("", [("brave_search", '{"query": "rain", "count": 3}')])
    assert read(fmt, text, cut=True, step=1) == read(fmt, text, cut=True)
    code = "<|python_tag|>print(1 +"
    assert read(fmt, code, cut=True) == ("", [("python", '{"code": "print(1 +"}')])


def test_llama_31s_template_writes_a_built_in_call_that_reads_back() -> None:
    """The call in the history, rendered by Llama 3.1's own template with `builtin_tools` (a
    chat_template_kwargs key), is read back as the same call."""
    source = (TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()
    renderer = ChatTemplate(source, "<s>", "</s>")
    call = {"name": "brave_search", "arguments": {"query": "weather in Paris"}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": call}]},
    ]
    kwargs = {"builtin_tools": ["brave_search", "wolfram_alpha"]}
    prompt = renderer.render(messages, add_generation_prompt=False, kwargs=kwargs)
    turn = prompt[prompt.rindex("<|end_header_id|>") + len("<|end_header_id|>") :]
    # The reply is what follows the header's blank line (the generation prompt ends with it).
    turn = turn.removeprefix("\n\n").split("<|eom_id|>")[0].split("<|eot_id|>")[0]
    assert "<|python_tag|>brave_search.call(" in turn
    assert read(FAMILIES["llama3"], turn) == ("", [("brave_search", json.dumps(call["arguments"]))])


def test_the_families_name_the_templates_they_are_detected_from() -> None:
    for family, fmt in FAMILIES.items():
        for template in fmt.templates:
            path = TEMPLATES / f"{template}.jinja"
            if path.exists():  # probed as at start-up: whether it renders tools counts too
                probe = TemplateTools.probe(ChatTemplate(path.read_text(), "<s>", "</s>"))
                assert probe.format is fmt, (family, template)


def test_probing_a_real_template_finds_its_family_and_what_it_renders() -> None:
    source = (TEMPLATES / "Qwen3-Coder.jinja").read_text()
    probe = TemplateTools.probe(ChatTemplate(source, "<s>", "</s>"))
    assert probe.format is FAMILIES["qwen3_coder"]
    assert probe.renders_tools and probe.renders_calls and probe.renders_results


def test_the_override_names_a_family_or_fails_with_the_list() -> None:
    source = (TEMPLATES / "Qwen3-Coder.jinja").read_text()
    assert detect(source, True, "glm") is FAMILIES["glm"]
    assert detect(source, True, "auto") is FAMILIES["qwen3_coder"]
    with pytest.raises(ValueError, match="qwen3_coder"):
        detect(source, True, "qwen4")
    assert PARSER_NAMES[0] == "auto" and set(PARSER_NAMES[1:]) == set(FAMILIES)


def test_the_options_help_names_every_family() -> None:
    declared = next(f for f in fields(GatewayConfig) if f.name == "tool_call_parser")
    info = setting_info(declared)
    assert info is not None
    for name in PARSER_NAMES:
        assert name in info.help, name


CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "abc123XYZ",  # nine letters and digits, as Mistral's templates insist
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "abc123XYZ", "name": "get_weather", "content": "sunny"},
]
HISTORY_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather.", "parameters": WEATHER},
    }
]


@pytest.mark.parametrize(("template", "family"), sorted(DETECTED.items()))
def test_a_call_in_the_history_reaches_the_model_in_its_familys_syntax(
    template: str, family: str
) -> None:
    """The conversation rendered as at serving time (what the template cannot show written as
    text): the family's parser finds the earlier call in the prompt, and the tool's result is
    there too."""
    renderer = ChatTemplate((TEMPLATES / f"{template}.jinja").read_text(), "<s>", "</s>")
    probe = TemplateTools.probe(renderer)
    messages, tools = probe.prepare(CONVERSATION, HISTORY_TOOLS)
    # Firefunction's template reads the tools as a JSON string in `functions`, and the date:
    # the variables llama.cpp passes it (a server sets them with --chat-template-kwargs).
    kwargs = (
        {"functions": json.dumps(HISTORY_TOOLS), "datetime": "2026-11-28"}
        if family == "firefunction"
        else None
    )
    prompt = renderer.render(messages, tools=tools, add_generation_prompt=True, kwargs=kwargs)
    assert "sunny" in prompt
    if probe.format.bare_json:  # a call is a reply that is JSON: read the assistant's turn
        prompt = prompt[prompt.find('{"name": "get_weather"') :]
    _, calls = read(probe.format, prompt)
    found = [json.loads(arguments) for name, arguments in calls if name == "get_weather"]
    assert {"city": "Paris", "days": 3} in found, prompt


NESTED_CALLS = [("get_weather", {**NESTED_ARGS, "days": 3}), ("get_time", {})]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_nested_unicode_calls_read_back_whole_and_cut_anywhere(family: str) -> None:
    """Two calls (nested JSON, text outside ASCII) as the family writes them, after some text:
    read back whole; and the reply cut after any character (by max_tokens, or ended there)
    reads the same fed whole and a character at a time."""
    fmt = FAMILIES[family]
    text = fmt.write_calls(NESTED_CALLS)
    if fmt.starts_in_call and fmt.framed is not None:
        text = text.removeprefix(fmt.framed.opens[0])
    elif not fmt.bare_json:
        text = "Sure. " + text
    expected = NESTED_CALLS if fmt.parallel else NESTED_CALLS[:1]
    content, calls = read(fmt, text)
    assert content.strip() in ("", "Sure.")
    assert [(name, json.loads(arguments)) for name, arguments in calls] == expected
    for end in range(1, len(text), 3):
        for cut in (True, False):
            assert read(fmt, text[:end], cut=cut, step=1) == read(fmt, text[:end], cut=cut), (
                end,
                cut,
            )


def test_a_call_ended_before_its_arguments_has_none() -> None:
    """Ended (not cut) after the name: `{}`; cut there by max_tokens: nothing yet."""
    kimi = "<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>"
    for family, text in (("glm", "<tool_call>get_time\n"), ("kimi_k2", kimi)):
        fmt = FAMILIES[family]
        name = "get_time"
        assert read(fmt, text) == ("", [(name, "{}")]) == read(fmt, text, step=1), text
        assert read(fmt, text, cut=True) == ("", [(name, "")]), text
