"""Preemption under the priority policy: which running request gives up its slot, and the
host memory its KV state may be saved in (`--swap-space`). Plain Python, no model.

A waiting request takes a slot from a running one only when it outranks it: the victim is
the running request with the worst priority, the latest arrival among equals, and only if
that priority is worse than the newcomer's. Equal priorities never preempt each other, so no
two requests take turns evicting each other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from ..cache.ram_cache import SavedState
    from .slots import Request, Slot

GIB = 1024**3


class Ranked(Protocol):
    priority: int  # lower is served first
    order: int  # arrival order


R = TypeVar("R", bound=Ranked)


def choose_victim(running: Iterable[R], incoming: Ranked) -> R | None:
    """The running request that gives its slot to `incoming`, or None when none ranks below."""
    victim = max(running, key=lambda r: (r.priority, r.order), default=None)
    if victim is None or victim.priority <= incoming.priority:
        return None
    return victim


def victim_slot(busy: Iterable[Slot], incoming: Request, spared: frozenset[int]) -> Slot | None:
    """The busy slot whose request gives its place to `incoming`, or None.

    Slots in `spared` are kept (an admission of this tick copies from them), and so are
    requests already ending.
    """
    # A request that scores its prompt is not preempted: its prompt's logprobs come
    # from its one prefill, which a resumption would repeat.
    candidates = {
        slot.occupant.key: slot
        for slot in busy
        if not slot.finish_reason
        and slot.index not in spared
        and slot.occupant.params.prompt_logprobs is None
    }
    victim = choose_victim([slot.occupant for slot in candidates.values()], incoming)
    return None if victim is None else candidates[victim.key]


class SwapSpace:
    """A byte budget for preempted requests' KV states held in host memory."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.used = 0

    def fits(self, n_bytes: int) -> bool:
        return n_bytes > 0 and self.used + n_bytes <= self.capacity

    def hold(self, request: Request, state: SavedState, n_tokens: int, n_bytes: int) -> None:
        """A preempted request's `n_tokens` cells, saved as `state`: it resumes from them."""
        request.saved_state = state
        request.saved_tokens = n_tokens
        request.saved_bytes = n_bytes
        self.used += n_bytes

    def drop(self, request: Request) -> None:
        """The request's saved state is restored or no longer needed: its bytes come back."""
        if request.saved_state is not None:
            self.used = max(0, self.used - request.saved_bytes)
            request.saved_state = None
            request.saved_bytes = 0
