"""qkmatmul.c, the matmuls of Q4_K, Q5_K and Q6_K weights that q0swap.c swaps in for ggml's
dot products: the same outputs to the bit as ggml_vec_dot_q4_K_q8_K, _q5_K_ and _q6_K_,
called here through ctypes on llama.cpp's own ggml, the activations quantized by ggml's
quantize_row_q8_K. Ten superblocks a row: Q5_K's mins are summed into one float per
superblock by a fused multiply-add in ggml's build, which an unfused sum fails from three.

Gemma's tokens through whole passes, swapped and not: test_default_model.py."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from loomserve.worker.engine import kernels
from tests.worker.engine.test_q0matmul import (
    VEC_DOT_ARGTYPES,
    assert_the_same_bits,
    ggml_cpu_library,
    quantized_by,
)

QK_K = 256
Q4_K = np.dtype(
    [("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)), ("qs", "u1", (QK_K // 2,))]
)  # ggml's block_q4_K, 144 bytes
Q5_K = np.dtype(
    [
        ("d", "<f2"),
        ("dmin", "<f2"),
        ("scales", "u1", (12,)),
        ("qh", "u1", (QK_K // 8,)),
        ("qs", "u1", (QK_K // 2,)),
    ]
)  # ggml's block_q5_K, 176 bytes
Q6_K = np.dtype(
    [("ql", "u1", (QK_K // 2,)), ("qh", "u1", (QK_K // 4,)), ("scales", "i1", (16,)), ("d", "<f2")]
)  # ggml's block_q6_K, 210 bytes
Q8_K = np.dtype([("d", "<f4"), ("qs", "i1", (QK_K,)), ("bsums", "<i2", (QK_K // 16,))])

GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K = 12, 13, 14
TYPES = {GGML_TYPE_Q4_K: Q4_K, GGML_TYPE_Q5_K: Q5_K, GGML_TYPE_Q6_K: Q6_K}

pytestmark = pytest.mark.skipif(
    kernels.library() is None or not kernels.library().ls_qk_matmul_supported(),
    reason="qkmatmul.c needs AVX-512 VNNI",
)


@pytest.fixture(scope="module")
def ggml_cpu():
    lib = ggml_cpu_library()
    lib.quantize_row_q8_K.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    for vec_dot in (
        lib.ggml_vec_dot_q4_K_q8_K,
        lib.ggml_vec_dot_q5_K_q8_K,
        lib.ggml_vec_dot_q6_K_q8_K,
    ):
        vec_dot.argtypes = VEC_DOT_ARGTYPES
    return lib


def weights(rng: np.random.Generator, kind: int, rows: int, n_blocks: int) -> np.ndarray:
    """Any bytes, and scales of either sign."""
    w = np.zeros((rows, n_blocks), dtype=TYPES[kind])
    w["d"] = rng.uniform(-2e-3, 2e-3, size=(rows, n_blocks)).astype(np.float16)
    for field in ("dmin", "scales", "qs", "ql", "qh"):
        if field in w.dtype.names:
            shape = (rows, n_blocks, *w.dtype[field].shape)
            if field == "dmin":
                w[field] = rng.uniform(-2e-3, 2e-3, size=shape).astype(np.float16)
            elif w.dtype[field].base == np.int8:
                w[field] = rng.integers(-128, 128, size=shape)
            else:
                w[field] = rng.integers(0, 256, size=shape)
    return w


def quantized(ggml_cpu, rng: np.random.Generator, rows: int, n_blocks: int) -> np.ndarray:
    """Activations as quantize_row_q8_K writes them."""
    return quantized_by(ggml_cpu.quantize_row_q8_K, Q8_K, rng, rows, n_blocks)


def ggml_matmul(ggml_cpu, kind: int, w: np.ndarray, acts: np.ndarray) -> np.ndarray:
    """ggml's dot product, a weight row and an activation row at a time (as its mul_mat runs
    K-quants with GGML_CPU_TILED_MM=0)."""
    n, n_blocks = w.shape
    m = acts.shape[0]
    out = np.zeros((m, n), dtype=np.float32)
    vec_dot = {
        GGML_TYPE_Q4_K: ggml_cpu.ggml_vec_dot_q4_K_q8_K,
        GGML_TYPE_Q5_K: ggml_cpu.ggml_vec_dot_q5_K_q8_K,
        GGML_TYPE_Q6_K: ggml_cpu.ggml_vec_dot_q6_K_q8_K,
    }[kind]
    for j in range(m):
        for r in range(n):
            vec_dot(
                n_blocks * QK_K, out[j, r:].ctypes.data, 0, w[r].ctypes.data, 0,
                acts[j].ctypes.data, 0, 1,
            )  # fmt: skip
    return out


@pytest.mark.parametrize("kind", list(TYPES), ids=["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("m", [1, 2, 3, 16, 17, 33])
@pytest.mark.parametrize("n_blocks", [10, 3, 1])
def test_the_outputs_are_ggmls_to_the_bit(ggml_cpu, kind, m, n_blocks):
    rng = np.random.default_rng(m * 10 + n_blocks + kind)
    w = weights(rng, kind, 301, n_blocks)  # an odd row count: the last row has no partner
    acts = quantized(ggml_cpu, rng, m, n_blocks)
    expected = ggml_matmul(ggml_cpu, kind, w, acts)
    assert_the_same_bits(kernels.library().ls_qk_matmul, kind, w, acts, expected)


def test_other_weight_types_are_refused():
    out = np.zeros((2, 4), dtype=np.float32)
    w, acts = np.zeros(4 * 144, dtype=np.uint8), np.zeros((2, 1), dtype=Q8_K)
    q3_k = 11
    assert not kernels.library().ls_qk_matmul(
        w.ctypes.data, q3_k, 1, 0, 4, acts.ctypes.data, 2, out.ctypes.data, 4
    )
