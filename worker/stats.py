"""What other threads may know of the tick loop: one frozen SchedulerStats per tick (as vLLM v1's
SchedulerStats), and the record of each tick and each finished request. Plain values.

The loop's thread builds them (sched/records.py) and hands them over whole; the IO thread reads
the latest SchedulerStats for heartbeats and /slots, the metrics' scrape thread for the gauges.
Neither touches the scheduler's live slots, queue or caches, nor imports them (a contract in
pyproject.toml checks that).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..protocol import Finish, Load, SlotState, TenantQueue
from ..protocol.messages import DEFAULT_TENANT

IDLE = "idle"  # an idle slot's state (strategies.SlotPhase.IDLE)


class SlotSnapshot(NamedTuple):
    """One busy slot as a tick left it: counts and times, copied out of the live Slot and
    Request so that the IO thread can report it (SlotsReport) while the loop goes on.

    A NamedTuple, immutable like a frozen dataclass but built several times faster: the loop
    copies every busy slot on every tick.
    """

    slot: int  # its index (not `index`: a tuple has that method)
    phase: str  # strategies.SlotPhase's value
    request_id: str
    gateway: bytes
    tenant: str
    priority: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int  # prompt tokens this request evaluated, besides the cached ones
    generated_tokens: int
    arrived_at: float  # time.monotonic(), as Request
    first_token_at: float  # 0.0 before the first token

    def state(self, now: float) -> SlotState:
        """Its wire form at time.monotonic() `now`: ages and rates from the copied times."""
        rate = 0.0
        if self.first_token_at and self.generated_tokens > 1 and now > self.first_token_at:
            # The first token came with the prompt's evaluation: the rate counts those after it.
            rate = (self.generated_tokens - 1) / (now - self.first_token_at)
        return SlotState(
            index=self.slot,
            state=self.phase,
            request_id=self.request_id,
            gateway=self.gateway.decode(errors="replace"),
            tenant=self.tenant,
            priority=self.priority,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            computed_tokens=self.computed_tokens,
            generated_tokens=self.generated_tokens,
            age_seconds=max(0.0, now - self.arrived_at),
            tokens_per_second=rate,
        )


@dataclass(frozen=True, slots=True)
class TickCost:
    """The tick-cost model's coefficients, in seconds (sched/tick_cost.py fits them)."""

    base: float = 0.0
    per_decode_token: float = 0.0
    per_prefill_token: float = 0.0


@dataclass(frozen=True, slots=True)
class RamCacheUsage:
    """The RAM prompt cache's counters since start-up and its size (cache/ram_cache.py)."""

    hits: int = 0  # admissions that restored an entry
    restored_tokens: int = 0  # prompt tokens those restores spared from evaluation
    saves: int = 0  # entries stored
    evictions: int = 0  # entries dropped to make room
    used_bytes: int = 0
    capacity_bytes: int = 0
    entries: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """The scheduler after the loop's latest tick: its load, its busy slots, and the counters
    the metrics report. The loop replaces it whole each tick; nobody changes one."""

    load: Load  # what heartbeats carry as it is
    tenants: dict[str, tuple[int, int]] = field(default_factory=dict)  # (running, waiting)
    prefixes: tuple[int, ...] = ()  # keys of the cached prompts, for routing (prefix_cache.py)
    kv_cells_used: int = 0  # KV cells holding tokens, running and reusable
    n_slots: int = 0
    busy: tuple[SlotSnapshot, ...] = ()  # the busy slots, by index; the others are idle
    preemptions: int = 0  # since start-up
    swap_used_bytes: int = 0  # host memory holding preempted requests' KV
    prefill_cap: int | None = None  # the latency target's latest cap on prompt tokens, if any
    tick_cost: TickCost = TickCost()
    ram_cache: RamCacheUsage = RamCacheUsage()

    def slot_states(self, now: float) -> list[SlotState]:
        """Every slot's wire form, idle ones included, in index order."""
        busy = {snapshot.slot: snapshot for snapshot in self.busy}
        return [
            busy[index].state(now) if index in busy else SlotState(index, IDLE)
            for index in range(self.n_slots)
        ]

    def tenant_queues(self) -> list[TenantQueue]:
        return [TenantQueue(name, *counts) for name, counts in sorted(self.tenants.items())]


@dataclass(frozen=True, slots=True)
class MediaRecord:
    """Images the loop took in: a Generate's images encoded (on the encoder's thread), or a
    tick's image rows (in embedding-only llama_decode calls, or in its token pass), for the
    metrics."""

    images: int = 0  # images of one Generate, encoded or from the encoded cache
    cached_images: int = 0  # of those, found in the encoded cache
    image_tokens: int = 0  # the positions they take in its prompt
    encode_seconds: float = 0.0
    passes: int = 0  # images whose last rows went in the cache this tick
    pass_seconds: float = 0.0  # of passes of images' rows alone (the streams wait for them)
    shared_rows: int = 0  # image rows that went in the tick's token pass, beside its tokens


@dataclass(frozen=True, slots=True)
class TickRecord:
    """What one tick did: for the tick log line and the metrics."""

    tick: int
    decode_tokens: int  # one per generating slot in the batch
    prefill_tokens: int  # prompt tokens evaluated
    pad_tokens: int  # tokens that only join slots into fewer passes (ubatches.py)
    ubatches: int  # forward passes llama.cpp makes of the batch
    sampled_tokens: int  # new tokens produced
    budget: int  # the batch's token budget
    slots_active: int
    queue_depth: int
    seconds: float
    drafts: int = 0  # slots that verified drafted tokens (speculation)
    draft_tokens: int = 0  # drafted tokens verified
    accepted_tokens: int = 0  # of those, the ones the samplers agreed with
    accepted_per_position: tuple[int, ...] = ()  # accepted drafts by position in the draft
    filler_tokens: int = 0  # tokens only there to keep drafts in one pass


@dataclass(frozen=True, slots=True)
class FinishRecord:
    """One finished request with its timings: for its log line and the metrics."""

    finish: Finish
    ttft_seconds: float | None  # None when no token was produced
    decode_seconds: float  # from the first token to the finish
    priority: int = 0
    tenant: str = DEFAULT_TENANT
    preemptions: int = 0  # times it gave its slot to a request of better priority
