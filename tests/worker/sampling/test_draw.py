"""draw.py and rowdraw.c: the host sampler's draws follow softmax(logits / T) over exactly the
tokens that top-k, top-p and min-p keep (chi-square over 100,000 draws per path), whatever the
head's span: a narrow one makes the rejection-sampled tail carry a tenth of the mass. First the
numpy reference of the draw's steps (oracle.py), then the C draw, which serves every row, held
to it."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

import loomserve.worker.sampling.draw as draw_module
import tests.worker.sampling.oracle as oracle
from loomserve.worker.sampling import rowscan
from loomserve.worker.sampling.draw import Truncation, draw_token
from tests.worker.sampling.oracle import Candidates, candidates, draw, exact_candidates

DRAWS = 100_000
N_VOCAB = 300


def _logits(seed: int = 0) -> np.ndarray:
    """A spread like a model's: a few strong tokens over a broad low tail."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 1.5, N_VOCAB)
    logits[rng.choice(N_VOCAB, 12, replace=False)] += rng.uniform(2.0, 6.0, 12)
    return logits.astype(np.float32)


def _expected(logits: np.ndarray, cut: Truncation) -> np.ndarray:
    """The target distribution, written out plainly: llama.cpp's order (top-k, top-p,
    min-p on the untempered logits), then softmax(logits / T) over what they keep."""
    values = logits.astype(np.float64)
    order = np.argsort(-values, kind="stable")
    kept = np.zeros(len(values), dtype=bool)
    ranked = order if not cut.top_k else order[: cut.top_k]
    if cut.top_p < 1.0:
        probs = np.exp(values[ranked] - values[ranked].max())
        probs /= probs.sum()
        cumulative, n_keep = 0.0, len(ranked)
        for i, p in enumerate(probs):
            cumulative += p
            if cumulative >= cut.top_p:
                n_keep = i + 1
                break
        ranked = ranked[:n_keep]
    kept[ranked] = True
    if cut.min_p > 0.0:
        kept &= values >= values.max() + math.log(cut.min_p)
    weights = np.where(kept, np.exp((values - values.max()) / cut.temperature), 0.0)
    return weights / weights.sum()


