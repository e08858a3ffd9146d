"""Slots and the waiting queue: the whole life of a request, from its queue to its Finish.

Plain Python over a deque and a list of slots, like nano-vllm's scheduler: no llama.cpp and
no ZeroMQ here, so it is tested without a model. The scheduler owns every state change of a
slot, in the order a tick makes them: admit waiting requests, plan the batch's runs of tokens
(the strategy splits the budget), advance the slots after the forward pass, record each
sampled token (deciding EOS, max_tokens and the context limit), and release the requests that
ended. The loop does the engine work each decision implies; the decisions that touch the
engine come back as values (Admission, Release) so that it stays explicit.

Who waits and who runs is decided with two helpers: the waiting queue (queueing.py: fcfs or
priority order, tenants' weighted round-robin and caps) and, under the priority policy,
preemption (preemption.py): a waiting request that outranks a running one takes its slot, and
the running one goes back to the queue to resume later where it stopped.

A slot's sequence is `tokens` (prompt, then generated tokens); its first `n_in_cache` tokens
have their keys and values in the cache at positions 0..n_in_cache-1. A slot that finishes
normally keeps that cache, so a later prompt with the same beginning skips those tokens
(prefix reuse, like llama-server's cache_prompt); prefix_cache.py decides where a request
goes and whose cache it starts from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from loomserve.protocol import Finish, FinishReason, SamplingParams, TokenChunk
from loomserve.worker.preemption import SwapSpace, choose_victim
from loomserve.worker.prefix_cache import can_place, place
from loomserve.worker.queueing import DEFAULT_TENANT, Policy, WaitingQueue
from loomserve.worker.ram_cache import RamCache, RamEntry
from loomserve.worker.strategies import (
    BatchPlan,
    BatchStrategy,
    DecodeMaximal,
    SlotPhase,
    SlotView,
    check_plan,
    limit_prefill,
)
from loomserve.worker.tick_cost import LatencyTarget
from loomserve.worker.ubatches import SplitRules, count_ubatches, gaps_to_bridge

log = structlog.get_logger(__name__)

RequestKey = tuple[bytes, str]  # (gateway identity, request id): ids are unique per gateway

KEEPS_CACHE = (FinishReason.STOP, FinishReason.LENGTH)  # the slot's KV is sound for reuse


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
    cached_tokens: int = 0  # prompt tokens whose KV was reused (Finish.cached_tokens, usage)
    completion_tokens: int = 0
    priority: int = 0  # lower is served first under the priority policy
    tenant: str = DEFAULT_TENANT
    order: int = -1  # arrival order in the waiting queue, set when first queued
    # After a preemption: the sequence to resume (prompt, then the tokens generated so far),
    # and its KV state saved in host memory (opaque to the scheduler) when it was swapped out.
    resume_tokens: list[int] | None = None
    saved_state: object = None
    saved_tokens: int = 0  # the tokens the saved state holds
    saved_bytes: int = 0
    preemptions: int = 0

    @property
    def request_id(self) -> str:
        return self.key[1]

    @property
    def gateway(self) -> bytes:
        return self.key[0]


@dataclass(slots=True)
class Slot:
    """One sequence of the shared KV cache; seq_id in llama.cpp is the slot's index."""

    index: int
    phase: SlotPhase = SlotPhase.IDLE
    request: Request | None = None
    tokens: list[int] = field(default_factory=list)
    n_in_cache: int = 0  # tokens[:n_in_cache] have their KV in the cache
    n_prompt: int = 0
    admitted_tick: int = 0
    last_used_tick: int = -1  # idle slots are reused least recently used first
    finish_reason: FinishReason | None = None  # set when the request ends; released next
    finish_message: str = ""

    @property
    def prompt_remaining(self) -> int:
        return self.n_prompt - self.n_in_cache if self.phase is SlotPhase.PREFILLING else 0

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
        """Mark the request over (the first reason wins); release_finished frees the slot."""
        if self.finish_reason is None:
            self.finish_reason = reason
            self.finish_message = message


