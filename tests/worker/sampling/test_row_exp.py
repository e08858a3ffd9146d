"""row_exp.py: a row's exponentials and their sum, by the row scan's kernel (rowscan.c: with
AVX-512, AVX2 or in plain C) or by ggml's vectorised one (llama.cpp's CPU library, as built
here): each exponential within 2 ulps, the sum within oracle.EXP_SUM_ERROR of the float64 sum,
the bounds rowdraw.c's top-p cuts are built on."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from loomserve.worker.sampling import rowscan
from tests.worker.sampling import row_exp, row_scan
from tests.worker.sampling.oracle import EXP_SUM_ERROR

SCAN_PART_BLOCKS = 64  # rowscan.c's: a top-p's scan sums the row in parts of this many blocks


def test_llama_cpps_cpu_library_gives_the_kernel():
    """The fast path is there (a build that stops exporting it would silently be 2-3x slower
    at top-p)."""
    assert row_exp.kernel() is not None


@pytest.fixture(params=["row scan", "ggml"])
def kernel_in_use(request, monkeypatch):
    """Each kernel in turn: the row scan's (at the `isa` fixture's instruction set, where the
    test takes it too), and ggml's."""
    if request.param == "ggml":
        monkeypatch.setattr(row_scan, "exp_sum", lambda row, peak, out: None)
    else:
        probe = np.zeros(16, dtype=np.float32)
        assert row_scan.exp_sum(probe, 0.0, np.empty_like(probe)) is not None
    return request.param


def _has_avx512() -> bool:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return "avx512f" in line.split()
    return False


@pytest.mark.parametrize("spread", [0.5, 3.0, 12.0, 40.0])
@pytest.mark.parametrize("size", [262_144, 1_001, 63])  # lengths that are no multiple of 16
def test_the_sum_and_each_exponential_match_float64(isa, kernel_in_use, spread, size):
    rng = np.random.default_rng(int(spread * 10) + size)
    row = rng.normal(0.0, spread, size).astype(np.float32)
    peak = float(row.max())
    out = np.empty_like(row)
    total = row_exp.exp_sum(row, peak, out)
    exact = np.exp(row.astype(np.float64) - peak)
    assert total == pytest.approx(float(exact.sum()), rel=EXP_SUM_ERROR / 10)
    _within_float32(out, exact, peak - row.astype(np.float64))


def _within_float32(out: np.ndarray, exact: np.ndarray, depth: np.ndarray) -> None:
    """Each exponential within 2 ulps, of a float32 difference to the best (6e-8 of its
    depth): the bounds draw.EXP_SUM_ERROR is built from. Under float32's least normal
    (tokens 87 logits under the best) only absolutely."""
    assert (np.abs(out - exact) <= exact * (2.4e-7 + 6e-8 * depth) + 1.2e-38).all()


def test_a_row_the_kernel_cannot_take_is_summed_by_numpy():
    """A strided view (every other logit) or float64 logits: numpy, the same figures."""
    row = np.random.default_rng(3).normal(0.0, 2.0, 4_096).astype(np.float32)
    for view in (row[::2], row[::2].astype(np.float64)):
        out = np.empty(len(view), dtype=np.float32)
        total = row_exp.exp_sum(view, float(view.max()), out)
        exact = np.exp(view.astype(np.float64) - float(view.max()))
        assert total == pytest.approx(float(exact.sum()), rel=1e-7)
        _within_float32(out, exact, float(view.max()) - view.astype(np.float64))


@pytest.mark.parametrize("spread", [0.5, 3.0, 12.0])
@pytest.mark.parametrize("size", [262_144, 1_001, 63])
def test_the_sum_under_a_bar_matches_float64(isa, spread, size):
    """ls_exp_sum_below (rowdraw.c's rest under a top-p's taken tokens, and a flat row's mass
    where the scan did not sum it): the float32 exponentials of the tokens under the bar
    summed, within the bound rowdraw.c gives it: each term within 2 ulps plus 6e-8 of its
    depth, and two float32 roundings of the sum."""
    rng = np.random.default_rng(size)
    row = rng.normal(0.0, spread, size).astype(np.float32)
    peak = float(row.max())
    library = rowscan.library()
    for bar in (np.inf, float(np.quantile(row, 0.9)), float(np.quantile(row, 0.1)), -np.inf):
        total = library.ls_exp_sum_below(row.ctypes.data, size, np.float32(peak), np.float32(bar))
        under = row < np.float32(bar)
        terms = np.exp(row.astype(np.float64) - peak)[under]
        depth = peak - row[under].astype(np.float64)
        bound = float((terms * (2.4e-7 + 1.2e-7 + 6e-8 * depth)).sum())
        assert abs(total - float(terms.sum())) <= bound


@pytest.mark.parametrize("spread", [0.5, 3.0, 12.0, 40.0])
@pytest.mark.parametrize("size", [262_144, 1_001, 63, 256])
def test_the_scan_and_the_sum_in_one_pass(spread, size):
    """ls_scan_exp_sum (a top-p's first pass in rowdraw.c): the blocks' maxima as
    ls_block_max gives them, and the sum of e^(x - peak) within draw.EXP_SUM_ERROR of the
    float64 one, though each block's terms are taken against the largest logit so far (here
    rising block after block, the order that rescales the sum most often), and the row in
    parts of 64 blocks, each against its own peak, then folded. And within the
    row's own bound: 2 ulps an exponential, two float32 roundings, 6e-8 per logit of the
    terms' weighted depth, which is at most the depths under the peak (the whole row's, when
    the peak comes first)."""
    rng = np.random.default_rng(size + 7)
    row = np.sort(rng.normal(0.0, spread, size)).astype(np.float32)
    library = rowscan.library()
    maxima = np.empty(-(-size // rowscan.BLOCK), dtype=np.float32)
    total, weighted_depth = ctypes.c_double(), ctypes.c_double()
    sums = (ctypes.byref(total), ctypes.byref(weighted_depth))
    if not _has_avx512():  # AVX-512 only, and says so: rowdraw.c then scans and counts
        assert library.ls_scan_exp_sum(row.ctypes.data, size, maxima.ctypes.data, *sums) == -1
        return
    for order, logits in enumerate((row, row[::-1].copy(), rng.permutation(row))):
        reference = np.empty_like(maxima)
        has_nan = library.ls_scan_exp_sum(logits.ctypes.data, size, maxima.ctypes.data, *sums)
        assert has_nan == library.ls_block_max(logits.ctypes.data, size, reference.ctypes.data)
        assert has_nan == 0 and maxima.tolist() == reference.tolist()
        depths = float(logits.max()) - logits.astype(np.float64)
        terms = np.exp(-depths)
        exact = float(terms.sum())
        assert total.value == pytest.approx(exact, rel=EXP_SUM_ERROR / 10)
        assert 0.0 <= weighted_depth.value <= float((terms * depths).sum()) * (1 + 1e-6)
        if order == 1:  # falling: every term taken against its part's peak, its first
            part = SCAN_PART_BLOCKS * rowscan.BLOCK
            part_peaks = np.repeat(logits[::part].astype(np.float64), part)[:size]
            below_part_peak = float((terms * (part_peaks - logits)).sum())
            assert weighted_depth.value == pytest.approx(below_part_peak, rel=1e-5)
        bound = exact * (2.4e-7 + 1.2e-7) + 6e-8 * weighted_depth.value
        assert abs(total.value - exact) <= bound
    logits = row.copy()
    logits[size // 2] = np.nan
    assert library.ls_scan_exp_sum(logits.ctypes.data, size, maxima.ctypes.data, *sums)
