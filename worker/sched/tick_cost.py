"""What a tick costs, learned from the ticks the worker ran; and the latency target built on it.

The model is linear in the batch's make-up, `seconds ≈ base + per_decode·decode_tokens +
per_prefill·prefill_tokens`, fitted online by recursive least squares with exponential
forgetting, so it follows the hardware it runs on (a 2-core CPU or a GPU) and changes in load
(other processes, longer contexts) within some tens of ticks. Plain Python, no model.

The latency target (`--itl-target-ms`) asks it how many prompt tokens fit in a tick beside the
decode tokens of the streams that are generating: a tick's length is the gap every stream sees
between two tokens.
"""

from __future__ import annotations

import math

from ..stats import TickCost
from .least_squares import RecursiveLeastSquares
from .strategies import BatchPlan, SlotPhase, SlotView, limit_prefill

FORGETTING = 0.98  # each tick weighs 2% less per newer tick: ~50 ticks of memory
MAX_COVARIANCE_TRACE = 1e4  # no forgetting beyond this: unexcited directions must not blow up
# Prompts still progress when the decode tokens alone miss the target: a tick may always
# carry this many prompt tokens, or as many as take this share of the target if more.
MIN_PREFILL_TOKENS = 16
MIN_PREFILL_SHARE = 0.25
WARM_UP_TICKS = 8  # observations before the model is trusted
OUTLIER_FACTOR = 3.0  # a tick this many times its prediction is counted as only that much


class TickCostModel:
    """Online least squares of a tick's seconds on its decode and prefill token counts."""

    def __init__(self, forgetting: float = FORGETTING) -> None:
        # theta: base, per decode token, per prefill token
        self.fit = RecursiveLeastSquares(3, forgetting, max_covariance_trace=MAX_COVARIANCE_TRACE)
        self.prefill_observations = 0

    @property
    def observations(self) -> int:
        return self.fit.observations

    @property
    def ready(self) -> bool:
        """Whether the model has seen enough ticks, some with prompt tokens, to be used."""
        return self.observations >= WARM_UP_TICKS and self.prefill_observations >= 2

    def coefficients(self) -> TickCost:
        """The fitted costs, none negative (noise can push a small one below zero)."""
        base, decode, prefill = (max(0.0, value) for value in self.fit.theta)
        return TickCost(base, decode, prefill)

    def predict(self, decode_tokens: int, prefill_tokens: int) -> float:
        cost = self.coefficients()
        return (
            cost.base
            + cost.per_decode_token * decode_tokens
            + (cost.per_prefill_token * prefill_tokens)
        )

    def observe(self, decode_tokens: int, prefill_tokens: int, seconds: float) -> None:
        """One tick that ran a forward pass: its token counts and how long it took."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        if self.ready:
            # A machine busy with something else makes a rare tick far slower than its
            # batch explains; counting it whole would throw the costs off for many ticks.
            predicted = self.predict(decode_tokens, prefill_tokens)
            seconds = min(seconds, OUTLIER_FACTOR * max(predicted, 1e-4))
        self.fit.observe((1.0, float(decode_tokens), float(prefill_tokens)), seconds)
        if prefill_tokens:
            self.prefill_observations += 1


class LatencyTarget:
    """How many prompt tokens a tick may carry beside its decode tokens to stay in target."""

    def __init__(self, target_seconds: float, model: TickCostModel) -> None:
        self.target = target_seconds
        self.model = model
        self.latest_cap: int | None = None  # for the metrics

    def prefill_cap(self, decode_tokens: int) -> int | None:
        """Prompt tokens that fit; None (no cap) until the model has learned enough."""
        if not self.model.ready:
            return None
        cost = self.model.coefficients()
        room = self.target - cost.base - cost.per_decode_token * decode_tokens
        if cost.per_prefill_token <= 0.0:
            return None
        room = max(room, MIN_PREFILL_SHARE * self.target)
        cap = max(MIN_PREFILL_TOKENS, math.floor(room / cost.per_prefill_token))
        self.latest_cap = cap
        return cap

    def limit(self, plan: BatchPlan, views: list[SlotView], budget: int) -> BatchPlan:
        """While a stream generates, hold the tick's prompt tokens to what the target allows;
        with nothing generating, prompts get the whole budget."""
        generating = sum(view.phase is SlotPhase.GENERATING for view in views)
        if not generating or not plan.prefill:
            return plan
        cap = self.prefill_cap(generating)
        return plan if cap is None else limit_prefill(plan, views, cap, budget)
