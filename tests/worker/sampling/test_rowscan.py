"""rowscan: the C scan (each instruction set this CPU runs) gives exactly what numpy gives: the
blocks' maxima, the row's peak (NaN where it holds one), and every band's tokens in order."""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest

import loomserve.worker.sampling.rowscan as rowscan
from loomserve.worker.sampling.rowscan import BLOCK
from tests.worker.sampling import row_scan
from tests.worker.sampling.row_scan import RowScan

SIZES = [1, 15, 16, 255, 256, 257, 1000, 4096 + 17, 262_144]


def test_the_library_is_built_and_used_on_this_machine():
    """pip builds rowscan.c (pyproject.toml's ext-modules); the sampler draws with it on any
    CPU, in plain C where it has neither AVX-512 nor AVX2 (the `isa` fixture runs each)."""
    assert rowscan.library() is not None
    assert rowscan.native() is rowscan.library()


def _row(size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    row = rng.normal(0.0, 3.0, size).astype(np.float32)
    row[rng.integers(size, size=size // 50)] = -np.inf  # banned tokens
    if size > 600:
        row[256:512] = -np.inf  # a whole block banned
        row[700:710] = row[690]  # ties
    return row


def _numpy_block_max(row: np.ndarray) -> np.ndarray:
    n_blocks = -(-len(row) // BLOCK)
    padded = np.full(n_blocks * BLOCK, -np.inf, dtype=np.float32)
    padded[: len(row)] = row
    return padded.reshape(n_blocks, BLOCK).max(axis=1)


@pytest.mark.parametrize("size", SIZES)
def test_block_maxima_peak_and_bands_match_numpy(isa, size):
    for seed in range(3):
        row = _row(size, seed)
        scan = RowScan(row)
        assert np.array_equal(scan.block_max, _numpy_block_max(row))
        assert scan.peak == float(row.max())
        finite = np.sort(row[np.isfinite(row)])
        edges = [-math.inf, float(finite[0]), float(finite[len(finite) // 2]), scan.peak - 2.5]
        edges += [scan.peak, math.inf]
        for low in edges:
            for high in edges:
                expected = np.flatnonzero((row >= np.float32(low)) & (row < np.float32(high)))
                found = scan.band(low, high)
                assert found.tolist() == expected.tolist(), (low, high)
        # A value is in the band that starts at it, not in the one that ends at it.
        assert np.array_equal(scan.band(scan.peak), np.flatnonzero(row == row.max()))
        assert len(scan.band(-math.inf, scan.peak)) == np.count_nonzero(row < row.max())


@pytest.mark.parametrize("size", SIZES)
def test_a_nan_anywhere_makes_the_peak_nan(isa, size):
    for where in sorted({0, size // 2, size - 1}):
        row = _row(size, 7)
        row[where] = np.nan
        assert math.isnan(RowScan(row).peak), where


def test_rows_all_banned_or_infinite(isa):
    row = np.full(1000, -np.inf, dtype=np.float32)
    assert RowScan(row).peak == -math.inf
    assert RowScan(row).band(-math.inf).tolist() == list(range(1000))
    row[300] = np.inf
    assert RowScan(row).peak == math.inf


def test_the_kth_block_maximum_is_reached_by_k_tokens():
    row = _row(262_144, 3)
    scan = RowScan(row)
    for k in (1, 40, 1024):
        assert np.count_nonzero(row >= scan.kth_block_max(k)) >= k
    assert scan.kth_block_max(1) == scan.peak
    assert scan.kth_block_max(1025) == -math.inf  # fewer blocks than k


def test_numpy_serves_where_the_library_is_missing(monkeypatch):
    row = _row(4096 + 17, 5)
    built = RowScan(row)
    monkeypatch.setattr(rowscan, "library", lambda: None)
    fallback = RowScan(row)
    assert np.array_equal(fallback.block_max, built.block_max)
    assert fallback.peak == built.peak
    low = built.peak - 3.0
    assert fallback.band(low).tolist() == built.band(low).tolist()


def test_rows_numpy_must_serve_are_scanned_by_numpy():
    """A row that is not contiguous float32 (a strided view, float64) is never handed to C."""
    row = _row(3000, 9)
    strided = np.repeat(row, 2)[::2]
    as_float64 = row.astype(np.float64)
    for other in (strided, as_float64):
        scan = RowScan(other)
        assert np.array_equal(scan.block_max, _numpy_block_max(row))
        expected = np.flatnonzero(row >= row.max() - 2.0)
        assert scan.band(scan.peak - 2.0).tolist() == expected.tolist()


def test_count_is_the_bands_length(isa):
    row = _row(262_144, 11)
    scan = RowScan(row)
    for depth in (1.0, 6.0, 20.0):
        low, high = scan.peak - depth, scan.peak - depth / 2
        assert scan.count(low, high) == len(scan.band(low, high))
        assert scan.count(low) == np.count_nonzero(row >= np.float32(low))


def test_sum_below_is_numpys_masked_sum(isa):
    rng = np.random.default_rng(13)
    for size in SIZES:
        row = _row(size, 17)
        values = rng.random(size).astype(np.float32)
        for below in (-math.inf, float(np.median(row)), float(row.max()), math.inf):
            expected = float(np.sum(values, where=row < np.float32(below), dtype=np.float64))
            assert row_scan.sum_below(values, row, below) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.9])
def test_cumulative_weights_are_numpys_cumsum_of_the_exponentials(isa, temperature):
    """rowdraw.c's weights: a running float64 sum from `start`, to within a few ulps of
    numpy's, for banned tokens (-inf: weight 0) and tokens far under the best alike."""
    library = rowscan.library()
    rng = np.random.default_rng(int(temperature * 10))
    for size in SIZES:
        row = _row(size, size) * np.float32(8.0)  # depths to ~100: some weights underflow
        scattered = np.sort(rng.choice(size, min(size, 3000), replace=False)).astype(np.int32)
        # ids that follow each other (a flat row's head) are read as a run, the others gathered
        following = np.arange(size, dtype=np.int32)
        for ids in (scattered, following):
            peak = np.float32(row.max())
            weights = np.empty(len(ids))
            last = library.ls_cumulative_weights(
                row.ctypes.data,
                ids.ctypes.data,
                len(ids),
                peak,
                temperature,
                2.5,
                weights.ctypes.data,
            )
            depths = (row[ids].astype(np.float64) - float(peak)) / temperature
            assert weights == pytest.approx(2.5 + np.cumsum(np.exp(depths)), rel=1e-14)
            assert last == weights[-1]
    nothing = library.ls_cumulative_weights(row.ctypes.data, ids.ctypes.data, 0, peak, 1.0, 2.5, 0)
    assert nothing == 2.5


def test_the_float64_exponentials_are_within_two_ulps(isa):
    """Each weight alone (start 0, one id a call's length): e^d for d from 0 down to -708,
    where float64 stays normal, and 0 for -inf and under e^-745."""
    library = rowscan.library()
    depths = np.concatenate([-np.geomspace(1e-12, 708.0, 5000), [0.0, -1e-300]])
    row = np.concatenate([depths, [-np.inf, -746.0, -800.0]]).astype(np.float32)
    weights = np.empty(len(row))
    # Each token first of eight, the other seven the -inf one (weight 0): the vector kernels'
    # first lane, whose running sum is the weight itself.
    ids = np.full(8, len(depths), dtype=np.int32)
    sums = np.empty(8)
    for i in range(len(row)):
        ids[0] = i
        library.ls_cumulative_weights(
            row.ctypes.data, ids.ctypes.data, 8, 0.0, 1.0, 0.0, sums.ctypes.data
        )
        weights[i] = sums[0]
        assert (sums == sums[0]).all()
    exact = np.exp(row.astype(np.float64))
    assert (np.abs(weights - exact) <= 4.5e-16 * exact).all()
    assert (weights[-3:] == 0.0).all()


def test_draws_are_the_same_under_every_instruction_set(isa):
    """rowdraw.c reads the row through the scan: the same seeds draw the same tokens whatever
    instruction set scans it (the AVX-512 draws are the reference)."""
    library = rowscan.library()
    rows = [_row(size, seed) for seed, size in enumerate((300, 4096 + 17, 262_144))]
    cuts = [(1.0, 0, 1.0, 0.0), (0.8, 40, 0.95, 0.05), (1.0, 0, 1.0, 0.1), (1.2, 3, 1.0, 0.0)]

    def draws() -> list:
        return [
            rowscan.draw(row, *cut, 4.0, seed) for row in rows for cut in cuts for seed in range(20)
        ]

    here = draws()
    library.ls_limit_isa(2)
    reference = draws()
    assert [(drawn.token, drawn.kept) for drawn in here] == [
        (drawn.token, drawn.kept) for drawn in reference
    ]
    # The weights are summed in another order with AVX-512: the same to a few ulps.
    assert [drawn.head_mass for drawn in here] == pytest.approx(
        [drawn.head_mass for drawn in reference], rel=1e-14
    )
    assert len({drawn[0] for drawn in here}) > 20


def _scan_rows(size: int) -> list[np.ndarray]:
    """Rows for the scan in parts: rising (the sums rescaled at every block), falling, the
    test rows (banned tokens, a banned block), and one whose first part is all -inf."""
    rising = np.sort(np.random.default_rng(size).normal(0.0, 4.0, size)).astype(np.float32)
    banned_first = _row(size, 3)
    banned_first[: 64 * BLOCK] = -np.inf
    banned_first[-1] = 5.0
    return [rising, rising[::-1].copy(), _row(size, 1), banned_first]


@pytest.mark.parametrize("size", [300, 64 * BLOCK, 64 * BLOCK + 1, 4096 * 5 + 17, 262_144])
def test_the_scan_in_parts_folds_to_the_one_pass_sums(size):
    """A top-p alone's scan, cut in parts that graphdraw.c's threads take a share of (here in
    reverse order) and folded in row order, gives ls_scan_exp_sum's block maxima, total and
    weighted depth to the bit; and the draw finished from them (ls_draw_from_scan) is
    ls_draw's, token and head mass."""
    library = rowscan.library()
    n_blocks, parts = -(-size // BLOCK), library.ls_scan_parts(size)
    assert parts == -(-n_blocks // 64)
    sums = np.zeros((parts, 3))
    maxima, whole = np.empty(n_blocks, np.float32), np.empty(n_blocks, np.float32)
    total, depth = ctypes.c_double(), ctypes.c_double()
    folded_total, folded_depth = ctypes.c_double(), ctypes.c_double()
    scratch = np.zeros(library.ls_draw_scratch_bytes(size) + 64, np.uint8)
    address = -(-scratch.ctypes.data // 64) * 64
    found = (ctypes.c_double * 2)()
    for row in _scan_rows(size):
        args = (row.ctypes.data, size, maxima.ctypes.data)
        if library.ls_isa() < 2:  # AVX-512 only: graphdraw.c then draws the row on one thread
            assert library.ls_scan_exp_sum_part(*args, 0, sums.ctypes.data) == -1
            return
        nan = [library.ls_scan_exp_sum_part(*args, p, sums[p].ctypes.data) for p in range(parts)]
        library.ls_scan_fold(sums.ctypes.data, parts, ctypes.byref(folded_total),
                             ctypes.byref(folded_depth))  # fmt: skip
        has_nan = library.ls_scan_exp_sum(
            row.ctypes.data, size, whole.ctypes.data, ctypes.byref(total), ctypes.byref(depth)
        )
        assert not any(nan) and has_nan == 0 and maxima.tolist() == whole.tolist()
        assert (folded_total.value, folded_depth.value) == (total.value, depth.value)
        assert total.value > 0.0
        for seed in range(12):
            for top_p in (0.5, 0.9, 0.99):
                settings = np.array([0.7, 0.0, top_p, 0.0, 4.0])
                ctypes.memmove(address, maxima.ctypes.data, maxima.nbytes)
                token = library.ls_draw_from_scan(
                    row.ctypes.data, size, settings.ctypes.data, seed, address,
                    total.value, depth.value, found,
                )  # fmt: skip
                alone = rowscan.draw(row, 0.7, 0, top_p, 0.0, 4.0, seed)
                assert (token, found[0]) == (alone.token, alone.head_mass)


def test_rows_drawn_in_one_call_are_each_rows_draw(isa):
    """ls_draw_rows: each row's token and head mass are ls_draw's for that row, seed and
    settings, in any order of rows and with a row twice; a row with a NaN gives its first
    NaN (numpy's argmax), weighing 1, whatever its settings."""
    logits = np.stack([_row(4096 + 17, seed) for seed in range(6)])
    logits[4, 100] = np.nan
    rows = np.array([3, 0, 4, 5, 3, 1, 2])
    cuts = [(1.0, 0, 1.0, 0.0, 4.0), (0.8, 40, 0.95, 0.05, 4.0), (0.7, 0, 0.95, 0.0, 4.0),
            (1.0, 0, 1.0, 0.1, 2.0), (1.2, 3, 1.0, 0.0, 4.0), (1.0, 0, 1.0, 0.0, 9.0),
            (0.5, 0, 0.5, 0.0, 4.0)]  # fmt: skip
    seeds = np.arange(7, dtype=np.uint64) * 1_000_003
    assert rowscan.draws_rows(logits)
    drawn = rowscan.draw_rows(logits, rows, np.array(cuts), seeds)
    for i, row in enumerate(rows):
        alone = rowscan.draw(logits[row], *cuts[i], int(seeds[i]))
        assert (drawn.tokens[i], drawn.head_mass[i]) == (alone.token, alone.head_mass)
    assert (drawn.tokens[2], drawn.head_mass[2]) == (100, 1.0)  # row 4: its NaN
    # A thread takes up to four rows at once, the maxima of those that are no top-p alone read
    # side by side: the NaN row among them (its cut moved on by one), on one thread and two.
    turned = cuts[1:] + cuts[:1]
    for threads in (1, 2):
        drawn = rowscan.draw_rows(logits, rows, np.array(turned), seeds, threads)
        for i, row in enumerate(rows):
            alone = rowscan.draw(logits[row], *turned[i], int(seeds[i]))
            assert (drawn.tokens[i], drawn.head_mass[i]) == (alone.token, alone.head_mass)
        assert (drawn.tokens[2], drawn.head_mass[2]) == (100, 1.0)
    with pytest.raises(ValueError, match="outside"):
        rowscan.draw_rows(logits, np.array([6]), np.array(cuts[:1]), seeds[:1])
    assert not rowscan.draws_rows(logits[:, ::2])  # strided: not rows it can read
    with pytest.raises(ValueError, match="contiguous"):
        rowscan.draw_rows(logits[:, ::2], rows, np.array(cuts), seeds)


@pytest.mark.parametrize("size", [4096 + 17, 3 * 4096])
def test_temperatures_drawn_four_rows_at_once_draw_as_each_row_alone(isa, size):
    """Rows whose maxima are read side by side, four at a time: the same tokens and head
    masses as each row drawn alone, for a temperature's head at its first span, under a min-p
    bar above it, too shallow (the span widens), over a flat row, and a last partial block."""
    logits = np.stack([_row(size, seed) for seed in range(3)] + [np.linspace(0, 1, size)])
    logits = logits.astype(np.float32)
    cuts = [(1.0, 0, 1.0, 0.0, 4.0), (1.0, 0, 1.0, 0.0, 0.5), (1.0, 0, 1.0, 0.5, 2.0),
            (0.5, 0, 1.0, 0.0, 9.0), (1.5, 0, 1.0, 0.05, 6.0),
            (1.0, 0, 1.0, 0.0, 20.0)] * 4  # fmt: skip
    rows = np.repeat(np.arange(4), len(cuts) // 4)
    settings = np.array(cuts)
    seeds = np.arange(len(rows), dtype=np.uint64) * 104_729
    alone = [
        rowscan.draw(logits[r], *cut, int(seed))
        for r, cut, seed in zip(rows, cuts, seeds, strict=True)
    ]
    for threads in (1, 2):
        drawn = rowscan.draw_rows(logits, rows, settings, seeds, threads)
        assert drawn.tokens.tolist() == [a.token for a in alone]
        assert drawn.head_mass.tolist() == [a.head_mass for a in alone]
    assert len({a.token for a in alone}) > 12


@pytest.mark.parametrize("size", SIZES)
def test_argmax_rows_is_numpys_argmax(isa, size):
    """The first largest logit's index, or the first NaN's, as numpy's argmax gives it: ties
    (within a block and across blocks), banned tokens, infinities and NaNs."""
    rows = np.stack([_row(size, seed) for seed in range(6)])
    rows[1, :] = -np.inf  # every token banned: the first
    rows[2, size // 3] = rows[2, -1] = rows[2].max() + 1.0  # a tie across blocks
    rows[3, size // 2] = np.nan
    rows[3, -1] = np.nan
    rows[4, size - 1] = np.inf
    rows[5, :] = 1.5  # all tied
    # Rows are taken up to four at once (read side by side): groups of 4 + 2, 3 + 3, 2 + 2 + 2.
    for threads in (1, 2, 3):
        assert rowscan.argmax_rows(rows, threads).tolist() == rows.argmax(axis=1).tolist()


def test_llama_cpps_openmp_threads_are_found_once_it_is_loaded():
    """llama.cpp's CPU backend loads libgomp; rowthreads.c finds it in the process and runs a
    tick's rows on that many of its threads (as many as asked, no more than there are rows),
    with the same tokens and argmaxes as one thread."""
    import llama_cpp  # noqa: F401  (loads libggml-cpu, and with it libgomp)

    assert rowscan.on_openmp()
    library = rowscan.library()
    logits = np.stack([_row(4096 + 17, seed) for seed in range(5)])
    n_rows, n = logits.shape
    floats = library.ls_argmax_scratch_floats(n)  # room for a thread's rows' block maxima
    block_max = np.empty((8, floats), dtype=np.float32)
    out = np.empty(n_rows, dtype=np.int64)
    for threads, team in ((1, 1), (2, 2), (3, 3), (8, 5)):  # 5 rows: 5 threads at most
        took_part = library.ls_argmax_rows_on(
            logits.ctypes.data, n_rows, n, block_max.ctypes.data, floats, threads, out.ctypes.data
        )  # fmt: skip
        assert took_part == team
        assert out.tolist() == logits.argmax(axis=1).tolist()
    rows = np.array([4, 0, 2, 2, 1, 3, 0])
    cuts = np.array([(1.0, 0, 1.0, 0.0, 4.0), (0.7, 0, 0.95, 0.0, 4.0), (0.8, 40, 0.95, 0.05, 4.0),
                     (1.0, 0, 1.0, 0.1, 2.0), (1.2, 3, 1.0, 0.0, 4.0), (1.0, 0, 1.0, 0.0, 9.0),
                     (0.5, 0, 0.5, 0.0, 4.0)])  # fmt: skip
    seeds = np.arange(7, dtype=np.uint64) * 7_919
    alone = rowscan.draw_rows(logits, rows, cuts, seeds)
    assert len(set(alone.tokens.tolist())) > 3
    for threads in (2, 3, 16):
        drawn = rowscan.draw_rows(logits, rows, cuts, seeds, threads)
        assert drawn.tokens.tolist() == alone.tokens.tolist()
        # A row the C draw leaves (a top-p alone on an AVX2 CPU) has no head mass yet.
        served = alone.tokens >= 0
        assert drawn.head_mass[served].tolist() == alone.head_mass[served].tolist()


def test_argmax_rows_numpy_serves_what_the_library_cannot():
    rows = np.random.default_rng(3).normal(size=(4, 600))
    for array in (rows, rows.astype(np.float32)[:, ::2]):  # float64; strided
        assert rowscan.argmax_rows(array).tolist() == array.argmax(axis=1).tolist()
