"""A GBNF grammar that forces a tool call: for tool_choice `required` or a named function.

Each function's call is the JSON object {"name": <its name>, <arguments_key>: <arguments>},
name first, its arguments held to the function's JSON schema by llama.cpp's schema converter;
the format's markers are written around the calls, so the parser reads them back as calls.

A string whose schema sets no maxLength may hold at most MAX_TOOL_STRING_CHARS characters
(beyond its minLength): a small model forced into a call can otherwise write one string until
max_tokens (`{"tz": "UTC-00:00:00:00:...`), and the call never ends.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from llama_cpp.llama_grammar import SchemaConverter

from loomserve.gateway.text.grammar import MAX_SCHEMA_REPEAT, schema_problem
from loomserve.gateway.tools.format import ToolFormat, XmlArguments
from loomserve.gateway.tools.framed import schema_types

# A character of a JSON string: anything but a quote, a backslash or a control character,
# or an escape.
STRICT_CHAR_RULE = r'char ::= [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'
# The most characters a string of a forced call's arguments holds where its schema sets no
# maxLength: the largest maxLength a schema may set (text/grammar.py's MAX_SCHEMA_REPEAT).
MAX_TOOL_STRING_CHARS = MAX_SCHEMA_REPEAT
# A string's characters, unbounded (how the converter writes a string without maxLength),
# or a GBNF literal or character class, which is left as it is.
_ANY_CHARS = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|(?<![\w-])(?:char|\(char\))\*')


class ToolGrammarError(ValueError):
    """A function's parameters are a JSON schema the grammar converter cannot handle."""


