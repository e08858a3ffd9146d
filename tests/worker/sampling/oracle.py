"""The tests' reference for the C draw (rowdraw.c): the same steps in numpy, token for token in
what they keep, the draw from them by numpy's generator. Once the worker's own fallback for the
rows the C left (a NaN, a top-p cut in doubt, a CPU without AVX-512); now only what
test_draw.py and test_rowscan.py hold rowdraw.c to (the C keeps copies of these constants:
test_draw.py checks that they do not drift).

candidates() reads the whole row once (its blocks' maxima), then only the tokens near the
best: those within `span` of it (the head: from a few to a few thousand tokens on a real
model), or the best k. It stays exact, not approximately right:
- top-k takes the k best from the tokens that reach the k-th largest block maximum; min-p
  cuts at its bar. A top-p alone needs the row's whole mass: bounded from counts on a peaked
  row, summed by a vectorised kernel on a flat one (row_exp.py), the cut exact either way (a
  cut the bounds leave in doubt is summed again, more precisely, and at last in float64).
- When nothing cuts, the tokens under the head keep their probability by rejection
  sampling: a draw takes a head token with its exact weight, or the tail with an envelope
  of the largest weight a tail token can have, and then a uniformly chosen tail token is
  kept with its true weight over that envelope (else the draw starts again). The span sets
  the envelope's mass against the head's (TAIL_MARGIN): a narrow head, a few draws.
- A row with no finite best logit (a NaN, or every token biased away) gives its argmax.

exact_candidates() is the same over the whole row with no head, the plainest statement of
what the filters keep.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

from loomserve.worker.sampling.draw import Truncation, _span
from tests.worker.sampling.row_exp import exp_sum
from tests.worker.sampling.row_scan import RowScan, sum_below

# A head whose envelope still outweighs it this many times over is widened once.
ENVELOPE_LIMIT = 4.0
# top-p without top-k: the nucleus is looked for among the tokens this far under the best
# (in logits), then in bands this much further down each, and past the last band's depth
# among all the rest.
NUCLEUS_SPAN = 8.0
NUCLEUS_BAND = 2.0
NUCLEUS_LAST_BAND = 40.0
# The row's mass, for top-p: summed over the tokens this far under the best, and bounded
# under them by counting the tokens in bands down to these depths (one count each). At 24
# the deepest band's edge leaves the vocabulary's rest under 1e-5 of the best token's weight.
NUCLEUS_MASS_SPAN = 16.0
NUCLEUS_BANDS = (20.0, 24.0)
# How far a row's mass summed in float32 may be from the float64 sum, relatively: each
# exponential within 2 ulps (2.4e-7; test_row_exp checks it), summed in float32 by at most 4
# levels of a tree before float64 takes over (2.4e-7: ggml's kernel adds 16 lanes, the row
# scan's 4), of a float32 difference to the best (6e-8 per logit of depth; by the weights'
# entropy bound the mass sits at most ln(n_vocab) = 12.5 deep on average): 1.23e-6 at worst,
# with room to spare. Gemma 270M's rows showed at most 8e-8.
EXP_SUM_ERROR = 2e-6
# One float32 exponential against float64's e^(x - peak): within 4 ulps (twice what
# test_row_exp allows) of e^ of the float32 difference, which is itself off by half an ulp, up
# to 6e-8 of the depth x - peak.
EXP_ERROR = 4.8e-7
DEPTH_ERROR = 6e-8
# A head holding more than 1 / HEAD_SHARE of the vocabulary is too costly to take out token
# by token: the whole row's mass is summed instead.
HEAD_SHARE = 16
_SCRATCH = threading.local()


@dataclass(slots=True)
class Candidates:
    """The tokens one row can give and their weights: found once per row (`candidates`), then
    `pick` draws. Tokens under the floor are candidates too when `row` is kept: each weighs
    under `envelope` and is drawn by rejection."""

    ids: np.ndarray  # the head's candidates
    cumulative: np.ndarray  # their tempered weights (relative to the peak's), summed in order
    peak: float
    temperature: float
    row: np.ndarray | None = None  # set: every token under the floor is a candidate too
    floor: float = 0.0  # a float32 value: tail tokens are those of the row under it
    n_tail: int = 0
    envelope: float = 0.0  # more than any tail token's tempered weight
    tail_least: float = -math.inf  # the least logit min-p lets a tail token have

    @property
    def head_mass(self) -> float:
        """The head's tempered weight, in units of the best token's: a hint for the next row."""
        return float(self.cumulative[-1])

    def pick(self, rng: np.random.Generator) -> int:
        head_mass = float(self.cumulative[-1])
        if self.row is None:
            return int(self.ids[_index(self.cumulative, rng.random() * head_mass)])
        row, temperature = self.row, self.temperature
        tail_mass = self.n_tail * self.envelope
        while True:
            u = rng.random() * (head_mass + tail_mass)
            if u < head_mass:
                return int(self.ids[_index(self.cumulative, u)])
            token = _tail_token(row, self.floor, rng)
            value = float(row[token])
            if value < self.tail_least:
                continue  # min-p refuses it: draw again from the start
            if rng.random() * self.envelope < math.exp((value - self.peak) / temperature):
                return token


def draw(
    row: np.ndarray, cut: Truncation, rng: np.random.Generator, margin: float | None = None
) -> int:
    """A token drawn from softmax(row / temperature) over the tokens the filters keep."""
    return candidates(row, cut, margin).pick(rng)


def candidates(
    row: np.ndarray, cut: Truncation, margin: float | None = None, mass_hint: float = 1.0
) -> Candidates:
    """What the filters keep of the row, and with what weight.

    The head's span follows `mass_hint`, the row's likely mass in units of the best
    token's weight (a request's last head_mass): narrow for a flat row, wide for a peaked
    one. `margin` fixes it instead (ln(n_vocab) + margin tempered nats: the tail's envelope
    weighs at most e^-margin of the best token). Any span gives the same distribution;
    tests narrow it so that the tail is drawn often.
    """
    n_vocab = row.shape[0]
    scan = RowScan(row)  # the one pass over the whole row; what follows reads bands of it
    peak = scan.peak
    if not math.isfinite(peak):  # a broken forward pass (NaN) or every token biased away
        return Candidates(np.array([int(row.argmax())]), np.ones(1), 0.0, cut.temperature)
    temperature = cut.temperature
    top_k = cut.top_k if 0 < cut.top_k < n_vocab else 0
    least = peak + math.log(cut.min_p) if cut.min_p > 0.0 else -math.inf  # min-p's bar
    if cut.top_p < 1.0 and not top_k:
        return _nucleus_candidates(scan, cut, least)
    if top_k:
        return _top_k_candidates(scan, cut, top_k, least)
    span = _span(n_vocab, margin, mass_hint)
    for widened in (False, True):
        # Tail tokens score under the floor: each weighs under e^-span, tempered.
        floor = np.float32(peak - span * temperature)  # compared in float32, as the row is
        if least > float(floor):
            # min-p keeps nothing under its bar, so no tail at all: the float32 nearest the
            # bar leaves out no float32 logit at or over it.
            return _kept(scan.band(least), row, peak, temperature, least)
        ids = scan.band(float(floor))
        n_tail = n_vocab - len(ids)
        # Every head token is kept (nothing cuts with a tail): their weights, once.
        cumulative = np.cumsum(np.exp((row[ids].astype(np.float64) - peak) / temperature))
        if not n_tail:
            return Candidates(ids, cumulative, peak, temperature)
        envelope = math.exp((float(floor) - peak) / temperature)  # > any tail token's weight
        head = float(cumulative[-1])
        if widened or margin is not None or n_tail * envelope <= ENVELOPE_LIMIT * head:
            found = Candidates(ids, cumulative, peak, temperature, row, float(floor), n_tail)
            found.envelope, found.tail_least = envelope, least
            return found
        span += math.log(n_tail * envelope / head)  # the hint was far off: once more
    raise AssertionError("unreachable: the widened head is always taken")


def _top_k_candidates(scan: RowScan, cut: Truncation, top_k: int, least: float) -> Candidates:
    """top-k, then top-p and min-p on what it keeps: the k best tokens are among those that
    reach the k-th largest block maximum (each block's best is a token), read from the
    blocks that reach it; its k tokens hold the whole mass a top-p after it needs."""
    row, peak = scan.row, scan.peak
    low = scan.kth_block_max(top_k)
    if cut.top_p == 1.0 and least > low:
        low = least  # min-p keeps nothing under its bar: the k best of those over it
    ids = scan.band(low)
    values = row[ids].astype(np.float64)
    if top_k < len(ids):
        best = np.argpartition(values, -top_k)[-top_k:]
        ids, values = ids[best], values[best]
    if cut.top_p < 1.0:
        ids, values = _cut_nucleus(ids, values, peak, cut.top_p, float(np.exp(values - peak).sum()))
    if least > -math.inf:
        keep = values >= least
        if not keep.all():
            ids, values = ids[keep], values[keep]
    cumulative = np.cumsum(np.exp((values - peak) / cut.temperature))
    return Candidates(ids, cumulative, peak, cut.temperature)


def _nucleus_candidates(scan: RowScan, cut: Truncation, least: float) -> Candidates:
    """top-p without top-k: the nucleus is cut where the best tokens' mass reaches top_p of
    the row's whole mass. That mass is bounded first, not summed over the whole vocabulary:
    the head's (the tokens NUCLEUS_MASS_SPAN under the best) summed exactly, and the rest's
    from how many tokens fall in each band under it (each weighs between the band's two
    edges). Where both bounds cut at the same token the cut is exact, for the cost of a few
    counts; a cut that the bounds leave in doubt, or a row too flat for a small head, pays
    for the exponentials of the whole vocabulary (the one pass an exact top-p needs at worst)."""
    row, peak = scan.row, scan.peak
    n_vocab = len(row)
    floor = np.float32(peak - NUCLEUS_MASS_SPAN)  # compared in float32, as the row is
    # A flat row: taking its head out token by token costs more than the whole pass (the
    # choice costs time or saves it, it never changes the draw).
    if scan.count(float(floor)) * HEAD_SHARE > n_vocab:
        return _summed_nucleus(scan, cut, least)
    head = scan.band(float(floor))
    head_mass = float(np.exp(row[head].astype(np.float64) - peak).sum())
    least_rest = most_rest = 0.0
    above, edge = len(head), float(floor)  # tokens at or over the band's top edge, and the edge
    for depth in NUCLEUS_BANDS:
        under = np.float32(peak - depth)
        count = above + scan.count(float(under), edge)
        least_rest += (count - above) * math.exp(float(under) - peak)
        most_rest += (count - above) * math.exp(edge - peak)
        above, edge = count, float(under)
    most_rest += (n_vocab - above) * math.exp(edge - peak)
    # Widened by far more than the sums' rounding, so that the bounds hold as computed.
    least_total = (head_mass + least_rest) * (1.0 - 1e-12)
    most_total = (head_mass + most_rest) * (1.0 + 1e-12)
    ids, mass = _best_first(scan, head, cut.top_p * most_total)
    last = _settled_cut(mass, cut.top_p, least_total, most_total)
    if last is None:
        return _summed_nucleus(scan, cut, least)
    return _kept(ids[: last + 1], row, peak, cut.temperature, least)


def _summed_nucleus(scan: RowScan, cut: Truncation, least: float) -> Candidates:
    """The nucleus from the row's whole mass, summed over every token in float32 (row_exp: a
    vectorised kernel), so known to within EXP_SUM_ERROR: the cut is exact where both
    ends of that range cut at the same token. Where not, the taken tokens' float64 mass and
    the float32 rest under them bound it far more closely; where even that leaves the cut in
    doubt, the row is summed again in float64."""
    row, peak = scan.row, scan.peak
    # In this thread's scratch row: a fresh 1 MB array per token costs as much again in
    # page faults as the exponentials themselves.
    exps = _scratch(len(row))
    total = exp_sum(row, peak, exps)
    least_total, most_total = total * (1.0 - EXP_SUM_ERROR), total * (1.0 + EXP_SUM_ERROR)
    ids, mass = _best_first(scan, None, cut.top_p * most_total)
    last = _settled_cut(mass, cut.top_p, least_total, most_total)
    if last is None:  # in doubt (1 row in 20 on Gemma's): the rest's sum narrows it 50-fold
        last = _settled_cut(mass, cut.top_p, *_mass_from_rest(row, ids, mass, exps))
    if last is None:  # rarer still: the whole row in float64
        ids, last = _float64_cut(scan, cut.top_p)
    return _kept(ids[: last + 1], row, peak, cut.temperature, least)


def _float64_cut(scan: RowScan, top_p: float) -> tuple[np.ndarray, int]:
    """The best tokens, best first, and the last one the nucleus keeps, from the row's mass
    summed in float64 (the reference's own sum)."""
    total = float(np.exp(scan.row.astype(np.float64) - scan.peak).sum())
    ids, mass = _best_first(scan, None, top_p * total)
    return ids, min(int(np.searchsorted(mass, top_p * total)), len(ids) - 1)


def _mass_from_rest(
    row: np.ndarray, ids: np.ndarray, mass: np.ndarray, exps: np.ndarray
) -> tuple[float, float]:
    """Bounds on the row's whole mass, far closer than the float32 sum's: the taken tokens'
    (`ids`, summed in float64 as `mass`) exactly, plus the sum of the float32 exponentials
    `exps` of every token under them. Only that rest carries float32 error: each term within
    EXP_ERROR of its value plus DEPTH_ERROR per logit of its depth (the float32 difference to
    the best), and since a term's depth is ln(1 / its weight), their weighted sum is at most
    rest * ln(n_vocab / rest) (the weights' entropy bound)."""
    # Every token at or over the least taken one is taken: the bands are taken whole.
    rest = sum_below(exps, row, float(row[ids[-1]]))
    error = rest * EXP_ERROR
    if rest > 0.0:
        error += DEPTH_ERROR * rest * max(math.log(len(row) / rest), 0.0)
    taken = float(mass[-1])
    return (taken + rest - error) * (1.0 - 1e-12), (taken + rest + error) * (1.0 + 1e-12)


def _settled_cut(
    mass: np.ndarray, top_p: float, least_total: float, most_total: float
) -> int | None:
    """The last token the nucleus keeps (`mass` summed best first), if the row's whole mass
    known only to lie between the two totals settles it: both put the cut at that token.
    None when they differ, or when `mass` falls short of the larger one's share."""
    last = int(np.searchsorted(mass, top_p * least_total))
    if last < len(mass) and last == int(np.searchsorted(mass, top_p * most_total)):
        return last
    return None


def _best_first(
    scan: RowScan, pool: np.ndarray | None, wanted: float
) -> tuple[np.ndarray, np.ndarray]:
    """The best tokens of `pool` (None: the whole row), best first, with their weights summed
    in that order, until they weigh `wanted` (or the pool is spent). They are taken band by
    band, each band sorted alone and put after the ones before it: the tokens within
    NUCLEUS_SPAN of the best, then each NUCLEUS_BAND further down (past NUCLEUS_LAST_BAND,
    all the rest). Sorting only these keeps a top-p from sorting the vocabulary, and thin
    bands keep a wide nucleus from sorting tens of thousands of tokens it does not reach."""
    row, peak = scan.row, scan.peak
    values = row if pool is None else row[pool]
    parts: list[np.ndarray] = []
    sums: list[np.ndarray] = []
    taken, mass = 0, 0.0
    top = np.float32(np.inf)  # the band's upper edge (exclusive)
    span = NUCLEUS_SPAN
    while True:
        floor = np.float32(peak - span) if span < NUCLEUS_LAST_BAND else np.float32(-np.inf)
        if pool is None:
            ids = scan.band(float(floor), float(top))
        else:
            ids = pool[np.flatnonzero((values >= floor) & (values < top))]
        ids = _best_first_order(ids, row[ids])
        band = np.exp(row[ids].astype(np.float64) - peak)
        band[0:1] += mass  # the cumulative sum goes on from the bands before
        band = np.cumsum(band)
        parts.append(ids)
        sums.append(band)
        taken += len(ids)
        mass = float(band[-1]) if len(band) else mass
        if mass >= wanted or taken == len(values):
            return np.concatenate(parts), np.concatenate(sums)
        top, span = floor, span + NUCLEUS_BAND


def _best_first_order(ids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """`ids` (ascending) by their float32 `values`, best first, ties in id order: what a
    stable argsort of -values gives, by one sort of 64-bit keys (the value's bits made to
    order as integers, then the id), which numpy sorts several times faster."""
    negated = np.negative(values, dtype=np.float32) + np.float32(0.0)  # -0.0 ties 0.0
    bits = negated.view(np.int32)
    ordered = bits ^ ((bits >> 31) & np.int32(0x7FFFFFFF))  # a negative float's bits reversed
    keys = (ordered.astype(np.int64) << 32) | ids.astype(np.int64)
    keys.sort()
    return (keys & 0xFFFFFFFF).astype(np.intp)


def _kept(
    ids: np.ndarray, row: np.ndarray, peak: float, temperature: float, least: float
) -> Candidates:
    """The nucleus's tokens, less those under min-p's bar, with their tempered weights."""
    values = row[ids].astype(np.float64)
    if least > -math.inf:
        keep = values >= least
        ids, values = ids[keep], values[keep]
    cumulative = np.cumsum(np.exp((values - peak) / temperature))
    return Candidates(ids, cumulative, peak, temperature)


def _scratch(size: int) -> np.ndarray:
    """This thread's float32 scratch row (rows are sampled on several threads at once)."""
    row = getattr(_SCRATCH, "row", None)
    if row is None or len(row) != size:
        row = _SCRATCH.row = np.empty(size, dtype=np.float32)
    return row


def _cut_nucleus(
    ids: np.ndarray, values: np.ndarray, peak: float, top_p: float, total: float
) -> tuple[np.ndarray, np.ndarray]:
    """The smallest set of the best of `ids` whose mass reaches top_p of `total`."""
    order = np.argsort(-values, kind="stable")
    ids, values = ids[order], values[order]
    mass = np.cumsum(np.exp(values - peak))
    last = min(int(np.searchsorted(mass, top_p * total)), len(mass) - 1)
    return ids[: last + 1], values[: last + 1]


def exact_candidates(row: np.ndarray, cut: Truncation) -> Candidates:
    """The same over the whole row, with no head: the reference the tests hold candidates()
    to (the sampler itself never reads the whole row this way)."""
    values = row.astype(np.float64)
    ids = np.arange(len(values))
    if 0 < cut.top_k < len(values):
        best = np.argpartition(values, -cut.top_k)[-cut.top_k :]
        ids, values = ids[best], values[best]
    peak = float(values.max())
    if cut.top_p < 1.0:
        order = np.argsort(-values, kind="stable")
        ids, values = ids[order], values[order]
        mass = np.cumsum(np.exp(values - peak))
        keep = min(int(np.searchsorted(mass, cut.top_p * mass[-1])), len(mass) - 1) + 1
        ids, values = ids[:keep], values[:keep]
    if cut.min_p > 0.0:
        keep_mask = values >= peak + math.log(cut.min_p)
        ids, values = ids[keep_mask], values[keep_mask]
    return Candidates(
        ids, np.cumsum(np.exp((values - peak) / cut.temperature)), peak, cut.temperature
    )


def c_token(row: np.ndarray, cut: Truncation, seed: int) -> int:
    """The token rowdraw.c draws from `row` with `seed` where what the filters keep has no tail
    (a top-p alone's nucleus, a row with no finite best logit): the C's first random number
    (splitmix64's, 53 bits) over the candidates' cumulative weights, in the order the C sums
    them (best first for a top-p alone, as candidates() gives them). Weights summed in another
    order can put a number within a few 1e-16 of an edge on the other side: never, in
    practice, for a test's few seeds."""
    found = candidates(row, cut)
    assert found.row is None, "a tail is drawn by rejection: no one token to expect"
    return int(found.ids[_index(found.cumulative, _splitmix_uniform(seed) * found.head_mass)])


def _splitmix_uniform(seed: int) -> float:
    """rowdraw.c's first uniform number in [0, 1) from `seed`: splitmix64's first output, its
    top 53 bits."""
    mask = (1 << 64) - 1
    z = (seed + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


def _index(cumulative: np.ndarray, u: float) -> int:
    """The category whose interval of the cumulative weights holds u (0 <= u < total)."""
    return min(int(np.searchsorted(cumulative, u, side="right")), len(cumulative) - 1)


def _tail_token(row: np.ndarray, floor: float, rng: np.random.Generator) -> int:
    """A token drawn uniformly from those under the floor (there is at least one)."""
    n_vocab = len(row)
    while True:
        token = int(rng.integers(n_vocab))
        if row[token] < floor:
            return token
