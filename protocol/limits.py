"""Limits on what a request may hand to llama.cpp's native parsers, checked in pure Python.

llama.cpp parses GBNF by recursion, one C++ frame chain per nested group, and expands
repetitions into generated rules: `root ::= ((((...))))` 20,000 deep overflows the stack and
kills the process, and a few kilobytes of `"a"{0,1999}` make millions of rules. The gateway
checks every grammar it builds and the worker checks every grammar it receives, with the
same function, so that a hostile peer that speaks the wire protocol directly cannot crash it.
"""

from __future__ import annotations

import re

# The JSON schema converter writes maxLength out in full: 40 strings of at most 200
# characters make 69 KB of GBNF, which llama.cpp parses in 50 ms.
MAX_GRAMMAR_BYTES = 256 * 1024
# At most about 500 bytes of C++ stack per nested group (measured: 2,000 levels fit in a
# 1 MiB thread stack, 4,000 do not); threads here get 8 MiB. Deep enough for the
# `(a (a (a ...)?)?)?` that JSON schema's maxLength/maxItems turn into.
MAX_GRAMMAR_NESTING = 1024
# Grammar elements after llama.cpp expands repetitions (`x{3,5}` is x x x and two optional
# rules); its parse time and memory grow with them. 200,000 parse in about 50 ms.
MAX_GRAMMAR_ELEMENTS = 200_000
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries

# GBNF's tokens, as llama.cpp's parser reads them: a backslash escapes the next character
# in literals and classes, `#` starts a comment wherever a space may stand.
_GBNF_TOKEN = re.compile(
    r"""
      (?P<comment> \#[^\r\n]* )
    | (?P<chars> "(?:\\.|[^"\\])*"? | \[(?:\\.|[^\]\\])*\]? )
    | (?P<atom> <[^>]*>? | [\w-]+ | ::= | [|.] )
    | (?P<repeat> \{ _ (?P<min>\d+) _ (?: (?P<comma>,) _ (?P<max>\d*) _ )? \} )
    | (?P<op> [()*+?] )
    """.replace("_", r"(?:\s|\#[^\r\n]*)*"),  # spaces and comments, as parse_space skips
    re.VERBOSE | re.DOTALL,
)


def grammar_problem(grammar: str) -> str | None:
    """Why this GBNF grammar must not reach llama.cpp's parser, or None when it may.

    A grammar that passes may still fail to parse; it can no longer crash the parser.
    """
    try:
        size = len(grammar.encode("utf-8"))
    except UnicodeEncodeError:
        return "the grammar is not valid UTF-8 text"
    if size > MAX_GRAMMAR_BYTES:
        return f"the grammar has {size} bytes; at most {MAX_GRAMMAR_BYTES} are allowed"
    depth = 0
    elements = 0
    last = 1  # elements that repeating the previous item copies
    for token in _GBNF_TOKEN.finditer(grammar):
        kind, text = token.lastgroup, token.group()
        if kind == "comment":
            continue
        if kind == "chars":  # a literal or a class: about one element per character
            last = max(len(text) - 2, 1)
        elif kind == "atom":
            last = 1
        elif kind == "repeat":
            low = _count(token["min"])
            high = low if not token["comma"] else _count(token["max"]) if token["max"] else None
            # x{m,n}: m - 1 more copies inline, then n - m optional rules (one when unbounded)
            optional = 1 if high is None else max(high - low, 0)
            elements += last * (max(low - 1, 0) + optional) + 2 * optional
        elif text == "(":
            depth += 1
            if depth > MAX_GRAMMAR_NESTING:
                return f"the grammar nests groups deeper than {MAX_GRAMMAR_NESTING} levels"
        elif text == ")":
            depth = max(depth - 1, 0)
            last = 1  # a group is one reference to its own rule
        else:  # * + ?
            elements += last + 2
        elements += 1
        if elements > MAX_GRAMMAR_ELEMENTS:
            return f"the grammar's repetitions expand to more than {MAX_GRAMMAR_ELEMENTS} elements"
    return None


def _count(digits: str) -> int:
    # Python refuses to convert very long digit strings; anything this large is too many.
    return int(digits) if len(digits) <= 9 else 10**9
