"""Structured output after thinking (gateway/text/think_grammar.py): the wrapped grammar,
compiled by llguidance on the tiny model's vocabulary and walked token by token as the
worker walks it, takes any thinking and then only what the original grammar takes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loomserve.gateway.text.grammar import grammar_error, json_schema_lark
from loomserve.gateway.text.reasoning import family_named
from loomserve.gateway.text.think_grammar import after_thinking
from loomserve.gateway.text.tokenizer import Vocab
from tests.grammars import grammar_accepts

JSON_ANSWER = json_schema_lark(
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
)
TOOL_ANSWER = 'start: "<" "t" "o" "o" "l" ">" %json {"type": "object"}\n'


@pytest.fixture(scope="module")
def vocab(tiny_model_path: Path) -> Iterator[Vocab]:
    loaded = Vocab(tiny_model_path)
    yield loaded
    loaded.close()


@pytest.mark.parametrize("name", ["deepseek_r1", "mistral", "seed_oss", "gpt_oss"])
def test_thinking_then_the_answer(vocab: Vocab, name: str) -> None:
    family = family_named(name)
    grammar = after_thinking(JSON_ANSWER, family, inside=False)
    assert grammar_error(grammar) is None
    thought = "a < b, so </ is not the end; <thinking> either"
    assert grammar_accepts(vocab, grammar, f'{family.start}{thought}{family.end}\n\n{{"a": 12}}')
    assert grammar_accepts(vocab, grammar, '{"a": 12}')  # no block: the answer alone
    assert not grammar_accepts(vocab, grammar, f"{family.start}x{family.end}not json")
    inside = after_thinking(JSON_ANSWER, family, inside=True)
    assert grammar_accepts(vocab, inside, f'{thought}{family.end}{{"a": 1}}')
    assert not grammar_accepts(vocab, inside, '{"a": 1}')  # the block is open: it must end first


def test_an_answer_that_opens_like_the_block_is_still_taken(vocab: Vocab) -> None:
    """`<think>` and the answer's `<tool>` share their first character: the answer alone
    is taken, as is the block before it."""
    family = family_named("deepseek_r1")
    grammar = after_thinking(TOOL_ANSWER, family, inside=False)
    assert grammar_accepts(vocab, grammar, '<tool>{"x": 1}')
    assert grammar_accepts(vocab, grammar, '<think>hm</think><tool>{"x": 1}')


def test_think_text_never_holds_the_end_marker(vocab: Vocab) -> None:
    family = family_named("deepseek_r1")
    grammar = after_thinking(JSON_ANSWER, family, inside=True)
    # The first </think> ends the thinking: text after it must be the answer.
    assert not grammar_accepts(vocab, grammar, 'x </think> y </think>{"a": 1}')
    assert grammar_accepts(vocab, grammar, 'x </thin y </think>{"a": 1}')
