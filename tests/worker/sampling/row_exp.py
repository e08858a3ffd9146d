"""e^(x - peak) over a whole row of logits, and its sum, for the tests' numpy reference of the
draw (oracle.py): by the row scan's kernel (rowscan.c: AVX-512, AVX2 or plain C), else by
ggml's own vectorised kernel where this llama.cpp build exports it (ggml_vec_soft_max_f32,
what ggml's softmax runs on a CPU), else by numpy. Once the worker's, when numpy finished the
rows the C draw left (rowdraw.c now sums them itself, with the same kernels).

Why: an exact top-p without a top-k needs the row's whole probability mass, an exponential per
token, 262,144 of them a token at Gemma's vocabulary. On this project's CPUs numpy's float32
exp takes 0.9-1.2 ms for them, ggml's kernel 0.38 ms (AVX2, AMD EPYC) or 0.11-0.14 ms
(AVX-512, Intel Xeon), the row scan's 0.09 ms on the latter, each exponential within 2 ulps
and the sum within 2e-8 of the float64 one. ctypes lets go of the GIL for the call, so the
sampling threads run it side by side."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np

from tests.worker.sampling import row_scan

_NAMES = ("libggml-cpu.so", "libggml-cpu.dylib", "ggml-cpu.dll")


@functools.cache
def kernel() -> Any | None:
    """ggml's kernel, from the folder llama-cpp-python loads its libraries from (its
    LLAMA_CPP_LIB_PATH, else its package's lib/); None where there is none. Found on first
    use, without importing llama_cpp: by then the worker has loaded libllama, which must be
    its process's first native library (cli/main.py), and this module stays pure Python."""
    folders = [Path(os.environ["LLAMA_CPP_LIB_PATH"])] if "LLAMA_CPP_LIB_PATH" in os.environ else []
    spec = importlib.util.find_spec("llama_cpp")
    if spec is not None and spec.origin is not None:
        folders.append(Path(spec.origin).parent / "lib")
    for folder in folders:
        for name in _NAMES:
            if not (folder / name).exists():
                continue
            try:
                found = ctypes.CDLL(str(folder / name)).ggml_vec_soft_max_f32
            except (OSError, AttributeError):
                continue
            found.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float]
            found.restype = ctypes.c_double
            return found
    return None


def exp_sum(row: np.ndarray, peak: float, out: np.ndarray) -> float:
    """out[i] = e^(row[i] - peak) in float32; returns their sum, accumulated in float64.
    `out` is a float32 array as long as the row. The row scan's AVX-512 kernel where the CPU
    has it (rowscan.c: its partial sums in vectors, where ggml's kernel adds each 16 to one
    float64 in turn; 90 against 110-140 us here), else ggml's."""
    total = row_scan.exp_sum(row, peak, out)
    if total is not None:
        return total
    vectorised = kernel()
    if vectorised is None or not (row.dtype == np.float32 and row.flags.c_contiguous):
        np.exp(np.subtract(row, np.float32(peak), out=out), out=out)
        return float(out.sum(dtype=np.float64))
    return float(vectorised(len(row), out.ctypes.data, row.ctypes.data, peak))
