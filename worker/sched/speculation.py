"""Self-speculative n-gram drafting (prompt lookup): what each slot proposes, and how much of it
a tick can afford. Plain Python, no model.

A generating slot proposes the tokens that followed the most recent earlier occurrence of its
last n tokens (prompt and output together; n from `ngram_max` down to `ngram_min`), as vLLM's
`ngram` method and llama-server's `ngram-simple` do. The loop puts the proposal in the tick's
one batch after the slot's last token, asks for logits at each, and keeps the longest prefix
the slot's own sampler agrees with (worker/tick/drafting.py); so each token is the sampler's own
choice, as in decoding one token at a time. (Not always bit for bit on a real model: a draft's
row is one of several of its sequence in the pass, and the CPU kernels sum such rows in
another order than a lone one: docs/speculation.md.)

How long a draft is follows two things. Each slot keeps its recent acceptance rate
(Acceptance): position j of a draft is accepted with about rate**j. And the tick pays for
drafts only where they are nearly free: plan_length weighs the tokens a draft length is
expected to add against what the tick then costs (the learned tick-cost model, plus a draft
surcharge learned here, DraftCost), and takes the length that produces the most tokens per
second, or none. With a KV stream per slot llama.cpp cuts a batch by sequence and gives each
ubatch an equal number of tokens per sequence (worker/sched/ubatches.py), so there every generating
slot in the tick gets the same number of extra tokens: drafts where it has one, filler
otherwise (tokens only there to keep one pass; their cells are dropped, nothing is read).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .least_squares import RecursiveLeastSquares

# Acceptance of a fresh slot: optimistic, so that a new request gets to show what it does.
PRIOR_ACCEPTED = 4.0
PRIOR_TRIED = 5.0
# Each verification weighs the older ones this much less: the rate follows the last few.
ACCEPTANCE_DECAY = 0.7
# A draft must raise the tick's expected tokens per second by this share at least: the
# cost model is noisy, and a draft that only breaks even is not worth the risk.
MIN_GAIN = 0.05
# After this many ticks in which proposals were passed over, one tick drafts anyway, so
# that the draft surcharge is measured again (a load that changed, a model that was wrong).
EXPLORE_INTERVAL = 64
DRAFT_COST_FORGETTING = 0.95


@dataclass(frozen=True, slots=True)
class SpecSettings:
    """The command line's limits on drafting."""

    max_tokens: int = 16  # --num-speculative-tokens: the most drafted tokens per slot per tick
    ngram_min: int = 2  # --prompt-lookup-min
    ngram_max: int = 4  # --prompt-lookup-max

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("prompt lookup sizes need 1 <= min <= max")


class NgramIndex:
    """Where each n-gram of one growing sequence last ended, for every n in [n_min, n_max]."""

    __slots__ = ("_indexed", "_maps", "n_max", "n_min")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        # _maps[n - n_min]: n-gram -> `end`, the index just after its latest indexed occurrence
        self._maps: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_max - n_min + 1)]
        self._indexed = 0  # n-grams ending at indices up to here are in the maps

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """k tokens that followed the latest earlier occurrence of the sequence's last n
        tokens, for the largest n that has one; [] when none has.

        A match that ends p tokens back says the sequence repeats with period p, so the draft
        goes on past the sequence's end by repeating those p tokens: a looping output (which
        greedy decoding of a small model often is) still gets a full-length draft instead of
        one cut to its period."""
        length = len(tokens)
        # Index every n-gram that ends before the current one, never the current one itself.
        for end in range(self._indexed + 1, length):
            for offset, table in enumerate(self._maps):
                n = self.n_min + offset
                if end >= n:
                    table[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, length - 1)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            found = self._maps[n - self.n_min].get(tuple(tokens[length - n :]))
            if found is not None:
                period = length - found
                draft = [tokens[found + j % period] for j in range(k)]
                # An image's positions hold negative placeholders (media.py): never a draft.
                return list(itertools.takewhile(lambda token: token >= 0, draft))
        return []


