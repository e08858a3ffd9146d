"""Slots and the waiting queue: who runs, who waits, and what each slot holds in the KV cache.

Plain Python over a deque and a list of slots, like nano-vllm's scheduler: no llama.cpp and
no ZeroMQ here, so it is tested without a model. The loop does the engine calls each
decision implies (trim a slot's cache on admission, drop it on release).

A slot's sequence is `tokens` (prompt, then generated tokens); its first `n_cached` tokens
have their keys and values in the cache at positions 0..n_cached-1. A slot that finishes
normally keeps that cache, so a later prompt with the same beginning skips those tokens
(prefix reuse, like llama-server's cache_prompt).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from loomserve.protocol import FinishReason, SamplingParams
from loomserve.worker.strategies import SlotPhase, SlotView

RequestKey = tuple[bytes, str]  # (gateway identity, request id): ids are unique per gateway


@dataclass(slots=True)
class Request:
    """One accepted Generate, from acceptance to its Finish."""

    key: RequestKey
    prompt: list[int]
    params: SamplingParams
    arrived_at: float  # time.monotonic() at acceptance
    sampler: object = None  # the engine's sampler chain, built at acceptance
    admitted_at: float = 0.0
    first_token_at: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose KV was reused from an earlier request
    completion_tokens: int = 0

    @property
    def request_id(self) -> str:
        return self.key[1]


@dataclass(slots=True)
class Slot:
    """One sequence of the shared KV cache; seq_id in llama.cpp is the slot's index."""

    index: int
    phase: SlotPhase = SlotPhase.IDLE
    request: Request | None = None
    tokens: list[int] = field(default_factory=list)
    n_cached: int = 0
    n_prompt: int = 0
    admitted_tick: int = 0
    last_used_tick: int = -1  # idle slots are reused least recently used first
    finish_reason: FinishReason | None = None  # set when the request ends; freed next tick
    finish_message: str = ""

    @property
    def prompt_remaining(self) -> int:
        return self.n_prompt - self.n_cached if self.phase is SlotPhase.PREFILLING else 0

    @property
    def busy(self) -> bool:
        return self.request is not None

    def view(self) -> SlotView:
        request = self.request
        return SlotView(
            index=self.index,
            phase=self.phase,
            prompt_remaining=self.prompt_remaining,
            generated=request.completion_tokens if request else 0,
            admitted_tick=self.admitted_tick,
        )

    def finish(self, reason: FinishReason, message: str = "") -> None:
        """Mark the request over; the loop frees the slot at the start of the next tick."""
        if self.finish_reason is None:
            self.finish_reason = reason
            self.finish_message = message


@dataclass(slots=True)
class Admission:
    """A queued request placed in a slot, reusing the first `reused` tokens of a cache.

    The cache is the slot's own when `source` is None; otherwise the loop copies the first
    `reused` cells of the source slot's sequence (a busy slot running the same prefix).
    """

    slot: Slot
    request: Request
    reused: int
    source: Slot | None = None


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


