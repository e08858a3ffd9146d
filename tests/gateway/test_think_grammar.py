"""Structured output after thinking (gateway/text/think_grammar.py): the wrapped grammar,
compiled by llama.cpp on the tiny model's vocabulary and walked token by token as the
worker walks it, takes any thinking and then only what the original grammar takes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import llama_cpp as llama
import pytest

from loomserve.gateway.text.reasoning import family_named
from loomserve.gateway.text.think_grammar import _rename_root, after_thinking
from loomserve.gateway.text.tokenizer import Vocab
from loomserve.worker.engine.grammar_state import GrammarState, _stacks, grammar_vocab

JSON_ANSWER = 'root ::= "{" ws "\\"a\\":" ws [0-9]+ ws "}"\nws ::= [ ]?'


@pytest.fixture(scope="module")
def vocab(tiny_model_path: Path) -> Iterator[Vocab]:
    loaded = Vocab(tiny_model_path)
    yield loaded
    loaded.close()


def walk(vocab: Vocab, grammar: str, text: str) -> tuple[bool, int]:
    """Whether the grammar takes the text (one token at a time, as the worker samples) and
    ends there, and the most parse stacks it kept on the way."""
    sampler = llama.llama_sampler_init_grammar(vocab.vocab, grammar.encode(), b"root")
    assert sampler, grammar
    state = GrammarState(sampler, grammar_vocab(vocab.vocab, vocab.n_tokens))
    most = 0
    try:
        for token in _byte_tokens(vocab, text):
            if not state.allows(token):
                return False, most
            state.accept(token)
            most = max(most, _stacks(sampler)[1])
        return state.allows(vocab.eos_id), most
    finally:
        state.close()


def _byte_tokens(vocab: Vocab, text: str) -> list[int]:
    """The text as one token per byte (the tokenizer would put a space before it)."""
    by_byte = {}
    for token in range(vocab.n_tokens):
        piece = vocab.piece(token)
        if len(piece) == 1:
            by_byte.setdefault(piece, token)
    return [by_byte[bytes([b])] for b in text.encode()]


@pytest.mark.parametrize("name", ["deepseek_r1", "mistral", "seed_oss", "gpt_oss"])
def test_thinking_then_the_answer(vocab: Vocab, name: str) -> None:
    family = family_named(name)
    grammar = after_thinking(JSON_ANSWER, family, inside=False)
    thought = "a < b, so </ is not the end; <thinking> either"
    taken, stacks = walk(vocab, grammar, f'{family.start}{thought}{family.end}\n\n{{"a": 12}}')
    assert taken and stacks <= 16
    assert walk(vocab, grammar, '{"a": 12}')[0]  # no block: the answer alone
    assert not walk(vocab, grammar, f"{family.start}x{family.end}not json")[0]
    inside = after_thinking(JSON_ANSWER, family, inside=True)
    assert walk(vocab, inside, f'{thought}{family.end}{{"a": 1}}')[0]
    assert not walk(vocab, inside, '{"a": 1}')[0]  # the block is open: it must end first


def test_think_text_never_holds_the_end_marker(vocab: Vocab) -> None:
    family = family_named("deepseek_r1")
    grammar = after_thinking(JSON_ANSWER, family, inside=True)
    # The first </think> ends the thinking: text after it must be the answer.
    assert not walk(vocab, grammar, 'x </think> y </think>{"a": 1}')[0]


def test_root_is_renamed_outside_literals_and_classes() -> None:
    grammar = 'root ::= "root" [root] item # root\nitem ::= root-x | root\nroot-x ::= "a"'
    assert _rename_root(grammar, "think-answer") == (
        'think-answer ::= "root" [root] item # root\nitem ::= root-x | think-answer\nroot-x ::= "a"'
    )
