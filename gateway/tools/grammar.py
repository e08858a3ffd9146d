"""A GBNF grammar that forces a tool call: for tool_choice `required` or a named function.

Each function's call is the JSON object {"name": <its name>, <arguments_key>: <arguments>},
name first, its arguments held to the function's JSON schema by llama.cpp's schema converter;
the format's markers are written around the calls, so the parser reads them back as calls.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from llama_cpp.llama_grammar import SchemaConverter

from loomserve.gateway.text.grammar import schema_problem
from loomserve.gateway.tools.format import ToolFormat

# A character of a JSON string: anything but a quote, a backslash or a control character,
# or an escape.
STRICT_CHAR_RULE = r'char ::= [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'


class ToolGrammarError(ValueError):
    """A function's parameters are a JSON schema the grammar converter cannot handle."""


def tool_grammar(
    fmt: ToolFormat, functions: list[tuple[str, dict[str, Any] | None]], parallel: bool
) -> str:
    """GBNF whose root is one call (several, when parallel and the format allows) of these
    (name, parameters schema) functions, in fmt's syntax."""
    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    alternatives = []
    for i, (name, parameters) in enumerate(functions):
        schema = copy.deepcopy(parameters) if parameters else {"type": "object"}
        problem = schema_problem(schema)  # bounded before the converter writes it out
        if problem:
            raise ToolGrammarError(f"function {name!r}: {problem}")
        try:
            # Each function's own "#/$defs/..." references resolve within its own schema.
            converter.resolve_refs(schema, f"tool-{i}")
            call = {
                "type": "object",
                "properties": {"name": {"const": name}, fmt.arguments_key: schema},
                "required": ["name", fmt.arguments_key],
                "additionalProperties": False,
            }
            alternatives.append(converter.visit(call, f"call-{i}"))
        except (AssertionError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ToolGrammarError(f"function {name!r}: unsupported JSON schema: {exc}") from exc
        except RecursionError as exc:
            raise ToolGrammarError(f"function {name!r}: the schema is too deep") from exc
    rules = [_strict_strings(converter.format_grammar()), f"call ::= {' | '.join(alternatives)}"]
    wrapped = f"{_literal(fmt.call_prefix)} call {_literal(fmt.call_suffix)}"
    if parallel and fmt.parallel:
        rules.append(f"wrapped-call ::= {wrapped}")
        calls = f"wrapped-call ({_literal(fmt.separator)} wrapped-call)*"
    else:
        calls = wrapped
    rules.append(f"root ::= {_literal(fmt.list_prefix)} {calls} {_literal(fmt.list_suffix)}")
    return "\n".join(rules) + "\n"


def _strict_strings(grammar: str) -> str:
    """llama-cpp-python's converter lets raw control characters into strings, which JSON
    forbids; llama.cpp's own converter keeps them out, as here."""
    lines = [
        STRICT_CHAR_RULE if line.startswith("char ::= ") else line for line in grammar.split("\n")
    ]
    return "\n".join(lines)


def _literal(text: str) -> str:
    """A GBNF string literal ("" when text is empty, which GBNF reads as nothing)."""
    return json.dumps(text) if text else ""
