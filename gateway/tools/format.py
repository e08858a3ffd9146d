"""How each family of models writes tool calls, told from its chat template's text.

A family is a ToolFormat value of a few lines. The same description serves three jobs: the
parsers find calls in the output (parser.py for calls written as JSON objects, framed.py for
calls whose name is written outside their arguments), the grammar forces a call in that
syntax (grammar.py), and calls in a conversation's history are written back as text when
the template cannot render them (template.py).

Two shapes cover the families:
- **JSON objects**: each call is {"name": ..., "arguments": {...}} (the keys may differ:
  Llama 3's "parameters", Command-R's "tool_name"), alone or in a JSON list, after a marker.
- **framed** (`Framed`): a marker, the name, a marker, the arguments (JSON, or one XML-ish
  element per parameter: `XmlArguments`, or Python keyword arguments: `python_args`), a
  closing marker.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import string
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class XmlArguments:
    """Arguments written one parameter at a time: KEY_OPEN key KEY_CLOSE [VALUE_OPEN] value
    VALUE_CLOSE; values are text, typed by the function's schema when read (framed.py)."""

    key_open: str
    key_close: str
    value_close: str
    value_open: str = ""  # GLM's <arg_value>, after the key's closing marker
    trim_newline: bool = False  # a value is written on lines of its own (Qwen3-Coder)
    separator: str = ""  # written after each parameter
    # A regex whose group 1 is the key, in the text up to KEY_CLOSE (DeepSeek's DSML writes
    # attributes after it: `city" string="true`); "": all of that text is the key.
    key_pattern: str = ""
    # KEY_CLOSE by the value's type, (a string's, any other's), where the family says it:
    # DSML's `" string="true">` and `" string="false">`; () means KEY_CLOSE alone.
    typed_key_close: tuple[str, str] | tuple[()] = ()

    def key_closing(self, is_string: bool) -> str:
        """What closes the key of a value that is (or is not) a string."""
        if not self.typed_key_close:
            return self.key_close
        return self.typed_key_close[0 if is_string else 1]

    def write(self, arguments: dict[str, Any]) -> str:
        """The arguments as this family writes them."""
        parts = []
        for key, value in arguments.items():
            is_string = isinstance(value, str)
            text = value if is_string else json.dumps(value, ensure_ascii=False)
            if self.trim_newline:
                text = f"\n{text}\n"
            closing = self.key_closing(is_string)
            parts.append(f"{self.key_open}{key}{closing}{self.value_open}{text}")
            parts.append(self.value_close + self.separator)
        return "".join(parts)


