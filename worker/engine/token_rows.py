"""Tokens as embedding rows, exactly as llama.cpp's graph makes them: so one pass can carry
the streams' tokens and an image's embeddings together.

llama.cpp takes a batch of all tokens or all embeddings (llama-batch.cpp), so an image's
rows would otherwise go in passes of their own: each such pass reads every weight again,
and the streams that generate wait for it on top of their own pass. Given each token's input
row here, a tick's one pass holds both, every token written as its row: the image's rows
are then prompt rows like any other, planned, chunked and held to the latency target by the
scheduler.

A token's row is what the graph's get_rows gives: ggml's own dequantization of the model's
`token_embd.weight` (the type's `to_float`, the very function get_rows calls), read from the
model file through ggml's gguf calls and multiplied by the input scale an architecture puts
on token input alone (Gemma: sqrt(n_embd); on embeddings it scales by 1).

Exact or not at all: `probe` decodes the same tokens both ways and compares the logits bit
for bit. Any difference (another llama.cpp, an architecture that treats token input in
another way, a LoRA) and images keep passes of their own.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import llama_cpp as llama
import numpy as np
import structlog

from .native_fence import ggml_library

log = structlog.get_logger(__name__)

# Architectures whose graph scales token input only (`ubatch.token ? sqrtf(n_embd) : 1.0f`
# in llama.cpp's src/models/gemma*.cpp): a token's row carries that scale here.
SQRT_SCALED = frozenset({"gemma3", "gemma3n", "gemma4", "gemma-embedding"})
GGML_TYPE_F32 = 0
TOKEN_EMBD = b"token_embd.weight"


class _GgufInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


class _TypeTraits(ctypes.Structure):  # ggml.h's struct ggml_type_traits
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


_ToFloat = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


def _ggml_base() -> ctypes.CDLL:
    base = ctypes.CDLL(str(ggml_library("libggml-base.so")))
    base.gguf_init_from_file.argtypes = [ctypes.c_char_p, _GgufInitParams]
    base.gguf_init_from_file.restype = ctypes.c_void_p
    base.gguf_free.argtypes = [ctypes.c_void_p]
    base.gguf_find_tensor.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    base.gguf_find_tensor.restype = ctypes.c_int64
    base.gguf_get_data_offset.argtypes = [ctypes.c_void_p]
    base.gguf_get_data_offset.restype = ctypes.c_size_t
    base.gguf_get_tensor_offset.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    base.gguf_get_tensor_offset.restype = ctypes.c_size_t
    base.gguf_get_tensor_type.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    base.gguf_get_tensor_type.restype = ctypes.c_int
    base.gguf_get_tensor_size.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    base.gguf_get_tensor_size.restype = ctypes.c_size_t
    base.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    base.ggml_row_size.restype = ctypes.c_size_t
    base.ggml_get_type_traits.argtypes = [ctypes.c_int]
    base.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    return base


class TokenRows:
    """The model's token input rows, read from its file on demand (`rows`)."""

    def __init__(
        self,
        table: np.ndarray,
        n_embd: int,
        to_float: Callable[[int, int, int], None] | None,
        scale: float,
    ) -> None:
        self._table = table  # n_vocab rows of the file's bytes (or floats, for F32)
        self.n_vocab = table.shape[0]
        self.n_embd = n_embd
        self._to_float = to_float
        self._scale = np.float32(scale)

    @classmethod
    def load(
        cls, model_path: Path, model: llama.llama_model_p, architecture: str
    ) -> TokenRows | None:
        """The rows of the model file's token_embd (`architecture`: GGUF's
        general.architecture, for the input scale); None (and why, in the log) where they
        cannot be read: no such tensor in this file (a split model), or a size that is not
        n_vocab rows of n_embd."""
        base = _ggml_base()
        gguf = base.gguf_init_from_file(str(model_path).encode(), _GgufInitParams(True, None))
        if not gguf:
            log.info("token rows: ggml cannot read the model file", path=str(model_path))
            return None
        try:
            tensor = base.gguf_find_tensor(gguf, TOKEN_EMBD)
            if tensor < 0:
                log.info("token rows: no token_embd.weight in the model file")
                return None
            offset = base.gguf_get_data_offset(gguf) + base.gguf_get_tensor_offset(gguf, tensor)
            ggml_type = base.gguf_get_tensor_type(gguf, tensor)
            size = base.gguf_get_tensor_size(gguf, tensor)
        finally:
            base.gguf_free(gguf)
        n_embd = llama.llama_model_n_embd(model)
        n_vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model))
        row_bytes = base.ggml_row_size(ggml_type, n_embd)
        if llama.llama_model_n_embd_inp(model) != n_embd or size != n_vocab * row_bytes:
            log.info("token rows: token_embd is not n_vocab rows of n_embd", size=size)
            return None
        scale = float(np.sqrt(np.float32(n_embd))) if architecture in SQRT_SCALED else 1.0
        if ggml_type == GGML_TYPE_F32:
            floats = np.memmap(model_path, np.float32, "r", offset, (n_vocab, n_embd))
            return cls(floats, n_embd, None, scale)
        traits = base.ggml_get_type_traits(ggml_type).contents
        if not traits.to_float:
            log.info("token rows: ggml has no to_float for the type", ggml_type=ggml_type)
            return None
        raw = np.memmap(model_path, np.uint8, "r", offset, (n_vocab, row_bytes))
        return cls(raw, n_embd, _ToFloat(traits.to_float), scale)

    def rows(self, tokens: np.ndarray) -> np.ndarray:
        """Each token's input row (float32, len(tokens) x n_embd), as the graph's get_rows
        and input scale make it."""
        if self._to_float is None:
            out = np.array(self._table[tokens], dtype=np.float32)
        else:
            out = np.empty((len(tokens), self.n_embd), dtype=np.float32)
            stride, address = out.strides[0], out.ctypes.data
            for i, token in enumerate(tokens.tolist()):
                self._to_float(self._table[token].ctypes.data, address + i * stride, self.n_embd)
        if self._scale != 1.0:
            out *= self._scale
        return out
