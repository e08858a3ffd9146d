"""Drawing a token from one row of logits: temperature, top-k, top-p and min-p, exact, on the
host, at about the cost of reading the row, in one call to rowdraw.c (csrc/sampling, through
rowscan.py's binding), which holds no GIL. Here: what a request's sampler hands it (its
filters, a seed from its generator, the head's span from its last row) and what it gets back.

llama.cpp's samplers copy all n_vocab logits into candidate structs and run each stage over
all of them: at Gemma's 262,144 tokens that is ~2 ms a token for a temperature alone and
~20 ms with top_p, which sorts the whole vocabulary. Nearly all of that work is spent on
tokens that are never drawn: one scoring 20 below the best has odds of e^-20 against it.

rowdraw.c reads the whole row once (its blocks' maxima), then only the tokens near the best:
those within `span` of it (the head), or the best k. It stays exact, not approximately right
(docs/sampling.md): top-k, top-p and min-p keep exactly the tokens the whole row's filters
keep, and when nothing cuts, the tokens under the head keep their probability by rejection
sampling against an envelope. It serves every row: one with no finite best logit (a NaN, or
every token biased away) gives its argmax, and a top-p cut that the float32 sums' bounds leave
in doubt is settled by the row's mass summed again more precisely.

The same steps in numpy are the tests' reference (tests/worker/sampling/oracle.py), which
also says why each step is what it is. The filters see the logits as llama.cpp's chain does
(top-k, then top-p, then min-p, on the untempered distribution); the temperature applies to
what they keep.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import rowscan

# The head's span is chosen so that the tail's envelope weighs about e^-TAIL_MARGIN of the
# row's whole (estimated) mass: here e^1 of it, so most draws go to the tail, for a few random
# numbers each (a few microseconds), and the head is narrow: its tokens' exponentials and
# their sum cost more than those draws. Measured on Gemma 270M's rows (docs/sampling.md):
# 0.5 took 160-190 us a token at temperature 1, -1 150-155 us, -1.5 180-200 us (the head
# then often falls short of rowdraw.c's ENVELOPE_LIMIT and is widened, a second pass).
# With no hint of the row's mass (a request's first token), the span assumes the least mass
# (the best token's alone): a wide head, the tail's envelope at most e^-TAIL_MARGIN of it.
# A request's later rows take the mass of its last head as the hint; a bad hint costs draws,
# never exactness (the envelope is checked against the head's mass).
TAIL_MARGIN = -1.0


@dataclass(frozen=True, slots=True)
class Truncation:
    """What a draw keeps and how it weighs it: the sampling fields of SamplingParams."""

    temperature: float  # > 0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off


def draw_token(
    row: np.ndarray,
    cut: Truncation,
    rng: np.random.Generator,
    mass_hint: float = 1.0,
    margin: float | None = None,
) -> tuple[int, float]:
    """A token drawn from softmax(row / temperature) over the tokens the filters keep, and
    the head's mass (the hint for the request's next row): one call to rowdraw.c, which takes
    one 64-bit seed from `rng` for the token's random numbers. `margin` fixes the head's span
    (ln(n_vocab) + margin) instead of the hint: any span gives the same distribution, and the
    tests narrow it so that the tail is drawn often."""
    span = _span(len(row), margin, mass_hint)
    seed = int(rng.bit_generator.random_raw())
    drawn = rowscan.draw(row, cut.temperature, cut.top_k, cut.top_p, cut.min_p, span, seed)
    return drawn.token, drawn.head_mass


def draw_tokens(
    logits: np.ndarray,
    rows: Sequence[int],
    cuts: Sequence[Truncation],
    rngs: Sequence[np.random.Generator],
    mass_hints: Sequence[float],
    threads: int = 1,
) -> list[tuple[int, float]]:
    """draw_token() for rows[i] of `logits` with cuts[i], rngs[i] and mass_hints[i], the same
    tokens: one call to rowdraw.c for them all (one GIL hand-over, not one a row), on
    `threads` of llama.cpp's OpenMP threads (rowthreads.c)."""
    if not rowscan.draws_rows(logits):  # not rows of contiguous float32: a call a row
        return [
            draw_token(logits[row], cut, rng, hint)
            for row, cut, rng, hint in zip(rows, cuts, rngs, mass_hints, strict=True)
        ]
    n_vocab = logits.shape[1]
    seeds = np.array([rng.bit_generator.random_raw() for rng in rngs], dtype=np.uint64)
    settings = np.array(
        [draw_settings(cut, n_vocab, hint) for cut, hint in zip(cuts, mass_hints, strict=True)],
        dtype=np.float64,
    ).reshape(len(rows), 5)
    drawn = rowscan.draw_rows(logits, np.asarray(rows, dtype=np.int64), settings, seeds, threads)
    return list(zip(drawn.tokens.tolist(), drawn.head_mass.tolist(), strict=True))


def draw_settings(cut: Truncation, n_vocab: int, mass_hint: float) -> tuple[float, ...]:
    """rowdraw.c's settings for one draw (temperature, top_k, top_p, min_p, span): the cut's,
    and the head's span by the hint."""
    return (cut.temperature, cut.top_k, cut.top_p, cut.min_p, _span(n_vocab, None, mass_hint))


def _span(n_vocab: int, margin: float | None, mass_hint: float) -> float:
    """How far under the best (tempered) the head reaches when nothing cuts: its tail's
    envelope then weighs about e^-TAIL_MARGIN of the row's mass, by the hint; `margin` fixes
    it instead (ln(n_vocab) + margin)."""
    if margin is not None:
        return max(math.log(n_vocab) + margin, 1e-3)
    mass = min(max(mass_hint, 1.0), float(n_vocab))  # the best token alone weighs 1
    return math.log(n_vocab / mass) + TAIL_MARGIN
