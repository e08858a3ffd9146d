"""Grammars checked the way the worker runs them: llguidance over a model's vocabulary, with
the worker's tokenizer and limits (worker/sampling/guidance.py)."""

from __future__ import annotations

from llguidance import LLMatcher, LLTokenizer

from loomserve.gateway.text.tokenizer import Vocab
from loomserve.protocol.limits import parser_limits
from loomserve.worker.sampling.guidance import llguidance_tokenizer

_TOKENIZERS: dict[int, LLTokenizer] = {}


def tokenizer(vocab: Vocab) -> LLTokenizer:
    """The worker's llguidance tokenizer of this vocabulary (built once per Vocab)."""
    key = id(vocab)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = llguidance_tokenizer(vocab.vocab, vocab.n_tokens)
    return _TOKENIZERS[key]


def matcher(vocab: Vocab, grammar: str) -> LLMatcher:
    """A fresh matcher of the grammar, which must compile."""
    compiled = LLMatcher(tokenizer(vocab), grammar, log_level=0, limits=parser_limits())
    assert not compiled.is_error(), compiled.get_error()
    return compiled


def grammar_accepts(vocab: Vocab, grammar: str, text: str) -> bool:
    """Whether the grammar lets `text` through, one byte token at a time, and then lets the
    reply end."""
    byte_ids = {vocab.piece(i): i for i in range(vocab.n_tokens) if len(vocab.piece(i)) == 1}
    compiled = matcher(vocab, grammar)
    for token in (byte_ids[bytes([b])] for b in text.encode()):
        if not compiled.consume_token(token):
            return False
    return compiled.is_accepting()
