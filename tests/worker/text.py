"""Text to token ids and back for the worker's tests, through the engine's own vocabulary: the
worker itself speaks only token ids (the gateways tokenize)."""

from __future__ import annotations

import ctypes

import llama_cpp as llama

from loomserve.worker.engine.engine import Engine


def tokenize(engine: Engine, text: str, add_special: bool = True) -> list[int]:
    data = text.encode()
    capacity = len(data) + 8
    buffer = (llama.llama_token * capacity)()
    n = llama.llama_tokenize(engine.vocab, data, len(data), buffer, capacity, add_special, False)
    if n < 0:
        raise ValueError("text too long to tokenize")
    return list(buffer[:n])


def detokenize(engine: Engine, tokens: list[int]) -> str:
    """The text of the tokens, special ones left out."""
    array = (llama.llama_token * len(tokens))(*tokens)
    capacity = 16 * len(tokens) + 16
    buffer = ctypes.create_string_buffer(capacity)
    n = llama.llama_detokenize(engine.vocab, array, len(tokens), buffer, capacity, True, False)
    return buffer.raw[: max(n, 0)].decode("utf-8", errors="replace")
