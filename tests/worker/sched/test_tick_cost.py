"""The tick-cost model and the latency target's cap on prompt tokens; pure Python, no model."""

from __future__ import annotations

import random

import pytest

from loomserve.protocol import SamplingParams
from loomserve.worker.sched.scheduler import Scheduler
from loomserve.worker.sched.slots import Request
from loomserve.worker.sched.strategies import (
    BatchPlan,
    PrefillPriority,
    SlotPhase,
    SlotView,
    limit_prefill,
)
from loomserve.worker.sched.tick_cost import MIN_PREFILL_TOKENS, LatencyTarget, TickCostModel


def feed(model: TickCostModel, base: float, decode: float, prefill: float, n: int, seed: int = 0):
    """n ticks of random make-up whose cost follows the given coefficients, with 3% noise."""
    rng = random.Random(seed)
    for _ in range(n):
        d, p = rng.randrange(0, 9), rng.choice([0, 0, 0, 16, 64, 128, 512])
        seconds = (base + decode * d + prefill * p) * rng.uniform(0.97, 1.03)
        model.observe(d, p, seconds)


def test_the_model_learns_a_cpus_costs():
    model = TickCostModel()
    assert not model.ready
    feed(model, base=0.040, decode=0.002, prefill=0.001, n=300)
    assert model.ready
    cost = model.coefficients()
    assert cost.base == pytest.approx(0.040, rel=0.15)
    assert cost.per_decode_token == pytest.approx(0.002, rel=0.25)
    assert cost.per_prefill_token == pytest.approx(0.001, rel=0.1)
    assert model.predict(8, 100) == pytest.approx(0.040 + 0.016 + 0.1, rel=0.1)


def test_the_model_follows_a_change_of_machine_or_load():
    model = TickCostModel()
    feed(model, base=0.040, decode=0.002, prefill=0.001, n=200)
    feed(model, base=0.004, decode=0.0002, prefill=0.00005, n=400, seed=1)  # a GPU, say
    assert model.coefficients().per_prefill_token == pytest.approx(0.00005, rel=0.2)
    feed(model, base=0.040, decode=0.002, prefill=0.001, n=400, seed=2)  # and back
    assert model.coefficients().per_prefill_token == pytest.approx(0.001, rel=0.2)


def test_decode_only_stretches_do_not_unlearn_the_prefill_cost():
    model = TickCostModel()
    feed(model, base=0.040, decode=0.002, prefill=0.001, n=200)
    for _ in range(2000):
        model.observe(8, 0, 0.040 + 0.016)
    assert model.coefficients().per_prefill_token == pytest.approx(0.001, rel=0.2)


def test_a_rare_stall_moves_the_model_little():
    model = TickCostModel()
    feed(model, base=0.040, decode=0.002, prefill=0.001, n=200)
    model.observe(8, 0, 5.0)  # something else took the machine for seconds
    assert model.predict(8, 0) < 0.1


def test_the_model_stays_sound_over_a_long_run():
    """A worker runs millions of ticks. Roundoff once left the covariance a little asymmetric,
    and the forgetting factor grew that part by 1/0.98 a tick: after some 2,000 ticks it was
    no longer positive definite, the fit went wild and an update divided by zero, failing a
    tick (500 "internal error in the worker's tick") in soaks with nothing else wrong."""
    model = TickCostModel()
    for seed in range(10):  # 20,000 ticks: under a minute of a small model's serving
        feed(model, base=0.0003, decode=0.00005, prefill=0.00002, n=2000, seed=seed)
        cost = model.coefficients()
        assert cost.base == pytest.approx(0.0003, rel=0.15)
        assert cost.per_decode_token == pytest.approx(0.00005, rel=0.25)
        assert cost.per_prefill_token == pytest.approx(0.00002, rel=0.1)
        p = model.fit.p
        assert all(p[i][j] == p[j][i] for i in range(3) for j in range(3))


def test_the_cap_fills_the_target_and_never_stops_prompts():
    model = TickCostModel()
    target = LatencyTarget(0.100, model)
    assert target.prefill_cap(8) is None  # not learned yet: no cap
    feed(model, base=0.040, decode=0.002, prefill=0.001, n=300)
    assert target.prefill_cap(8) == pytest.approx(44, abs=8)  # (100 - 40 - 16) ms / 1 ms
    assert target.prefill_cap(0) > target.prefill_cap(8)
    assert LatencyTarget(0.030, model).prefill_cap(8) == MIN_PREFILL_TOKENS
    # 64 decode tokens alone take 168 ms of a 200 ms target: prompts still get a quarter.
    assert LatencyTarget(0.200, model).prefill_cap(64) == pytest.approx(50, abs=8)


def views() -> list[SlotView]:
    gen = [SlotView(i, SlotPhase.GENERATING, 0, 3, 0) for i in range(3)]
    pre = [
        SlotView(3, SlotPhase.PREFILLING, 100, 0, 5),
        SlotView(4, SlotPhase.PREFILLING, 50, 0, 2),
    ]
    return gen + pre


def test_limit_prefill_keeps_the_oldest_chunks_and_decodes_everyone():
    plan = PrefillPriority().plan(views(), budget=151, chunk_size=512, queue_depth=0)
    assert plan.prefill == {4: 50, 3: 100} and plan.decode == [0]
    limited = limit_prefill(plan, views(), cap=60, budget=151)
    assert limited.prefill == {4: 50, 3: 10}  # slot 4 was admitted first
    assert limited.decode == [0, 1, 2]  # the room freed goes to the streams left out
    assert limit_prefill(plan, views(), cap=1000, budget=151) is plan


def request(request_id: str, first_token: int, prompt_len: int) -> Request:
    prompt = list(range(first_token, first_token + prompt_len))
    return Request((b"gw", request_id), prompt, SamplingParams(), 0.0)


def test_the_scheduler_caps_prompts_only_while_a_stream_generates():
    model = TickCostModel()
    feed(model, base=0.040, decode=0.002, prefill=0.001, n=300)
    scheduler = Scheduler(4, 4, 1024, latency=LatencyTarget(0.100, model))
    scheduler.enqueue(request("first", 1, 300))
    scheduler.admit(tick=0, now=0.0)
    step = scheduler.schedule(budget=512, chunk_size=512)
    assert step.plan == BatchPlan(prefill={0: 300})  # nothing generates: the whole prompt
    scheduler.advance(step)
    scheduler.record_token(step.runs[0].slot, 7, False, now=0.0)

    scheduler.enqueue(request("second", 1000, 300))
    scheduler.admit(tick=1, now=0.0)
    step = scheduler.schedule(budget=512, chunk_size=512)
    assert step.plan.decode == [0]
    assert 30 <= step.plan.prefill[1] <= 70  # (100 - 40 - 2) ms at 1 ms a token
