"""A tiny vision projector (an `mmproj` GGUF) for the tiny text model, for fast image tests.

LLaVA-style: a two-layer CLIP-like vision tower on 32x32 images in 8x8 patches (16 patches,
so 16 image tokens an image), then libmtmd's "mlp" projector (mm.0, GELU, mm.2) up to the
text model's embedding width. Random but fixed weights, written with the `gguf` package the
way convert_image_encoder_to_gguf.py names them, so libmtmd loads and encodes it for real in
milliseconds. Pair it with a text model of the same `n_embd` (tests/tiny_model.py's is 64).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np


@dataclass(frozen=True, slots=True)
class VisionShape:
    """The dimensions of a generated projector; the defaults are the tiny test one."""

    n_embd_text: int = 64  # the text model's embedding width: the projector's output
    n_embd: int = 32
    n_head: int = 2
    n_layer: int = 2  # llava reads the next-to-last layer, so one layer runs
    n_ff: int = 64
    image_size: int = 32
    patch_size: int = 8
    n_mm_hidden: int = 64
    # "mlp": LLaVA 1.5's projector (causal, every patch a token); "gemma3": Gemma 3's (its
    # images attend both ways, patches average-pooled `merge` a side, begin/end markers).
    projector: str = "mlp"
    merge: int = 2

    @property
    def image_tokens(self) -> int:
        """How many embeddings (image tokens) one image becomes."""
        side = self.image_size // self.patch_size
        return (side // self.merge) ** 2 if self.projector == "gemma3" else side**2


TINY_VISION = VisionShape()
TINY_GEMMA3 = VisionShape(projector="gemma3", n_layer=1)


def write_tiny_mmproj(path: Path, seed: int = 4321, shape: VisionShape = TINY_VISION) -> Path:
    """Write an mmproj GGUF with the shape's projector type ("mlp" or "gemma3") to path."""
    if shape.projector == "gemma3":
        return _write_gemma3(path, seed, shape)
    rng = np.random.default_rng(seed)

    def weight(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        values = rng.standard_normal((rows, cols), dtype=np.float32) * (gain / np.sqrt(cols))
        return values.astype(np.float32)

    def bias(n: int) -> np.ndarray:
        return (rng.standard_normal(n, dtype=np.float32) * 0.1).astype(np.float32)

    writer = clip_writer(path, "tiny-vision-test", "mlp", shape, shape.n_embd_text, 1e-5)

    n_pos = shape.image_tokens + 1  # the patches and the class embedding
    # numpy shapes are ggml's ne reversed: the conv kernel is ne [patch, patch, 3, n_embd].
    patch = rng.standard_normal((shape.n_embd, 3, shape.patch_size, shape.patch_size))
    writer.add_tensor("v.patch_embd.weight", (patch / shape.patch_size).astype(np.float32))
    writer.add_tensor("v.class_embd", bias(shape.n_embd))
    writer.add_tensor("v.position_embd.weight", weight(n_pos, shape.n_embd, gain=0.5))
    writer.add_tensor("v.pre_ln.weight", np.ones(shape.n_embd, dtype=np.float32))
    writer.add_tensor("v.pre_ln.bias", np.zeros(shape.n_embd, dtype=np.float32))
    for layer in range(shape.n_layer):
        prefix = f"v.blk.{layer}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            writer.add_tensor(f"{prefix}.{name}.weight", weight(shape.n_embd, shape.n_embd))
            writer.add_tensor(f"{prefix}.{name}.bias", bias(shape.n_embd))
        for name in ("ln1", "ln2"):
            writer.add_tensor(f"{prefix}.{name}.weight", np.ones(shape.n_embd, dtype=np.float32))
            writer.add_tensor(f"{prefix}.{name}.bias", np.zeros(shape.n_embd, dtype=np.float32))
        writer.add_tensor(f"{prefix}.ffn_up.weight", weight(shape.n_ff, shape.n_embd))
        writer.add_tensor(f"{prefix}.ffn_up.bias", bias(shape.n_ff))
        writer.add_tensor(f"{prefix}.ffn_down.weight", weight(shape.n_embd, shape.n_ff))
        writer.add_tensor(f"{prefix}.ffn_down.bias", bias(shape.n_embd))
    # Large enough that an image moves the text model's logits: different images, different
    # greedy tokens (the tests check that).
    writer.add_tensor("mm.0.weight", weight(shape.n_mm_hidden, shape.n_embd, gain=2.0))
    writer.add_tensor("mm.0.bias", bias(shape.n_mm_hidden))
    writer.add_tensor("mm.2.weight", weight(shape.n_embd_text, shape.n_mm_hidden, gain=8.0))
    writer.add_tensor("mm.2.bias", bias(shape.n_embd_text))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_gemma3(path: Path, seed: int, shape: VisionShape) -> Path:
    """Gemma 3's layout: a SigLIP tower (learned positions, no class embedding), then
    average pooling, an RMS norm and one projection (convert_hf_to_gguf.py's names)."""
    rng = np.random.default_rng(seed)

    def weight(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        values = rng.standard_normal((rows, cols), dtype=np.float32) * (gain / np.sqrt(cols))
        return values.astype(np.float32)

    def bias(n: int) -> np.ndarray:
        return (rng.standard_normal(n, dtype=np.float32) * 0.1).astype(np.float32)

    writer = clip_writer(path, "tiny-gemma3-vision-test", "gemma3", shape, shape.n_embd_text, 1e-6)
    writer.add_uint32("clip.vision.projector.scale_factor", shape.merge)

    n_patches = (shape.image_size // shape.patch_size) ** 2
    patch = rng.standard_normal((shape.n_embd, 3, shape.patch_size, shape.patch_size))
    writer.add_tensor("v.patch_embd.weight", (patch / shape.patch_size).astype(np.float32))
    writer.add_tensor("v.patch_embd.bias", bias(shape.n_embd))
    writer.add_tensor("v.position_embd.weight", weight(n_patches, shape.n_embd, gain=0.5))
    for layer in range(shape.n_layer):
        prefix = f"v.blk.{layer}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            writer.add_tensor(f"{prefix}.{name}.weight", weight(shape.n_embd, shape.n_embd))
            writer.add_tensor(f"{prefix}.{name}.bias", bias(shape.n_embd))
        for name in ("ln1", "ln2"):
            writer.add_tensor(f"{prefix}.{name}.weight", np.ones(shape.n_embd, dtype=np.float32))
            writer.add_tensor(f"{prefix}.{name}.bias", np.zeros(shape.n_embd, dtype=np.float32))
        writer.add_tensor(f"{prefix}.ffn_up.weight", weight(shape.n_ff, shape.n_embd))
        writer.add_tensor(f"{prefix}.ffn_up.bias", bias(shape.n_ff))
        writer.add_tensor(f"{prefix}.ffn_down.weight", weight(shape.n_embd, shape.n_ff))
        writer.add_tensor(f"{prefix}.ffn_down.bias", bias(shape.n_embd))
    writer.add_tensor("v.post_ln.weight", np.ones(shape.n_embd, dtype=np.float32))
    writer.add_tensor("v.post_ln.bias", np.zeros(shape.n_embd, dtype=np.float32))
    writer.add_tensor("mm.soft_emb_norm.weight", np.ones(shape.n_embd, dtype=np.float32))
    # ggml's ne [n_embd_text, n_embd]: the graph multiplies by its transpose.
    writer.add_tensor("mm.input_projection.weight", weight(shape.n_embd, shape.n_embd_text, 8.0))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_qwen2vl(folder: Path, seed: int = 77) -> tuple[Path, Path]:
    """A tiny Qwen2-VL pair in folder: a `qwen2vl` text model (M-RoPE: its rope split in
    sections, tests/tiny_model.py's vocabulary) and a `qwen2vl_merger` projector (two patch
    kernels, 2D M-RoPE in the tower, 2x2 patches merged into a token). Its images take fewer
    rope positions than tokens (max(nx, ny) of the merged grid) and four positions a row,
    which the worker lays out as llama.cpp's mtmd helper does (sched/media.py)."""
    from tests.tiny_model import TINY, vocabulary

    rng = np.random.default_rng(seed)

    def weight(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        values = rng.standard_normal((rows, cols), dtype=np.float32) * (gain / np.sqrt(cols))
        return values.astype(np.float32)

    def bias(n: int) -> np.ndarray:
        return (rng.standard_normal(n, dtype=np.float32) * 0.1).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    shape = TINY
    head_dim, kv = shape.n_embd // shape.n_head, shape.n_head_kv * (shape.n_embd // shape.n_head)
    tokens, scores, types = vocabulary()
    model = folder / "tiny-qwen2vl.gguf"
    writer = gguf.GGUFWriter(str(model), arch="qwen2vl")
    writer.add_name("tiny-qwen2vl-test")
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_array("qwen2vl.rope.dimension_sections", [2, 3, 3, 0])  # head_dim / 2 in all
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_tensor("token_embd.weight", weight(len(tokens), shape.n_embd, gain=8.0))
    writer.add_tensor("output_norm.weight", ones(shape.n_embd))
    writer.add_tensor("output.weight", weight(len(tokens), shape.n_embd, gain=6.0))
    for layer in range(shape.n_layer):
        prefix = f"blk.{layer}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", ones(shape.n_embd))
        for name, rows in (("attn_q", shape.n_embd), ("attn_k", kv), ("attn_v", kv)):
            writer.add_tensor(f"{prefix}.{name}.weight", weight(rows, shape.n_embd))
            writer.add_tensor(f"{prefix}.{name}.bias", bias(rows))
        writer.add_tensor(f"{prefix}.attn_output.weight", weight(shape.n_embd, shape.n_embd))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", ones(shape.n_embd))
        writer.add_tensor(f"{prefix}.ffn_gate.weight", weight(shape.n_ff, shape.n_embd))
        writer.add_tensor(f"{prefix}.ffn_up.weight", weight(shape.n_ff, shape.n_embd))
        writer.add_tensor(f"{prefix}.ffn_down.weight", weight(shape.n_embd, shape.n_ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    vision = VisionShape(patch_size=4, n_layer=2)
    mmproj = folder / "mmproj-tiny-qwen2vl.gguf"
    writer = clip_writer(
        mmproj, "tiny-qwen2vl-vision-test", "qwen2vl_merger", vision, shape.n_embd, 1e-6
    )
    side, n = vision.patch_size, vision.n_embd
    for name in ("v.patch_embd.weight", "v.patch_embd.weight.1"):  # a kernel per frame
        kernel = rng.standard_normal((n, 3, side, side)) / side
        writer.add_tensor(name, kernel.astype(np.float32))
    for layer in range(vision.n_layer):
        prefix = f"v.blk.{layer}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            writer.add_tensor(f"{prefix}.{name}.weight", weight(n, n))
            writer.add_tensor(f"{prefix}.{name}.bias", bias(n))
        for name in ("ln1", "ln2"):
            writer.add_tensor(f"{prefix}.{name}.weight", ones(n))
            writer.add_tensor(f"{prefix}.{name}.bias", np.zeros(n, dtype=np.float32))
        writer.add_tensor(f"{prefix}.ffn_up.weight", weight(vision.n_ff, n))
        writer.add_tensor(f"{prefix}.ffn_up.bias", bias(vision.n_ff))
        writer.add_tensor(f"{prefix}.ffn_down.weight", weight(n, vision.n_ff))
        writer.add_tensor(f"{prefix}.ffn_down.bias", bias(n))
    writer.add_tensor("v.post_ln.weight", ones(n))
    writer.add_tensor("v.post_ln.bias", np.zeros(n, dtype=np.float32))
    # The merger: 2x2 patches' features side by side, then two layers to the text width.
    writer.add_tensor("mm.0.weight", weight(4 * n, 4 * n, gain=2.0))
    writer.add_tensor("mm.0.bias", bias(4 * n))
    writer.add_tensor("mm.2.weight", weight(shape.n_embd, 4 * n, gain=8.0))
    writer.add_tensor("mm.2.bias", bias(shape.n_embd))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, mmproj


def png_bytes(width: int, height: int, seed: int = 0) -> bytes:
    """A random RGB PNG of the given size, written with zlib alone (no imaging library)."""
    import struct
    import zlib

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    raw = b"".join(b"\x00" + row.tobytes() for row in pixels)  # filter type 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def png_header(width: int, height: int) -> bytes:
    """A PNG's signature and header chunk only: what a 20,000 x 20,000 image starts with."""
    import struct
    import zlib

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    crc = struct.pack(">I", zlib.crc32(b"IHDR" + header) & 0xFFFFFFFF)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + header + crc


def clip_writer(
    path: Path, name: str, projector: str, vision: VisionShape, projection_dim: int, eps: float
) -> gguf.GGUFWriter:
    """A GGUF writer for a projector file, its header written: the vision tower's shape,
    `projector` (libmtmd's projector type) into `projection_dim`, images normalized to
    [-1, 1]. The caller adds the tensors and writes the file."""
    writer = gguf.GGUFWriter(str(path), arch="clip")
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_string("clip.projector_type", projector)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.embedding_length", vision.n_embd)
    writer.add_uint32("clip.vision.attention.head_count", vision.n_head)
    writer.add_uint32("clip.vision.feed_forward_length", vision.n_ff)
    writer.add_uint32("clip.vision.block_count", vision.n_layer)
    writer.add_uint32("clip.vision.projection_dim", projection_dim)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", eps)
    writer.add_uint32("clip.vision.image_size", vision.image_size)
    writer.add_uint32("clip.vision.patch_size", vision.patch_size)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    return writer


if __name__ == "__main__":
    import sys

    print(write_tiny_mmproj(Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-mmproj.gguf")))