def _chi_square_p(counts: np.ndarray, expected: np.ndarray) -> float:
    """The p-value of Pearson's chi-square (bins under 5 expected draws pooled), by the
    Wilson-Hilferty approximation of its distribution."""
    order = np.argsort(expected)
    pooled_o, pooled_e, o_acc, e_acc = [], [], 0.0, 0.0
    for i in order:
        o_acc += counts[i]
        e_acc += expected[i]
        if e_acc >= 5:
            pooled_o.append(o_acc)
            pooled_e.append(e_acc)
            o_acc = e_acc = 0.0
    if e_acc and pooled_e:
        pooled_o[-1] += o_acc
        pooled_e[-1] += e_acc
    observed, wanted = np.array(pooled_o), np.array(pooled_e)
    statistic = float(((observed - wanted) ** 2 / wanted).sum())
    dof = len(wanted) - 1
    z = ((statistic / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _counts(found: Candidates, draws: int = DRAWS) -> np.ndarray:
    """How often each token is picked in `draws` draws from the row's candidates (found
    once: what the filters keep does not change from draw to draw)."""
    rng = np.random.default_rng(1234)
    counts = np.zeros(N_VOCAB)
    for _ in range(draws):
        counts[found.pick(rng)] += 1
    return counts


# A head so narrow that the tail, drawn by rejection, holds a tenth of the mass.
NARROW = -0.5
CUTS = {
    "temperature 1": (Truncation(1.0), None),
    "temperature 0.6": (Truncation(0.6), None),
    "top-k 20": (Truncation(1.0, top_k=20), None),
    "top-p 0.9": (Truncation(0.8, top_p=0.9), None),
    "top-p 0.9999": (Truncation(1.0, top_p=0.9999), None),
    "min-p 0.01": (Truncation(1.0, min_p=0.01), None),
    "top-k, top-p, min-p": (Truncation(0.7, top_k=40, top_p=0.95, min_p=0.05), None),
    "temperature 1, narrow head": (Truncation(1.0), NARROW),
    "temperature 2.5, narrow head": (Truncation(2.5), NARROW),
    "top-p 0.9, narrow head": (Truncation(1.0, top_p=0.9), NARROW),
    "min-p 1e-4, narrow head": (Truncation(1.3, min_p=1e-4), NARROW),
}


@pytest.mark.parametrize("name", list(CUTS))
def test_draws_follow_the_tempered_softmax_over_the_kept_tokens(name):
    (cut, margin), logits = CUTS[name], _logits()
    expected = _expected(logits, cut)
    counts = _counts(candidates(logits, cut, margin))
    # Exactly the kept tokens: nothing outside the set, and every token it holds with a
    # share above 1 in 5,000 drawn at least once.
    assert counts[expected == 0].sum() == 0
    assert (counts[expected > 2e-4] > 0).all()
    assert _chi_square_p(counts, expected * DRAWS) > 1e-3


def test_the_narrow_span_draws_much_of_the_mass_from_the_tail():
    """The rejection path carries real weight in the tests above, not a rounding error."""
    logits = _logits()
    floor = logits.max() - (math.log(N_VOCAB) + NARROW)
    expected = _expected(logits, Truncation(1.0))
    assert expected[logits < floor].sum() > 0.05


def test_the_whole_row_reference_agrees_too():
    logits, cut = _logits(3), CUTS["top-k, top-p, min-p"][0]
    counts = _counts(exact_candidates(logits, cut))
    assert _chi_square_p(counts, _expected(logits, cut) * DRAWS) > 1e-3


def test_a_top_k_beyond_the_head_and_minus_infinity_logits():
    logits = _logits(5)
    logits[:100] = -np.inf  # a logit bias of -inf on a third of the vocabulary
    cut = Truncation(1.0, top_k=250)  # more than the head holds at a narrow span
    expected = _expected(logits, cut)
    counts = _counts(candidates(logits, cut, NARROW))
    assert counts[:100].sum() == 0
    assert _chi_square_p(counts, expected * DRAWS) > 1e-3


def test_the_same_generator_state_gives_the_same_tokens():
    logits, cut = _logits(), Truncation(1.0, top_p=0.95)
    first = [draw(logits, cut, np.random.default_rng(42)) for _ in range(5)]
    again = [draw(logits, cut, np.random.default_rng(42)) for _ in range(5)]
    assert first == again


# Cuts at Gemma's vocabulary size, on _peaked_262k rows.
CUTS_262K = {
    "top-k": Truncation(1.0, top_k=40),
    "top-p": Truncation(0.7, top_p=0.95),
    "top-p near 1": Truncation(1.0, top_p=0.9999),
    "min-p": Truncation(1.0, min_p=0.05),
    "all three": Truncation(0.8, top_k=40, top_p=0.95, min_p=0.05),
}


def _peaked_262k() -> np.ndarray:
    """A spread like a model's at Gemma's vocabulary size: a peaked few over a broad tail."""
    rng = np.random.default_rng(11)
    row = rng.normal(0.0, 3.0, 262_144).astype(np.float32)
    row[rng.choice(262_144, 300, replace=False)] += rng.uniform(4.0, 18.0, 300).astype(np.float32)
    return row


@pytest.mark.parametrize("cut", list(CUTS_262K.values()), ids=list(CUTS_262K))
def test_at_a_262k_vocabulary_the_filters_keep_what_the_whole_row_keeps(cut):
    """The head's cuts against the whole row's, token for token, at Gemma's vocabulary size
    (a spread like a model's: a peaked few over a broad tail)."""
    row = _peaked_262k()
    found, whole = candidates(row, cut), exact_candidates(row, cut)
    assert found.row is None  # a cut inside the head: no tail to draw by rejection
    assert sorted(found.ids.tolist()) == sorted(whole.ids.tolist())
    weights = np.diff(found.cumulative, prepend=0.0)
    whole_weights = dict(
        zip(whole.ids.tolist(), np.diff(whole.cumulative, prepend=0.0), strict=True)
    )
    for token, weight in zip(found.ids.tolist(), weights, strict=True):
        assert weight == pytest.approx(whole_weights[token], rel=1e-9)


def test_a_temperature_alone_keeps_every_token():
    """No filter: the head is drawn from directly and every other token by rejection."""
    row = np.random.default_rng(2).normal(0.0, 3.0, 262_144).astype(np.float32)
    found = candidates(row, Truncation(1.0))
    assert found.row is not None and len(found.ids) + found.n_tail == 262_144
    # The envelope is held to at most ENVELOPE_LIMIT times the head's weight (the head is
    # widened where it would weigh more): a draw takes a few tries at most on average.
    assert found.n_tail * found.envelope <= oracle.ENVELOPE_LIMIT * found.cumulative[-1]


def test_rows_without_a_finite_peak_give_a_token_not_an_error():
    rng = np.random.default_rng(0)
    for row in (np.full(N_VOCAB, np.nan, np.float32), np.full(N_VOCAB, -np.inf, np.float32)):
        assert 0 <= draw(row, Truncation(1.0, top_p=0.9), rng) < N_VOCAB


def _spread_row(seed: int, spread: float) -> np.ndarray:
    """A 262,144-token row: a normal spread with a few hundred tokens lifted over it."""
    rng = np.random.default_rng(seed)
    row = rng.normal(0.0, spread, 262_144).astype(np.float32)
    row[rng.choice(262_144, 300, replace=False)] += rng.uniform(2.0, 4.0 * spread, 300).astype(
        np.float32
    )
    return row


@pytest.mark.parametrize("spread", [1.0, 3.0, 6.0, 45.0])
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.95, 0.999])
def test_top_p_alone_keeps_what_the_whole_row_keeps_at_any_spread(spread, top_p):
    """The nucleus cut from bounds on the row's mass is the whole row's cut, token for token:
    flat rows (which sum the whole row) and peaked ones (which count bands) alike."""
    for seed in range(3):
        row, cut = _spread_row(seed, spread), Truncation(0.7, top_p=top_p)
        found, whole = candidates(row, cut), exact_candidates(row, cut)
        assert found.ids.tolist() == whole.ids.tolist()
        assert found.cumulative == pytest.approx(whole.cumulative, rel=1e-9)


