"""Structured output after thinking: a grammar (a JSON schema's, a forced tool call's) that
constrains only what comes after the think block, so that a reasoning model still thinks.

The result is llguidance's top-level grammar (its JSON form) of two grammars: the think
block, then the answer (`@answer`, the request's own Lark). The block is any text up to the
family's end marker, matched lazily (llguidance's `suffix`: it ends at the first marker,
which it includes), then a little whitespace. When the prompt opened the block the reply
starts in it; otherwise the block is optional and must open with the start marker. Tokens
are their text with control tokens written out (worker/sampling/guidance.py), so markers that
are single tokens match too.
"""

from __future__ import annotations

import json

from .reasoning import ReasoningFamily

# Whitespace the model may write between the block's end and the answer (Qwen3: "\n\n").
GAP = r"/[ \t\n]{0,8}/"


def after_thinking(grammar: str, family: ReasoningFamily, inside: bool) -> str:
    """The grammar (Lark), preceded by the family's think block (mandatory when `inside`)."""
    block = "think-text think-gap"
    start = (
        f"start: {block} @answer"
        if inside
        else f"start: ({_characters(family.start)} {block})? @answer"
    )
    think = "\n".join(
        [
            start,
            f"think-text[suffix={_literal(family.end)}]: /(?s:.*)/",
            f"think-gap: {GAP}",
        ]
    )
    return json.dumps(
        {"grammars": [{"lark_grammar": think}, {"name": "answer", "lark_grammar": grammar}]}
    )


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _characters(text: str) -> str:
    """One literal per character: llguidance's lexer takes the longest lexeme it can, so a
    start marker written whole (`"<think>"`) would take the `<` that opens the answer's own
    marker (`<tool_call>`)."""
    return " ".join(_literal(char) for char in text)
