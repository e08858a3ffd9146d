"""csrc/sampling's library, loaded with ctypes: draw(), a whole token drawn in one call
(rowdraw.c), and draw_rows(), a tick's rows in one; each row's argmax (argmax_rows); and the
row scan they read the row through (rowscan.c: each block's largest logit, then the tokens whose
logits lie in a band, from the blocks that reach it), with AVX-512, AVX2 or plain C, whichever
the CPU has. The tests' numpy reference of the draw reads rows through the same scan
(tests/worker/sampling/row_scan.py).

Why: the host sampler's draw is bound by reading its row, 1 MB at Gemma's 262,144 tokens. A
numpy max, then a compare and a nonzero over the whole row for the tokens near the best, read
it three times (about 240 us here); the scan's first pass keeps the blocks' maxima, and a band
is then read from the few blocks that reach it (about 115 us for both). ctypes lets go of the
GIL for each call, so the sampling threads scan rows side by side.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import threading
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

BLOCK = 256  # rowscan.c's
_ROW, _LENGTH = ctypes.c_void_p, ctypes.c_int64  # an array's address, its length
_REAL = ctypes.c_double
_BAND = [_ROW, _LENGTH, _ROW, ctypes.c_float, ctypes.c_float]  # row, n, block_max, low, high
# rowscan.c's functions: their arguments' C types and their result's.
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "ls_block_max": ([_ROW, _LENGTH, _ROW], ctypes.c_int),
    "ls_gather": ([*_BAND, _ROW], ctypes.c_int64),
    "ls_count": (_BAND, ctypes.c_int64),
    "ls_exp_sum": ([_ROW, _LENGTH, ctypes.c_float, _ROW], _REAL),
    "ls_sum_below": ([_ROW, _ROW, _LENGTH, ctypes.c_float], _REAL),
    "ls_exp_sum_below": ([_ROW, _LENGTH, ctypes.c_float, ctypes.c_float], _REAL),
    # row, n, block_max, total, weighted_depth
    "ls_scan_exp_sum": ([_ROW, _LENGTH, _ROW, _ROW, _ROW], ctypes.c_int),
    # the same scan in parts (graphdraw.c's threads take a share each): row, n, block_max,
    # part, its sums; then the parts' sums, how many, total, weighted_depth
    "ls_scan_parts": ([_LENGTH], _LENGTH),
    "ls_scan_exp_sum_part": ([_ROW, _LENGTH, _ROW, _LENGTH, _ROW], ctypes.c_int),
    "ls_scan_fold": ([_ROW, _LENGTH, _ROW, _ROW], None),
    # row, ids, n, peak, temperature, start, weights
    "ls_cumulative_weights": (
        [_ROW, _ROW, _LENGTH, ctypes.c_float, _REAL, _REAL, _ROW],
        _REAL,
    ),
    # row, n, temperature, top_k, top_p, min_p, span, seed, scratch, what it found
    "ls_draw": (
        [_ROW, _LENGTH, _REAL, _LENGTH, _REAL, _REAL, _REAL, ctypes.c_uint64, _ROW, _ROW],
        ctypes.c_int64,
    ),
    # row, n, settings, seed, scratch (the row's maxima first), total, weighted_depth, found
    "ls_draw_from_scan": (
        [_ROW, _LENGTH, _ROW, ctypes.c_uint64, _ROW, _REAL, _REAL, _ROW],
        ctypes.c_int64,
    ),
    # logits, n, count, rows, settings, seeds, scratch, its stride, threads, tokens, found
    "ls_draw_rows_on": (
        [_ROW, _LENGTH, _LENGTH, _ROW, _ROW, _ROW, _ROW, _LENGTH, ctypes.c_int, _ROW, _ROW],
        ctypes.c_int,  # how many threads took part
    ),
    # rows, n_rows, n, block_max, its stride, threads, out
    "ls_argmax_rows_on": (
        [_ROW, _LENGTH, _LENGTH, _ROW, _LENGTH, ctypes.c_int, _ROW],
        ctypes.c_int,  # how many threads took part
    ),
    "ls_openmp": ([], ctypes.c_int),
    "ls_draw_scratch_bytes": ([_LENGTH], _LENGTH),
    "ls_draw_ids_at": ([_LENGTH], _LENGTH),
    "ls_float64_cuts": ([], _LENGTH),  # top-p cuts settled by a float64 sum (for the tests)
    "ls_argmax_scratch_floats": ([_LENGTH], _LENGTH),
    # graphdraw.c's: the draw inside llama_decode (backend_sampling.py's GraphDraws)
    "ls_graph_iface": ([], ctypes.c_void_p),
    "ls_graph_draw_bytes": ([], _LENGTH),
    "ls_graph_bind": ([ctypes.c_char_p], ctypes.c_int),
    "ls_graph_rows_drawn": ([], _LENGTH),
    "ls_graph_set_pass_hook": ([ctypes.c_void_p], None),
    "ls_limit_isa": ([ctypes.c_int], None),
    "ls_isa": ([], ctypes.c_int),
}
_SCRATCH = threading.local()


@functools.cache
def library() -> Any | None:
    """csrc/sampling's library as built beside this package (pip builds it: pyproject.toml's
    ext-modules), on any CPU (plain C where it has neither AVX-512 nor AVX2); None where it is
    missing."""
    return load_native(Path(__file__).resolve().parent, "_sampling", _SIGNATURES)


def native() -> Any:
    """library(), which the worker cannot sample without: the draw is the C's alone."""
    lib = library()
    if lib is None:
        raise RuntimeError(
            "loomserve's sampling library (csrc/sampling) is not built: pip install builds it"
        )
    return lib