@dataclass(slots=True)
class Acceptance:
    """A slot's recent per-token acceptance: accepted drafts over drafts verified up to and
    including the first rejection (later ones say nothing), decayed."""

    accepted: float = PRIOR_ACCEPTED
    tried: float = PRIOR_TRIED

    @property
    def rate(self) -> float:
        return self.accepted / self.tried

    def update(self, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        seen = accepted + (accepted < drafted)
        self.accepted = ACCEPTANCE_DECAY * self.accepted + accepted
        self.tried = ACCEPTANCE_DECAY * self.tried + seen


def expected_accepted(rate: float, n_draft: int) -> float:
    """Drafted tokens expected to be accepted: position j passes with about rate**j."""
    if n_draft <= 0 or rate <= 0.0:
        return 0.0
    if rate >= 1.0:
        return float(n_draft)
    return rate * (1.0 - rate**n_draft) / (1.0 - rate)


@dataclass(frozen=True, slots=True)
class Proposal:
    """One generating slot's candidate draft for this tick."""

    slot: int
    tokens: list[int]  # may be empty: no n-gram matched (or the request drafts nothing)
    rate: float  # the slot's acceptance rate


def plan_length(
    proposals: Sequence[Proposal],
    room: int,
    tick_seconds: Callable[[int], float],
    uniform: int = 0,
    allowed: Callable[[int], bool] = lambda length: True,
    min_gain: float = MIN_GAIN,
) -> int:
    """The draft length L for this tick: each slot drafts min(L, its proposal); with
    `uniform` runs (a KV stream per slot) each of them is filled up to L extra tokens.
    L maximises expected tokens per second, (slots + expected accepted drafts) /
    tick_seconds(extra tokens), within `room` extra tokens and the lengths `allowed` says
    keep the tick's forward passes; 0 when no length beats drafting nothing by min_gain."""
    longest = max((len(p.tokens) for p in proposals), default=0)
    if not longest or room <= 0:
        return 0
    n_slots = len(proposals)
    base = tick_seconds(0)
    if base <= 0.0:
        return 0
    best_length, best_value = 0, n_slots / base * (1.0 + min_gain)
    for length in range(1, longest + 1):
        drafted = [min(length, len(p.tokens)) for p in proposals]
        extra = uniform * length if uniform else sum(drafted)
        if extra > room:
            break
        gain = sum(expected_accepted(p.rate, n) for p, n in zip(proposals, drafted, strict=True))
        seconds = tick_seconds(extra)
        if seconds <= 0.0 or not allowed(length):
            continue
        value = (n_slots + gain) / seconds
        if value > best_value:
            best_length, best_value = length, value
    return best_length


class DraftCost:
    """What the extra tokens of a drafting tick cost beyond the tick-cost model's prediction
    for its decode and prompt tokens: `fixed + per_token * extra`, by recursive least squares
    on the drafting ticks only (a first extra token in a batch of one can cost far more than
    the next ones: another kernel path)."""

    def __init__(self, per_token_prior: float = 0.0) -> None:
        self.fit = RecursiveLeastSquares(
            2, DRAFT_COST_FORGETTING, prior=(0.0, per_token_prior), initial_covariance=1e2
        )

    @property
    def observations(self) -> int:
        return self.fit.observations

    @property
    def per_token(self) -> float:
        return max(0.0, self.fit.theta[1])

    def predict(self, extra_tokens: int) -> float:
        if not extra_tokens:
            return 0.0
        fixed, per_token = self.fit.theta
        return max(0.0, fixed) + max(0.0, per_token) * extra_tokens

    def observe(self, extra_tokens: int, surcharge: float) -> None:
        """One drafting tick: its extra tokens and the seconds it took beyond the prediction
        for the same tick without them."""
        if extra_tokens:
            self.fit.observe((1.0, float(extra_tokens)), surcharge)


@dataclass(slots=True)
class SlotDrafts:
    """What the speculator keeps per running request: its n-gram index and its acceptance."""

    owner: object  # the request this belongs to; a new request in the slot starts afresh
    index: NgramIndex
    acceptance: Acceptance = field(default_factory=Acceptance)


class Speculator:
    """Per-slot proposals and acceptance, the draft surcharge, and the tick's draft length."""

    def __init__(self, settings: SpecSettings, n_slots: int) -> None:
        self.settings = settings
        self._slots: list[SlotDrafts | None] = [None] * n_slots
        self.cost = DraftCost()
        self._passed_over = 0  # ticks since the last that drafted, with proposals on offer

    def state(self, slot: int, owner: object) -> SlotDrafts:
        entry = self._slots[slot]
        if entry is None or entry.owner is not owner:
            settings = self.settings
            entry = SlotDrafts(owner, NgramIndex(settings.ngram_min, settings.ngram_max))
            self._slots[slot] = entry
        return entry

    def propose(self, slot: int, owner: object, tokens: Sequence[int]) -> Proposal:
        entry = self.state(slot, owner)
        draft = entry.index.propose(tokens, self.settings.max_tokens)
        return Proposal(slot, draft, entry.acceptance.rate)

    def choose(
        self,
        proposals: Sequence[Proposal],
        room: int,
        tick_seconds: Callable[[int], float],
        uniform: int,
        allowed: Callable[[int], bool],
    ) -> int:
        """The tick's draft length (plan_length), exploring now and then when it says none."""
        length = plan_length(proposals, room, tick_seconds, uniform, allowed)
        if length or not any(p.tokens for p in proposals):
            self._passed_over = 0
            return length
        self._passed_over += 1
        if self._passed_over < EXPLORE_INTERVAL:
            return 0
        self._passed_over = 0
        # Measure again: as if the surcharge were only its per-token part.
        per_token = self.cost.per_token

        def optimistic(extra: int) -> float:
            return tick_seconds(0) + per_token * extra

        return plan_length(proposals, room, optimistic, uniform, allowed, min_gain=0.0)

    def verified(self, slot: int, owner: object, drafted: int, accepted: int) -> None:
        self.state(slot, owner).acceptance.update(drafted, accepted)
