"""A grammar (llguidance's Lark) that forces a tool call: for tool_choice `required` or a
named function.

Each function's call is the JSON object {"name": <its name>, <arguments_key>: <arguments>},
name first, its arguments held to the function's JSON schema by llguidance (`%json {...}`,
compiled by llguidance itself); the format's markers are written around the calls, so the
parser reads them back as calls. Framed formats (format.py's Framed) write the name in their
own syntax and the arguments as JSON, as XML-ish elements, as Python keywords or as Gemma 4's
quoted members.

A string whose schema sets no maxLength may hold at most MAX_TOOL_STRING_CHARS characters
(beyond its minLength): a small model forced into a call can otherwise write one string until
max_tokens (`{"tz": "UTC-00:00:00:00:...`), and the call never ends.
"""

from __future__ import annotations

import json
from typing import Any

from ...protocol.limits import MAX_GUIDANCE_GRAMMAR_BYTES
from ..text.grammar import (
    JSON_OPTIONS,
    MAX_SCHEMA_REPEAT,
    closed_objects,
    schema_problem,
)
from .format import ToolFormat, XmlArguments
from .framed import schema_types

# The most characters a string of a forced call's arguments holds where its schema sets no
# maxLength: the largest maxLength a schema may set (text/grammar.py's MAX_SCHEMA_REPEAT).
MAX_TOOL_STRING_CHARS = MAX_SCHEMA_REPEAT
# A call's JSON as templates write it (json.dumps, `tojson`): `{"a": 1, "b": [2, 3]}`, no
# other whitespace, so that a model's calls are written one way (and a repeated call is seen
# to be one).
CALL_JSON = {
    **{key: value for key, value in JSON_OPTIONS.items() if key != "whitespace_pattern"},
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# An integer of a forced call without bounds has at most 15 digits (llama.cpp's converter's
# bound): a small model otherwise writes digits until max_tokens.
LARGEST_TOOL_INTEGER = 10**15 - 1
# A character of a Python string in double quotes, escaped as JSON escapes it (which Python
# reads alike; JSON's `\/` is left out, as Python keeps its backslash).
PYTHON_CHAR = r'(?:[^"\\\x7F\x00-\x1F]|\\(?:["\\bfnrt]|u[0-9a-fA-F]{4}))'


class ToolGrammarError(ValueError):
    """A function's parameters are a JSON schema the grammar converter cannot handle."""


def tool_grammar(
    fmt: ToolFormat, functions: list[tuple[str, dict[str, Any] | None]], parallel: bool
) -> str:
    """Lark whose start is one call (several, when parallel and the format allows) of these
    (name, parameters schema) functions, in fmt's syntax."""
    alternatives: list[str] = []
    rules: list[str] = []  # the framed calls' own rules
    size, counted = 0, 0  # the rules' bytes so far, and how many rules that counts
    for i, (name, parameters) in enumerate(functions):
        # Stop where the grammar is already over the limit: 128 functions of 800 properties
        # each took the gateway 0.7 s to write out whole only to refuse it.
        size += sum(len(rule.encode()) for rule in rules[counted:])
        counted = len(rules)
        if size > MAX_GUIDANCE_GRAMMAR_BYTES:
            raise ToolGrammarError(
                f"the grammar has more than {size} bytes with the first {i} of "
                f"{len(functions)} functions alone; at most {MAX_GUIDANCE_GRAMMAR_BYTES} "
                "are allowed"
            )
        schema = closed_objects(parameters) if parameters else {"type": "object"}
        problem = schema_problem(schema)  # bounded before anything reads it
        if problem:
            raise ToolGrammarError(f"function {name!r}: {problem}")
        if not isinstance(schema, dict):
            raise ToolGrammarError(f"function {name!r}: its parameters are not a JSON schema")
        _bound_values(schema)
        if fmt.framed is not None:
            alternatives.append(_framed_call(fmt, i, name, schema, rules))
            continue
        head = {fmt.index_key: {"type": "string", "pattern": "^[0-9]{1,3}$"}}
        properties = {fmt.name_key: {"const": name}, fmt.arguments_key: schema}
        call = {
            "type": "object",
            "properties": {**head, **properties} if fmt.index_key else properties,
            "required": [*([fmt.index_key] if fmt.index_key else []), *properties],
            "additionalProperties": False,
            **_definitions(schema),  # its "#/$defs/..." references resolve from the call's root
        }
        rules.append(f"call-{i}: {_json(call)}")
        alternatives.append(f"call-{i}")
    rules.append(f"call: {' | '.join(alternatives)}")
    wrapped = _sequence(_literal(fmt.call_prefix), "call", _literal(fmt.call_suffix))
    separator = fmt.separator
    if fmt.framed is not None and fmt.starts_in_call:  # the prompt opened the first call
        separator += fmt.framed.opens[0]
    if parallel and fmt.parallel:
        rules.append(f"wrapped-call: {wrapped}")
        calls = _sequence("wrapped-call", f"({_sequence(_literal(separator), 'wrapped-call')})*")
    else:
        calls = wrapped
    rules.append("start: " + _sequence(_literal(fmt.list_prefix), calls, _literal(fmt.list_suffix)))
    return "\n".join(rules) + "\n"


def _framed_call(
    fmt: ToolFormat, i: int, name: str, schema: dict[str, Any], rules: list[str]
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
        written += ["/[0-9]{1,3}/", _literal(part)]
    if framed.string_quote:
        arguments = _quoted_arguments(framed.string_quote, i, schema, rules)
    elif framed.python_args:
        arguments = _python_arguments(i, schema, rules)
    elif framed.xml is None:
        arguments = _json(schema)
    else:
        arguments = _xml_arguments(framed.xml, i, schema, rules)
    parts = [*written, _literal(framed.written_after_name), arguments]
    parts += [_literal(framed.written_after_args + framed.close)]
    rules.append(f"call-{i}-framed: " + _sequence(*parts))
    return f"call-{i}-framed"


def _xml_arguments(xml: XmlArguments, i: int, schema: dict[str, Any], rules: list[str]) -> str:
    """One element per parameter, in the schema's order (the optional ones optional); a
    string's text is any characters but `<`, as many as its minLength and maxLength allow
    (without a maxLength, at most MAX_TOOL_STRING_CHARS beyond its minLength), or one of its
    enum's texts; other values are JSON."""
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    definitions = _definitions(schema)
    newline = _literal("\n") if xml.trim_newline else ""
    elements = []
    close = _literal(xml.value_close + xml.separator)
    ending = _regex_literal(("\n" if xml.trim_newline else "") + xml.value_close + xml.separator)
    for key, value_schema in properties.items():
        choices = value_schema.get("enum")
        texts = choices if isinstance(choices, list) and choices else None
        if texts is not None and not all(isinstance(text, str) for text in texts):
            texts = None  # an enum of numbers or mixed values: JSON, as written
        is_string = texts is not None or (
            schema_types(value_schema) == {"string"} and "enum" not in value_schema
        )
        head = _literal(xml.key_open + key + xml.key_closing(is_string) + xml.value_open)
        if is_string:
            # The text (as written: not JSON) and what closes it in one regex: as two lexemes,
            # the text (which may hold a newline) would take the newline that ends it.
            if texts is not None:
                text = "(?:" + "|".join(_regex_literal(t) for t in texts) + ")"
            else:
                text = f"[^<]{{{_string_bounds(value_schema)}}}"
            element = _sequence(head, newline, f"/{text}{ending}/")
        else:
            element = _sequence(head, newline, _json(value_schema, definitions), newline, close)
        elements.append(f"({element})" + ("" if key in required else "?"))
    rules.append(f"call-{i}-parameters: " + (" ".join(elements) or '""'))
    return f"call-{i}-parameters"


def _quoted_arguments(quote: str, i: int, schema: dict[str, Any], rules: list[str]) -> str:
    """Gemma 4's arguments: `{key:value,...}` with bare keys in sorted order (as its template
    writes them), the required ones first, and strings between quote markers; other values
    as JSON. Optional parameters after the first are each optional."""
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    keys = sorted(properties, key=lambda k: (k not in required, k))
    definitions = _definitions(schema)
    members = []
    for key in keys:
        value_schema = properties[key]
        if schema_types(value_schema) == {"string"} and "enum" not in value_schema:
            text = f"/[^<]{{{_string_bounds(value_schema)}}}/"
            value = _sequence(_literal(quote), text, _literal(quote))
        else:
            value = _json(value_schema, definitions)
        members.append((key in required, _sequence(_literal(key + ":"), value)))
    body = _members(members, '","')
    rules.append(f'call-{i}-quoted: "{{" {body} "}}"')
    return f"call-{i}-quoted"


def _python_arguments(i: int, schema: dict[str, Any], rules: list[str]) -> str:
    """Python keyword arguments (`city="Paris", days=3`), the required ones first, each in the
    schema's order; strings in double quotes (as many characters as _xml_arguments allows),
    booleans True/False, None; other values as JSON (which the parser reads too)."""
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    keys = sorted(properties, key=lambda k: k not in required)  # stable: the schema's order
    definitions = _definitions(schema)
    members = []
    for key in keys:
        value_schema = properties[key]
        types = schema_types(value_schema)
        if types == {"string"} and "enum" not in value_schema:
            value = f'/"{PYTHON_CHAR}{{{_string_bounds(value_schema)}}}"/'
        elif types == {"boolean"}:
            value = '("True" | "False")'
        elif types == {"null"}:
            value = '"None"'
        else:
            value = _json(value_schema, definitions)
        members.append((key in required, _sequence(_literal(key + "="), value)))
    rules.append(f"call-{i}-keywords: {_members(members, chr(34) + ', ' + chr(34))}")
    return f"call-{i}-keywords"


def _members(members: list[tuple[bool, str]], separator: str) -> str:
    """Members in order, separated, each optional one optional (with its separator); when
    none is required, no members at all too."""
    body = ""
    for n, (needed, member) in enumerate(members):
        part = member if n == 0 else f"{separator} {member}"
        body += f" {part}" if needed or n == 0 else f" ({part})?"
    if members and not members[0][0]:  # nothing required: no arguments at all is a call too
        body = f" ({body.strip()})?"
    return body.strip() or '""'


def _bound_values(schema: Any) -> None:
    """Give every string that sets no maxLength (and no enum, const or pattern, which bound
    it themselves) one, MAX_TOOL_STRING_CHARS beyond its minLength, and every integer without
    bounds 15 digits at most (LARGEST_TOOL_INTEGER, as llama.cpp's converter writes them). In
    place."""
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
        elif isinstance(node, dict):
            types = schema_types(node)
            fixed = {"enum", "const"} & node.keys()
            if (
                "string" in types
                and "maxLength" not in node
                and not fixed | {"pattern"} & node.keys()
            ):
                node["maxLength"] = _min_length(node) + MAX_TOOL_STRING_CHARS
            if "integer" in types and not fixed:
                node.setdefault("minimum", -LARGEST_TOOL_INTEGER)
                node.setdefault("maximum", LARGEST_TOOL_INTEGER)
            todo.extend(node.values())


def _string_bounds(schema: dict[str, Any]) -> str:
    """`low,high` of a string's length, for a regex's repetition."""
    low = _min_length(schema)
    high = schema.get("maxLength")
    return f"{low},{int(high) if isinstance(high, int) else low + MAX_TOOL_STRING_CHARS}"


def _min_length(schema: dict[str, Any]) -> int:
    low = schema.get("minLength", 0)
    return low if isinstance(low, int) and low >= 0 else 0


def _definitions(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema's definitions, taken out of it (in place): `$defs` and `definitions`, for
    the schema they are written into, whose root its `#/$defs/...` references then mean."""
    return {key: schema.pop(key) for key in ("$defs", "definitions") if key in schema}


def _json(schema: Any, definitions: dict[str, Any] | None = None) -> str:
    """llguidance's inline JSON schema, written as chat templates write a call's JSON
    (CALL_JSON), with the parameters' definitions for one parameter's schema."""
    if isinstance(schema, dict) and definitions:
        schema = {**schema, **definitions}
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**CALL_JSON, **(schema.get("x-guidance") or {})}}
    return f"%json {json.dumps(schema)}"


def _sequence(*parts: str) -> str:
    """Lark items in a row (empty ones left out; an empty row is the empty string)."""
    return " ".join(p for p in parts if p) or '""'


def _regex_literal(text: str) -> str:
    """Text as itself inside a Lark /regex/: its metacharacters, the slash and newlines
    escaped."""
    return "".join(
        r"\n" if char == "\n" else "\\" + char if char in _REGEX_META else char for char in text
    )


_REGEX_META = frozenset(r"\.+*?()|[]{}^$#&-~/")


def _literal(text: str) -> str:
    """Lark for this text: one literal per character ("" when text is empty: nothing to
    write). llguidance's lexer takes the longest lexeme it can, so a marker written as one
    literal that starts with another (the separator "\n" and the closing "\n</list>") would
    swallow the text that should have followed the shorter; single characters never do."""
    return " ".join(json.dumps(char) for char in text)
