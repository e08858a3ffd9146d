"""Drawing a token from one row of logits: temperature, top-k, top-p and min-p, exact, on the
host, at about the cost of an argmax. Plain numpy: no llama.cpp, no state.

llama.cpp's samplers copy all n_vocab logits into candidate structs and run each stage over
all of them: at Gemma's 262,144 tokens that is ~2 ms a token for a temperature alone and
~20 ms with top_p, which sorts the whole vocabulary. Nearly all of that work is spent on
tokens that are never drawn: one scoring 20 below the best has odds of e^-20 against it.

candidates() reads the row twice, for its maximum and for the tokens within `span` of it (the
head: from a few to a few thousand tokens on a real model), and works on the head alone.
It stays exact, not approximately right:
- top-k, top-p and min-p cut inside the head (top-p checks its cut against both bounds of
  the probability mass under the head, and sums that mass when the bounds disagree); when
  one reaches below the head the whole row is worked through (`exact_candidates`).
- When nothing cuts, the tokens under the head keep their probability by rejection
  sampling: a draw takes a head token with its exact weight, or the tail with an envelope
  of the largest weight a tail token can have, and then a uniformly chosen tail token is
  kept with its true weight over that envelope (else the draw starts again). The span makes
  the envelope's mass a small share of the best token's weight (TAIL_MARGIN).

The filters see the logits as llama.cpp's chain does (top-k, then top-p, then min-p, on the
untempered distribution); the temperature applies to what they keep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# The head's span: the tail's envelope holds at most e^-TAIL_MARGIN of the best token's weight,
# so a draw looks at the tail about once in five (cheaply: one or two random numbers).
TAIL_MARGIN = 1.6
# A top-p cut without a top-k needs the probability mass under the head bounded tightly
# enough to place the cut: a wider head, with at most e^-6 of the best token's weight below.
NUCLEUS_MARGIN = 6.0
# top-p sorts only the best tokens of the head, this many first, then eight times more.
NUCLEUS_FIRST = 64


@dataclass(frozen=True, slots=True)
class Truncation:
    """What a draw keeps and how it weighs it: the sampling fields of SamplingParams."""

    temperature: float  # > 0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off


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


def candidates(row: np.ndarray, cut: Truncation, margin: float | None = None) -> Candidates:
    """What the filters keep of the row, and with what weight.

    `margin` sets the head's span; any span gives the same distribution (tests narrow it so
    that the tail is drawn often); the default keeps the tail's work rare.
    """
    n_vocab = row.shape[0]
    peak = float(row.max())
    if not math.isfinite(peak):  # a broken forward pass (NaN) or every token biased away
        return Candidates(np.array([int(row.argmax())]), np.ones(1), 0.0, cut.temperature)
    if margin is None:
        top_p_alone = cut.top_p < 1.0 and not 0 < cut.top_k < n_vocab
        margin = NUCLEUS_MARGIN if top_p_alone else TAIL_MARGIN
    # Tail tokens score under the floor: each weighs under e^-span untempered and under
    # e^-(span / temperature) tempered, both at most e^-margin / n_vocab of the peak's.
    span = max(math.log(n_vocab) + margin, 1e-3) * max(cut.temperature, 1.0)
    floor = np.float32(peak - span)  # compared in float32, as the row is
    ids = np.flatnonzero(row >= floor)
    values = row[ids].astype(np.float64)
    n_tail = n_vocab - len(ids)
    # Whether every token under the floor is still a candidate, and the least logit min-p
    # lets such a token have.
    with_tail, tail_least = n_tail > 0, -math.inf

    if 0 < cut.top_k < n_vocab:
        if len(ids) < cut.top_k:
            return exact_candidates(row, cut)  # top-k reaches under the head
        if cut.top_k < len(ids):
            best = np.argpartition(values, -cut.top_k)[-cut.top_k :]
            ids, values = ids[best], values[best]
        with_tail = False

    if cut.top_p < 1.0:
        tail_bound = n_tail * math.exp(float(floor) - peak) if with_tail else 0.0
        nucleus = _nucleus(values, peak, cut.top_p, tail_bound)
        if nucleus is None:  # the cut depends on the tail's exact mass (top_p near 1)
            nucleus = _nucleus(values, peak, cut.top_p, _tail_mass(row, floor, peak), exact=True)
            if nucleus is None:
                return exact_candidates(row, cut)  # the nucleus reaches under the head
        ids, values = ids[nucleus], values[nucleus]
        with_tail = False

    if cut.min_p > 0.0:
        least = peak + math.log(cut.min_p)
        keep = values >= least
        if not keep.all():
            ids, values = ids[keep], values[keep]
        if least >= float(floor):
            with_tail = False
        tail_least = least

    cumulative = np.cumsum(np.exp((values - peak) / cut.temperature))
    found = Candidates(ids, cumulative, peak, cut.temperature)
    if with_tail:
        found.row, found.floor, found.n_tail = row, float(floor), n_tail
        found.envelope = math.exp((float(floor) - peak) / cut.temperature)
        found.tail_least = tail_least
    return found


def _nucleus(
    values: np.ndarray, peak: float, top_p: float, tail: float, exact: bool = False
) -> np.ndarray | None:
    """The positions in `values` of top-p's nucleus, best first, when the head decides it:
    `tail` bounds the untempered mass under the head (is that mass, when `exact`). None when
    the cut lies at different tokens for the two bounds, or under the head."""
    weights = np.exp(values - peak)
    head = float(weights.sum())
    low, high = top_p * (head if not exact else head + tail), top_p * (head + tail)
    size = NUCLEUS_FIRST
    while True:
        if size < len(weights):
            best = np.argpartition(weights, -size)[-size:]
        else:
            best = np.arange(len(weights))
        best = best[np.argsort(-weights[best], kind="stable")]
        mass = np.cumsum(weights[best])
        if mass[-1] >= high or size >= len(weights):
            break
        size *= 8
    first, last = int(np.searchsorted(mass, low)), int(np.searchsorted(mass, high))
    if last >= len(mass) or first != last:
        return None
    return best[: last + 1]


def exact_candidates(row: np.ndarray, cut: Truncation) -> Candidates:
    """The same over the whole row, with no head: the reference, and the path for filters
    that reach under the head."""
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


def _tail_mass(row: np.ndarray, floor: np.float32, peak: float) -> float:
    """The untempered weight of every token under the floor, summed (a pass over the row)."""
    tail = row[row < floor].astype(np.float64)
    return float(np.exp(tail - peak).sum())
