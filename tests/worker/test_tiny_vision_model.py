"""The generated tiny vision projector loads and encodes through libmtmd itself (the raw
llama_cpp.mtmd_cpp calls, no loomserve code), so image tests run the real pipeline."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import llama_cpp as llama
import numpy as np
import pytest
from llama_cpp import mtmd_cpp as mtmd

from tests.tiny_vision_model import TINY_VISION, png_bytes, write_tiny_qwen2vl


@pytest.fixture(scope="module")
def mtmd_ctx(tiny_model_path: Path, tiny_mmproj_path: Path) -> Iterator[int]:
    llama.llama_backend_init()
    params = llama.llama_model_default_params()
    model = llama.llama_model_load_from_file(str(tiny_model_path).encode(), params)
    assert model
    ctx_params = mtmd.mtmd_context_params_default()
    ctx_params.use_gpu = False
    ctx_params.n_threads = 1
    ctx_params.print_timings = False
    ctx = mtmd.mtmd_init_from_file(str(tiny_mmproj_path).encode(), model, ctx_params)
    assert ctx, "libmtmd refused the generated projector"
    yield ctx
    mtmd.mtmd_free(ctx)
    llama.llama_model_free(model)


def encode(ctx: int, image: bytes, prompt: bytes) -> tuple[list[int], np.ndarray, bytes]:
    """Tokenize prompt with one image and encode it: chunk kinds, the embeddings, the id."""
    buf = (ctypes.c_uint8 * len(image)).from_buffer_copy(image)
    bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(ctx, buf, len(image), False)
    assert bitmap
    chunks = mtmd.mtmd_input_chunks_init()
    text = mtmd.mtmd_input_text(prompt, len(prompt), True, True)
    bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
    try:
        assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1) == 0
        kinds, embd, ident = [], np.zeros(0, dtype=np.float32), b""
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            kinds.append(mtmd.mtmd_input_chunk_get_type(chunk))
            if kinds[-1] == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                n = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
                assert n == TINY_VISION.image_tokens
                assert mtmd.mtmd_encode_chunk(ctx, chunk) == 0
                out = mtmd.mtmd_get_output_embd(ctx)
                embd = np.ctypeslib.as_array(out, shape=(n * TINY_VISION.n_embd_text,)).copy()
                ident = mtmd.mtmd_input_chunk_get_id(chunk)
        return kinds, embd, ident
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)


def test_the_projector_loads_and_encodes_an_image(mtmd_ctx: int) -> None:
    assert mtmd.mtmd_support_vision(mtmd_ctx)
    marker = mtmd.mtmd_default_marker()
    kinds, embd, ident = encode(mtmd_ctx, png_bytes(40, 24, seed=1), b"look " + marker + b" now")
    text, image = mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT, mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE
    assert kinds == [text, image, text]
    assert embd.shape == (TINY_VISION.image_tokens * 64,) and np.isfinite(embd).all()
    assert len(ident) == 64  # the bitmap's content hash, hex


def test_different_images_encode_differently(mtmd_ctx: int) -> None:
    marker = mtmd.mtmd_default_marker()
    _, first, id_first = encode(mtmd_ctx, png_bytes(32, 32, seed=1), marker)
    _, again, id_again = encode(mtmd_ctx, png_bytes(32, 32, seed=1), marker)
    _, other, id_other = encode(mtmd_ctx, png_bytes(32, 32, seed=2), marker)
    assert np.array_equal(first, again) and id_first == id_again
    assert not np.allclose(first, other) and id_first != id_other


def test_the_qwen2vl_pair_loads_with_m_rope_positions(tmp_path: Path) -> None:
    """libmtmd loads the generated Qwen2-VL pair, M-RoPE on, and its image takes fewer
    positions than tokens: llama.cpp's own mtmd_helper_eval_chunks advances by positions."""
    model_path, mmproj_path = write_tiny_qwen2vl(tmp_path)
    llama.llama_backend_init()
    model = llama.llama_model_load_from_file(
        str(model_path).encode(), llama.llama_model_default_params()
    )
    assert model
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings = False, 1, False
    ctx = mtmd.mtmd_init_from_file(str(mmproj_path).encode(), model, params)
    assert ctx, "libmtmd refused the generated Qwen2-VL projector"
    context_params = llama.llama_context_default_params()
    context_params.n_ctx = context_params.n_batch = context_params.n_ubatch = 256
    context_params.n_threads = context_params.n_threads_batch = 1
    lctx = llama.llama_init_from_model(model, context_params)
    image = png_bytes(40, 24, seed=1)
    buf = (ctypes.c_uint8 * len(image)).from_buffer_copy(image)
    bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(ctx, buf, len(image), False)
    chunks = mtmd.mtmd_input_chunks_init()
    prompt = b"look " + mtmd.mtmd_default_marker() + b" now"
    text = mtmd.mtmd_input_text(prompt, len(prompt), True, True)
    try:
        assert mtmd.mtmd_decode_use_mrope(ctx)
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1) == 0
        sizes = []
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            sizes.append(
                (mtmd.mtmd_input_chunk_get_n_tokens(chunk), mtmd.mtmd_input_chunk_get_n_pos(chunk))
            )
        n_tokens, n_pos = sizes[1]  # the image's
        assert 0 < n_pos < n_tokens
        n_past = llama.llama_pos(0)
        assert mtmd.mtmd_helper_eval_chunks(ctx, lctx, chunks, 0, 0, 256, True, n_past) == 0
        assert n_past.value == sum(pos for _, pos in sizes)
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
        mtmd.mtmd_free(ctx)
        llama.llama_free(lctx)
        llama.llama_model_free(model)
