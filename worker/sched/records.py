"""What the loop tells other threads and the log, built on the loop's thread: the SchedulerStats
it publishes after each tick, the records of its ticks and finished requests that the metrics
read (their types in stats.py), and the `tick` and `request finished` log lines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from ...protocol import Load
from ..stats import (
    FinishRecord,
    RamCacheUsage,
    SchedulerStats,
    SlotSnapshot,
    TickCost,
    TickRecord,
)
from .scheduler import Scheduler
from .slots import Release, Slot, Step

log = structlog.get_logger("loomserve.worker.tick.loop")  # the logger these lines always had


@dataclass(slots=True)
class SpecCounts:
    """One tick's drafted and accepted tokens, for its TickRecord."""

    drafts: int = 0
    drafted: int = 0
    accepted: int = 0
    per_position: list[int] = field(default_factory=list)

    def add(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.drafted += drafted
        self.accepted += accepted
        if accepted > len(self.per_position):
            self.per_position.extend([0] * (accepted - len(self.per_position)))
        for position in range(accepted):
            self.per_position[position] += 1


def scheduler_stats(
    scheduler: Scheduler, tick_cost: TickCost, prefixes: tuple[int, ...]
) -> SchedulerStats:
    """The scheduler now, copied for other threads (the loop's call, after each tick)."""
    ram = scheduler.ram
    latency = scheduler.latency
    return SchedulerStats(
        load=Load(scheduler.queue_depth, scheduler.free_slots, scheduler.running),
        tenants=scheduler.waiting.counts(),
        prefixes=prefixes,
        kv_cells_used=sum(slot.n_in_cache for slot in scheduler.slots),
        n_slots=len(scheduler.slots),
        # Only the busy slots are copied: an idle one has nothing to say but its index.
        busy=tuple(slot_snapshot(slot) for slot in scheduler.slots if slot.request is not None),
        preemptions=scheduler.preemptions,
        swap_used_bytes=scheduler.swap.used,
        prefill_cap=latency.latest_cap if latency is not None else None,
        tick_cost=tick_cost,
        ram_cache=RamCacheUsage(
            ram.stats.hits,
            ram.stats.restored_tokens,
            ram.stats.saves,
            ram.stats.evictions,
            ram.used,
            ram.capacity,
            len(ram),
        ),
    )


def slot_snapshot(slot: Slot) -> SlotSnapshot:
    """A busy slot's copy (plain attribute reads: this runs per busy slot per tick)."""
    request = slot.occupant
    gateway, request_id = request.key
    prompt = len(request.prompt)
    return SlotSnapshot(
        slot.index,
        slot.phase.value,
        request_id,
        gateway,
        request.tenant,
        request.priority,
        prompt,
        request.cached_tokens,
        max(0, min(slot.n_in_cache, prompt) - request.cached_tokens),
        request.completion_tokens,
        request.arrived_at,
        request.first_token_at,
    )


def tick_record(
    tick: int,
    step: Step,
    n_sampled: int,
    budget: int,
    scheduler: Scheduler,
    seconds: float,
    counts: SpecCounts,
) -> TickRecord:
    plan = step.plan
    return TickRecord(
        tick=tick,
        decode_tokens=len(plan.decode),
        prefill_tokens=plan.n_tokens - len(plan.decode),
        pad_tokens=step.n_pad,
        ubatches=step.ubatches,
        sampled_tokens=n_sampled,
        budget=budget,
        slots_active=scheduler.running,
        queue_depth=scheduler.queue_depth,
        seconds=seconds,
        drafts=counts.drafts,
        draft_tokens=counts.drafted,
        accepted_tokens=counts.accepted,
        accepted_per_position=tuple(counts.per_position),
        filler_tokens=step.n_extra - counts.drafted,
    )


def finish_record(release: Release, now: float) -> FinishRecord:
    request, first = release.request, release.request.first_token_at
    return FinishRecord(
        finish=release.finish,
        ttft_seconds=first - request.arrived_at if first else None,
        decode_seconds=now - first if first else 0.0,
        priority=request.priority,
        tenant=request.tenant,
        preemptions=request.preemptions,
    )


def log_tick(record: TickRecord, batch_tokens: int) -> None:
    log.info(
        "tick",
        tick=record.tick,
        batch_tokens=batch_tokens,
        decode_tokens=record.decode_tokens,
        prefill_tokens=record.prefill_tokens,
        pad_tokens=record.pad_tokens,
        draft_tokens=record.draft_tokens or None,
        accepted_tokens=record.accepted_tokens if record.draft_tokens else None,
        ubatches=record.ubatches,
        slots_active=record.slots_active,
        queue_depth=record.queue_depth,
        tick_ms=round(record.seconds * 1000, 3),
    )


def log_finish(record: FinishRecord) -> None:
    finish = record.finish
    decoded = finish.completion_tokens - 1
    log.info(
        "request finished",
        request_id=finish.request_id,
        reason=finish.reason,
        prompt_tokens=finish.prompt_tokens,
        completion_tokens=finish.completion_tokens,
        cached_tokens=finish.cached_tokens,
        priority=record.priority,
        tenant=record.tenant,
        preemptions=record.preemptions or None,
        queue_ms=round(finish.queue_seconds * 1000, 3),
        ttft_ms=None if record.ttft_seconds is None else round(record.ttft_seconds * 1000, 3),
        tokens_per_second=(
            round(decoded / record.decode_seconds, 2)
            if decoded > 0 and record.decode_seconds > 0
            else None
        ),
        message=finish.message or None,
    )
