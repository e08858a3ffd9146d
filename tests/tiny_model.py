"""A tiny llama-architecture GGUF, written with the `gguf` package, for fast engine tests.

Two layers, 64-dim, a SentencePiece-style vocabulary with all 256 byte tokens and no
duplicates. The weights are random but fixed, and large enough that the logits have clear
winners: greedy outputs then do not flip between batched and single-sequence kernels.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The dimensions of a generated model; the defaults are the tiny test model."""

    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_layer: int = 2
    n_ff: int = 128
    context_length: int = 1024
    extra_vocab: int = 0  # synthetic pieces beyond the word list, for realistic vocab sizes
    f16: bool = False


TINY = ModelShape()
# About the size of Gemma 3 270M, for benchmarks where the default model cannot travel.
BENCH_270M = ModelShape(
    n_embd=640,
    n_head=5,  # head size 128, which every llama.cpp attention kernel supports
    n_head_kv=1,
    n_layer=18,
    n_ff=2048,
    context_length=8192,
    extra_vocab=32000,
    f16=True,
)

WORDS = (
    "the a an and or of to in on is it that this with for as was be are at by from "
    "hello world story once upon time there lived small big cat dog tree house river "
    "say tell me you we they what how why when where who which one two three four five "
    "user assistant system question answer json name value true false null yes no"
).split()


def vocabulary(extra: int = 0) -> tuple[list[str], list[float], list[int]]:
    """Token texts, scores and types, SentencePiece style."""
    types = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>"]
    kinds = [types.UNKNOWN, types.CONTROL, types.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    kinds += [types.BYTE] * 256
    pieces = ["▁", *list(string.ascii_lowercase + string.ascii_uppercase + string.digits)]
    pieces += list(".,!?;:'\"()[]{}-_/*+=<>@#%&")
    pieces += ["▁" + c for c in string.ascii_lowercase + string.ascii_uppercase + string.digits]
    pieces += ["▁" + w for w in WORDS] + [w for w in WORDS if len(w) > 1]
    pieces += [f"▁w{i}" for i in range(extra)]
    seen: set[str] = set(tokens)
    for piece in pieces:
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
            kinds.append(types.NORMAL)
    # Longer pieces score higher, so the tokenizer merges into whole words when it can.
    scores = [0.0] * 259 + [float(len(t)) - 10.0 for t in tokens[259:]]
    return tokens, scores, [int(k) for k in kinds]


def write_tiny_model(
    path: Path,
    seed: int = 1234,
    shape: ModelShape = TINY,
    sampling: dict[str, float | int] | None = None,
    chat_template: str | None = None,
    pooling: int | None = None,
) -> Path:
    """Write a generated model (the tiny one unless shape says otherwise) to path; `sampling`
    adds general.sampling.* defaults (e.g. {"temp": 0.0, "top_k": 5}); with chat_template,
    the model ships that template; with pooling, it declares that pooling (4: rank, a
    reranker's)."""
    tokens, scores, token_types = vocabulary(shape.extra_vocab)
    dtype = np.float16 if shape.f16 else np.float32
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def weight(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        values = rng.standard_normal((rows, cols), dtype=np.float32) * (gain / np.sqrt(cols))
        return values.astype(dtype)

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name("tiny-llama-test")
    for key, value in (sampling or {}).items():
        if isinstance(value, int):
            writer.add_int32(f"general.sampling.{key}", value)
        else:
            writer.add_float32(f"general.sampling.{key}", value)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_dimension_count(shape.n_embd // shape.n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if shape.f16 else gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(token_types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    if pooling is not None:  # a llama_pooling_type: the model declares a pooling head
        writer.add_pooling_type(gguf.PoolingType(pooling))

    writer.add_tensor("token_embd.weight", weight(n_vocab, shape.n_embd, gain=8.0))
    writer.add_tensor("output_norm.weight", np.ones(shape.n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", weight(n_vocab, shape.n_embd, gain=6.0))
    head_dim = shape.n_embd // shape.n_head
    for layer in range(shape.n_layer):
        prefix = f"blk.{layer}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", np.ones(shape.n_embd, dtype=np.float32))
        writer.add_tensor(f"{prefix}.attn_q.weight", weight(shape.n_embd, shape.n_embd))
        writer.add_tensor(
            f"{prefix}.attn_k.weight", weight(shape.n_head_kv * head_dim, shape.n_embd)
        )
        writer.add_tensor(
            f"{prefix}.attn_v.weight", weight(shape.n_head_kv * head_dim, shape.n_embd)
        )
        writer.add_tensor(f"{prefix}.attn_output.weight", weight(shape.n_embd, shape.n_embd))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", np.ones(shape.n_embd, dtype=np.float32))
        writer.add_tensor(f"{prefix}.ffn_gate.weight", weight(shape.n_ff, shape.n_embd))
        writer.add_tensor(f"{prefix}.ffn_up.weight", weight(shape.n_ff, shape.n_embd))
        writer.add_tensor(f"{prefix}.ffn_down.weight", weight(shape.n_embd, shape.n_ff))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


if __name__ == "__main__":
    import sys

    target = Path(sys.argv[1] if len(sys.argv) > 1 else "tiny.gguf")
    size = sys.argv[2] if len(sys.argv) > 2 else "tiny"
    print(write_tiny_model(target, shape={"tiny": TINY, "bench-270m": BENCH_270M}[size]))
