"""Batching strategies (ADR 008): how one tick's token budget is split between slots.

A strategy sees read-only views of the busy slots and answers with a BatchPlan: which
generating slots decode one token, and how many prompt tokens each prefilling slot
evaluates. It never touches the engine, so it is plain Python, testable without a model.
Every plan is checked (check_plan, by CheckedPlans) before a batch is built from it.

Pick one by name (decode-maximal, prefill-priority, balanced) or by a dotted path to your
own class, `package.module:Class` or `package.module.Class`, built with no arguments.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable

import structlog

log = structlog.get_logger("loomserve.worker.sched.scheduler")  # the logger this line always had


class SlotPhase(StrEnum):
    IDLE = "idle"
    PREFILLING = "prefilling"
    GENERATING = "generating"


@dataclass(frozen=True, slots=True)
class SlotView:
    """What a strategy may know about one busy slot."""

    index: int
    phase: SlotPhase
    prompt_remaining: int  # prompt tokens not yet in the KV cache (0 while generating)
    generated: int  # tokens generated so far for the current request
    admitted_tick: int  # the tick the request took this slot; lower means it came first


@dataclass(slots=True)
class BatchPlan:
    """One tick's batch, as decided by a strategy."""

    decode: list[int] = field(default_factory=list)  # generating slots that decode one token
    prefill: dict[int, int] = field(default_factory=dict)  # prefilling slot -> prompt tokens

    @property
    def n_tokens(self) -> int:
        return len(self.decode) + sum(self.prefill.values())


@runtime_checkable
class BatchStrategy(Protocol):
    """Decides how one tick's budget is spent. Must not keep references to the views."""

    def plan(
        self, slots: Sequence[SlotView], budget: int, chunk_size: int, queue_depth: int
    ) -> BatchPlan: ...


class InvalidPlan(ValueError):
    """A strategy returned a plan the loop cannot run."""


def check_plan(plan: BatchPlan, slots: Sequence[SlotView], budget: int) -> None:
    """Raise InvalidPlan unless the plan fits, names slots in the right phase, and progresses."""
    by_index = {view.index: view for view in slots}
    if len(set(plan.decode)) != len(plan.decode):
        raise InvalidPlan("a slot decodes twice in one tick")
    for index in plan.decode:
        view = by_index.get(index)
        if view is None or view.phase is not SlotPhase.GENERATING:
            raise InvalidPlan(f"slot {index} is not generating")
    for index, n_tokens in plan.prefill.items():
        view = by_index.get(index)
        if view is None or view.phase is not SlotPhase.PREFILLING:
            raise InvalidPlan(f"slot {index} is not prefilling")
        if not 0 < n_tokens <= view.prompt_remaining:
            raise InvalidPlan(
                f"slot {index} asked for {n_tokens} prompt tokens of {view.prompt_remaining}"
            )
    if plan.n_tokens > budget:
        raise InvalidPlan(f"the plan holds {plan.n_tokens} tokens, over the budget of {budget}")
    if slots and plan.n_tokens == 0:
        raise InvalidPlan("the plan is empty while slots have work: nothing would progress")


def _generating(slots: Sequence[SlotView]) -> list[SlotView]:
    return [view for view in slots if view.phase is SlotPhase.GENERATING]


def _prefilling(slots: Sequence[SlotView]) -> list[SlotView]:
    # First come, first prefilled: the oldest admission gets its chunk first.
    views = [view for view in slots if view.phase is SlotPhase.PREFILLING]
    return sorted(views, key=lambda view: (view.admitted_tick, view.index))


def _fill_prefill(plan: BatchPlan, prefilling: list[SlotView], budget: int, chunk_size: int) -> int:
    """Give each prefilling slot up to one chunk while budget lasts; return what is left."""
    for view in prefilling:
        if budget <= 0:
            break
        n_tokens = min(chunk_size, view.prompt_remaining, budget)
        plan.prefill[view.index] = n_tokens
        budget -= n_tokens
    return budget


