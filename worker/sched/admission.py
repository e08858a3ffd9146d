"""Seating: where an admitted request goes, the slot it takes and the cache it starts from.

The scheduler admits waiting requests in the queue's order (scheduler.py) and keeps who runs
where; for each one it admits, this picks the slot whose cache holds most of the request's
sequence (cache/prefix_cache.py: the slot's own cells, a busy slot's prefix to copy, or a
prefix kept in host memory), or restores the request's own saved state after a preemption,
and readies the slot for it. When the slot's cache would be lost and the RAM cache lacks it,
the Admission says to save it first. Plain Python, no model.
"""

from __future__ import annotations

from ..cache.prefix_cache import can_place, place
from ..cache.ram_cache import RamCache
from .media import outside_image
from .slots import Admission, Request, Slot, set_phase
from .ubatches import SplitRules


class Seating:
    """Places admitted requests in idle slots, each where most of its sequence is cached."""

    def __init__(
        self, slots: list[Slot], rules: SplitRules, min_copy_tokens: int, ram: RamCache
    ) -> None:
        self.slots = slots  # the scheduler's own list
        self.rules = rules
        # A busy slot's prefix is copied only when it saves at least this many tokens.
        self.min_copy_tokens = min_copy_tokens
        self.ram = ram  # slots' caches kept after their slots were taken

    def has_room(self, reserved: frozenset[int]) -> bool:
        """Whether an idle slot outside `reserved` (this tick's copy sources) may take one."""
        return can_place(self.slots, reserved)

    def seat(self, request: Request, tick: int, now: float, reserved: frozenset[int]) -> Admission:
        """Put `request` in the idle slot that suits it best and say what the engine must do
        for the slot's cells (check has_room first). A swapped-out request restores its own
        state: the caller gives its swap space back."""
        tokens = request.resume_tokens or request.prompt
        # A cached prefix has no logits to score its tokens with: a request that scores
        # its prompt evaluates it all, in the least recently used slot.
        scores = request.params.prompt_logprobs is not None
        placement = place(
            self.slots,
            [] if scores else tokens,
            per_slot_streams=self.rules.per_slot_streams,
            min_copy_tokens=self.min_copy_tokens,
            ram=self.ram,
            reserved=reserved,
            chunk=self.rules.prompt_chunk,
        )
        slot, reused = self.slots[placement.target], placement.reused
        source = None if placement.source is None else self.slots[placement.source]
        ram_entry = placement.ram
        restore = request.saved_state
        if restore is not None:  # swapped out: its own saved cells, not a shared prefix
            reused, source, ram_entry = request.saved_tokens, None, None
        else:
            reused = outside_image(request.media, reused)
        kept = reused if source is None and ram_entry is None and restore is None else 0
        save_first = self._worth_saving(slot, kept)
        slot.request = request
        slot.tokens = list(tokens)
        slot.n_in_cache = reused
        slot.n_prompt = len(tokens)
        slot.admitted_tick = tick
        slot.finish_reason = None
        slot.finish_message = ""
        slot.finish_code = ""
        set_phase(slot)
        if not request.admitted_at:  # its first admission: the queue time and cache hits
            request.admitted_at = now
            request.cached_tokens = reused
        return Admission(
            slot,
            request,
            reused,
            source if reused else None,
            restore,
            ram_entry=ram_entry,
            save_first=save_first,
        )

    def _worth_saving(self, slot: Slot, kept: int) -> list[int] | None:
        """The slot's cached tokens, when taking it for a request that keeps only `kept` of
        them loses a block or more that the RAM cache does not hold yet."""
        ram = self.ram
        if not ram.enabled or slot.n_in_cache - kept < ram.block_tokens:
            return None
        cached = slot.tokens[: slot.n_in_cache]
        return cached if ram.worth_saving(cached) else None