@dataclass(frozen=True, slots=True)
class Framed:
    """Calls written OPEN name NAME_END ... ARGS_OPEN arguments ... CLOSE (parsed by framed.py).

    Parsing is lenient where models vary (space around markers, text between the name and
    ARGS_OPEN, such as Mistral's [CALL_ID]); writing and the grammar use the first marker of
    each tuple and the `written_*` texts.
    """

    opens: tuple[str, ...]  # markers that open one call
    name_ends: tuple[str, ...]  # what may follow the name (left in place for what comes next)
    close: str  # the marker that ends a call; "": the arguments end it
    args_open: str = ""  # skipped to after the name: the arguments follow it
    xml: XmlArguments | None = None  # None: the arguments are a JSON object
    between: tuple[str, ...] = ()  # markers skipped between two calls of a run
    name_pattern: str = ""  # a regex whose group 1 is the name, in the name's text (Kimi)
    name_written: str = "{name}"  # the name's text as written ({index}: the call's index)
    written_after_name: str = ""  # NAME_END and what leads to the arguments, as written
    written_after_args: str = ""  # between the arguments and CLOSE, as written
    content_name: str = ""  # a "call" of this name is the answer's text (Functionary v3.2)
    name_as_id: bool = False  # the name's text is the call's id (Kimi's functions.NAME:0)
    # The arguments are an object with bare keys and strings between this marker (Gemma 4's
    # <|"|>), not JSON; read whole, as JSON.
    string_quote: str = ""
    # Python-style calls (Llama 4, LFM2): a run is a list `[f(a=1), g()]`, each call's
    # arguments Python keyword arguments of literal values, read whole (never run) once the
    # call's `)` closes them.
    python_args: bool = False


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """One family's tool-call syntax."""

    name: str
    opens: tuple[str, ...]  # markers that open a run of calls anywhere in the output
    closes: str | None  # the marker that ends a run (None: the JSON itself ends it)
    bare_json: bool  # output that starts with `{` or `[` is a run of calls
    arguments_key: str  # "arguments", or "parameters" (Llama 3)
    parallel: bool  # the syntax holds several calls in one reply
    # Written around calls (history written as text, and the grammar of a forced call):
    call_prefix: str = ""
    call_suffix: str = ""
    list_prefix: str = ""
    list_suffix: str = ""
    separator: str = ""
    id_alphabet_length: int = 0  # ids of exactly this many letters and digits (Mistral); 0: any
    name_key: str = "name"  # the JSON object's key for the name (Command-R: "tool_name")
    index_key: str = ""  # a key written first with the call's index (Command-R: "tool_call_id")
    framed: Framed | None = None  # the name outside the arguments (framed.py reads these)
    starts_in_call: bool = False  # the prompt ends with a call's opener (Functionary v3.2)
    # After this marker (one of `opens`), text that is not JSON is a built-in tool's call
    # (Llama 3.1's <|python_tag|>): `NAME.call(k=v)` calls NAME, other text is code, a call of
    # `python` with {"code": text} (as llama.cpp named it). Read whole, at the reply's end.
    code_marker: str = ""
    templates: tuple[str, ...] = ()  # the model files whose templates select it (docs, tests)

    def write_calls(self, calls: list[tuple[str, Any]]) -> str:
        """(name, arguments) pairs as this model would have written them."""
        if not self.parallel:
            calls = calls[:1]
        texts = [self._write_call(i, name, arguments) for i, (name, arguments) in enumerate(calls)]
        body = self.separator.join(self.call_prefix + t + self.call_suffix for t in texts)
        return self.list_prefix + body + self.list_suffix

    def _write_call(self, index: int, name: str, arguments: Any) -> str:
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):  # JSON text: written as a value
                arguments = json.loads(arguments)
        framed = self.framed
        if framed is None:
            head = {self.index_key: str(index)} if self.index_key else {}
            call = {**head, self.name_key: name, self.arguments_key: arguments}
            return json.dumps(call, ensure_ascii=False)
        if framed.xml is not None and isinstance(arguments, dict):
            args = framed.xml.write(arguments)
        elif framed.string_quote:
            args = _write_quoted(arguments, framed.string_quote)
        elif framed.python_args:
            args = write_keywords(arguments) if isinstance(arguments, dict) else ""
        else:
            args = arguments if isinstance(arguments, str) else json.dumps(arguments)
        written = framed.name_written.format(name=name, index=index)
        return (
            f"{framed.opens[0] if framed.opens else ''}{written}{framed.written_after_name}{args}"
            f"{framed.written_after_args}{framed.close}"
        )

    def markers(self) -> tuple[str, ...]:
        """Every marker the parser looks for (control tokens among them must be seen)."""
        found = [*self.opens, self.closes or ""]
        if self.framed is not None:
            f = self.framed
            found += [*f.opens, *f.name_ends, f.close, f.args_open, *f.between, f.string_quote]
            if f.xml is not None:
                found += [f.xml.key_open, f.xml.key_close, f.xml.value_open, f.xml.value_close]
        return tuple(dict.fromkeys(m for m in found if m.strip()))

    def new_call_id(self) -> str:
        """An id for a call the model made, in the shape its template accepts."""
        if self.id_alphabet_length:
            alphabet = string.ascii_letters + string.digits
            return "".join(secrets.choice(alphabet) for _ in range(self.id_alphabet_length))
        return "call_" + secrets.token_hex(12)


def _write_quoted(value: Any, quote: str) -> str:
    """A value as Gemma 4's template writes a call's arguments: keys bare and in order,
    strings between quote markers."""
    if isinstance(value, str):
        return f"{quote}{value}{quote}"
    if isinstance(value, dict):
        items = (f"{k}:{_write_quoted(v, quote)}" for k, v in sorted(value.items()))
        return "{" + ",".join(items) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_write_quoted(v, quote) for v in value) + "]"
    return json.dumps(value)


def write_keywords(arguments: dict[str, Any]) -> str:
    """Arguments as Python keyword arguments (`city="Paris", days=3`); strings as JSON writes
    them, which Python reads alike."""
    return ", ".join(f"{key}={_python_literal(value)}" for key, value in arguments.items())


