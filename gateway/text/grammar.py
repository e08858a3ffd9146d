"""A request's grammar, from `grammar` or `response_format`, checked before llama.cpp sees it.

JSON schemas become GBNF in llama-cpp-python's converter, which writes repetitions out in
full (`maxLength: 10000000` is an 80 MB grammar nested ten million groups deep), so a schema
is bounded before conversion; every grammar is then bounded again by protocol.limits before
llama.cpp's own parser, which recurses per nested group, compiles it. A grammar that parses
but can never finish (protocol.grammar_shape: a rule whose every alternative recurses)
is refused as well: llama.cpp would follow it until its parse stacks freeze the worker.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

from loomserve.gateway.api.errors import invalid_request
from loomserve.gateway.api.schemas import GenerationFields
from loomserve.gateway.text.tokenizer import Vocab
from loomserve.protocol.grammar_shape import grammar_shape_problem

MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 64
# The converter writes `maxLength: n` out as n nested groups; protocol.limits allows 1024.
MAX_SCHEMA_REPEAT = 1000
_REPEAT_KEYWORDS = frozenset(
    {"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"}
)
_PATTERN_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def request_grammar(request: GenerationFields, vocab: Vocab) -> str | None:
    """The GBNF grammar the request asks for, or None; a 400 for one that cannot be used."""
    fmt = request.response_format
    wants_json = fmt is not None and fmt.type != "text"
    if request.grammar and wants_json:
        raise invalid_request("give either grammar or a JSON response_format, not both", "grammar")
    if request.grammar:
        grammar, param = request.grammar, "grammar"
    elif wants_json:
        grammar, param = _json_grammar(fmt), "response_format"
    else:
        return None
    error = vocab.grammar_error(grammar) or grammar_shape_problem(grammar)
    if error:
        raise invalid_request(error, param)
    return grammar


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
        return JSON_GBNF
    problem = schema_problem(schema)
    if problem:
        raise invalid_request(problem, "response_format")
    try:
        return json_schema_to_gbnf(json.dumps(schema))
    except (AssertionError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise invalid_request(f"unsupported JSON schema: {exc}", "response_format") from exc
