"""Slots and the waiting queue: the whole life of a request, from its queue to its Finish.

Plain Python over a deque and a list of slots, like nano-vllm's scheduler: no llama.cpp and
no ZeroMQ here, so it is tested without a model. The scheduler owns every state change of a
slot, in the order a tick makes them: admit waiting requests, plan the batch's runs of tokens
(the strategy splits the budget), advance the slots after the forward pass, record each
sampled token (deciding EOS, max_tokens and the context limit), and release the requests that
ended. The loop does the engine work each decision implies; the decisions that touch the
engine come back as values (Admission, Release; slots.py holds these types) so that it
stays explicit.

Who waits and who runs is decided with two helpers: the waiting queue (queueing.py: fcfs or
priority order, tenants' weighted round-robin and caps) and, under the priority policy,
preemption (preemption.py): a waiting request that outranks a running one takes its slot, and
the running one goes back to the queue to resume later where it stopped.

A slot that finishes normally keeps its cache (slots.py), so a later prompt with the same
beginning skips those tokens (prefix reuse, like llama-server's cache_prompt); prefix_cache.py
decides where a request goes and whose cache it starts from.
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog

from loomserve.protocol import ErrorCode, FinishReason, TokenChunk
from loomserve.worker.cache.prefix_cache import can_place, place
from loomserve.worker.cache.ram_cache import RamCache, SavedState
from loomserve.worker.sched.preemption import SwapSpace, victim_slot
from loomserve.worker.sched.queueing import Policy, WaitingQueue
from loomserve.worker.sched.shaping import add_drafts, shape, ubatches_with_filler
from loomserve.worker.sched.slots import (
    KEEPS_CACHE,
    Admission,
    Preemption,
    Release,
    Request,
    RequestKey,
    Run,
    Sampled,
    Slot,
    Step,
    set_phase,
)
from loomserve.worker.sched.strategies import (
    BatchPlan,
    BatchStrategy,
    CheckedPlans,
    DecodeMaximal,
    SlotPhase,
    SlotView,
)
from loomserve.worker.sched.tick_cost import LatencyTarget
from loomserve.worker.sched.ubatches import SplitRules

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
        # A busy slot's prefix is copied only when it saves at least this many tokens.
        self.min_copy_tokens = min_copy_tokens
        self.strategy: BatchStrategy = strategy or DecodeMaximal()
        self.waiting: WaitingQueue[Request] = waiting if waiting is not None else WaitingQueue()
        self.swap = SwapSpace(swap_bytes)
        self.ram = RamCache(ram_cache_bytes)  # slots' caches kept after their slots were taken
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
        """What the strategy sees: the slots with work this tick."""
        return [slot.view() for slot in self.slots if slot.request and not slot.finish_reason]

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
            self._drop_saved_state(request)
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
            elif not can_place(self.slots, sources):
                break
            self.waiting.pop()
            admission = self._place(request, tick, now, sources)
            admission.preempted = preempted
            admissions.append(admission)
        return admissions

    def _place(
        self, request: Request, tick: int, now: float, reserved: frozenset[int]
    ) -> Admission:
        tokens = request.resume_tokens or request.prompt
        # A cached prefix has no logits to score its tokens with: a request that scores
        # its prompt evaluates it all, in the least recently used slot.
        scores = request.params.prompt_logprobs is not None
        placement = place(
            self.slots,
            [] if scores else tokens,
            per_slot_streams=self.split_rules.per_slot_streams,
            min_copy_tokens=self.min_copy_tokens,
            ram=self.ram,
            reserved=reserved,
            chunk=self.split_rules.prompt_chunk,
        )
        slot, reused = self.slots[placement.target], placement.reused
        source = None if placement.source is None else self.slots[placement.source]
        ram_entry = placement.ram
        restore = request.saved_state
        if restore is not None:  # swapped out: its own saved cells, not a shared prefix
            reused, source, ram_entry = request.saved_tokens, None, None
            self._drop_saved_state(request)
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
        self._slot_of[request.key] = slot
        self.waiting.started(request.tenant)
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
        request = preemption.request
        request.saved_state = state
        request.saved_tokens = preemption.n_cached
        request.saved_bytes = n_bytes
        self.swap.take(n_bytes)

    def _drop_saved_state(self, request: Request) -> None:
        if request.saved_state is not None:
            self.swap.give_back(request.saved_bytes)
            request.saved_state = None
            request.saved_bytes = 0

    # --- plan the batch -----------------------------------------------------------------

    def schedule(self, budget: int, chunk_size: int) -> Step:
        """This tick's runs: the strategy splits the budget; the runs go in slot order."""
        self._budget = budget
        views = self.views()
        if not views:
            return Step(BatchPlan())
        limit = self.latency.limit if self.latency is not None else None
        plan = self._plans.plan(self.strategy, views, budget, chunk_size, self.queue_depth, limit)
        slots = self.slots
        runs = []
        for index in plan.decode:
            slot = slots[index]
            runs.append(Run(slot, slot.tokens[-1:], slot.n_in_cache, True))
        for index, n_tokens in plan.prefill.items():
            slot = slots[index]
            start, end = slot.n_in_cache, slot.n_in_cache + n_tokens
            # Logits only where a token is sampled (the last prompt token), unless the
            # request scores its prompt.
            score = slot.occupant.params.prompt_logprobs is not None
            runs.append(Run(slot, slot.tokens[start:end], start, end == slot.n_prompt, score))
        return shape(Step(plan, runs), budget, self.split_rules, self.slots)

    def ubatches_with_filler(self, step: Step, length: int) -> int:
        """The passes the step would take with `length` more tokens on every decode and
        padding run (shaping.py)."""
        return ubatches_with_filler(step, length, self._budget, self.split_rules)

    def add_drafts(self, step: Step, drafts: dict[int, list[int]], length: int) -> None:
        """Put the drafted tokens after each generating slot's last token (shaping.py)."""
        add_drafts(step, drafts, length, self._budget, self.split_rules)

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

    def update(self, sampled: Sequence[Sampled], now: float) -> list[tuple[bytes, TokenChunk]]:
        """Apply what the samplers gave after a forward pass, the one place sampled tokens
        change a slot: record each slot's tokens until its request ends, keep the cells of
        the drafts it agreed with, end the requests that must end. Return the chunks to send,
        with their gateways."""
        chunks: list[tuple[bytes, TokenChunk]] = []
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
                    chunks.append((request.gateway, chunk))
                if slot.finish_reason is not None:
                    break
            # Every recorded token but the last was a draft whose cell now holds; the loop
            # drops the cells of the rest of the run.
            slot.n_in_cache += recorded - 1
        return chunks

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
