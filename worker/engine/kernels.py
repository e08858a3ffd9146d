"""loomserve's matmul kernels for quantized weights, swapped into the passes whose tokens
graphdraw.c draws (csrc/kernels: q0matmul.c, qkmatmul.c, q0swap.c), and the probe of ggml's
layout that fences all native code reaching into llama.cpp's graph (abiprobe.c,
native_fence.py).

Why the engine's and not sampling's: the kernels multiply the model's weights; they ride on
the graph draw only because its sampler is the one hook llama.cpp gives into a pass's graph
as it is built (graphdraw.c runs ls_q0_swap_graph as its pass hook, set here by address).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as llama
import structlog

from ..sampling.graph_draw import graph_draw_library
from ..sampling.rowscan import load_native
from . import native_fence

log = structlog.get_logger(__name__)

_ROW, _LENGTH = ctypes.c_void_p, ctypes.c_int64  # an array's address, its length
# csrc/kernels' functions: their arguments' C types and their result's.
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    # q0swap.c's: bind ggml's graph calls and ggml-cpu's quantizers, swap on or off
    "ls_q0_bind": ([ctypes.c_char_p, ctypes.c_char_p], ctypes.c_int),
    "ls_q0_swap": ([ctypes.c_int], None),
    "ls_q0_swapped": ([], _LENGTH),
    "ls_q0_swap_kquants": ([ctypes.c_int], None),
    "ls_q0_swappable": ([ctypes.c_int], ctypes.c_int),
    "ls_q0_check": ([ctypes.c_int, ctypes.c_void_p], ctypes.c_int),
    "ls_q0_matmul_supported": ([], ctypes.c_int),
    "ls_q0_sooner": ([ctypes.c_int, _LENGTH], ctypes.c_int),  # weight type, activation rows
    "ls_qk_matmul_supported": ([], ctypes.c_int),
    # weights, their type, blocks a row, first row, end row, activations, rows, out, stride
    "ls_q0_matmul": (
        [_ROW, ctypes.c_int, _LENGTH, _LENGTH, _LENGTH, _ROW, _LENGTH, _ROW, _LENGTH],
        ctypes.c_int,
    ),
    "ls_qk_matmul": (
        [_ROW, ctypes.c_int, _LENGTH, _LENGTH, _LENGTH, _ROW, _LENGTH, _ROW, _LENGTH],
        ctypes.c_int,
    ),
    # abiprobe.c's: ggml's tensor as found through its public calls, and as declared
    "ls_abi_probe": ([ctypes.c_char_p, _ROW], _LENGTH),
    "ls_abi_declared": ([_ROW], _LENGTH),
}

# ggml's numbers of the weight types whose matmuls q0swap.c can swap: q0matmul.c's (AVX2 and
# AVX-512 VNNI), and qkmatmul.c's K-quants (AVX-512 VNNI).
Q0_TYPES = {8: "Q8_0", 6: "Q5_0", 2: "Q4_0"}
SWAPPED_TYPES = {**Q0_TYPES, 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


@functools.cache
def library() -> Any | None:
    """csrc/kernels' library as built beside this package; None where it is not built."""
    return load_native(Path(__file__).resolve().parent, "_kernels", _SIGNATURES)


@dataclass(frozen=True)
class GraphNative:
    """The native code a drawing pass runs inside llama.cpp's graph: sampling's draw
    (graphdraw.c) and, where this ggml and CPU allow, the kernels' swap as its pass hook."""

    draw: Any  # csrc/sampling's library, bound to ggml
    kernels: Any | None  # csrc/kernels' library, bound to ggml; None: ggml's matmuls

    def swaps(self) -> bool:
        """Whether any weight type's matmul can be swapped for loomserve's."""
        return self.kernels is not None and any(
            self.kernels.ls_q0_swappable(kind) for kind in SWAPPED_TYPES
        )


@functools.cache
def graph_native() -> GraphNative | None:
    """The graph draw and its kernels, where native_fence.py allows them on this install;
    None where the draw cannot run in the graph (no C draw, a llama.cpp without backend
    sampling, or one whose layout this project has not verified)."""
    kernels = library()
    draw = graph_draw_library()
    if kernels is None or draw is None:
        return None
    fence = native_fence.verdict(kernels)
    if not fence.allowed:
        log.warning(
            "loomserve's draw and kernels inside llama.cpp's graph are off with this "
            "llama.cpp: the host sampler and ggml's matmuls serve (the same tokens, slower)",
            install=fence.install,
            reason=fence.reason,
        )
        return None
    libs = Path(llama.__file__).parent / "lib"
    ggml_base, ggml_cpu = libs / "libggml-base.so", libs / "libggml-cpu.so"
    if not ggml_base.exists() or not draw.ls_graph_bind(str(ggml_base).encode()):
        return None
    # The matmuls that passes which draw run instead of ggml's (the same numbers, sooner),
    # where the CPU can: each type is checked against this ggml's own dot product as it binds.
    if not ggml_cpu.exists() or not kernels.ls_q0_bind(
        str(ggml_base).encode(), str(ggml_cpu).encode()
    ):
        draw.ls_graph_set_pass_hook(None)
        return GraphNative(draw, None)
    # A type whose kernel this CPU cannot run is ggml's without a word; one that ran and
    # disagreed with this ggml is worth one.
    runs = SWAPPED_TYPES if kernels.ls_qk_matmul_supported() else Q0_TYPES
    differing = [name for kind, name in runs.items() if not kernels.ls_q0_swappable(kind)]
    if differing:
        log.warning(
            "this ggml's dot product differs from loomserve's kernel for these weights; "
            "they stay on ggml's",
            types=differing,
        )
    draw.ls_graph_set_pass_hook(ctypes.cast(kernels.ls_q0_swap_graph, ctypes.c_void_p))
    return GraphNative(draw, kernels)