def test_a_peaked_row_is_cut_without_summing_the_whole_row(monkeypatch):
    """The bounds settle a peaked row's nucleus: the pass over every token is not taken."""

    def refused(*_args):
        raise AssertionError("summed the whole row")

    monkeypatch.setattr(oracle, "_summed_nucleus", refused)
    rng = np.random.default_rng(4)  # like a model's: a few clear favourites over a broad tail
    row = rng.normal(0.0, 2.0, 262_144).astype(np.float32)
    row[rng.choice(262_144, 5, replace=False)] = rng.uniform(18.0, 22.0, 5).astype(np.float32)
    found = candidates(row, Truncation(0.7, top_p=0.95))
    monkeypatch.undo()
    assert found.ids.tolist() == exact_candidates(row, Truncation(0.7, top_p=0.95)).ids.tolist()


def test_a_cut_the_bounds_leave_in_doubt_sums_the_whole_row(monkeypatch):
    """Two tokens weighing 1 and e^-1 over 200,000 at -18: the mass under the summed head
    (about 0.003 of 1.37) decides whether the nucleus holds one token or two. Its bounds
    disagree, so the row is summed, and the cut is the whole row's: two tokens."""
    row = np.full(262_144, -50.0, dtype=np.float32)
    row[:200_000] = -18.0
    row[200_000], row[200_001] = 0.0, -1.0
    total = 1.0 + math.exp(-1.0) + 200_000 * math.exp(-18.0) + 62_142 * math.exp(-50.0)
    cut = Truncation(1.0, top_p=1.0 / total + 2e-4)  # just over the best token's share
    summed = []
    original = oracle._summed_nucleus
    monkeypatch.setattr(
        oracle, "_summed_nucleus", lambda *args: summed.append(1) or original(*args)
    )
    found = candidates(row, cut)
    assert summed == [1]
    assert found.ids.tolist() == [200_000, 200_001] == exact_candidates(row, cut).ids.tolist()


