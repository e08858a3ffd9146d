"""The row scan for the tests' numpy reference of the draw (oracle.py): rowscan.c's scan and
sums through ctypes (the worker's library, rowscan.py), and numpy's where the C cannot read
the row (not contiguous float32) or the library is missing. Once the worker's own, when
numpy finished the rows the C draw left; test_rowscan.py holds each instruction set's scan
to numpy's answers through it."""

from __future__ import annotations

import math
import threading

import numpy as np

from loomserve.worker.sampling import rowscan
from loomserve.worker.sampling.rowscan import BLOCK

_SCRATCH = threading.local()


class RowScan:
    """A row of logits (float32) and its blocks' maxima: `peak` is the row's largest logit
    (NaN if it holds one, as numpy's max), `band` the tokens between two values."""

    __slots__ = ("_lib", "block_max", "peak", "row")

    def __init__(self, row: np.ndarray) -> None:
        self.row = row
        n_blocks = -(-len(row) // BLOCK)
        self._lib = lib = rowscan.library() if _plain(row) else None
        if lib is None:
            padded = np.full(n_blocks * BLOCK, -np.inf, dtype=np.float32)
            padded[: len(row)] = row
            self.block_max = padded.reshape(n_blocks, BLOCK).max(axis=1)
            self.peak = float(row.max())
            return
        self.block_max = np.empty(n_blocks, dtype=np.float32)
        has_nan = lib.ls_block_max(row.ctypes.data, len(row), self.block_max.ctypes.data)
        self.peak = math.nan if has_nan else float(self.block_max.max())

    def band(self, low: float, high: float = math.inf) -> np.ndarray:
        """The tokens whose logit x has low <= x < high (compared in float32, as the row
        is), in order: np.flatnonzero((row >= low) & (row < high))."""
        low32, high32 = np.float32(low), np.float32(high)
        if self._lib is None:
            return np.flatnonzero((self.row >= low32) & (self.row < high32))
        ids = _scratch(len(self.row))
        found = self._lib.ls_gather(*self._args(), low32, high32, ids.ctypes.data)
        return ids[:found].astype(np.intp)

    def count(self, low: float, high: float = math.inf) -> int:
        """How many tokens band(low, high) holds, found without gathering them."""
        if self._lib is None:
            return len(self.band(low, high))
        return int(self._lib.ls_count(*self._args(), np.float32(low), np.float32(high)))

    def _args(self) -> tuple[int, int, int]:
        return self.row.ctypes.data, len(self.row), self.block_max.ctypes.data

    def kth_block_max(self, k: int) -> float:
        """A value that at least k tokens reach: the k-th largest block maximum (each is a
        token's logit), or -inf where there are fewer than k blocks."""
        if k > len(self.block_max):
            return -math.inf
        return float(np.partition(self.block_max, -k)[-k])


def _scratch(size: int) -> np.ndarray:
    """This thread's buffer for a band's token ids (rows are scanned on several threads)."""
    ids = getattr(_SCRATCH, "ids", None)
    if ids is None or len(ids) < size:
        ids = _SCRATCH.ids = np.empty(size, dtype=np.int32)
    return ids


def exp_sum(row: np.ndarray, peak: float, out: np.ndarray) -> float | None:
    """out[i] = e^(row[i] - peak) in float32 and their sum in float64, by rowscan.c's kernel;
    None where it cannot serve (a row that is not contiguous float32)."""
    lib = rowscan.library()
    if lib is None or not _plain(row) or not _plain(out):
        return None
    total = float(lib.ls_exp_sum(row.ctypes.data, len(row), np.float32(peak), out.ctypes.data))
    return total if total >= 0.0 else None


def sum_below(values: np.ndarray, row: np.ndarray, below: float) -> float:
    """The float64 sum of values[i] over the tokens whose logit row[i] < below (float32
    compares): np.sum(values, where=row < below, dtype=np.float64), in one pass."""
    lib = rowscan.library()
    if lib is None or not _plain(values) or not _plain(row):
        return float(np.sum(values, where=row < np.float32(below), dtype=np.float64))
    return float(lib.ls_sum_below(values.ctypes.data, row.ctypes.data, len(row), np.float32(below)))


def _plain(array: np.ndarray) -> bool:
    """Whether the C can read the array as it is: contiguous float32."""
    return array.dtype == np.float32 and array.flags.c_contiguous
