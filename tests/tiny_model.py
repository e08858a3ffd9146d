"""A tiny llama-architecture GGUF, written with the `gguf` package, for fast engine tests.

Two layers, 64-dim, a SentencePiece-style vocabulary with all 256 byte tokens and no
duplicates. The weights are random but fixed, and large enough that the logits have clear
winners: greedy outputs then do not flip between batched and single-sequence kernels.
"""

from __future__ import annotations

import string
from pathlib import Path

import gguf
import numpy as np

N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
N_LAYER = 2
N_FF = 128
CONTEXT_LENGTH = 1024

WORDS = (
    "the a an and or of to in on is it that this with for as was be are at by from "
    "hello world story once upon time there lived small big cat dog tree house river "
    "say tell me you we they what how why when where who which one two three four five "
    "user assistant system question answer json name value true false null yes no"
).split()


def vocabulary() -> tuple[list[str], list[float], list[int]]:
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
    seen: set[str] = set(tokens)
    for piece in pieces:
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
            kinds.append(types.NORMAL)
    # Longer pieces score higher, so the tokenizer merges into whole words when it can.
    scores = [0.0] * 259 + [float(len(t)) - 10.0 for t in tokens[259:]]
    return tokens, scores, [int(k) for k in kinds]


def write_tiny_model(path: Path, seed: int = 1234) -> Path:
    """Write the tiny model to path and return path."""
    tokens, scores, token_types = vocabulary()
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def weight(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name("tiny-llama-test")
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(token_types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)

    writer.add_tensor("token_embd.weight", weight(n_vocab, N_EMBD, gain=8.0))
    writer.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    writer.add_tensor("output.weight", weight(n_vocab, N_EMBD, gain=6.0))
    head_dim = N_EMBD // N_HEAD
    for layer in range(N_LAYER):
        prefix = f"blk.{layer}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        writer.add_tensor(f"{prefix}.attn_q.weight", weight(N_EMBD, N_EMBD))
        writer.add_tensor(f"{prefix}.attn_k.weight", weight(N_HEAD_KV * head_dim, N_EMBD))
        writer.add_tensor(f"{prefix}.attn_v.weight", weight(N_HEAD_KV * head_dim, N_EMBD))
        writer.add_tensor(f"{prefix}.attn_output.weight", weight(N_EMBD, N_EMBD))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        writer.add_tensor(f"{prefix}.ffn_gate.weight", weight(N_FF, N_EMBD))
        writer.add_tensor(f"{prefix}.ffn_up.weight", weight(N_FF, N_EMBD))
        writer.add_tensor(f"{prefix}.ffn_down.weight", weight(N_EMBD, N_FF))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


if __name__ == "__main__":
    import sys

    print(write_tiny_model(Path(sys.argv[1] if len(sys.argv) > 1 else "tiny.gguf")))