def test_a_wide_nucleus_taken_band_by_band_keeps_what_the_whole_row_keeps(monkeypatch):
    """Thin bands, and the rest of the row taken at once past a shallow last band: the cut
    and the order of the kept tokens are still the whole row's (on flat and peaked rows)."""
    monkeypatch.setattr(oracle, "NUCLEUS_BAND", 0.5)
    monkeypatch.setattr(oracle, "NUCLEUS_LAST_BAND", 10.0)
    for spread in (1.0, 3.0, 6.0):
        for top_p in (0.9, 0.9999):
            row, cut = _spread_row(7, spread), Truncation(1.0, top_p=top_p)
            found, whole = candidates(row, cut), exact_candidates(row, cut)
            assert found.ids.tolist() == whole.ids.tolist()
            assert found.cumulative == pytest.approx(whole.cumulative, rel=1e-9)


def _tiered_row(margin: float) -> tuple[np.ndarray, Truncation]:
    """A flat row in three tiers: the best token (0), 100,000 at -13 and the rest at -20, cut
    `margin` (of the best token's weight) past the best token's share: so two tokens, by a
    margin the float32 sum's bound cannot settle."""
    row = np.full(262_144, -20.0, dtype=np.float32)
    row[:100_000] = -13.0
    row[100_005] = 0.0
    total = float(np.exp(row.astype(np.float64)).sum())
    return row, Truncation(1.0, top_p=(1.0 + margin) / total)


@pytest.mark.parametrize("sign", [-1.0, 0.0, 1.0])
def test_a_cut_is_exact_whatever_error_the_summed_mass_has_within_its_bound(monkeypatch, sign):
    """The whole row's mass is summed in float32 (ggml's kernel), within EXP_SUM_ERROR of the
    float64 sum, each exponential within EXP_ERROR plus DEPTH_ERROR per logit of depth. Made
    off by nearly that much either way, on purpose, the cut is still the float64 one: where
    the error could move it (a cut 1e-7 or 1e-10 past the best token's weight, here) the
    doubt is settled by the rest's bounds or by a float64 sum."""
    real_sum = oracle.exp_sum

    def off_sum(row, peak, out):
        total = real_sum(row, peak, out)
        # The sum by 9/10 of its bound, each exponential by 3/4 of its own: the kernel's
        # own error (an ulp or two) and the float32 product's rounding come on top.
        depth = (peak - row).astype(np.float32)
        out *= 1.0 + sign * 0.75 * (oracle.EXP_ERROR + oracle.DEPTH_ERROR * depth)
        return total * (1.0 + sign * 0.9 * oracle.EXP_SUM_ERROR)

    monkeypatch.setattr(oracle, "exp_sum", off_sum)
    row = np.full(262_144, -13.0, dtype=np.float32)  # a flat tail holding 37 % of the mass
    row[5] = 0.0
    total = float(np.exp(row.astype(np.float64)).sum())
    rows = [(row, Truncation(1.0, top_p=(1.0 + 1e-7) / total))]  # 2 tokens, by 2e-6 of one
    rows += [_tiered_row(1e-7), _tiered_row(-1e-7), _tiered_row(1e-10), _tiered_row(-1e-10)]
    rows += [(_spread_row(seed, 1.0), Truncation(0.7, top_p=0.999)) for seed in range(3)]
    for logits, cut in rows:
        assert candidates(logits, cut).ids.tolist() == exact_candidates(logits, cut).ids.tolist()


@pytest.mark.parametrize("margin", [1e-7, -1e-7])
def test_a_cut_in_doubt_is_settled_by_the_rest_without_a_float64_sum(monkeypatch, margin):
    """The float32 sum's bound (2e-6 of the mass) leaves a cut 1e-7 from a token's edge in
    doubt; the taken tokens' float64 mass plus the deep tier's float32 sum (its error some
    1e-6 of 3e-4) settles it, so the whole row is not summed again."""

    def refused(*_args):
        raise AssertionError("summed the whole row in float64")

    monkeypatch.setattr(oracle, "_float64_cut", refused)
    row, cut = _tiered_row(margin)
    found = candidates(row, cut)
    monkeypatch.undo()
    assert len(found.ids) == (2 if margin > 0 else 1)
    assert found.ids.tolist() == exact_candidates(row, cut).ids.tolist()