class Scheduler:
    """Slots plus a bounded FIFO of requests waiting for one."""

    def __init__(
        self, n_slots: int, max_queue: int, slot_context: int, min_copy_tokens: int = 1
    ) -> None:
        self.slots = [Slot(index) for index in range(n_slots)]
        self.max_queue = max_queue
        self.slot_context = slot_context
        # A busy slot's prefix is copied only when it saves at least this many tokens.
        self.min_copy_tokens = min_copy_tokens
        self.waiting: deque[Request] = deque()
        self.live: dict[RequestKey, Request] = {}  # every accepted, unfinished request
        self._slot_of: dict[RequestKey, Slot] = {}

    # --- counts -----------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def running(self) -> int:
        return len(self._slot_of)

    @property
    def free_slots(self) -> int:
        return len(self.slots) - len(self._slot_of)

    def has_work(self) -> bool:
        """Whether a tick would do anything: a busy slot or a waiting request."""
        return bool(self._slot_of) or bool(self.waiting)

    def busy_slots(self) -> Iterator[Slot]:
        return (slot for slot in self.slots if slot.request is not None)

    def views(self) -> list[SlotView]:
        """What the strategy sees: the slots with work this tick."""
        return [slot.view() for slot in self.slots if slot.request and not slot.finish_reason]

    # --- requests in ------------------------------------------------------------------

    def can_enqueue(self) -> bool:
        """Whether one more request fits: a free slot for it, or room in the queue."""
        return len(self.waiting) < self.max_queue + self.free_slots

    def enqueue(self, request: Request) -> int:
        """Queue an accepted request; return how many requests wait ahead of it for a slot."""
        self.waiting.append(request)
        self.live[request.key] = request
        return max(0, len(self.waiting) - self.free_slots)

    def cancel(self, key: RequestKey) -> Request | None:
        """Cancel a request. A queued one is removed and returned; a running one is marked."""
        request = self.live.get(key)
        if request is None:
            return None
        slot = self._slot_of.get(key)
        if slot is not None:
            slot.finish(FinishReason.CANCELLED)
            return None
        self.waiting.remove(request)
        del self.live[key]
        return request

    def keys_of(self, gateway: bytes) -> list[RequestKey]:
        return [key for key in self.live if key[0] == gateway]

    # --- slots ------------------------------------------------------------------------

    def admit(self, tick: int, now: float) -> list[Admission]:
        """Move waiting requests into free slots, FIFO, each where most of its prompt is cached."""
        admissions = []
        while self.waiting and self.free_slots:
            request = self.waiting.popleft()
            slot, source, shared = self._placement(request.prompt)
            # At least the last prompt token is evaluated again: its logits give token one.
            reused = min(shared, len(request.prompt) - 1)
            slot.phase = SlotPhase.PREFILLING
            slot.request = request
            slot.tokens = list(request.prompt)
            slot.n_cached = reused
            slot.n_prompt = len(request.prompt)
            slot.admitted_tick = tick
            slot.finish_reason = None
            slot.finish_message = ""
            request.admitted_at = now
            request.cached_tokens = reused
            self._slot_of[request.key] = slot
            admissions.append(Admission(slot, request, reused, source if reused else None))
        return admissions

    def _placement(self, prompt: list[int]) -> tuple[Slot, Slot | None, int]:
        """The free slot for a prompt, the slot whose cache it copies (if not its own), and
        how many leading prompt tokens that cache holds.

        Prefer an idle slot that caches the longest prefix (no copy needed). When a busy
        slot caches a prefix longer by min_copy_tokens or more, take the least recently used
        idle slot and copy from it.
        """
        idle = [slot for slot in self.slots if slot.request is None]
        lru = min(idle, key=lambda slot: slot.last_used_tick)
        own, own_shared = lru, 0
        donor, donor_shared = None, 0
        for slot in self.slots:
            if not slot.n_cached:
                continue
            shared = common_prefix(slot.tokens[: slot.n_cached], prompt)
            if slot.request is None:
                if (shared, -slot.last_used_tick) > (own_shared, -own.last_used_tick):
                    own, own_shared = slot, shared
            elif shared > donor_shared:
                donor, donor_shared = slot, shared
        if donor is not None and donor_shared - own_shared >= self.min_copy_tokens:
            return lru, donor, donor_shared
        return own, None, own_shared

    def release(self, slot: Slot, tick: int, keep_cache: bool) -> Request:
        """Free a finished slot; it keeps its cached tokens for reuse only if keep_cache."""
        request = slot.request
        assert request is not None
        del self._slot_of[request.key]
        del self.live[request.key]
        slot.request = None
        slot.phase = SlotPhase.IDLE
        slot.last_used_tick = tick
        if keep_cache:
            del slot.tokens[slot.n_cached :]
        else:
            slot.tokens = []
            slot.n_cached = 0
        return request

    def finished_slots(self) -> list[Slot]:
        return [slot for slot in self.slots if slot.request and slot.finish_reason]
