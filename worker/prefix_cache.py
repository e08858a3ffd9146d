"""Prefix-cache placement: which slot a request takes, and whose cached prefix it reuses.

Plain Python over the scheduler's slots, no model. A slot keeps the KV cells of the sequence
it ran (prompt, then generated tokens) after its request ends, so a later prompt that starts
the same way skips those tokens (prefix reuse, like llama-server's cache_prompt). place()
looks once over every slot's cached tokens and answers with a Placement: the idle slot the
request takes, and the cache it starts from (that slot's own, or a copy of another slot's).

Which idle slots may take a request depends on the KV cache's layout. With one cache shared
by all slots any idle slot will do. With a KV stream per slot, busy slots with consecutive
ids share a forward pass (ubatches.py), so a request takes an idle slot with the most busy
neighbours, and a longer prefix cached elsewhere is copied there: a stream copy costs far
less than a pass more on every tick of the request's life.

How much of a shared prefix a request may reuse is one rule, usable_prefix().
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class CachedSlot(Protocol):
    """What placement reads of a slot (scheduler.Slot)."""

    index: int
    tokens: list[int]
    n_in_cache: int  # tokens[:n_in_cache] have their KV in the cache
    last_used_tick: int

    @property
    def busy(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request goes: the slot it takes, and the leading tokens it need not evaluate.

    With `source` None those tokens are the target's own cells; otherwise the engine copies
    them from the source slot's.
    """

    target: int  # the idle slot's index
    reused: int  # leading tokens of the request's sequence whose KV it reuses
    source: int | None = None  # a slot whose first `reused` cells are copied into target


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix, by bisection over C-speed slice comparisons."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def usable_prefix(shared: int, n_tokens: int) -> int:
    """How many of `shared` cached leading tokens a sequence of n_tokens may reuse.

    At least the last token is evaluated again: its logits give the next token.
    """
    return max(0, min(shared, n_tokens - 1))


def place(
    slots: Sequence[CachedSlot],
    tokens: list[int],
    *,
    per_slot_streams: bool,
    min_copy_tokens: int,
) -> Placement:
    """The idle slot for a sequence and the cache it starts from (at least one slot is idle).

    The target is the candidate (candidate_slots) whose own cache holds the longest usable
    prefix, least recently used first among equals. When another slot holds one longer by
    min_copy_tokens or more, the least recently used candidate takes the request and copies
    that prefix instead, keeping the other candidates' caches.
    """
    candidates = candidate_slots(slots, per_slot_streams)
    candidate_ids = {slot.index for slot in candidates}
    shared = _usable_by_slot(slots, tokens)
    target = max(candidates, key=lambda slot: (shared.get(slot.index, 0), -slot.last_used_tick))
    target_shared = shared.get(target.index, 0)
    source, source_shared = None, 0
    for index, n_shared in shared.items():
        if index not in candidate_ids and n_shared > source_shared:
            source, source_shared = index, n_shared
    if source is not None and source_shared - target_shared >= min_copy_tokens:
        lru = min(candidates, key=lambda slot: slot.last_used_tick)
        return Placement(lru.index, source_shared, source)
    return Placement(target.index, target_shared)


def candidate_slots(slots: Sequence[CachedSlot], per_slot_streams: bool) -> list[CachedSlot]:
    """The idle slots a request may take: any, or with a KV stream per slot those with the
    most busy neighbours (they join their neighbours' forward pass)."""
    idle = [slot for slot in slots if not slot.busy]
    if not per_slot_streams:
        return idle

    def busy(index: int) -> bool:
        return 0 <= index < len(slots) and slots[index].busy

    def neighbours(slot: CachedSlot) -> int:
        return busy(slot.index - 1) + busy(slot.index + 1)

    best = max(neighbours(slot) for slot in idle)
    return [slot for slot in idle if neighbours(slot) == best]


def _usable_by_slot(slots: Sequence[CachedSlot], tokens: list[int]) -> dict[int, int]:
    """Each slot's usable cached prefix of the sequence, for the slots that cache any."""
    shared = {}
    for slot in slots:
        if slot.n_in_cache:
            n = usable_prefix(common_prefix(slot.tokens[: slot.n_in_cache], tokens), len(tokens))
            if n:
                shared[slot.index] = n
    return shared