@dataclass(slots=True)
class Preemption:
    """A running request that gave its slot to a waiting one of better priority.

    The slot keeps the victim's cells for now. The loop may save them (swap_out) before the
    slot's next request uses it; otherwise the request recomputes them when it resumes.
    """

    slot: Slot
    request: Request
    n_cached: int  # the tokens the slot's cells hold for the request


@dataclass(slots=True)
class Admission:
    """A queued request placed in a slot, reusing the first `reused` tokens of a cache.

    The cache is the slot's own when `source` is None: the engine keeps that sequence's first
    `reused` cells and drops the rest. Otherwise the engine drops the slot's sequence and
    copies the first `reused` cells of the source slot's (a busy slot running the same prefix).
    A resumed request whose state was swapped out has it in `restore`: the engine drops the
    slot's sequence and loads that state instead. A prefix found in the RAM cache is in
    `ram_entry`: the engine drops the slot's sequence, loads the entry's state and keeps its
    first `reused` cells. `preempted` is the running request that gave up this slot for it:
    the loop deals with that one first. `save_first` holds the slot's cached tokens when they
    are worth keeping in the RAM cache: the loop saves the slot's cells before anything else.
    """

    slot: Slot
    request: Request
    reused: int
    source: Slot | None = None
    restore: object = None
    preempted: Preemption | None = None
    ram_entry: RamEntry | None = None
    save_first: list[int] | None = None


@dataclass(slots=True)
class Run:
    """Consecutive tokens of one slot in this tick's batch."""

    slot: Slot
    tokens: list[int]
    start: int  # the cache position of tokens[0]
    sample: bool  # a token is sampled from the last token's logits
    # Logits on every token, not only the last: they score the prompt tokens that follow
    # (SamplingParams.prompt_logprobs).
    score: bool = False
    # A padding token that only joins its neighbours' pass (ubatches.py): its cell is dropped
    # after the forward pass and the slot does not advance.
    pad: bool = False
    # Speculation (speculation.py): the last `draft` tokens before the filler are drafted
    # tokens, each with logits, kept only as far as the sampler agrees; the last `filler`
    # tokens only give the run the tick's common length, and their cells are dropped.
    draft: int = 0
    filler: int = 0


@dataclass(slots=True)
class Step:
    """One tick's work, as planned: the strategy's plan and the runs that carry it out."""

    plan: BatchPlan
    runs: list[Run] = field(default_factory=list)  # in slot order, padding runs included
    n_pad: int = 0  # padding tokens among the runs
    ubatches: int = 0  # the forward passes llama.cpp will make of the batch
    n_extra: int = 0  # drafted and filler tokens (speculation), beyond the plan's

    @property
    def n_tokens(self) -> int:
        return self.plan.n_tokens + self.n_pad + self.n_extra


