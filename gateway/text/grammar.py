"""A request's grammar, from `grammar` or `response_format`, as llguidance reads it, checked
before any worker sees it.

Every grammar becomes llguidance's Lark (docs/grammar.md): a request's GBNF is converted
(llguidance's gbnf_to_lark; a request may send Lark itself, starting with `start:` or
`%llguidance`), a JSON schema is inlined as `%json {...}` and compiled by llguidance itself.
The result is compiled here once with the workers' limits (protocol/limits.py), so a
grammar that cannot run is a 400 naming the problem, never a worker's error. A GBNF that
parses but can never finish (protocol.grammar_shape: a rule whose every alternative
recurses) is refused as well: its output could only end at max_tokens.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark, is_lark_syntax

from ...protocol.grammar_shape import grammar_shape_problem
from ...protocol.limits import grammar_problem, guidance_grammar_problem, parser_limits
from ..api.errors import invalid_request
from ..api.schemas import GenerationFields

# JSON in llguidance's output: properties in the schema's order; between tokens nothing, a
# space, or a newline and up to 20 spaces or tabs (compact, `{"a": 1}`, or pretty-printed:
# llama.cpp's converter's `space` rule; a small model given more writes whitespace until
# max_tokens); unknown keywords ignored, as llama.cpp's converter ignores them; `\u00fc`
# escapes as well as the characters.
JSON_OPTIONS = {
    "whitespace_flexible": True,
    "whitespace_pattern": r"(?: |\n[ \t]{0,20})?",
    "lenient": True,
    "json_allow_general_unicode_escapes": True,  # "Z\u00fcrich", as json.dumps writes it
}
MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 64
# The converter writes `maxLength: n` out as n nested groups; protocol.limits allows 1024.
MAX_SCHEMA_REPEAT = 1000
_REPEAT_KEYWORDS = frozenset(
    {"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"}
)
_PATTERN_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def request_grammar(request: GenerationFields) -> str | None:
    """The Lark grammar the request asks for, or None; a 400 for one that cannot be used."""
    fmt = request.response_format
    wants_json = fmt is not None and fmt.type != "text"
    if request.grammar and wants_json:
        raise invalid_request("give either grammar or a JSON response_format, not both", "grammar")
    if request.grammar:
        grammar, param = _requested_lark(request.grammar), "grammar"
    elif wants_json:
        grammar, param = _json_grammar(fmt), "response_format"
    else:
        return None
    error = grammar_error(grammar)
    if error:
        raise invalid_request(error, param)
    return grammar


def grammar_error(grammar: str) -> str | None:
    """Why llguidance cannot run this grammar (Lark or its JSON form) within the workers'
    limits, or None."""
    problem = guidance_grammar_problem(grammar)  # first: bounds what llguidance reads
    if problem:
        return problem
    message = LLMatcher.validate_grammar(grammar, limits=parser_limits())
    return f"the grammar cannot be used: {message}" if message else None


def json_schema_lark(schema: Any) -> str:
    """Lark whose output is JSON that the schema accepts (llguidance compiles the schema)."""
    if isinstance(schema, dict):
        schema = closed_objects(schema)
        schema["x-guidance"] = {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}
    return f"start: %json {json.dumps(schema)}\n"


def closed_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of the schema in which an object that lists its properties and says nothing of
    others allows none (`additionalProperties: false`), as llama.cpp's converter reads it
    (and OpenAI's strict mode requires): a model does not pad its answer with keys."""
    # Each dict and list copied once, in one walk without recursion (copy.deepcopy took most
    # of the 0.7 s a request of 128 tools of 800 properties spent in the gateway).
    if not isinstance(schema, dict):  # not a schema: the caller says so
        return schema
    copied = dict(schema)
    todo: list[dict[Any, Any] | list[Any]] = [copied]
    while todo:
        node = todo.pop()
        entries = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in list(entries):
            if isinstance(value, dict | list):
                node[key] = inner = dict(value) if isinstance(value, dict) else list(value)
                todo.append(inner)
        if isinstance(node, dict) and "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
    return copied


def _requested_lark(text: str) -> str:
    """A request's own grammar as Lark: GBNF converted (a 400 naming what cannot be), or
    Lark as it is."""
    problem = grammar_problem(text)
    if problem:
        raise invalid_request(problem, "grammar")
    if is_lark_syntax(text):
        return text
    problem = grammar_shape_problem(text)
    if problem:
        raise invalid_request(problem, "grammar")
    try:
        return any_to_lark(text)
    except RecursionError:
        raise invalid_request("the GBNF grammar nests too deeply", "grammar") from None
    except Exception as exc:  # the converter raises plain Exceptions, with the reason
        raise invalid_request(f"the GBNF grammar cannot be read: {exc}", "grammar") from None


def schema_problem(schema: Any) -> str | None:
    """Why a JSON schema is too large or too deep to convert, or None; walked without recursion."""
    try:
        size = len(json.dumps(schema))
    except (TypeError, ValueError, RecursionError):
        return "the JSON schema cannot be serialized"
    if size > MAX_SCHEMA_BYTES:
        return f"the JSON schema has {size} bytes; at most {MAX_SCHEMA_BYTES} are allowed"
    todo: list[tuple[Any, int]] = [(schema, 1)]
    while todo:
        node, depth = todo.pop()
        if depth > MAX_SCHEMA_DEPTH:
            return f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels"
        if isinstance(node, list):
            todo.extend((item, depth + 1) for item in node)
        elif isinstance(node, dict):
            for key, value in node.items():
                problem = _keyword_problem(key, value)
                if problem:
                    return problem
                todo.append((value, depth + 1))
    return None


def _keyword_problem(key: str, value: Any) -> str | None:
    if key in _REPEAT_KEYWORDS and isinstance(value, int) and value > MAX_SCHEMA_REPEAT:
        return f"{key} may be at most {MAX_SCHEMA_REPEAT} in a JSON schema"
    if key == "pattern" and isinstance(value, str):
        for match in _PATTERN_REPEAT.finditer(value):
            if any(len(n) > 4 or int(n) > MAX_SCHEMA_REPEAT for n in match.groups() if n):
                return f"pattern repetitions may be at most {MAX_SCHEMA_REPEAT} in a JSON schema"
    return None


def _json_grammar(fmt: Any) -> str:
    schema = fmt.schema_
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise invalid_request("json_schema needs a schema", "response_format.json_schema")
        schema = fmt.json_schema.schema_
    if schema is None:
        schema = {"type": "object"}  # json_object: any object
    problem = schema_problem(schema)
    if problem:
        raise invalid_request(problem, "response_format")
    return json_schema_lark(schema)
