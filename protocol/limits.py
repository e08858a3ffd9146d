"""Limits on what a request may hand to a grammar parser, checked in pure Python first.

A request's GBNF is read by a converter that recurses per nested group and expands
repetitions (as llama.cpp's own parser does: `root ::= ((((...))))` 20,000 deep overflows a
stack, a few kilobytes of `"a"{0,1999}` make millions of rules): grammar_problem bounds it.
What the workers run is llguidance's grammar, which bounds its own nesting and work
(GRAMMAR_LIMITS); guidance_grammar_problem bounds its size. The gateway checks every grammar
it builds and the worker every grammar it receives, with the same functions, so that a peer
that speaks the wire protocol directly cannot crash either.
"""

from __future__ import annotations

import re

from llguidance import LLParserLimits

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
# An llguidance grammar (what the gateway sends): Lark with JSON schemas inlined, which
# llguidance compiles in milliseconds and bounds by GRAMMAR_LIMITS; 128 tools of a 8 KB schema
# each fit. Larger is refused before it is read: a 400 in microseconds, not minutes of compile.
MAX_GUIDANCE_GRAMMAR_BYTES = 1024 * 1024
# llguidance's own limits (LLParserLimits), the same in the gateway's check and the worker's
# matcher: each grammar's compile and each token's step is bounded by work done, not time.
# Its defaults, but for fewer lexer states (1-2 KB each: 100,000 is at most ~200 MB) and fewer
# Earley items a step. Items cost most where a grammar has many short lexemes: on Gemma's
# 262,144 tokens the audit's wide500 (500 alternatives of `[a-z ]* "q<i>z"`) reached the
# default 50,000 in 91-127 ms, and seven in one tick froze every stream for 0.9 s; at 10,000
# it fails its own request in about 18 ms. JSON schemas (a 300-value enum, anyOf of 20
# objects, nested arrays with patterns), GBNF word and list grammars and 64-tool call
# grammars in four formats all run at 5,000, under 5 ms a step (measured alike).
GRAMMAR_LIMITS: dict[str, int] = {
    "max_items_in_row": 2_000,  # the branching of one production row
    "initial_lexer_fuel": 1_000_000,  # building the lexer: ~50,000 a millisecond
    "step_lexer_fuel": 200_000,  # one token's lexer work: ~14,000 a millisecond
    "step_max_items": 10_000,  # one token's Earley items
    "max_lexer_states": 100_000,
    "max_grammar_size": 500_000,  # symbols in the grammar's productions
}


def parser_limits() -> LLParserLimits:
    """GRAMMAR_LIMITS as llguidance takes them, with errors that do not print the parser's
    state."""
    limits = GRAMMAR_LIMITS
    return LLParserLimits(
        max_items_in_row=limits["max_items_in_row"],
        initial_lexer_fuel=limits["initial_lexer_fuel"],
        step_lexer_fuel=limits["step_lexer_fuel"],
        step_max_items=limits["step_max_items"],
        max_lexer_states=limits["max_lexer_states"],
        max_grammar_size=limits["max_grammar_size"],
        verbose_errors=False,
    )


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


def guidance_grammar_problem(grammar: str) -> str | None:
    """Why this grammar (llguidance's Lark or JSON form) is too large to compile, or None.
    llguidance bounds the rest itself (nesting, GRAMMAR_LIMITS)."""
    return _size_problem(grammar, MAX_GUIDANCE_GRAMMAR_BYTES)


def _size_problem(grammar: str, limit: int) -> str | None:
    try:
        size = len(grammar.encode("utf-8"))
    except UnicodeEncodeError:
        return "the grammar is not valid UTF-8 text"
    if size > limit:
        return f"the grammar has {size} bytes; at most {limit} are allowed"
    return None


def grammar_problem(grammar: str) -> str | None:
    """Why this GBNF grammar must not reach a GBNF parser, or None when it may.

    A grammar that passes may still fail to parse; it can no longer crash the parser.
    """
    problem = _size_problem(grammar, MAX_GRAMMAR_BYTES)
    if problem:
        return problem
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
