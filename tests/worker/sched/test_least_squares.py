"""The online fit under the tick-cost model and the draft surcharge: it must find known costs
and stay sound over a worker's lifetime of updates."""

from __future__ import annotations

import random

import pytest

from loomserve.worker.sched.least_squares import RecursiveLeastSquares
from loomserve.worker.sched.speculation import DraftCost


def test_it_finds_known_coefficients_and_stays_symmetric_for_100k_updates():
    rng = random.Random(5)
    fit = RecursiveLeastSquares(3, forgetting=0.98)
    truth = (0.002, 0.0004, 0.00003)
    for step in range(100_000):
        x = (1.0, float(rng.randrange(1, 17)), float(rng.choice((0, 0, 64, 512))))
        y = sum(t * v for t, v in zip(truth, x, strict=True)) * rng.uniform(0.97, 1.03)
        fit.observe(x, y)
        if step % 10_000 == 9_999:
            assert fit.theta == pytest.approx(truth, rel=0.1)
            p = fit.p
            assert all(p[i][j] == p[j][i] for i in range(3) for j in range(3))
            assert all(p[i][i] > 0 for i in range(3))


def test_the_draft_surcharge_stays_sound_over_20k_drafting_ticks():
    """It forgets faster (0.95) than the tick-cost model, so an asymmetric covariance grew 5 %
    per drafting tick before the fit was shared."""
    rng = random.Random(9)
    cost = DraftCost()
    for _ in range(20_000):
        extra = rng.randrange(1, 65)
        cost.observe(extra, (0.004 + 0.0006 * extra) * rng.uniform(0.95, 1.05))
    assert cost.predict(32) == pytest.approx(0.004 + 0.0006 * 32, rel=0.1)
    assert cost.per_token == pytest.approx(0.0006, rel=0.15)
    p = cost.fit.p  # before: [[-9949, 332], [291, -9.7]], no longer a covariance at all
    assert p[0][1] == p[1][0] and p[0][0] > 0 and p[1][1] > 0
    assert p[0][0] * p[1][1] > p[0][1] ** 2


def test_non_finite_observations_are_ignored():
    fit = RecursiveLeastSquares(2, forgetting=0.98)
    fit.observe((1.0, 2.0), float("nan"))
    fit.observe((1.0, 2.0), float("inf"))
    assert fit.observations == 0 and fit.theta == [0.0, 0.0]