def test_the_nucleus_order_is_a_stable_sort_best_first():
    """Bands are put best first by a sort of integer keys: the order of a stable argsort of
    the negated logits, ties (frequent in quantized logits, and 0.0 against -0.0) in id order."""
    rng = np.random.default_rng(21)
    for _ in range(300):
        n = int(rng.integers(1, 2_000))
        ids = np.sort(rng.choice(262_144, n, replace=False))
        scale = rng.choice([1.0, 0.25, 1e-3])
        values = (rng.integers(-6, 6, n) * scale).astype(np.float32)
        values[rng.integers(n, size=n // 8)] = -0.0
        values[rng.integers(n, size=n // 8)] = rng.normal(0.0, 20.0, n // 8).astype(np.float32)
        expected = ids[np.argsort(-values, kind="stable")]
        assert oracle._best_first_order(ids, values).tolist() == expected.tolist()


# rowdraw.c: the same draws in one C call (draw_token).


def _token_counts(logits: np.ndarray, cut: Truncation, margin: float | None = None) -> np.ndarray:
    """How often draw_token picks each token in DRAWS draws, the head's mass fed back as a
    request's sampler feeds it."""
    rng, counts, mass = np.random.default_rng(99), np.zeros(len(logits)), 1.0
    for _ in range(DRAWS):
        token, mass = draw_token(logits, cut, rng, mass, margin)
        counts[token] += 1
    return counts


@pytest.mark.parametrize("name", list(CUTS))
def test_draw_token_follows_the_tempered_softmax_over_the_kept_tokens(name):
    (cut, margin), logits = CUTS[name], _logits(8)
    expected = _expected(logits, cut)
    counts = _token_counts(logits, cut, margin)
    assert counts[expected == 0].sum() == 0
    assert (counts[expected > 2e-4] > 0).all()
    assert _chi_square_p(counts, expected * DRAWS) > 1e-3


@pytest.mark.parametrize("name", list(CUTS))
def test_the_c_draw_keeps_what_the_reference_keeps_under_every_instruction_set(isa, name):
    """Every cut, on any CPU (plain C where it has neither AVX-512 nor AVX2): the tokens the
    whole row's filters keep, in the reference's order for a top-p alone."""
    (cut, _), logits = CUTS[name], _logits()
    kept = _c_kept(logits, cut)
    if cut.top_p == 1.0 and cut.top_k == 0:  # nothing cuts: a tail (every token) is kept
        return
    assert kept is not None
    whole = exact_candidates(logits, cut).ids.tolist()
    assert sorted(kept.tolist()) == sorted(whole)
    if _top_p_alone(cut):
        assert kept.tolist() == candidates(logits, cut).ids.tolist()


def test_draw_token_top_k_ties_at_the_kth_token_go_to_the_lowest_ids():
    """Quantized logits tie often: the k kept are the stable sort's first k."""
    logits = _logits(4)
    logits[[7, 50, 120, 121, 299]] = 30.0  # five tied best tokens, three kept
    cut = Truncation(1.0, top_k=3)
    counts = _token_counts(logits, cut)
    assert counts.nonzero()[0].tolist() == [7, 50, 120]
    assert _chi_square_p(counts, _expected(logits, cut) * DRAWS) > 1e-3


@pytest.mark.parametrize(
    "cut",
    [Truncation(1.0, top_k=20), Truncation(0.9, top_k=60, top_p=0.8, min_p=0.01)],
    ids=["top-k", "top-k, top-p, min-p"],
)
def test_draw_token_top_k_among_more_blocks_than_k(cut):
    """k under the row's number of blocks: the k best are gathered only from the blocks that
    reach the k-th largest block maximum."""
    rng = np.random.default_rng(17)
    logits = rng.normal(0.0, 2.0, 40_000).astype(np.float32)  # 157 blocks
    logits[rng.choice(40_000, 80, replace=False)] += rng.uniform(3.0, 6.0, 80).astype(np.float32)
    expected = _expected(logits, cut)
    counts = _token_counts(logits, cut)
    assert counts[expected == 0].sum() == 0
    assert _chi_square_p(counts, expected * DRAWS) > 1e-3


def test_draw_token_is_the_same_from_the_same_generator_state():
    logits = _logits()
    for cut in (Truncation(1.0), Truncation(0.8, top_k=40, top_p=0.95, min_p=0.05)):
        runs = []
        for _ in range(2):
            rng, mass, tokens = np.random.default_rng(42), 1.0, []
            for _ in range(50):
                token, mass = draw_token(logits, cut, rng, mass)
                tokens.append(token)
            runs.append(tokens)
        assert runs[0] == runs[1]
        assert len(set(runs[0])) > 5  # drawn, not the argmax again and again


@pytest.mark.parametrize("strided", [False, True])
def test_draw_tokens_are_draw_token_row_by_row(strided):
    """draw_tokens (a tick's plain rows in one call) gives each row the token and head mass
    that draw_token gives it, from the same generator state, tick after tick: through
    ls_draw_rows, through a call per row where the logits are not contiguous (each row copied
    for the C), a row with a NaN among them."""
    cuts = [cut for cut, margin in CUTS.values() if margin is None]
    logits = np.stack([_logits(seed) for seed in range(len(cuts))])
    logits[2, 5] = np.nan
    if strided:
        logits = np.repeat(logits, 2, axis=1)[:, ::2]
    rows = list(range(len(cuts)))[::-1]  # not in the logits' order
    cuts = cuts[::-1]
    batched = [np.random.default_rng(row) for row in rows]
    each = [np.random.default_rng(row) for row in rows]
    hints = [1.0] * len(rows)
    for _ in range(5):
        drawn = draw_module.draw_tokens(logits, rows, cuts, batched, hints)
        expected = [
            draw_token(logits[row], cut, rng, hint)
            for row, cut, rng, hint in zip(rows, cuts, each, hints, strict=True)
        ]
        assert drawn == expected
        hints = [mass for _, mass in drawn]


def _rows_without_a_finite_peak(size: int) -> list[np.ndarray]:
    """A NaN (a broken forward pass) late in a row, NaNs everywhere, every token biased away
    (-inf), and a token at +inf: rows the reference answers with their argmax."""
    late_nan = _logits(3) if size == N_VOCAB else _spread_row(3, 3.0)
    late_nan[size - 7] = np.nan
    late_nan[size - 2] = np.nan
    infinite = np.full(size, -np.inf, np.float32)
    infinite[size // 3] = infinite[size // 2] = np.inf
    return [late_nan, np.full(size, np.nan, np.float32), np.full(size, -np.inf, np.float32),
            infinite]  # fmt: skip


NO_PEAK_CUTS = [
    Truncation(1.0),
    Truncation(0.7, top_k=5),
    Truncation(1.0, top_p=0.9),  # a top-p alone: its row summed in the scan with AVX-512
    Truncation(0.8, top_k=40, top_p=0.95, min_p=0.05),
    Truncation(1.0, min_p=0.1),
]


@pytest.mark.parametrize("size", [N_VOCAB, 262_144])
def test_a_row_without_a_finite_peak_gives_the_references_token(isa, size):
    """The rows the C once left to numpy (a NaN, no finite best logit) are drawn in C on any
    CPU, token for token as the reference draws them (their argmax, numpy's: the first NaN,
    else the first largest), weighing 1, for every cut; through ls_draw and ls_draw_rows (a
    tick's rows, four at a time) alike."""
    rows = _rows_without_a_finite_peak(size)
    rng = np.random.default_rng(0)
    for row in rows:
        expected = int(row.argmax())
        for cut in NO_PEAK_CUTS:
            assert candidates(row, cut).ids.tolist() == [expected]  # the reference's
            assert draw_token(row, cut, rng) == (expected, 1.0)
    logits = np.stack(rows)
    cuts = NO_PEAK_CUTS[: len(rows)]
    drawn = draw_module.draw_tokens(logits, range(len(rows)), cuts, [rng] * len(rows), [1.0] * 4)
    assert drawn == [(int(row.argmax()), 1.0) for row in rows]


def _top_p_alone(cut: Truncation) -> bool:
    return cut.top_p < 1.0 and cut.top_k <= 0 and cut.min_p <= 0.0


def _c_kept(row: np.ndarray, cut: Truncation) -> np.ndarray | None:
    return rowscan.draw_candidates(row, cut.temperature, cut.top_k, cut.top_p, cut.min_p)


C_CUTS_262K = {**CUTS_262K, "wide top-k": Truncation(1.0, top_k=3000, min_p=0.001)}


@pytest.mark.parametrize("cut", list(C_CUTS_262K.values()), ids=list(C_CUTS_262K))
def test_the_c_draw_keeps_what_the_whole_row_keeps_at_a_262k_vocabulary(isa, cut):
    row = _peaked_262k()
    kept, whole = _c_kept(row, cut), exact_candidates(row, cut).ids
    assert kept is not None
    if cut.top_p < 1.0:
        assert kept.tolist()[: len(whole)] == sorted(whole.tolist(), key=lambda t: (-row[t], t))
    assert sorted(kept.tolist()) == sorted(whole.tolist())


@pytest.mark.parametrize("spread", [1.0, 3.0, 6.0, 45.0])
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.95, 0.999])
def test_the_c_top_p_alone_keeps_what_the_whole_row_keeps_at_any_spread(isa, spread, top_p):
    for seed in range(3):
        row, cut = _spread_row(seed, spread), Truncation(0.7, top_p=top_p)
        assert _c_kept(row, cut).tolist() == exact_candidates(row, cut).ids.tolist()


def test_the_c_top_p_sums_the_row_where_the_counts_leave_the_cut_in_doubt(isa):
    """The row of test_a_cut_the_bounds_leave_in_doubt_sums_the_whole_row: two tokens."""
    row = np.full(262_144, -50.0, dtype=np.float32)
    row[:200_000] = -18.0
    row[200_000], row[200_001] = 0.0, -1.0
    total = 1.0 + math.exp(-1.0) + 200_000 * math.exp(-18.0) + 62_142 * math.exp(-50.0)
    cut = Truncation(1.0, top_p=1.0 / total + 2e-4)
    assert _c_kept(row, cut).tolist() == [200_000, 200_001]


@pytest.mark.parametrize("margin", [1e-7, -1e-7, 1e-10, -1e-10])
def test_the_c_top_p_cut_is_exact_however_close(isa, margin):
    """Cuts 1e-7 from a token's edge are settled by the rest's sum, which narrows the float32
    bound; at 1e-10 only a sum more exact than float32's can tell, and the C sums the row
    again (float64 terms, an 80-bit sum): the whole row's cut either way, and seeded draws
    token for token the reference's (where the C once left the row to numpy)."""
    row, cut = _tiered_row(margin)
    cuts = rowscan.library().ls_float64_cuts()
    assert _c_kept(row, cut).tolist() == exact_candidates(row, cut).ids.tolist()
    assert rowscan.library().ls_float64_cuts() - cuts == (abs(margin) < 1e-9)
    rng = np.random.default_rng(5)
    for _ in range(20):
        seed = _next_seed(rng)
        assert draw_token(row, cut, rng)[0] == oracle.c_token(row, cut, seed)


def _next_seed(rng: np.random.Generator) -> int:
    """The seed draw_token will take from `rng` next (from a copy of its state)."""
    copy = np.random.PCG64()
    copy.state = rng.bit_generator.state
    return int(copy.random_raw())


def _doubtful_row(margin: float, size: int = 4_096) -> tuple[np.ndarray, Truncation]:
    """A flat row whose top-p cut falls `margin` (of the best token's weight) past its three
    best tokens (0, -0.5, -1: a real distribution to draw from) into a tier of tokens at -13:
    so four tokens, or three, by a margin no float32 sum's bound can settle, not even the
    rest's under the taken tokens (the rest at -16 weighs 3e-4, its bound some 4e-10)."""
    row = np.full(size, -16.0, dtype=np.float32)
    row[: size * 3 // 8] = -13.0
    row[[size - 3, size - 2, size - 1]] = [0.0, -0.5, -1.0]
    total = float(np.exp(row.astype(np.float64)).sum())
    best = 1.0 + math.exp(-0.5) + math.exp(-1.0)
    return row, Truncation(0.9, top_p=(best + margin) / total)


@pytest.mark.parametrize("margin", [1e-10, -1e-10])
def test_draws_from_a_cut_in_doubt_follow_the_softmax_over_the_kept_tokens(isa, margin):
    """A cut only a float64 sum settles, drawn in C: the whole row's tokens (three, or the
    tier's first as a fourth), seeded draws the reference's token for token, and 20,000 of
    them distributed as the tempered softmax over those tokens (chi-square)."""
    row, cut = _doubtful_row(margin)
    whole = exact_candidates(row, cut).ids.tolist()
    assert len(whole) == (4 if margin > 0 else 3)
    summed = []
    original = oracle._float64_cut
    with pytest.MonkeyPatch.context() as patch:  # the reference needs its float64 sum too
        patch.setattr(oracle, "_float64_cut", lambda *args: summed.append(1) or original(*args))
        candidates(row, cut)
    assert summed == [1]
    cuts = rowscan.library().ls_float64_cuts()
    assert _c_kept(row, cut).tolist() == candidates(row, cut).ids.tolist()
    assert rowscan.library().ls_float64_cuts() - cuts == 1  # the C's float64 sum, too
    assert sorted(_c_kept(row, cut).tolist()) == sorted(whole)
    rng = np.random.default_rng(8)
    for _ in range(20):
        seed = _next_seed(rng)
        assert draw_token(row, cut, rng)[0] == oracle.c_token(row, cut, seed)
    draws = 20_000
    counts = np.zeros(len(row))
    for _ in range(draws):
        counts[draw_token(row, cut, rng)[0]] += 1
    expected = _expected(row, cut)
    assert counts[expected == 0].sum() == 0
    assert _chi_square_p(counts, expected * draws) > 1e-3


@pytest.mark.parametrize("spread", [1.0, 6.0, 45.0])
def test_without_avx512_the_c_top_p_cuts_every_row(isa, spread):
    """Without AVX-512 the scan does not sum the row: a peaked row's cut comes from the
    counted bounds, a flat one's from the row summed by AVX2's kernel or plain C's, exactly the
    whole row's either way."""
    for seed in range(3):
        row = _spread_row(seed, spread)
        for cut in (Truncation(0.7, top_p=0.95), Truncation(1.0, top_p=0.5)):
            assert _c_kept(row, cut).tolist() == exact_candidates(row, cut).ids.tolist()


def test_without_the_library_the_worker_cannot_draw_and_says_why(monkeypatch):
    """No numpy draw serves in its place: a missing build fails by name."""
    monkeypatch.setattr(rowscan, "library", lambda: None)
    with pytest.raises(RuntimeError, match="not built"):
        draw_token(_logits(), Truncation(1.0), np.random.default_rng(0))


def test_the_c_draw_has_draw_pys_constants():
    """rowdraw.c keeps its own copies of the reference's constants: the two must not drift."""
    source = (Path(__file__).resolve().parents[3] / "csrc" / "sampling" / "rowdraw.c").read_text()
    names = (
        "ENVELOPE_LIMIT NUCLEUS_SPAN NUCLEUS_BAND NUCLEUS_LAST_BAND NUCLEUS_MASS_SPAN "
        "EXP_SUM_ERROR EXP_ERROR DEPTH_ERROR HEAD_SHARE"
    ).split()
    for name in names:
        found = re.search(rf"\b{name} = ([0-9.e-]+)", source)
        assert found, name
        assert float(found.group(1)) == getattr(oracle, name), name
    bands = re.search(r"NUCLEUS_BANDS\[\] = \{([^}]*)\}", source)
    assert bands and tuple(map(float, bands.group(1).split(","))) == oracle.NUCLEUS_BANDS
