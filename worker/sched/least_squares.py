"""Recursive least squares with exponential forgetting: the online fit under the tick-cost model
(tick_cost.py) and the draft surcharge (speculation.py). Plain Python, no model.

Each observation (x, y) moves the coefficients theta toward explaining y as theta . x, with
older observations weighing `forgetting` less per newer one, so the fit follows a machine
whose speed changes. P, the coefficients' scaled covariance, is kept symmetric and bounded:
where roundoff once left it slightly asymmetric, dividing by the forgetting factor grew that
part a few percent per update, and within some thousands of updates P stopped being positive
definite, the fit went wild and an update divided by zero (the failed ticks of the second
fault audit). Directions the data never excites would grow the same way without the bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from operator import mul


class RecursiveLeastSquares:
    """theta fitted online to observations y ≈ theta . x."""

    def __init__(
        self,
        n_features: int,
        forgetting: float,
        prior: Sequence[float] | None = None,
        initial_covariance: float = 1e3,
        max_covariance_trace: float = 1e4,
    ) -> None:
        self.n = n_features
        self.forgetting = forgetting
        self.theta = list(prior) if prior is not None else [0.0] * n_features
        self.p = [
            [initial_covariance if i == j else 0.0 for j in range(n_features)]
            for i in range(n_features)
        ]
        self.max_trace = max_covariance_trace
        self.observations = 0

    def predict(self, x: Sequence[float]) -> float:
        return sum(map(mul, self.theta, x))

    def observe(self, x: Sequence[float], y: float) -> None:
        # Written for the tick loop, which observes every tick: no index loops.
        if not math.isfinite(y):
            return
        p = self.p
        px = [sum(map(mul, row, x)) for row in p]  # P x
        # Past the bound, stop forgetting: P then shrinks (or stays) instead of growing.
        trace = sum(row[i] for i, row in enumerate(p))
        lam = self.forgetting if trace <= self.max_trace else 1.0
        denominator = lam + sum(map(mul, x, px))
        if not denominator > 0.0:  # P lost definiteness after all: start the fit's doubt anew
            n = self.n
            self.p = [[self.max_trace / n if i == j else 0.0 for j in range(n)] for i in range(n)]
            return
        step = (y - self.predict(x)) / denominator
        self.theta = [t + v * step for t, v in zip(self.theta, px, strict=True)]
        # (P - (P x)(P x)^T / d) / lam: entries (i, j) and (j, i) multiply the same two floats
        # (in either order, the same product) from a symmetric P, so P stays exactly symmetric.
        scale = 1.0 / lam
        self.p = [
            [(p_ij - a * b / denominator) * scale for p_ij, b in zip(row, px, strict=True)]
            for row, a in zip(p, px, strict=True)
        ]
        self.observations += 1