def load_native(
    folder: Path, stem: str, signatures: dict[str, tuple[list[Any], Any]]
) -> Any | None:
    """The shared library `stem` built beside a package, with each function's argument and
    result types set from `signatures`; None where it is not built."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = folder / f"{stem}{suffix}"
        if not path.exists():
            continue
        found = ctypes.CDLL(str(path))
        for name, (arguments, result) in signatures.items():
            function = getattr(found, name)
            function.argtypes, function.restype = arguments, result
        return found
    return None


def argmax_rows(rows: np.ndarray, threads: int = 1) -> np.ndarray:
    """Each row's argmax (numpy's: the first largest, or the first NaN), in one call that lets
    go of the GIL, on `threads` of llama.cpp's OpenMP threads (rowthreads.c; on this thread
    alone where there are none); by numpy where the library cannot serve."""
    lib = library()
    if lib is None or rows.ndim != 2 or not _plain(rows):
        return rows.argmax(axis=1)
    n_rows, n = rows.shape
    out = np.empty(n_rows, dtype=np.int64)
    floats = lib.ls_argmax_scratch_floats(n)
    block_max = np.empty((max(threads, 1), floats), dtype=np.float32)
    lib.ls_argmax_rows_on(
        rows.ctypes.data, n_rows, n, block_max.ctypes.data, floats, threads, out.ctypes.data
    )
    return out


def on_openmp() -> bool:
    """Whether argmax_rows and draw_rows can share rows out among llama.cpp's OpenMP threads:
    the library is there and libgomp is loaded in this process (by llama.cpp's CPU backend)."""
    lib = library()
    return lib is not None and lib.ls_openmp() == 1


class Drawn(NamedTuple):
    """What ls_draw found: the token, its candidates' tempered mass (in units of the best
    token's weight), and how many candidates it kept (-1: every token, a tail too)."""

    token: int
    head_mass: float
    kept: int


def draw(
    row: np.ndarray,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    span: float,
    seed: int,
) -> Drawn:
    """A token drawn from the row in one call (rowdraw.c), for any row: one that is not
    contiguous float32 is copied into one first."""
    lib = native()
    if not _plain(row):
        row = np.ascontiguousarray(row, dtype=np.float32)
    found = (ctypes.c_double * 2)()
    token = lib.ls_draw(
        row.ctypes.data,
        len(row),
        temperature,
        top_k,
        top_p,
        min_p,
        span,
        seed,
        _draw_scratch(lib, len(row))[0],
        found,
    )
    return Drawn(int(token), found[0], int(found[1]))


class DrawnRows(NamedTuple):
    """What ls_draw_rows_on found, a row each."""

    tokens: np.ndarray  # int64, one a row
    head_mass: np.ndarray  # float64, as Drawn's


def draws_rows(logits: np.ndarray) -> bool:
    """Whether draw_rows can read these logits: the library is there, and they are rows of
    contiguous float32."""
    return library() is not None and logits.ndim == 2 and _plain(logits)


def draw_rows(
    logits: np.ndarray,
    rows: np.ndarray,
    settings: np.ndarray,
    seeds: np.ndarray,
    threads: int = 1,
) -> DrawnRows:
    """draw() for several rows of `logits` (draws_rows(logits) must hold) in one call:
    rows[i]'s token with settings[i] (temperature, top_k, top_p, min_p, span: float64) and
    seeds[i] (uint64), on `threads` of llama.cpp's OpenMP threads (rowthreads.c; on this
    thread alone where there are none). The tokens do not depend on `threads`."""
    lib = library()
    if lib is None or not draws_rows(logits):
        raise ValueError("draw_rows needs the library and rows of contiguous float32")
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    settings = np.ascontiguousarray(settings, dtype=np.float64)
    seeds = np.ascontiguousarray(seeds, dtype=np.uint64)
    if settings.shape != (len(rows), 5) or seeds.shape != rows.shape:
        raise ValueError("a row's settings are five numbers, and its seed one")
    if rows.size and not (rows.min() >= 0 and rows.max() < len(logits)):
        raise ValueError("rows outside the logits")  # C would read past them
    n = logits.shape[1]
    tokens = np.empty(len(rows), dtype=np.int64)
    found = np.empty((len(rows), 2), dtype=np.float64)
    scratch, stride = _draw_scratch(lib, n, max(threads, 1))
    lib.ls_draw_rows_on(
        logits.ctypes.data,
        n,
        len(rows),
        rows.ctypes.data,
        settings.ctypes.data,
        seeds.ctypes.data,
        scratch,
        stride,
        threads,
        tokens.ctypes.data,
        found.ctypes.data,
    )
    return DrawnRows(tokens, found[:, 0])


def draw_candidates(
    row: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
) -> np.ndarray | None:
    """The tokens rowdraw.c draws from (in its order: best first for a top-p), for the tests
    to hold to the whole row's; None where it keeps a tail (every token is a candidate)."""
    drawn = draw(row, temperature, top_k, top_p, min_p, 1.0, 0)
    lib = native()
    if drawn.kept < 0:
        return None
    _, _, scratch, address, _ = _SCRATCH.draw
    start = address - scratch.ctypes.data + lib.ls_draw_ids_at(len(row))
    return scratch[start : start + 4 * drawn.kept].view(np.int32).astype(np.intp)


def _draw_scratch(lib: Any, size: int, rooms: int = 1) -> tuple[int, int]:
    """The address of this thread's room for `rooms` draws at once over `size` logits, and
    the bytes from one room to the next (each 64-byte aligned)."""
    scratch = getattr(_SCRATCH, "draw", None)
    if scratch is None or scratch[0] < size or scratch[1] < rooms:
        stride = -(-lib.ls_draw_scratch_bytes(size) // 64) * 64
        buffer = np.empty(rooms * stride + 64, dtype=np.uint8)
        address = -(-buffer.ctypes.data // 64) * 64
        scratch = _SCRATCH.draw = (size, rooms, buffer, address, stride)
    return scratch[3], scratch[4]


def _plain(array: np.ndarray) -> bool:
    """Whether the C can read the array as it is: contiguous float32."""
    return array.dtype == np.float32 and array.flags.c_contiguous
