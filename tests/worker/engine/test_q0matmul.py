"""q0matmul.c, the matmuls of Q8_0, Q5_0 and Q4_0 weights that q0swap.c swaps in for
ggml's: the same outputs to the bit as ggml's own kernels (llamafile's sgemm for two rows and
more, ggml_vec_dot_q8_0_q8_0 and its kin for one), called here through ctypes on llama.cpp's
own ggml; and the check q0swap.c runs as it binds.

Gemma's tokens through whole passes, swapped and not: test_default_model.py."""

from __future__ import annotations

import ctypes
import itertools
from pathlib import Path

import llama_cpp as llama
import numpy as np
import pytest

from loomserve.worker.engine import kernels
from loomserve.worker.engine.kernels import Q0_TYPES, SWAPPED_TYPES, graph_native

QK = 32
Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", (QK,))])  # ggml's block_q8_0, 34 bytes
Q5_0 = np.dtype([("d", "<f2"), ("qh", "u1", (4,)), ("qs", "u1", (QK // 2,))])  # 22 bytes
Q4_0 = np.dtype([("d", "<f2"), ("qs", "u1", (QK // 2,))])  # 18 bytes
GGML_TYPE_F32, GGML_TYPE_Q4_0, GGML_TYPE_Q5_0, GGML_TYPE_Q8_0 = 0, 2, 6, 8
TYPES = {GGML_TYPE_Q8_0: Q8_0, GGML_TYPE_Q5_0: Q5_0, GGML_TYPE_Q4_0: Q4_0}

pytestmark = pytest.mark.skipif(
    kernels.library() is None or not kernels.library().ls_q0_matmul_supported(),
    reason="q0matmul.c needs AVX2 or AVX-512 VNNI",
)


class ComputeParams(ctypes.Structure):
    """ggml's struct ggml_compute_params (ggml-cpu-impl.h): one thread of one."""

    _fields_ = [
        ("ith", ctypes.c_int),
        ("nth", ctypes.c_int),
        ("wsize", ctypes.c_size_t),
        ("wdata", ctypes.c_void_p),
        ("threadpool", ctypes.c_void_p),
        ("use_ref", ctypes.c_bool),
    ]


# ggml's vec_dot functions: n, &out, its stride, weights, their stride, activations, theirs,
# rows (1).
VEC_DOT_ARGTYPES = [ctypes.c_int, *[ctypes.c_void_p, ctypes.c_size_t] * 3, ctypes.c_int]


def ggml_cpu_library() -> ctypes.CDLL:
    """llama.cpp's ggml-cpu, its fp16 tables set up."""
    lib = ctypes.CDLL(str(Path(llama.__file__).parent / "lib" / "libggml-cpu.so"))
    lib.ggml_cpu_init()
    return lib


@pytest.fixture(scope="module")
def ggml_cpu():
    lib = ggml_cpu_library()
    lib.quantize_row_q8_0.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    for vec_dot in (
        lib.ggml_vec_dot_q8_0_q8_0,
        lib.ggml_vec_dot_q5_0_q8_0,
        lib.ggml_vec_dot_q4_0_q8_0,
    ):
        vec_dot.argtypes = VEC_DOT_ARGTYPES
    lib.llamafile_sgemm.restype = ctypes.c_bool
    lib.llamafile_sgemm.argtypes = [
        ctypes.POINTER(ComputeParams),
        *[ctypes.c_int64] * 3,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int64,
        *[ctypes.c_int] * 3,
    ]
    return lib


def weights(rng: np.random.Generator, kind: int, rows: int, n_blocks: int) -> np.ndarray:
    w = np.zeros((rows, n_blocks), dtype=TYPES[kind])
    w["d"] = rng.uniform(1e-3, 2e-2, size=(rows, n_blocks)).astype(np.float16)
    if kind == GGML_TYPE_Q8_0:
        w["qs"] = rng.integers(-127, 128, size=(rows, n_blocks, QK))
    else:
        w["qs"] = rng.integers(0, 256, size=(rows, n_blocks, QK // 2))
    if kind == GGML_TYPE_Q5_0:
        w["qh"] = rng.integers(0, 256, size=(rows, n_blocks, 4))
    return w


def quantized_by(
    quantize, block: np.dtype, rng: np.random.Generator, rows: int, n_blocks: int
) -> np.ndarray:
    """Activations quantized by one of ggml's quantizers into its `block`s, as the mul_mat
    quantizes them."""
    n = n_blocks * block["qs"].shape[0]
    floats = (rng.standard_normal((rows, n)) * rng.uniform(0.1, 5, (rows, 1))).astype(np.float32)
    blocks = np.zeros((rows, n_blocks), dtype=block)
    for r in range(rows):
        quantize(floats[r].ctypes.data, blocks[r].ctypes.data, n)
    return blocks


def quantized(ggml_cpu, rng: np.random.Generator, rows: int, n_blocks: int) -> np.ndarray:
    """Activations as quantize_row_q8_0 writes them."""
    return quantized_by(ggml_cpu.quantize_row_q8_0, Q8_0, rng, rows, n_blocks)


def ggml_matmul(ggml_cpu, kind: int, w: np.ndarray, acts: np.ndarray) -> np.ndarray:
    n, n_blocks = w.shape
    m = acts.shape[0]
    out = np.zeros((m, n), dtype=np.float32)
    if m == 1:  # llamafile's sgemm declines one row: ggml's dot product, a row at a time
        vec_dot = {
            GGML_TYPE_Q8_0: ggml_cpu.ggml_vec_dot_q8_0_q8_0,
            GGML_TYPE_Q5_0: ggml_cpu.ggml_vec_dot_q5_0_q8_0,
            GGML_TYPE_Q4_0: ggml_cpu.ggml_vec_dot_q4_0_q8_0,
        }[kind]
        for r in range(n):
            vec_dot(
                n_blocks * QK, out[0, r:].ctypes.data, 0, w[r].ctypes.data, 0,
                acts[0].ctypes.data, 0, 1,
            )  # fmt: skip
        return out
    params = ComputeParams(0, 1, 0, None, None, False)
    assert ggml_cpu.llamafile_sgemm(
        ctypes.byref(params), n, m, n_blocks, w.ctypes.data, n_blocks, acts.ctypes.data,
        n_blocks, out.ctypes.data, n, kind, GGML_TYPE_Q8_0, GGML_TYPE_F32,
    )  # fmt: skip
    return out


def cut_among_threads(
    kernel, kind: int, w: np.ndarray, acts: np.ndarray, splits: tuple[int, ...] = ()
) -> np.ndarray:
    """A kernel's outputs (ls_q0_matmul's or ls_qk_matmul's), the weight rows cut at `splits`
    as the threads of a pass cut them."""
    n, n_blocks = w.shape
    m = acts.shape[0]
    out = np.full((m, n), np.nan, dtype=np.float32)
    for first, end in itertools.pairwise([0, *splits, n]):
        assert kernel(
            w.ctypes.data, kind, n_blocks, first, end, acts.ctypes.data, m, out.ctypes.data, n
        )
    return out


def assert_the_same_bits(kernel, kind: int, w: np.ndarray, acts: np.ndarray, expected) -> None:
    """The kernel's outputs are `expected` to the bit, whole and cut in shares (even bounds,
    as q0swap.c cuts them, and odd ones)."""
    bits = expected.view(np.uint32)
    assert cut_among_threads(kernel, kind, w, acts).view(np.uint32).tolist() == bits.tolist()
    splits = (2, len(w) // 2, len(w) * 2 // 3 | 1)
    assert np.array_equal(cut_among_threads(kernel, kind, w, acts, splits).view(np.uint32), bits)


@pytest.mark.parametrize("kind", list(TYPES), ids=["Q8_0", "Q5_0", "Q4_0"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 16, 17, 40])
@pytest.mark.parametrize("n_blocks", [20, 3])
def test_the_outputs_are_ggmls_to_the_bit(ggml_cpu, kind, m, n_blocks):
    rng = np.random.default_rng(m * 100 + n_blocks + kind)
    w = weights(rng, kind, 1001, n_blocks)  # an odd row count: the last row has no partner
    acts = quantized(ggml_cpu, rng, m, n_blocks)
    expected = ggml_matmul(ggml_cpu, kind, w, acts)
    assert_the_same_bits(kernels.library().ls_q0_matmul, kind, w, acts, expected)


def test_other_weight_types_are_refused():
    rng = np.random.default_rng(0)
    w, acts = weights(rng, GGML_TYPE_Q8_0, 4, 2), np.zeros((2, 2), dtype=Q8_0)
    out = np.zeros((2, 4), dtype=np.float32)
    lib = kernels.library()
    q4_1 = 3
    assert not lib.ls_q0_matmul(
        w.ctypes.data, q4_1, 2, 0, 4, acts.ctypes.data, 2, out.ctypes.data, 4
    )


def test_the_swap_binds_wherever_the_kernel_runs():
    """graph_native binds ggml's graph calls and ggml-cpu's quantizer for the swap, and
    the operations' numbers are the ones declared: a llama.cpp that moved them fails here,
    not in a skip."""
    native = graph_native()
    assert native is not None and native.kernels is not None
    lib = native.kernels
    libs = Path(llama.__file__).parent / "lib"
    assert lib.ls_q0_bind(
        str(libs / "libggml-base.so").encode(), str(libs / "libggml-cpu.so").encode()
    )
    # A library without them binds nothing.
    try:
        assert not lib.ls_q0_bind(b"libc.so.6", str(libs / "libggml-cpu.so").encode())
    finally:
        assert lib.ls_q0_bind(
            str(libs / "libggml-base.so").encode(), str(libs / "libggml-cpu.so").encode()
        )
    # Binding checked every type's kernel against this ggml's own dot product; the K-quants'
    # run where the CPU has AVX-512 VNNI, and are ggml's elsewhere.
    assert all(lib.ls_q0_swappable(kind) for kind in Q0_TYPES)
    kquants = [kind for kind in SWAPPED_TYPES if kind not in Q0_TYPES]
    assert all(lib.ls_q0_swappable(k) == lib.ls_qk_matmul_supported() for k in kquants)
    assert not lib.ls_q0_swappable(3)  # Q4_1: no kernel


# Each swapped type's dot product in ggml, and that of a type of smaller blocks (which reads
# no further than the row it is given).
VEC_DOTS = {
    GGML_TYPE_Q8_0: ("ggml_vec_dot_q8_0_q8_0", "ggml_vec_dot_q5_0_q8_0"),
    GGML_TYPE_Q5_0: ("ggml_vec_dot_q5_0_q8_0", "ggml_vec_dot_q4_0_q8_0"),
    GGML_TYPE_Q4_0: ("ggml_vec_dot_q4_0_q8_0", "ggml_vec_dot_iq4_nl_q8_0"),
    12: ("ggml_vec_dot_q4_K_q8_K", "ggml_vec_dot_q3_K_q8_K"),
    13: ("ggml_vec_dot_q5_K_q8_K", "ggml_vec_dot_q4_K_q8_K"),
    14: ("ggml_vec_dot_q6_K_q8_K", "ggml_vec_dot_q4_K_q8_K"),
}


@pytest.mark.parametrize("kind", list(VEC_DOTS), ids=list(SWAPPED_TYPES.values()))
def test_the_check_at_binding_finds_a_kernel_that_differs(kind):
    """What decides which types are swapped: the kernel against ggml's own dot product for
    the type, output for output. Against another type's dot product it disagrees."""
    lib, ggml_cpu = kernels.library(), ggml_cpu_library()
    assert graph_native() is not None
    if kind not in Q0_TYPES and not lib.ls_qk_matmul_supported():
        pytest.skip("qkmatmul.c needs AVX-512 VNNI")
    right, wrong = (
        ctypes.cast(getattr(ggml_cpu, name), ctypes.c_void_p) for name in VEC_DOTS[kind]
    )
    assert lib.ls_q0_check(kind, right)
    assert not lib.ls_q0_check(kind, wrong)
