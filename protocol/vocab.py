"""A fingerprint of a model's vocabulary, so gateways refuse to serve a worker they cannot read.

The worker sends it in ModelInfo; a gateway computes the same function over its vocab-only
copy of the model and compares. Pure: each side reads its own tokens from llama.cpp and
passes them here, so the two peers share this function and nothing else.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable


def vocab_fingerprint(tokens: Iterable[tuple[bytes, int]]) -> str:
    """sha256 hex digest over every token's (text, attribute bits), in id order.

    Each token contributes its text's length, the text's bytes and its attribute bits, so no
    two different vocabularies can hash alike by shifting bytes between tokens.
    """
    tokens = list(tokens)
    digest = hashlib.sha256(struct.pack("<q", len(tokens)))
    for text, attributes in tokens:
        digest.update(struct.pack("<qi", len(text), attributes))
        digest.update(text)
    return digest.hexdigest()
