"""Batching strategies decide each tick's batch composition; pure Python, no model."""

from __future__ import annotations

import sys
import types

import pytest

from loomserve.worker.sched.strategies import (
    Balanced,
    BatchPlan,
    DecodeMaximal,
    InvalidPlan,
    PrefillPriority,
    SlotPhase,
    SlotView,
    check_plan,
    load_strategy,
)

GEN, PRE = SlotPhase.GENERATING, SlotPhase.PREFILLING


def generating(index: int, tick: int = 0) -> SlotView:
    return SlotView(index, GEN, prompt_remaining=0, generated=3, admitted_tick=tick)


def prefilling(index: int, remaining: int, tick: int = 0) -> SlotView:
    return SlotView(index, PRE, prompt_remaining=remaining, generated=0, admitted_tick=tick)


def test_decode_maximal_decodes_everyone_then_fills_with_prompt_chunks():
    slots = [generating(0), prefilling(1, 100, tick=2), generating(2), prefilling(3, 5, tick=1)]
    plan = DecodeMaximal().plan(slots, budget=32, chunk_size=16, queue_depth=0)
    assert plan.decode == [0, 2]
    # The older admission (slot 3) is prefilled first; slot 1 gets what is left.
    assert plan.prefill == {3: 5, 1: 16}
    assert plan.n_tokens == 23
    check_plan(plan, slots, 32)


def test_decode_maximal_cuts_the_last_chunk_to_the_budget():
    slots = [generating(0), generating(1), prefilling(2, 100)]
    plan = DecodeMaximal().plan(slots, budget=10, chunk_size=512, queue_depth=0)
    assert plan.decode == [0, 1]
    assert plan.prefill == {2: 8}


def test_prefill_priority_spends_the_budget_on_prompts_first():
    slots = [generating(0), generating(1), prefilling(2, 30), prefilling(3, 30, tick=1)]
    plan = PrefillPriority().plan(slots, budget=40, chunk_size=16, queue_depth=4)
    assert plan.prefill == {2: 16, 3: 16}
    assert plan.decode == [0, 1]  # 8 tokens left, both decode
    starved = PrefillPriority().plan(slots, budget=33, chunk_size=16, queue_depth=4)
    assert starved.prefill == {2: 16, 3: 16}
    assert starved.decode == [0]


def test_balanced_splits_the_budget_and_lends_unused_halves():
    many_decoders = [generating(i) for i in range(12)] + [prefilling(12, 100)]
    plan = Balanced().plan(many_decoders, budget=16, chunk_size=64, queue_depth=0)
    assert len(plan.decode) == 8 and plan.prefill == {12: 8}

    few_decoders = [generating(0), prefilling(1, 100)]
    plan = Balanced().plan(few_decoders, budget=16, chunk_size=64, queue_depth=0)
    assert plan.decode == [0] and plan.prefill == {1: 15}  # decode's slack goes to prefill

    short_prompt = [generating(i) for i in range(12)] + [prefilling(12, 2)]
    plan = Balanced().plan(short_prompt, budget=16, chunk_size=64, queue_depth=0)
    assert len(plan.decode) == 12 and plan.prefill == {12: 2}  # prefill's slack goes back


@pytest.mark.parametrize("strategy", [DecodeMaximal(), PrefillPriority(), Balanced()])
def test_every_built_in_plan_is_valid_and_uses_the_budget(strategy):
    slots = [generating(0), prefilling(1, 3), generating(2), prefilling(3, 50), generating(4)]
    for budget in (5, 8, 13, 64):
        plan = strategy.plan(slots, budget=budget, chunk_size=7, queue_depth=2)
        check_plan(plan, slots, budget)
        assert plan.n_tokens == min(budget, 3 + 3 + 7)


@pytest.mark.parametrize(
    ("plan", "problem"),
    [
        (BatchPlan(decode=[1]), "not generating"),
        (BatchPlan(decode=[0, 0]), "twice"),
        (BatchPlan(prefill={0: 1}), "not prefilling"),
        (BatchPlan(prefill={1: 11}), "asked for 11"),
        (BatchPlan(prefill={1: 0}), "asked for 0"),
        (BatchPlan(decode=[0], prefill={1: 10}), "over the budget"),
        (BatchPlan(decode=[7]), "not generating"),
    ],
)
def test_check_plan_refuses_what_the_loop_cannot_run(plan, problem):
    slots = [generating(0), prefilling(1, 10)]
    with pytest.raises(InvalidPlan, match=problem):
        check_plan(plan, slots, budget=8)


class EveryOtherTick:
    """A user's strategy: lives in a module of its own, built with no arguments."""

    def plan(self, slots, budget, chunk_size, queue_depth):
        return BatchPlan(decode=[s.index for s in slots if s.phase is GEN][:1])


@pytest.fixture
def user_module(monkeypatch):
    module = types.ModuleType("my_strategies")
    module.EveryOtherTick = EveryOtherTick
    monkeypatch.setitem(sys.modules, "my_strategies", module)
    return module


@pytest.mark.parametrize("spec", ["my_strategies:EveryOtherTick", "my_strategies.EveryOtherTick"])
def test_load_strategy_by_dotted_path(user_module, spec):
    strategy = load_strategy(spec)
    assert isinstance(strategy, EveryOtherTick)
    assert strategy.plan([generating(0), generating(1)], 8, 4, 0).decode == [0]


@pytest.mark.parametrize(
    ("spec", "cls"),
    [
        ("decode-maximal", DecodeMaximal),
        ("prefill-priority", PrefillPriority),
        ("balanced", Balanced),
    ],
)
def test_load_strategy_by_name(spec, cls):
    assert isinstance(load_strategy(spec), cls)


@pytest.mark.parametrize(
    "spec",
    [
        "fastest",
        "no_such_module:Thing",
        "loomserve.worker.sched.strategies:Nope",
        "loomserve.worker.sched.strategies:SlotPhase",
    ],
)
def test_load_strategy_refuses_unknown_names(spec):
    with pytest.raises(ValueError):
        load_strategy(spec)


def test_check_plan_refuses_an_empty_plan_while_slots_have_work():
    with pytest.raises(InvalidPlan, match="nothing would progress"):
        check_plan(BatchPlan(), [generating(0)], budget=8)
    check_plan(BatchPlan(), [], budget=8)
