"""Python-style calls' arguments as JSON: `city="Paris", days=3` to `{"city": "Paris", ...}`.

Parsed by Python's ast, never run: literal values only (strings, numbers, booleans, None,
lists, tuples, sets, dicts with string keys), and JSON's true/false/null as well, which
models write inside Python calls. Used by framed.py (Llama 4's and LFM2's `[f(a=1)]`) and
parser.py (Llama 3.1's built-in tools, `brave_search.call(query="...")`).
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any


def python_arguments(text: str) -> str | None:
    """Python keyword arguments (`city="Paris", days=3`) as a JSON object's text; None when
    they are not keyword arguments of literal values. Parsed by Python's ast, never run."""
    try:
        tree = ast.parse(f"f({text})", mode="eval")
        call = tree.body
        if not isinstance(call, ast.Call) or call.args:
            return None
        arguments: dict[str, Any] = {}
        for keyword in call.keywords:
            if keyword.arg is None:  # **mapping
                return None
            arguments[keyword.arg] = _literal(keyword.value)
        return json.dumps(arguments, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


_NAMED_LITERALS = {"true": True, "false": False, "null": None}  # JSON's, in Python calls


def _literal(node: ast.expr) -> Any:
    """A literal's value (strings, numbers, booleans, None, lists, tuples, sets, dicts with
    string keys); ValueError for anything else (names, calls, operators)."""
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, (str, bool, int)):
            return value
        if isinstance(value, float) and math.isfinite(value):
            return value
        raise ValueError("not a JSON value")
    if isinstance(node, ast.Name) and node.id in _NAMED_LITERALS:
        return _NAMED_LITERALS[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("a sign before no number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_literal(element) for element in node.elts]
    if isinstance(node, ast.Dict):
        result = {}
        for key_node, value_node in zip(node.keys, node.values, strict=True):
            key = _literal(key_node) if key_node is not None else None  # None: **mapping
            if not isinstance(key, str):
                raise ValueError("a key that is no string")
            result[key] = _literal(value_node)
        return result
    raise ValueError("not a literal")


def leading_keywords(text: str) -> str | None:
    """The keyword arguments of a call cut short that are whole (each followed by a comma),
    as JSON text; None when none is."""
    commas = [i for i, ch in enumerate(text) if ch == ","]
    for at in reversed(commas):  # the longest run of whole keyword arguments
        arguments = python_arguments(text[:at])
        if arguments is not None:
            return arguments
    return None
