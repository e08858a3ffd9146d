"""A fingerprint of a model's vocabulary, so gateways refuse to serve a worker they cannot read.

The worker sends it in ModelInfo; a gateway computes the same function on its vocab-only
copy of the model and compares. Both call vocab_fingerprint with a llama_vocab pointer:
`llama_cpp.llama_model_get_vocab(model)`.
"""

from __future__ import annotations

import hashlib
import struct

import llama_cpp as llama


def vocab_fingerprint(vocab: llama.llama_vocab_p) -> str:
    """sha256 hex digest over every token's text and attributes, in id order.

    `vocab` is a llama_vocab pointer (from llama_model_get_vocab), not a model pointer.
    Each token contributes its text's length, the text's bytes and its attribute bits,
    so no two different vocabularies can hash alike by shifting bytes between tokens.
    """
    n_tokens = llama.llama_vocab_n_tokens(vocab)
    digest = hashlib.sha256(struct.pack("<q", n_tokens))
    get_text, get_attr = llama.llama_vocab_get_text, llama.llama_vocab_get_attr
    for token in range(n_tokens):
        text = get_text(vocab, token) or b""
        digest.update(struct.pack("<qi", len(text), get_attr(vocab, token)))
        digest.update(text)
    return digest.hexdigest()