def tool_grammar(
    fmt: ToolFormat, functions: list[tuple[str, dict[str, Any] | None]], parallel: bool
) -> str:
    """GBNF whose root is one call (several, when parallel and the format allows) of these
    (name, parameters schema) functions, in fmt's syntax."""
    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    alternatives: list[str] = []
    framed_rules: list[str] = []  # the framed calls' own rules, beside the converter's
    for i, (name, parameters) in enumerate(functions):
        schema = copy.deepcopy(parameters) if parameters else {"type": "object"}
        problem = schema_problem(schema)  # bounded before the converter writes it out
        if problem:
            raise ToolGrammarError(f"function {name!r}: {problem}")
        try:
            # Each function's own "#/$defs/..." references resolve within its own schema.
            converter.resolve_refs(schema, f"tool-{i}")
            if fmt.framed is not None:
                alternatives.append(_framed_call(converter, fmt, i, name, schema, framed_rules))
                continue
            head = {fmt.index_key: {"type": "string", "pattern": "^[0-9]{1,3}$"}}
            properties = {fmt.name_key: {"const": name}, fmt.arguments_key: schema}
            call = {
                "type": "object",
                "properties": {**head, **properties} if fmt.index_key else properties,
                "required": [*([fmt.index_key] if fmt.index_key else []), *properties],
                "additionalProperties": False,
            }
            alternatives.append(converter.visit(call, f"call-{i}"))
        except (AssertionError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ToolGrammarError(f"function {name!r}: unsupported JSON schema: {exc}") from exc
        except RecursionError as exc:
            raise ToolGrammarError(f"function {name!r}: the schema is too deep") from exc
    rules = [_bounded_strings(converter.format_grammar()), *framed_rules]
    rules.append(f"call ::= {' | '.join(alternatives)}")
    wrapped = f"{_literal(fmt.call_prefix)} call {_literal(fmt.call_suffix)}"
    separator = fmt.separator
    if fmt.framed is not None and fmt.starts_in_call:  # the prompt opened the first call
        separator += fmt.framed.opens[0]
    if parallel and fmt.parallel:
        rules.append(f"wrapped-call ::= {wrapped}")
        calls = f"wrapped-call ({_literal(separator)} wrapped-call)*"
    else:
        calls = wrapped
    rules.append(f"root ::= {_literal(fmt.list_prefix)} {calls} {_literal(fmt.list_suffix)}")
    return "\n".join(rules) + "\n"


def _framed_call(
    converter: SchemaConverter,
    fmt: ToolFormat,
    i: int,
    name: str,
    schema: dict[str, Any],
    rules: list[str],
) -> str:
    """The rule of one function's framed call (format.py's Framed), its arguments held to
    the schema: a JSON object, or one XML-ish element per parameter."""
    framed = fmt.framed
    assert framed is not None
    opener = "" if fmt.starts_in_call or not framed.opens else framed.opens[0]
    before, _, after = framed.name_written.partition("{name}")
    written = [_literal(opener + before.replace("{index}", ""))]
    written += [_literal(name)]
    index_parts = after.split("{index}")
    written += [_literal(index_parts[0])]
    for part in index_parts[1:]:  # Kimi's functions.NAME:0
        written += ["[0-9]{1,3}", _literal(part)]
    if framed.string_quote:
        arguments = _quoted_arguments(converter, framed.string_quote, i, schema, rules)
    elif framed.python_args:
        arguments = _python_arguments(converter, i, schema, rules)
    elif framed.xml is None:
        arguments = converter.visit(schema, f"call-{i}-arguments")
    else:
        arguments = _xml_arguments(converter, framed.xml, i, schema, rules)
    parts = [*written, _literal(framed.written_after_name), arguments]
    parts += [_literal(framed.written_after_args + framed.close)]
    rules.append(f"call-{i}-framed ::= " + " ".join(p for p in parts if p))
    return f"call-{i}-framed"


def _xml_arguments(
    converter: SchemaConverter,
    xml: XmlArguments,
    i: int,
    schema: dict[str, Any],
    rules: list[str],
) -> str:
    """One element per parameter, in the schema's order (the optional ones optional); a
    string's text is any characters but `<`, as many as its minLength and maxLength allow
    (without a maxLength, at most MAX_TOOL_STRING_CHARS beyond its minLength)."""
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    newline = _literal("\n") if xml.trim_newline else ""
    elements = []
    for j, (key, value_schema) in enumerate(properties.items()):
        if schema_types(value_schema) == {"string"} and "enum" not in value_schema:
            low = int(value_schema.get("minLength", 0))
            high = int(value_schema.get("maxLength", low + MAX_TOOL_STRING_CHARS))
            value = f"[^<]{{{low},{high}}}"
        else:
            value = converter.visit(value_schema, f"call-{i}-p{j}")
        head = _literal(xml.key_open + key + xml.key_close + xml.value_open)
        element = " ".join(
            p
            for p in (head, newline, value, newline, _literal(xml.value_close + xml.separator))
            if p
        )
        elements.append(f"({element})" + ("" if key in required else "?"))
    rules.append(f"call-{i}-parameters ::= " + (" ".join(elements) or '""'))
    return f"call-{i}-parameters"


def _quoted_arguments(
    converter: SchemaConverter,
    quote: str,
    i: int,
    schema: dict[str, Any],
    rules: list[str],
) -> str:
    """Gemma 4's arguments: `{key:value,...}` with bare keys in sorted order (as its template
    writes them), the required ones first, and strings between quote markers; other values
    as JSON. Optional parameters after the first are each optional."""
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    keys = sorted(properties, key=lambda k: (k not in required, k))
    members = []
    for j, key in enumerate(keys):
        value_schema = properties[key]
        if schema_types(value_schema) == {"string"} and "enum" not in value_schema:
            low = int(value_schema.get("minLength", 0))
            high = int(value_schema.get("maxLength", low + MAX_TOOL_STRING_CHARS))
            value = f"{_literal(quote)} [^<]{{{low},{high}}} {_literal(quote)}"
        else:
            value = converter.visit(value_schema, f"call-{i}-q{j}")
        members.append((key in required, f"{_literal(key + ':')} {value}"))
    body = ""
    for n, (needed, member) in enumerate(members):
        part = member if n == 0 else f'"," {member}'
        body += f" {part}" if needed or n == 0 else f" ({part})?"
    if members and not members[0][0]:  # nothing required: no arguments at all is a call too
        body = f" ({body.strip()})?"
    rules.append(f'call-{i}-quoted ::= "{{"{body} "}}"')
    return f"call-{i}-quoted"


# A character of a Python string in double quotes, escaped as JSON escapes it (which Python
# reads alike; JSON's `\/` is left out, as Python keeps its backslash).
PYTHON_CHAR_RULE = r'python-char ::= [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4})'


def _python_arguments(
    converter: SchemaConverter, i: int, schema: dict[str, Any], rules: list[str]
) -> str:
    """Python keyword arguments (`city="Paris", days=3`), the required ones first, each in the
    schema's order; strings in double quotes (as many characters as _xml_arguments allows),
    booleans True/False, None; other values as JSON (which the parser reads too)."""
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    keys = sorted(properties, key=lambda k: k not in required)  # stable: the schema's order
    members = []
    for j, key in enumerate(keys):
        value_schema = properties[key]
        types = schema_types(value_schema)
        if types == {"string"} and "enum" not in value_schema:
            low = int(value_schema.get("minLength", 0))
            high = int(value_schema.get("maxLength", low + MAX_TOOL_STRING_CHARS))
            value = f'"\\"" python-char{{{low},{high}}} "\\""'
        elif types == {"boolean"}:
            value = '("True" | "False")'
        elif types == {"null"}:
            value = '"None"'
        else:
            value = converter.visit(value_schema, f"call-{i}-k{j}")
        members.append((key in required, f"{_literal(key + '=')} {value}"))
    if PYTHON_CHAR_RULE not in rules:
        rules.append(PYTHON_CHAR_RULE)
    body = ""
    for n, (needed, member) in enumerate(members):
        part = member if n == 0 else f'", " {member}'
        body += f" {part}" if needed or n == 0 else f" ({part})?"
    if members and not members[0][0]:  # nothing required: no arguments at all is a call too
        body = f" ({body.strip()})?"
    rules.append(f"call-{i}-keywords ::= {body.strip() or chr(34) * 2}")
    return f"call-{i}-keywords"


def _bounded_strings(grammar: str) -> str:
    """Strings of JSON's characters only, each at most MAX_TOOL_STRING_CHARS long.

    llama-cpp-python's converter lets raw control characters into strings, which JSON
    forbids; llama.cpp's own converter keeps them out, as here. An unbounded `char*` (or
    `(char)*`, after a minLength) becomes `char{0,N}`, which llama.cpp expands once, into
    rules that do not nest (whereas a schema's maxLength is written out as N nested groups).
    """
    bounded = f"char{{0,{MAX_TOOL_STRING_CHARS}}}"

    def bound(match: re.Match[str]) -> str:
        return match.group() if match.group()[0] in '"[' else bounded

    lines = [
        STRICT_CHAR_RULE if line.startswith("char ::= ") else _ANY_CHARS.sub(bound, line)
        for line in grammar.split("\n")
    ]
    return "\n".join(lines)


def _literal(text: str) -> str:
    """A GBNF string literal ("" when text is empty, which GBNF reads as nothing)."""
    return json.dumps(text) if text else ""
