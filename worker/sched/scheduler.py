"""Slots and the waiting queue: the whole life of a request, from its queue to its Finish.

Plain Python over a deque and a list of slots, like nano-vllm's scheduler: no llama.cpp and
no ZeroMQ here, so it is tested without a model. The scheduler owns every state change of a
slot, in the order a tick makes them: admit waiting requests, plan the batch's runs of tokens
(the strategy splits the budget; shaping.py makes the runs), advance the slots after the
forward pass, record each sampled token (deciding EOS, max_tokens and the context limit) and
put its chunk in the tick's PendingOutputs, and release the requests that ended. The loop
does the engine work each decision implies; the decisions that touch the engine come back as
values (Admission, Release; slots.py holds these types) so that it stays explicit.

Who waits and who runs is decided here with the waiting queue (queueing.py: fcfs or priority
order, tenants' weighted round-robin and caps) and, under the priority policy, preemption
(preemption.py): a waiting request that outranks a running one takes its slot, and the
running one goes back to the queue to resume later where it stopped. Where an admitted
request sits, and whose cache it starts from, is admission.py's (prefix reuse, like
llama-server's cache_prompt: a slot that finishes normally keeps its cache).
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog

from ...protocol import ErrorCode, FinishReason, Outputs, TokenChunk
from ..cache.ram_cache import RamCache, SavedState
from ..io.channels import Sink
from .admission import Seating
from .media import MediaSpan, media_at
from .preemption import SwapSpace, victim_slot
from .queueing import Policy, WaitingQueue
from .shaping import add_drafts, shape, ubatches_with_filler
from .slots import (
    KEEPS_CACHE,
    Admission,
    Preemption,
    Release,
    Request,
    RequestKey,
    Sampled,
    Slot,
    Step,
    set_phase,
)
from .strategies import (
    BatchPlan,
    BatchStrategy,
    CheckedPlans,
    DecodeMaximal,
    SlotPhase,
    SlotView,
)
from .tick_cost import LatencyTarget
from .ubatches import SplitRules

log = structlog.get_logger(__name__)


class Scheduler:
    """Slots plus a bounded queue of requests waiting for one, and each request's life in them.

    The queue (queueing.py) is per-tenant priority heaps: arrival order under fcfs.
    """

    def __init__(
        self,
        n_slots: int,
        max_queue: int,
        slot_context: int,
        min_copy_tokens: int = 1,
        strategy: BatchStrategy | None = None,
        split_rules: SplitRules | None = None,
        waiting: WaitingQueue[Request] | None = None,
        swap_bytes: int = 0,
        latency: LatencyTarget | None = None,
        ram_cache_bytes: int = 0,
    ) -> None:
        self.slots = [Slot(index) for index in range(n_slots)]
        self.split_rules = split_rules or SplitRules()
        self.max_queue = max_queue
        self.slot_context = slot_context
        self.strategy: BatchStrategy = strategy or DecodeMaximal()
        self.waiting: WaitingQueue[Request] = waiting if waiting is not None else WaitingQueue()
        self.swap = SwapSpace(swap_bytes)
        self.ram = RamCache(ram_cache_bytes)  # slots' caches kept after their slots were taken
        self._seating = Seating(self.slots, self.split_rules, min_copy_tokens, self.ram)
        self.latency = latency  # the --itl-target-ms cap on prompt tokens per tick
        self.preemptions = 0
        self.live: dict[RequestKey, Request] = {}  # every accepted, unfinished request
        self._slot_of: dict[RequestKey, Slot] = {}
        # Left the queue, with why the worker cancelled them; released next.
        self._cancelled_waiting: list[tuple[Request, str, FinishReason]] = []
        self._plans = CheckedPlans()  # the strategy's plans, checked, with a fallback
        self._budget = 0  # the latest schedule()'s token budget

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
        """Whether a tick would do anything: a busy slot, a waiting or an unreleased request."""
        return bool(self._slot_of) or bool(self.waiting) or bool(self._cancelled_waiting)

    def views(self) -> list[SlotView]:
        """What the strategy sees: the slots with token work this tick (not one whose next
        positions are an image's that waits for its pass: media_due)."""
        return [
            view
            for slot in self.slots
            if slot.request and not slot.finish_reason
            for view in (slot.view(),)
            if view.phase is not SlotPhase.PREFILLING or view.prompt_remaining
        ]

    # --- requests in and out ----------------------------------------------------------

    def can_enqueue(self) -> bool:
        """Whether one more request fits: a free slot for it, or room in the queue."""
        return len(self.waiting) < self.max_queue + self.free_slots

    def enqueue(self, request: Request) -> int:
        """Queue an accepted request; return how many requests wait ahead of it for a slot."""
        self.waiting.push(request)
        self.live[request.key] = request
        return max(0, len(self.waiting) - self.free_slots)

    def cancel(
        self, key: RequestKey, message: str = "", reason: FinishReason = FinishReason.CANCELLED
    ) -> bool:
        """Cancel a live request, queued or running; False when there is none by that key.

        Either way its Finish comes from the next release_finished. A message says why the
        worker cancelled it on its own (the gateway asked: none), so that the gateway can tell
        its client the request did not simply end. reason is the finish to record: the
        gateway's, which is STOP when it ended the reply on a stop string.
        """
        request = self.live.get(key)
        if request is None:
            return False
        slot = self._slot_of.get(key)
        if slot is not None:
            slot.finish(reason, message)
        else:
            self.waiting.remove(request)
            del self.live[key]
            self.swap.drop(request)
            self._cancelled_waiting.append((request, message, reason))
        return True

    def cancel_all(self, message: str = "") -> None:
        for key in list(self.live):
            self.cancel(key, message)

    def keys_of(self, gateway: bytes) -> list[RequestKey]:
        return [key for key in self.live if key[0] == gateway]

    # --- admit ------------------------------------------------------------------------

    def admit(self, tick: int, now: float) -> list[Admission]:
        """Move waiting requests into free slots in the queue's order, each where most of its
        sequence is cached; under the priority policy, into a lower-priority request's slot."""
        admissions: list[Admission] = []
        while self.waiting:
            request = self.waiting.peek()
            if request is None:  # every waiting tenant is at its cap
                break
            preempted = None
            # A slot that an admission of this tick copies from keeps its cells until the
            # copy is made (at the next decode): it is no victim and no target this tick.
            sources = frozenset(a.source.index for a in admissions if a.source is not None)
            if not self.free_slots:
                preempted = self._preempt_for(request, tick, sources)
                if preempted is None:
                    break
            elif not self._seating.has_room(sources):
                break
            self.waiting.pop()
            admission = self._seating.seat(request, tick, now, sources)
            if admission.restore is not None:
                self.swap.drop(request)
            self._slot_of[request.key] = admission.slot
            self.waiting.started(request.tenant)
            admission.preempted = preempted
            admissions.append(admission)
        return admissions

    def prefix_lost(self, admission: Admission) -> None:
        """The engine could not keep (or restore) the admitted slot's cells: its whole
        sequence is evaluated."""
        slot = admission.slot
        slot.n_in_cache = 0
        if admission.request.resume_tokens is None:
            admission.request.cached_tokens = 0
        set_phase(slot)

    # --- preemption ---------------------------------------------------------------------

    def _preempt_for(
        self, request: Request, tick: int, spared: frozenset[int]
    ) -> Preemption | None:
        """Free a slot for `request` by preempting a running request it outranks, if any."""
        if self.waiting.policy is not Policy.PRIORITY:
            return None
        slot = victim_slot(self._slot_of.values(), request, spared)
        if slot is None:
            return None
        victim = slot.occupant
        preemption = Preemption(slot, victim, slot.n_in_cache)
        victim.resume_tokens = list(slot.tokens)
        victim.preemptions += 1
        self.preemptions += 1
        log.debug(
            "preempted",
            request_id=victim.request_id,
            priority=victim.priority,
            by=request.request_id,
            generated=victim.completion_tokens,
        )
        # Its cells stay with the slot, like a finished request's, until the loop saved them.
        self._vacate(slot, tick, keep_cache=True)
        self.waiting.push(victim)
        return preemption

    def swap_out(self, preemption: Preemption, state: SavedState, n_bytes: int) -> None:
        """The loop saved a preempted request's cells; it resumes from them."""
        self.swap.hold(preemption.request, state, preemption.n_cached, n_bytes)

    # --- plan the batch -----------------------------------------------------------------

    def schedule(self, budget: int, chunk_size: int) -> Step:
        """This tick's runs: the strategy splits the budget; the runs go in slot order."""
        self._budget = budget
        views = self.views()
        if not views:
            return Step(BatchPlan())
        limit = self.latency.limit if self.latency is not None else None
        plan = self._plans.plan(self.strategy, views, budget, chunk_size, self.queue_depth, limit)
        return shape(plan, self.slots, budget, self.split_rules)

    def ubatches_with_filler(self, step: Step, length: int) -> int:
        """The passes the step would take with `length` more tokens on every decode and
        padding run (shaping.py)."""
        return ubatches_with_filler(step, length, self._budget, self.split_rules)

    def add_drafts(self, step: Step, drafts: dict[int, list[int]], length: int) -> None:
        """Put the drafted tokens after each generating slot's last token (shaping.py)."""
        add_drafts(step, drafts, length, self._budget, self.split_rules)

    # --- images: their embeddings' passes, before the tick's ----------------------------

    def media_due(self) -> list[tuple[Slot, MediaSpan]]:
        """The prefilling slots whose next positions are an image's, with that image, oldest
        admission first: the loop puts embeddings in the cache before the strategy plans the
        token runs (all of them, or with a latency target one image a tick while streams
        generate, and of a causal image the rows the target leaves room for; the others
        wait for theirs, out of the plan)."""
        due = []
        for slot in self.slots:
            if slot.request is None or slot.finish_reason or slot.phase is not SlotPhase.PREFILLING:
                continue
            span = media_at(slot.request.media, slot.n_in_cache)
            if span is not None and not span.in_token_pass:
                due.append((slot, span))
        return sorted(due, key=lambda item: (item[0].admitted_tick, item[0].index))

    def generating(self) -> bool:
        """Whether a slot is generating: its stream waits for every pass of the tick."""
        return self.n_generating() > 0

    def n_generating(self) -> int:
        return sum(slot.phase is SlotPhase.GENERATING and bool(slot.request) for slot in self.slots)

    def media_rows_cap(self) -> int | None:
        """The image rows a tick's pass may take beside the generating streams to keep to
        the latency target (as many as its prompt tokens); None: no cap (no target, no
        stream generating, or the tick cost not learned yet)."""
        generating = self.n_generating()
        if self.latency is None or not generating:
            return None
        return self.latency.prefill_cap(generating)

    def media_decoded(self, slot: Slot, span: MediaSpan) -> None:
        """The image's remaining embeddings are in the slot's cells."""
        slot.n_in_cache = span.end

    def media_failed(self, slot: Slot, message: str) -> None:
        """An image's pass failed: its request ends with an error."""
        slot.finish(FinishReason.ERROR, message)

    def media_progressed(self, slot: Slot, rows: int) -> None:
        """A pass put the next `rows` of the slot's image in its cells, not all of them: the
        rest go in the next ticks (a causal image under a latency target)."""
        slot.n_in_cache += rows

    # --- after the forward pass ---------------------------------------------------------

    def advance(self, step: Step) -> None:
        """The forward pass put every run's tokens in the cache."""
        for run in step.runs:
            if not run.pad:
                # Drafted tokens join the cache as the sampler agrees with them (update).
                run.slot.n_in_cache += len(run.tokens) - run.draft - run.filler

    def fail(self, step: Step, message: str) -> None:
        """The forward pass failed: every request in it ends with an error."""
        for run in step.runs:
            if not run.pad:
                run.slot.finish(FinishReason.ERROR, message)

    def fail_running(self, message: str) -> None:
        """Every running request ends with an error (its state may be half-updated)."""
        for slot in self.slots:
            if slot.request is not None:
                slot.finish(FinishReason.ERROR, message)

    def room(self, slot: Slot) -> int:
        """Tokens the slot's request may still generate (max_tokens, the slot's context)."""
        request = slot.occupant
        left = request.params.max_tokens - request.completion_tokens
        return max(0, min(left, self.slot_context - len(slot.tokens)))

    def update(self, sampled: Sequence[Sampled], now: float, outputs: PendingOutputs) -> None:
        """Apply what the samplers gave after a forward pass, the one place sampled tokens
        change a slot: record each slot's tokens until its request ends, keep the cells of
        the drafts it agreed with, end the requests that must end, and put each token's
        chunk in its gateway's Outputs."""
        for entry in sampled:
            slot = entry.slot
            request = slot.occupant
            if entry.failure is not None:
                # Its own grammar failed it: a bad request, not the engine's fault.
                slot.finish(FinishReason.ERROR, entry.failure, ErrorCode.INVALID_REQUEST.value)
                continue
            if entry.grammar_complete:  # the token ends it: before max_tokens can
                slot.finish(FinishReason.STOP)
            recorded = 0
            for position, token in enumerate(entry.tokens):
                chunk = self.record_token(slot, token, entry.end_of_generation[position], now)
                recorded += 1
                if chunk is not None:
                    if entry.logprobs is not None:
                        chunk.logprobs = [entry.logprobs[position]]
                    outputs.to(request.gateway).tokens.append(chunk)
                if slot.finish_reason is not None:
                    break
            # Every recorded token but the last was a draft whose cell now holds; the loop
            # drops the cells of the rest of the run.
            slot.n_in_cache += recorded - 1

    def record_token(
        self, slot: Slot, token: int, end_of_generation: bool, now: float
    ) -> TokenChunk | None:
        """Append a sampled token and end the request if it must; return the chunk to send.

        An end-of-generation token (unless the request ignores EOS) is counted but not sent:
        it is not text. max_tokens and the slot's context end a request after its token.
        """
        request = slot.occupant
        request.completion_tokens += 1
        if not request.first_token_at:
            request.first_token_at = now
        slot.phase = SlotPhase.GENERATING
        slot.tokens.append(token)
        params = request.params
        if end_of_generation and not params.ignore_eos:
            slot.finish(FinishReason.STOP)
            return None
        if request.completion_tokens >= params.max_tokens or len(slot.tokens) >= self.slot_context:
            slot.finish(FinishReason.LENGTH)
        return TokenChunk(request.request_id, [token], seq=request.completion_tokens - 1)

    # --- release ------------------------------------------------------------------------

    def release_finished(self, tick: int, now: float) -> list[Release]:
        """Free every request that ended: cancelled in the queue first, then finished slots.

        A slot that finished normally keeps its evaluated tokens for prefix reuse; any other
        end drops its cells (Release.drop_sequence).
        """
        releases = [
            Release(request, request.finished(reason, message, now), None)
            for request, message, reason in self._cancelled_waiting
        ]
        self._cancelled_waiting.clear()
        for slot in self.slots:
            request, reason = slot.request, slot.finish_reason
            if request is None or reason is None:
                continue
            keep = reason in KEEPS_CACHE
            finish = request.finished(reason, slot.finish_message, now, slot.finish_code)
            self._vacate(slot, tick, keep)
            del self.live[request.key]
            releases.append(Release(request, finish, None if keep else slot.index))
        return releases

    def _vacate(self, slot: Slot, tick: int, keep_cache: bool) -> None:
        """Free a slot of its request (which leaves, or waits again if preempted)."""
        request = slot.occupant
        del self._slot_of[request.key]
        self.waiting.stopped(request.tenant)
        slot.request = None
        slot.phase = SlotPhase.IDLE
        slot.last_used_tick = tick
        if keep_cache:
            del slot.tokens[slot.n_in_cache :]
        else:
            slot.tokens = []
            slot.n_in_cache = 0


class PendingOutputs:
    """This tick's Outputs, by gateway, sent together at its end: the update puts each token's
    chunk here, the loop each finish, prompt scoring its logprobs (vLLM's scheduler likewise
    returns one EngineCoreOutputs per client from its update)."""

    def __init__(self) -> None:
        self._by_gateway: dict[bytes, Outputs] = {}

    def to(self, gateway: bytes) -> Outputs:
        outputs = self._by_gateway.get(gateway)
        if outputs is None:
            outputs = self._by_gateway[gateway] = Outputs(tokens=[], finishes=[])
        return outputs

    def send(self, sink: Sink) -> None:
        """Send every gateway its Outputs, if any, and start over."""
        if self._by_gateway:
            for gateway, outputs in self._by_gateway.items():
                sink.send(gateway, outputs)
            self._by_gateway = {}
            sink.flush()
