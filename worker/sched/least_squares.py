"""Recursive least squares with exponential forgetting: the online fit under the tick-cost model
(tick_cost.py) and the draft surcharge (speculation.py). Plain Python, no model.

Each observation (x, y) moves the coefficients theta toward explaining y as theta . x, with
older observations weighing `forgetting` less per newer one, so the fit follows a machine
whose speed changes. P, the coefficients' scaled covariance, is kept symmetric and bounded:
roundoff leaves it slightly asymmetric, dividing by the forgetting factor grows that part a
few percent per update, and within some thousands of updates P stopped being positive
definite, the fit went wild and an update divided by zero (the failed ticks of the second
fault audit). Directions the data never excites would grow the same way without the bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


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
        return sum(t * v for t, v in zip(self.theta, x, strict=True))

    def observe(self, x: Sequence[float], y: float) -> None:
        if not math.isfinite(y):
            return
        n, p = self.n, self.p
        px = [sum(p[i][j] * x[j] for j in range(n)) for i in range(n)]
        # Past the bound, stop forgetting: P then shrinks (or stays) instead of growing.
        lam = self.forgetting if sum(p[i][i] for i in range(n)) <= self.max_trace else 1.0
        denominator = lam + sum(x[i] * px[i] for i in range(n))
        if not denominator > 0.0:  # P lost definiteness after all: start the fit's doubt anew
            self.p = [[self.max_trace / n if i == j else 0.0 for j in range(n)] for i in range(n)]
            return
        gain = [value / denominator for value in px]
        error = y - self.predict(x)
        self.theta = [self.theta[i] + gain[i] * error for i in range(n)]
        new = [[(p[i][j] - gain[i] * px[j]) / lam for j in range(n)] for i in range(n)]
        self.p = [[(new[i][j] + new[j][i]) / 2 for j in range(n)] for i in range(n)]
        self.observations += 1