def limit_prefill(plan: BatchPlan, slots: Sequence[SlotView], cap: int, budget: int) -> BatchPlan:
    """The plan with at most `cap` prompt tokens, the oldest admissions' chunks kept first.

    A latency target applies this to any strategy's plan. Generating slots the strategy left
    out for prompt tokens decode in the room that frees: the target protects their streams.
    """
    if sum(plan.prefill.values()) <= cap:
        return plan
    admitted = {view.index: (view.admitted_tick, view.index) for view in slots}
    limited = BatchPlan(decode=list(plan.decode))
    left = cap
    for index in sorted(plan.prefill, key=admitted.__getitem__):
        if left <= 0:
            break
        limited.prefill[index] = n_tokens = min(plan.prefill[index], left)
        left -= n_tokens
    room = budget - limited.n_tokens
    if room > 0:
        planned = set(limited.decode)
        left_out = [view.index for view in _generating(slots) if view.index not in planned]
        limited.decode.extend(left_out[:room])
    return limited


class DecodeMaximal:
    """Every generating slot decodes first; prompt chunks fill what budget is left."""

    name = "decode-maximal"

    def plan(
        self, slots: Sequence[SlotView], budget: int, chunk_size: int, queue_depth: int
    ) -> BatchPlan:
        plan = BatchPlan(decode=[view.index for view in _generating(slots)][:budget])
        _fill_prefill(plan, _prefilling(slots), budget - len(plan.decode), chunk_size)
        return plan


class PrefillPriority:
    """Prompt chunks first, so new requests start sooner; decode tokens fill the rest."""

    name = "prefill-priority"

    def plan(
        self, slots: Sequence[SlotView], budget: int, chunk_size: int, queue_depth: int
    ) -> BatchPlan:
        plan = BatchPlan()
        left = _fill_prefill(plan, _prefilling(slots), budget, chunk_size)
        plan.decode = [view.index for view in _generating(slots)][:left]
        return plan


class Balanced:
    """Half the budget for decode and half for prefill; either half's slack goes to the other."""

    name = "balanced"

    def plan(
        self, slots: Sequence[SlotView], budget: int, chunk_size: int, queue_depth: int
    ) -> BatchPlan:
        generating = _generating(slots)
        prefilling = _prefilling(slots)
        prefill_need = sum(min(chunk_size, view.prompt_remaining) for view in prefilling)
        decode_share = max(budget // 2, budget - prefill_need)
        plan = BatchPlan(decode=[view.index for view in generating][:decode_share])
        _fill_prefill(plan, prefilling, budget - len(plan.decode), chunk_size)
        return plan


BUILT_IN: dict[str, type] = {
    DecodeMaximal.name: DecodeMaximal,
    PrefillPriority.name: PrefillPriority,
    Balanced.name: Balanced,
}


def load_strategy(spec: str) -> BatchStrategy:
    """The strategy named by spec: a built-in name, or `package.module:Class` / `.Class`."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]()
    module_name, sep, class_name = spec.partition(":")
    if not sep:
        module_name, _, class_name = spec.rpartition(".")
    if not module_name or not class_name:
        known = ", ".join(BUILT_IN)
        raise ValueError(f"unknown strategy {spec!r}: use one of {known} or package.module:Class")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load strategy {spec!r}: {exc}") from exc
    try:
        strategy = cls()
    except Exception as exc:
        raise ValueError(f"cannot build strategy {spec!r} with no arguments: {exc}") from exc
    if not callable(getattr(strategy, "plan", None)):
        raise ValueError(f"strategy {spec!r} has no plan(slots, budget, chunk_size, queue_depth)")
    return strategy


class CheckedPlans:
    """A strategy's plans, checked and limited (the latency target); when the strategy fails,
    decode-maximal plans the tick, logged the first time and every 1000th."""

    def __init__(self) -> None:
        self.failures = 0
        self._fallback = DecodeMaximal()

    def plan(
        self,
        strategy: BatchStrategy,
        views: list[SlotView],
        budget: int,
        chunk_size: int,
        depth: int,
        limit: Callable[[BatchPlan, list[SlotView], int], BatchPlan] | None = None,
    ) -> BatchPlan:
        try:
            plan = strategy.plan(views, budget, chunk_size, depth)
            check_plan(plan, views, budget)
            if limit is not None:
                plan = limit(plan, views, budget)
        except Exception as exc:  # InvalidPlan, or anything a user's strategy raises
            self.failures += 1
            if self.failures % 1000 == 1:  # the first, then every 1000th
                log.error(
                    "strategy failed; decode-maximal plans this tick",
                    strategy=getattr(strategy, "name", type(strategy).__qualname__),
                    error=str(exc),
                    failures=self.failures,
                )
            plan = self._fallback.plan(views, budget, chunk_size, depth)
        return plan
