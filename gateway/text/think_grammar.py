"""Structured output after thinking: a grammar (a JSON schema's, a forced tool call's) that
constrains only what comes after the think block, so that a reasoning model still thinks.

The grammar is wrapped: its `root` becomes another rule, and the new root is the think
block (free text that cannot hold the end marker, then the marker), then that rule. The
think text is a small automaton over the end marker's characters (one rule per prefix of the
marker matched so far, KMP's failure links), so the parse stays deterministic: a handful of
llama.cpp parse stacks at most, whatever the text. When the prompt opened the block the
reply starts in it; otherwise the block is optional and must open with the start marker.
llama.cpp matches a grammar's literals against each token's text with control tokens written
out, so markers that are single tokens match too.
"""

from __future__ import annotations

import json
import re

from loomserve.gateway.text.reasoning import ReasoningFamily

# Rule names no JSON-schema or tool grammar of ours uses.
PREFIX = "think-"
ANSWER = f"{PREFIX}answer"
# Whitespace the model may write between the block's end and the answer (Qwen3: "\n\n").
GAP = r"[ \t\n]{0,8}"
_RULE_NAME = re.compile(r"[a-zA-Z0-9-]+")


def after_thinking(grammar: str, family: ReasoningFamily, inside: bool) -> str:
    """The grammar, preceded by the family's think block (mandatory when `inside`)."""
    body = _rename_root(grammar, ANSWER)
    end = family.end
    block = f"{PREFIX}s0 {_literal(end)} {PREFIX}gap"
    if inside:
        root = f"root ::= {block} {ANSWER}"
    else:
        root = f"root ::= ({_literal(family.start)} {block})? {ANSWER}"
    rules = [root, f"{PREFIX}gap ::= {GAP}", *_without(end)]
    return "\n".join(rules) + "\n" + body


def _without(marker: str) -> list[str]:
    """Rules `think-s0` ... : any text that does not contain marker (any prefix of it may
    end the text: the marker itself follows)."""
    chars = sorted(set(marker))
    others = "[^" + "".join(_class_char(c) for c in chars) + "]"
    rules = []
    for state in range(len(marker)):
        options = [f"{others} {PREFIX}s0"]
        for char in chars:
            following = _next_state(marker, state, char)
            if following < len(marker):  # reaching the end would write the marker
                options.append(f"{_literal(char)} {PREFIX}s{following}")
        options.append('""')
        rules.append(f"{PREFIX}s{state} ::= " + " | ".join(options))
    return rules


def _next_state(marker: str, state: int, char: str) -> int:
    """How much of the marker is matched after `char`, with `state` characters matched."""
    text = marker[:state] + char
    for size in range(min(len(text), len(marker)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _class_char(char: str) -> str:
    return "\\" + char if char in "]^\\-[" else char


def _rename_root(grammar: str, name: str) -> str:
    """The grammar with its rule `root` (definition and references) named `name`; string
    literals, character classes and comments are left as they are."""
    out: list[str] = []
    i, n = 0, len(grammar)
    while i < n:
        char = grammar[i]
        if char in '"[':
            close = '"' if char == '"' else "]"
            j = i + 1
            while j < n and grammar[j] != close:
                j += 2 if grammar[j] == "\\" else 1
            out.append(grammar[i : j + 1])
            i = j + 1
        elif char == "#":
            j = grammar.find("\n", i)
            j = n if j < 0 else j
            out.append(grammar[i:j])
            i = j
        elif match := _RULE_NAME.match(grammar, i):
            word = match.group()
            out.append(name if word == "root" else word)
            i = match.end()
        else:
            out.append(char)
            i += 1
    return "".join(out)
