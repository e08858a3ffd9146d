"""The shape of a tick's batch: the runs of slot tokens that carry out the strategy's plan,
ordered, padded and grown so that llama.cpp makes as few forward passes of it as it can
(ubatches.py says how it cuts a batch). Plain Python.

The scheduler shapes every plan into a step (shape); speculation asks what a common draft
length would cost in passes (ubatches_with_filler) and then adds the drafts (add_drafts).
"""

from __future__ import annotations

from collections.abc import Sequence

from .slots import Run, Slot, Step
from .strategies import BatchPlan, SlotPhase
from .ubatches import SplitRules, count_ubatches, gaps_to_bridge


def shape(plan: BatchPlan, slots: Sequence[Slot], budget: int, rules: SplitRules) -> Step:
    """The plan's runs in slot order, padded so that llama.cpp makes as few passes as it can
    (ubatches.py).

    Slot order costs nothing where the cache is one stream, and there it stays one pass.
    """
    step = Step(plan, runs(plan, slots))
    step.runs.sort(key=lambda run: run.slot.index)
    if rules.per_slot_streams and rules.padding:
        room = budget - step.plan.n_tokens
        in_batch = [run.slot.index for run in step.runs]

        def paddable(index: int) -> bool:
            return can_pad(slots[index], rules)

        pads = gaps_to_bridge(in_batch, paddable, room) if room else []
        if pads:
            for index in pads:
                slot = slots[index]
                # Any token will do; the slot's next position keeps its cells in order.
                step.runs.append(Run(slot, [0], slot.n_in_cache, False, pad=True))
            step.runs.sort(key=lambda run: run.slot.index)
            step.n_pad = len(pads)
    lengths = [(run.slot.index, len(run.tokens)) for run in step.runs]
    step.ubatches = count_ubatches(lengths, budget, rules.per_slot_streams)
    return step


def runs(plan: BatchPlan, slots: Sequence[Slot]) -> list[Run]:
    """A run per slot in the plan: a generating slot's last token, or its prompt's next chunk."""
    found = []
    for index in plan.decode:
        slot = slots[index]
        found.append(Run(slot, slot.tokens[-1:], slot.n_in_cache, True))
    for index, n_tokens in plan.prefill.items():
        slot = slots[index]
        start, end = slot.n_in_cache, slot.n_in_cache + n_tokens
        # Logits only where a token is sampled (the last prompt token), unless the request
        # scores its prompt.
        score = slot.occupant.params.prompt_logprobs is not None
        found.append(Run(slot, slot.tokens[start:end], start, end == slot.n_prompt, score))
    return found


def can_pad(slot: Slot, rules: SplitRules) -> bool:
    # A busy slot's next cell is written by its own next token anyway.
    return slot.busy or not slot.n_in_cache or rules.pad_cached_slots


def ubatches_with_filler(step: Step, length: int, budget: int, rules: SplitRules) -> int:
    """The passes the step would take with `length` more tokens on every decode and
    padding run (speculation's common length, where each slot has its own KV stream)."""
    lengths = []
    for run in step.runs:
        grows = run.pad or (run.sample and run.slot.phase is SlotPhase.GENERATING)
        lengths.append((run.slot.index, len(run.tokens) + (length if grows else 0)))
    return count_ubatches(lengths, budget, rules.per_slot_streams)


def add_drafts(
    step: Step, drafts: dict[int, list[int]], length: int, budget: int, rules: SplitRules
) -> None:
    """Put the drafted tokens after each generating slot's last token; with a KV stream
    per slot, also fill every decode and padding run up to `length` extra tokens."""
    uniform = rules.per_slot_streams
    for run in step.runs:
        decoding = run.sample and run.slot.phase is SlotPhase.GENERATING
        if not (decoding or (run.pad and uniform)):
            continue
        draft = drafts.get(run.slot.index, []) if decoding else []
        filler = length - len(draft) if uniform else 0
        # Filler repeats the run's first token: any token will do, nothing reads it.
        run.tokens = run.tokens + draft + run.tokens[:1] * filler
        run.draft, run.filler = len(draft), filler
        step.n_extra += len(draft) + filler
    lengths = [(run.slot.index, len(run.tokens)) for run in step.runs]
    step.ubatches = count_ubatches(lengths, budget, rules.per_slot_streams)