def _python_literal(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, dict):
        items = (
            f"{json.dumps(str(k), ensure_ascii=False)}: {_python_literal(v)}"
            for k, v in value.items()
        )
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_python_literal(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def _json_family(name: str, opens: tuple[str, ...], closes: str | None, **more: Any) -> ToolFormat:
    """A family whose calls are JSON objects, parallel, named "name" with "arguments"."""
    fields: dict[str, Any] = {"bare_json": False, "arguments_key": "arguments", "parallel": True}
    return ToolFormat(name=name, opens=opens, closes=closes, **(fields | more))


def _framed_family(name: str, framed: Framed, **more: Any) -> ToolFormat:
    """A family whose calls are framed, parallel unless said otherwise."""
    fields: dict[str, Any] = {
        "opens": (), "bare_json": False, "arguments_key": "arguments", "parallel": True
    }  # fmt: skip
    return ToolFormat(name=name, closes=None, framed=framed, **(fields | more))


# Hermes 2/3, Qwen 2.5/3, QwQ, Granite 4 and most fine-tunes: <tool_call>{json}</tool_call>.
HERMES = _json_family(
    "hermes", ("<tool_call>",), "</tool_call>", call_prefix="<tool_call>\n",
    call_suffix="\n</tool_call>", separator="\n",
    templates=("Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "Qwen-QwQ-32B",
               "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "ibm-granite-granite-4.0"),
)  # fmt: skip
# Models whose template knows no tools (Gemma 2/3, Phi-3.5): the tools go into the system
# prompt (template.py) and the reply uses Hermes' tags, the syntax most models have seen.
GENERIC = replace(HERMES, name="generic", templates=("google-gemma-2-2b-it",))
# Mistral Nemo/Small 3.1: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], 9-char ids.
MISTRAL = _json_family(
    "mistral", ("[TOOL_CALLS]",), None, list_prefix="[TOOL_CALLS][", list_suffix="]",
    separator=", ", id_alphabet_length=9, templates=("mistralai-Mistral-Nemo-Instruct-2407",),
)  # fmt: skip
# Llama 3.1-3.3: a bare {"name": ..., "parameters": {...}}, maybe after <|python_tag|>; or
# after it, a built-in tool's call (brave_search.call(query="..."), or code_interpreter's code).
LLAMA3 = ToolFormat(
    name="llama3", opens=("<|python_tag|>",), closes=None, bare_json=True,
    arguments_key="parameters", parallel=False, code_marker="<|python_tag|>",
    templates=("meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct"),
)  # fmt: skip
# A template that renders tools in a way we do not know: the reply is taken to be JSON.
JSON = ToolFormat(
    name="json", opens=(), closes=None, bare_json=True, arguments_key="arguments",
    parallel=False,
)  # fmt: skip
# Granite 3.x (and Phi-4-mini's form): <|tool_call|>[{"name": ..., "arguments": {...}}].
GRANITE = _json_family(
    "granite", ("<|tool_call|>",), None, list_prefix="<|tool_call|>[", list_suffix="]",
    separator=", ", templates=("ibm-granite-granite-3.3-2B-Instruct",),
)  # fmt: skip
# Phi-4-mini: <|tool_call|>[{"name": ..., "arguments": {...}}]<|/tool_call|>; its template
# lists the tools between <|tool|> and <|/tool|> (llama.cpp ships none to test with).
PHI4 = _json_family(
    "phi4", ("<|tool_call|>",), "<|/tool_call|>", list_prefix="<|tool_call|>[",
    list_suffix="]<|/tool_call|>", separator=", ",
)  # fmt: skip
# Firefunction v2: " functools[{"name": ..., "arguments": {...}}]".
FIREFUNCTION = _json_family(
    "firefunction", (" functools", "functools"), None, list_prefix=" functools[",
    list_suffix="]", separator=", ", templates=("fireworks-ai-llama-3-firefunction-v2",),
)  # fmt: skip
# Command-R7B: <|START_ACTION|>[{"tool_call_id": "0", "tool_name": ..., "parameters": {...}}]
COMMAND_R7B = _json_family(
    "command_r7b", ("<|START_ACTION|>",), "<|END_ACTION|>", arguments_key="parameters",
    list_prefix="<|START_ACTION|>[", list_suffix="]<|END_ACTION|>", separator=", ",
    name_key="tool_name", index_key="tool_call_id",
    templates=("CohereForAI-c4ai-command-r7b-12-2024-tool_use",),
)  # fmt: skip
# Command R+ (its tool-use template): Action:\n```json\n[{"tool_name": ..., "parameters":
# {...}}, ...]``` (the template writes the list indented, which the parser skips).
COMMAND_R_PLUS = _json_family(
    "command_r_plus", ("Action:\n```json", "Action: ```json", "Action:```json"), "```",
    arguments_key="parameters", name_key="tool_name", list_prefix="Action:\n```json\n[\n",
    list_suffix="\n]```", separator=",\n",
    templates=("CohereForAI-c4ai-command-r-plus-tool_use",),
)  # fmt: skip
# Qwen3-Coder, Qwen3.5, Nemotron 3 (and Seed-OSS, in <seed:tool_call>): <tool_call>\n
# <function=NAME>\n<parameter=KEY>\nvalue\n</parameter>\n</function>\n</tool_call>
QWEN3_CODER = _framed_family(
    "qwen3_coder",
    Framed(opens=("<function=",), name_ends=(">",), close="</function>", args_open=">",
           xml=XmlArguments("<parameter=", ">", "</parameter>", trim_newline=True,
                             separator="\n"),
           between=("<tool_call>", "</tool_call>", "<seed:tool_call>", "</seed:tool_call>"),
           written_after_name=">\n"),
    call_prefix="<tool_call>\n", call_suffix="\n</tool_call>", separator="\n",
    templates=("Qwen3-Coder", "Qwen3.5-4B", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"),
)  # fmt: skip
# GLM-4.5/4.6/4.7: <tool_call>NAME\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call>
GLM = _framed_family(
    "glm",
    Framed(opens=("<tool_call>",), name_ends=("<arg_key>", "\n", "</tool_call>"),
           close="</tool_call>",
           xml=XmlArguments("<arg_key>", "</arg_key>", "</arg_value>", value_open="<arg_value>",
                             separator="\n"),
           written_after_name="\n"),
    separator="\n", templates=("GLM-4.6", "GLM-4.7-Flash"),
)  # fmt: skip
# MiniMax-M2: <minimax:tool_call>\n<invoke name="NAME">\n<parameter name="k">v</parameter>\n
# </invoke>\n</minimax:tool_call>
MINIMAX = _framed_family(
    "minimax_m2",
    Framed(opens=('<invoke name="',), name_ends=('">',), close="</invoke>", args_open='">',
           xml=XmlArguments('<parameter name="', '">', "</parameter>", separator="\n"),
           between=("<minimax:tool_call>", "</minimax:tool_call>"), written_after_name='">'),
    list_prefix="<minimax:tool_call>\n", list_suffix="\n</minimax:tool_call>", separator="\n",
    templates=("MiniMax-M2",),
)  # fmt: skip
# gpt-oss (Harmony): <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
# {...}<|call|>; the recipient may also come before the channel (` to=functions.NAME<|channel|>`)
HARMONY = _framed_family(
    "harmony",
    Framed(opens=("<|channel|>commentary to=functions.", "<|channel|>analysis to=functions.",
                  " to=functions.", "to=functions."),
           name_ends=(" ", "<|channel|>", "<|constrain|>", "<|message|>"), close="<|call|>",
           args_open="<|message|>", between=("<|start|>assistant", "<|end|>"),
           written_after_name=" <|constrain|>json<|message|>"),
    separator="<|start|>assistant", templates=("openai-gpt-oss-120b",),
)  # fmt: skip
# DeepSeek V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
# <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
DEEPSEEK_V31 = _framed_family(
    "deepseek_v3_1",
    Framed(opens=("<｜tool▁call▁begin｜>",), name_ends=("<｜tool▁sep｜>",),
           close="<｜tool▁call▁end｜>", args_open="<｜tool▁sep｜>",
           between=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
           written_after_name="<｜tool▁sep｜>"),
    list_prefix="<｜tool▁calls▁begin｜>", list_suffix="<｜tool▁calls▁end｜>",
    templates=("deepseek-ai-DeepSeek-V3.1",),
)  # fmt: skip
# DeepSeek V3 and R1 (and their distills): ...<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n
# ```json\n{...}\n```<｜tool▁call▁end｜>...
DEEPSEEK_R1 = _framed_family(
    "deepseek_r1",
    Framed(opens=("<｜tool▁call▁begin｜>function<｜tool▁sep｜>",), name_ends=("\n",),
           close="<｜tool▁call▁end｜>", args_open="```json",
           between=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
           written_after_name="\n```json\n", written_after_args="\n```"),
    list_prefix="<｜tool▁calls▁begin｜>", list_suffix="<｜tool▁calls▁end｜>", separator="\n",
    templates=("llama-cpp-deepseek-r1", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"),
)  # fmt: skip
# DeepSeek V3.2 (DSML): <｜DSML｜function_calls>\n<｜DSML｜invoke name="NAME">\n
# <｜DSML｜parameter name="k" string="true|false">v</｜DSML｜parameter>\n</｜DSML｜invoke>\n
# </｜DSML｜function_calls>; a string value as it is, others as JSON. Its `string` attribute
# is read past (the schema types the value); calls written here and forced calls write it.
DEEPSEEK_V32 = _framed_family(
    "deepseek_v3_2",
    Framed(opens=('<｜DSML｜invoke name="',), name_ends=('">',), close="</｜DSML｜invoke>",
           args_open='">',
           xml=XmlArguments('<｜DSML｜parameter name="', '">', "</｜DSML｜parameter>",
                             separator="\n", key_pattern=r'([^"]*)(?:".*)?',
                             typed_key_close=('" string="true">', '" string="false">')),
           between=("<｜DSML｜function_calls>", "</｜DSML｜function_calls>",
                    "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"),
           written_after_name='">\n'),
    list_prefix="<｜DSML｜function_calls>\n", list_suffix="</｜DSML｜function_calls>",
    call_suffix="\n", templates=("deepseek-ai-DeepSeek-V3.2",),
)  # fmt: skip
# DeepSeek V4: the same calls in <｜DSML｜tool_calls>.
DEEPSEEK_V4 = replace(
    DEEPSEEK_V32, name="deepseek_v4", list_prefix="<｜DSML｜tool_calls>\n",
    list_suffix="</｜DSML｜tool_calls>",
    templates=("deepseek-ai-DeepSeek-V4", "deepseek-ai-DeepSeek-V4-Flash-0731"),
)  # fmt: skip
# Kimi-K2: <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
# <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>
KIMI_K2 = _framed_family(
    "kimi_k2",
    Framed(opens=("<|tool_call_begin|>",), name_ends=("<|tool_call_argument_begin|>",),
           close="<|tool_call_end|>", args_open="<|tool_call_argument_begin|>",
           between=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
           name_pattern=r"\s*(?:functions\.)?(.+?)(?::\d+)?\s*",
           name_written="functions.{name}:{index}", name_as_id=True,
           written_after_name="<|tool_call_argument_begin|>"),
    list_prefix="<|tool_calls_section_begin|>", list_suffix="<|tool_calls_section_end|>",
    templates=("moonshotai-Kimi-K2", "Kimi-K2-Instruct", "Kimi-K2-Thinking"),
)  # fmt: skip
# Mistral Small 3.2, Devstral, Magistral, Ministral 3: [TOOL_CALLS]NAME[ARGS]{...} (maybe
# [CALL_ID]id before [ARGS]), one marker per call.
MISTRAL_ARGS = _framed_family(
    "mistral_args",
    Framed(opens=("[TOOL_CALLS]",), name_ends=("[ARGS]", "[CALL_ID]"), close="",
           args_open="[ARGS]", written_after_name="[ARGS]"),
    id_alphabet_length=9,
    templates=("Mistral-Small-3.2-24B-Instruct-2506", "unsloth-mistral-Devstral-Small-2507",
               "mistralai-Ministral-3-14B-Reasoning-2512"),
)  # fmt: skip
# Functionary v3.1 (Llama 3.1): <function=NAME>{...}</function>
FUNCTIONARY_V31 = _framed_family(
    "functionary_v3_1",
    Framed(opens=("<function=",), name_ends=(">",), close="</function>", args_open=">",
           written_after_name=">"),
    templates=("meetkai-functionary-medium-v3.1",),
)  # fmt: skip
# Functionary v3.2: the prompt ends with >>>; the reply is `all\n` and text, or NAME\n{...},
# each further message after another >>>.
FUNCTIONARY_V32 = _framed_family(
    "functionary_v3_2",
    Framed(opens=(">>>",), name_ends=("\n",), close="", args_open="\n",
           written_after_name="\n", content_name="all"),
    starts_in_call=True, templates=("meetkai-functionary-medium-v3.2",),
)  # fmt: skip

# Gemma 4: <|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>, one marker per call.
GEMMA4 = _framed_family(
    "gemma4",
    Framed(opens=("<|tool_call>call:",), name_ends=("{",), close="<tool_call|>",
           string_quote='<|"|>'),
    templates=("google-gemma-4-31B-it",),
)  # fmt: skip

# Python-style calls: [get_weather(city="Paris", days=3), get_time()].
_PYTHON_CALLS = Framed(
    opens=(), name_ends=("(",), close="", args_open="(", python_args=True,
    name_pattern=r"\s*([A-Za-z_][\w.]*)\s*", written_after_name="(", written_after_args=")",
)  # fmt: skip
# Llama 4 (vLLM's "pythonic"): a reply that starts with `[` is a list of calls.
PYTHONIC = _framed_family(
    "pythonic", _PYTHON_CALLS, bare_json=True, list_prefix="[", list_suffix="]", separator=", ",
)  # fmt: skip
# LFM2 and LFM2.5: <|tool_call_start|>[get_weather(city="Paris"), get_time()]<|tool_call_end|>
LFM2 = _framed_family(
    "lfm2", replace(_PYTHON_CALLS, between=("<|tool_call_end|>",)), opens=("<|tool_call_start|>",),
    list_prefix="<|tool_call_start|>[", list_suffix="]<|tool_call_end|>", separator=", ",
    templates=("LFM2-8B-A1B", "LFM2.5-8B-A1B", "LFM2.5-Instruct"),
)  # fmt: skip

FAMILIES: dict[str, ToolFormat] = {
    f.name: f
    for f in (
        HERMES, QWEN3_CODER, GLM, MINIMAX, HARMONY, DEEPSEEK_V31, DEEPSEEK_R1, DEEPSEEK_V32,
        DEEPSEEK_V4, KIMI_K2,
        MISTRAL_ARGS, MISTRAL, LLAMA3, GRANITE, FIREFUNCTION, COMMAND_R7B, COMMAND_R_PLUS,
        FUNCTIONARY_V31,
        FUNCTIONARY_V32, GEMMA4, PHI4, LFM2, PYTHONIC, JSON, GENERIC,
    )
}  # fmt: skip
PARSER_NAMES = ("auto", *FAMILIES)  # --tool-call-parser's choices


def detect(template_source: str, renders_tools: bool, override: str = "auto") -> ToolFormat:
    """The format a template's model uses, from markers in the template's own text (or the
    family named by --tool-call-parser)."""
    if override != "auto":
        if override not in FAMILIES:
            raise ValueError(f"unknown tool-call parser {override!r}; one of: {PARSER_NAMES}")
        return FAMILIES[override]
    s = template_source
    if "<function=" in s and "<parameter=" in s:
        return QWEN3_CODER
    if "<arg_key>" in s:
        return GLM
    if "<minimax:tool_call>" in s:
        return MINIMAX
    if "<|call|>" in s and "<|channel|>" in s:
        return HARMONY
    if "<|tool_call_begin|>" in s:
        return KIMI_K2
    if "｜DSML｜" in s:  # DeepSeek V3.2 and V4 build their markers from this token
        return DEEPSEEK_V32 if "function_calls>" in s else DEEPSEEK_V4
    if "tool▁call▁begin" in s:
        return DEEPSEEK_R1 if "```json" in s else DEEPSEEK_V31
    if "<|tool_call>" in s and "<tool_call|>" in s:
        return GEMMA4
    if "<|tool_call_start|>" in s or "List of tools: " in s:  # as llama.cpp tells LFM2
        return LFM2
    if "[func_name1(" in s:  # Llama 4's instruction to call in Python's syntax
        return PYTHONIC
    if "<|START_ACTION|>" in s:
        return COMMAND_R7B
    if "Action:" in s and "tool_name" in s:  # Command R+'s instruction and its calls
        return COMMAND_R_PLUS
    if "<tool_call>" in s:
        return HERMES
    if "[TOOL_CALLS]" in s:
        return MISTRAL_ARGS if "[ARGS]" in s else MISTRAL
    if "<|/tool|>" in s:
        return PHI4
    if "<|tool_call|>" in s:
        return GRANITE
    if "functools[" in s:
        return FIREFUNCTION
    if ">>>" in s and "all" in s:
        return FUNCTIONARY_V32
    if "<function=" in s:
        return FUNCTIONARY_V31
    if "<|python_tag|>" in s or ("<|start_header_id|>" in s and "ipython" in s):
        return LLAMA3
    return JSON if renders_tools else GENERIC