@dataclass(slots=True)
class Release:
    """A request that ended and left its slot or the queue, and what its end asks of the loop."""

    request: Request
    finish: Finish  # for the request's gateway
    drop_sequence: int | None  # the slot whose cells the engine drops; None when kept or unused


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
        waiting: WaitingQueue | None = None,
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
        self.waiting = waiting if waiting is not None else WaitingQueue()
        self.swap = SwapSpace(swap_bytes)
        self.ram = RamCache(ram_cache_bytes)  # slots' caches kept after their slots were taken
        self.latency = latency  # the --itl-target-ms cap on prompt tokens per tick
        self.preemptions = 0
        self.live: dict[RequestKey, Request] = {}  # every accepted, unfinished request
        self._slot_of: dict[RequestKey, Slot] = {}
        # Left the queue, with why the worker cancelled them; released next.
        self._cancelled_waiting: list[tuple[Request, str]] = []
        self._fallback = DecodeMaximal()
        self._strategy_failures = 0
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

    def cancel(self, key: RequestKey, message: str = "") -> bool:
        """Cancel a live request, queued or running; False when there is none by that key.

        Either way its Finish comes from the next release_finished. A message says why the
        worker cancelled it on its own (the gateway asked: none), so that the gateway can tell
        its client the request did not simply end.
        """
        request = self.live.get(key)
        if request is None:
            return False
        slot = self._slot_of.get(key)
        if slot is not None:
            slot.finish(FinishReason.CANCELLED, message)
        else:
            self.waiting.remove(request)
            del self.live[key]
            self._drop_saved_state(request)
            self._cancelled_waiting.append((request, message))
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
        _set_phase(slot)
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
        _set_phase(slot)

    # --- preemption ---------------------------------------------------------------------

    def _preempt_for(
        self, request: Request, tick: int, spared: frozenset[int]
    ) -> Preemption | None:
        """Free a slot for `request` by preempting a running request it outranks, if any."""
        if self.waiting.policy is not Policy.PRIORITY:
            return None
        # A request that scores its prompt is not preempted: its prompt's logprobs come
        # from its one prefill, which a resumption would repeat.
        running = [
            slot.request
            for slot in self._slot_of.values()
            if not slot.finish_reason
            and slot.index not in spared
            and slot.request.params.prompt_logprobs is None
        ]
        victim = choose_victim(running, request)
        if victim is None:
            return None
        slot = self._slot_of[victim.key]
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

    def swap_out(self, preemption: Preemption, state: object, n_bytes: int) -> None:
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
        plan = self._plan(views, budget, chunk_size)
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
            score = slot.request.params.prompt_logprobs is not None
            runs.append(Run(slot, slot.tokens[start:end], start, end == slot.n_prompt, score))
        return self._shape(Step(plan, runs), budget)

    def _shape(self, step: Step, budget: int) -> Step:
        """Order and pad the runs so that llama.cpp makes as few passes as it can (ubatches.py).

        Slot order costs nothing where the cache is one stream, and there it stays one pass.
        """
        rules = self.split_rules
        step.runs.sort(key=lambda run: run.slot.index)
        if rules.per_slot_streams and rules.padding:
            room = budget - step.plan.n_tokens
            in_batch = [run.slot.index for run in step.runs]
            pads = gaps_to_bridge(in_batch, self._paddable, room) if room else []
            if pads:
                slots = self.slots
                for index in pads:
                    slot = slots[index]
                    # Any token will do; the slot's next position keeps its cells in order.
                    step.runs.append(Run(slot, [0], slot.n_in_cache, False, pad=True))
                step.runs.sort(key=lambda run: run.slot.index)
                step.n_pad = len(pads)
        lengths = [(run.slot.index, len(run.tokens)) for run in step.runs]
        step.ubatches = count_ubatches(lengths, budget, rules.per_slot_streams)
        return step

    def ubatches_with_filler(self, step: Step, length: int) -> int:
        """The passes the step would take with `length` more tokens on every decode and
        padding run (speculation's common length, where each slot has its own KV stream)."""
        lengths = []
        for run in step.runs:
            grows = run.pad or (run.sample and run.slot.phase is SlotPhase.GENERATING)
            lengths.append((run.slot.index, len(run.tokens) + (length if grows else 0)))
        return count_ubatches(lengths, self._budget, self.split_rules.per_slot_streams)

    def add_drafts(self, step: Step, drafts: dict[int, list[int]], length: int) -> None:
        """Put the drafted tokens after each generating slot's last token; with a KV stream
        per slot, also fill every decode and padding run up to `length` extra tokens."""
        uniform = self.split_rules.per_slot_streams
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
        step.ubatches = count_ubatches(lengths, self._budget, self.split_rules.per_slot_streams)

    def accept_drafts(self, slot: Slot, accepted: int) -> None:
        """`accepted` drafted tokens of the slot's last run are now its sequence's: their
        cells hold. The loop drops the rest of the run's cells."""
        slot.n_in_cache += accepted

    def _paddable(self, index: int) -> bool:
        slot = self.slots[index]
        # A busy slot's next cell is written by its own next token anyway.
        return slot.busy or not slot.n_in_cache or self.split_rules.pad_cached_slots

    def _plan(self, views: list[SlotView], budget: int, chunk_size: int) -> BatchPlan:
        depth = self.queue_depth
        try:
            plan = self.strategy.plan(views, budget, chunk_size, depth)
            check_plan(plan, views, budget)
            if self.latency is not None:
                plan = self._within_target(plan, views, budget)
        except Exception as exc:  # InvalidPlan, or anything a user's strategy raises
            self._strategy_failures += 1
            if self._strategy_failures % 1000 == 1:  # the first, then every 1000th
                log.error(
                    "strategy failed; decode-maximal plans this tick",
                    strategy=getattr(self.strategy, "name", type(self.strategy).__qualname__),
                    error=str(exc),
                    failures=self._strategy_failures,
                )
            plan = self._fallback.plan(views, budget, chunk_size, depth)
        return plan

    def _within_target(self, plan: BatchPlan, views: list[SlotView], budget: int) -> BatchPlan:
        """While a stream generates, hold the tick's prompt tokens to what the target allows;
        with nothing generating, prompts get the whole budget."""
        generating = sum(view.phase is SlotPhase.GENERATING for view in views)
        if not generating or not plan.prefill:
            return plan
        cap = self.latency.prefill_cap(generating)
        return plan if cap is None else limit_prefill(plan, views, cap, budget)

    # --- after the forward pass ---------------------------------------------------------

    def advance(self, step: Step) -> None:
        """The forward pass put every run's tokens in the cache."""
        for run in step.runs:
            if not run.pad:
                # Drafted tokens join the cache as the sampler accepts them (accept_drafts).
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

    def record_token(
        self, slot: Slot, token: int, end_of_generation: bool, now: float
    ) -> TokenChunk | None:
        """Append a sampled token and end the request if it must; return the chunk to send.

        An end-of-generation token (unless the request ignores EOS) is counted but not sent:
        it is not text. max_tokens and the slot's context end a request after its token.
        """
        request = slot.request
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
            Release(request, self._finish(request, FinishReason.CANCELLED, message, now), None)
            for request, message in self._cancelled_waiting
        ]
        self._cancelled_waiting.clear()
        for slot in self.slots:
            request, reason = slot.request, slot.finish_reason
            if request is None or reason is None:
                continue
            keep = reason in KEEPS_CACHE
            finish = self._finish(request, reason, slot.finish_message, now)
            self._vacate(slot, tick, keep)
            del self.live[request.key]
            releases.append(Release(request, finish, None if keep else slot.index))
        return releases

    def _vacate(self, slot: Slot, tick: int, keep_cache: bool) -> None:
        """Free a slot of its request (which leaves, or waits again if preempted)."""
        request = slot.request
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

    @staticmethod
    def _finish(request: Request, reason: FinishReason, message: str, now: float) -> Finish:
        started = request.admitted_at or now
        return Finish(
            request_id=request.request_id,
            reason=reason.value,
            prompt_tokens=len(request.prompt),
            completion_tokens=request.completion_tokens,
            cached_tokens=request.cached_tokens,
            queue_seconds=started - request.arrived_at,
            message=message,
        )


def _set_phase(slot: Slot) -> None:
    """A slot decodes once everything but its last token is cached and a token was
    generated (a resumed request); otherwise it prefills the rest of its sequence."""
    resumed = slot.request.completion_tokens > 0
    decoding = resumed and slot.n_in_cache == len(slot.tokens) - 1
    slot.phase = SlotPhase.GENERATING if decoding else SlotPhase.PREFILLING
