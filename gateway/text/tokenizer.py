"""The model's vocabulary without its weights: tokenize, turn tokens into text.

The gateway owns text, so it loads the GGUF with vocab_only and never touches tensors.
"""

from __future__ import annotations

import codecs
import ctypes
import functools
import threading
from pathlib import Path
from typing import Protocol

import llama_cpp
import structlog

from ...protocol.vocab import vocab_fingerprint

GGML_LOG_ERROR, GGML_LOG_CONT = 4, 5  # ggml's levels; 1-3 are debug, info and warn
_llama_log = structlog.get_logger("llama.cpp")
_last_level = [0]  # a CONT piece belongs to the line before it


@llama_cpp.llama_log_callback
def _forward_llama_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    """llama.cpp's lines through structlog: its errors as errors, the rest at debug. The
    vocabulary load repeats what the worker's load of the same file says (a model's token
    type warnings, say), where the worker logs it at its proper level."""
    if level != GGML_LOG_CONT:
        _last_level[0] = level
    message = text.decode(errors="replace").strip()
    if message:
        (_llama_log.error if _last_level[0] == GGML_LOG_ERROR else _llama_log.debug)(message)


class Vocab:
    """A vocab-only llama.cpp model: the tokenizer the worker uses, shared read-only."""

    def __init__(self, model_path: Path) -> None:
        llama_cpp.llama_backend_init()
        # Not llama-cpp-python's own callback, which prints raw lines on stderr.
        llama_cpp.llama_log_set(_forward_llama_log, ctypes.c_void_p(0))
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), params)
        if not model:
            raise ValueError(f"cannot load the vocabulary of {model_path}")
        self.model = model
        self.vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_tokens: int = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.bos_id: int = llama_cpp.llama_vocab_bos(self.vocab)
        self.eos_id: int = llama_cpp.llama_vocab_eos(self.vocab)
        self.add_bos: bool = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        self.bos_text = self._special_text(self.bos_id)
        self.eos_text = self._special_text(self.eos_id)
        template = llama_cpp.llama_model_chat_template(model, None)
        self.chat_template: str | None = template.decode() if template else None
        self.architecture = self.meta("general.architecture")
        self._pieces: dict[int, bytes] = {}
        # One buffer per thread: requests are prepared (and detokenized) in threads too.
        self._local = threading.local()

    def close(self) -> None:
        """Free the llama.cpp model; the Vocab is unusable afterwards."""
        if self.model:
            llama_cpp.llama_model_free(self.model)
            self.model = None

    def fingerprint(self) -> str:
        """The same sha256 over the vocabulary that the worker puts in ModelInfo."""
        get_text, get_attr = llama_cpp.llama_vocab_get_text, llama_cpp.llama_vocab_get_attr
        return vocab_fingerprint(
            (get_text(self.vocab, token) or b"", get_attr(self.vocab, token))
            for token in range(llama_cpp.llama_vocab_n_tokens(self.vocab))
        )

    def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
        """Token ids of text; add_special adds BOS (and EOS) as the model wants them."""
        data = text.encode("utf-8", errors="replace")
        capacity = len(data) + 8
        while True:
            buffer = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(
                self.vocab, data, len(data), buffer, capacity, add_special, parse_special
            )
            if n >= 0:
                return buffer[:n]
            capacity = -n

    @functools.cached_property
    def longest_token(self) -> int:
        """Bytes of the longest token's text: no token stands for more text than this.

        (A token's text spells a space as `▁` or `Ġ` and a byte as `<0x0A>`: never shorter
        than the bytes it stands for.)"""
        get_text = llama_cpp.llama_vocab_get_text
        return max(len(get_text(self.vocab, token) or b"") for token in range(self.n_tokens))

    @functools.cached_property
    def context_train(self) -> int:
        """The model's training context from its GGUF metadata (0 when the file has none).

        llama_model_n_ctx_train reads 0 on a vocab-only load, so the metadata is read."""
        value = self.meta(f"{self.architecture}.context_length")
        return int(value) if value.isdigit() else 0

    def piece(self, token_id: int) -> bytes:
        """The bytes a generated token stands for; control tokens (BOS, EOS) render as nothing."""
        cached = self._pieces.get(token_id)
        if cached is None:
            cached = self._to_piece(token_id, special=False)
            self._pieces[token_id] = cached
        return cached

    def detokenize(self, token_ids: list[int]) -> str:
        """Text of token ids with special tokens written out, as llama-server's /detokenize."""
        data = b"".join(self._to_piece(t, special=True) for t in token_ids)
        return data.decode("utf-8", errors="replace")

    def text_of(self, token_id: int) -> str:
        """One token's own text, special tokens written out; for /tokenize's pieces."""
        return self._to_piece(token_id, special=True).decode("utf-8", errors="replace")

    def is_valid(self, token_id: int) -> bool:
        return 0 <= token_id < self.n_tokens

    def meta(self, key: str) -> str:
        """The GGUF metadata value of key, as text; empty when the file has none."""
        buffer = ctypes.create_string_buffer(128)
        n = llama_cpp.llama_model_meta_val_str(self.model, key.encode(), buffer, len(buffer))
        return buffer.value.decode(errors="replace") if n >= 0 else ""

    def _special_text(self, token_id: int) -> str:
        if token_id < 0:
            return ""
        return llama_cpp.llama_vocab_get_text(self.vocab, token_id).decode(errors="replace")

    def _to_piece(self, token_id: int, special: bool) -> bytes:
        buffer = getattr(self._local, "buffer", None)
        if buffer is None:
            buffer = self._local.buffer = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(self.vocab, token_id, buffer, len(buffer), 0, special)
        if n < 0:
            buffer = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token_id, buffer, -n, 0, special)
        return buffer.raw[:n]


class Pieces(Protocol):
    """What turning generated tokens into text needs of a vocabulary (Vocab has it)."""

    @property
    def n_tokens(self) -> int: ...  # token ids run from 0 to n_tokens - 1

    def piece(self, token_id: int) -> bytes: ...


class IncrementalDetokenizer:
    """Generated tokens to text as they come, holding back bytes of an unfinished character."""

    __slots__ = ("_decoder", "_vocab")

    def __init__(self, vocab: Pieces) -> None:
        self._vocab = vocab
        # A byte-level token may carry half of a multi-byte character; the incremental
        # decoder keeps such a tail until the next token completes it.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: list[int]) -> str:
        """The text that the new tokens complete."""
        piece = self._vocab.piece
        return self._decoder.decode(b"".join(piece(t) for t in token_ids))

    def push_one(self, token_id: int) -> str:
        return self._decoder.decode(self._vocab.piece(token_id))

    def flush(self) -> str:
        """What is held back, at the end of the stream; an unfinished character becomes U+FFFD."""
        return self._decoder.decode(b"", final=True)
