"""What the loop tells about its ticks and finished requests: the records the metrics read,
and the `tick` and `request finished` log lines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from loomserve.protocol import Finish
from loomserve.worker.sched.queueing import DEFAULT_TENANT
from loomserve.worker.sched.scheduler import Scheduler
from loomserve.worker.sched.slots import Release, Step

log = structlog.get_logger("loomserve.worker.tick.loop")  # the logger these lines always had


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
