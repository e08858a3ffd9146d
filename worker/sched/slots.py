"""A request's life in the worker, as values: the request, its slot, and what the scheduler
decides about them each tick (Admission, Preemption, Run, Step, Release). Plain Python.

A slot's sequence is `tokens` (prompt, then generated tokens); its first `n_in_cache` tokens
have their keys and values in the cache at positions 0..n_in_cache-1 (seq_id in llama.cpp is
the slot's index). The scheduler (scheduler.py, with the helpers it calls: admission.py seats
a request, preemption.py's SwapSpace keeps a preempted one's saved state) makes every change
of these values; the loop does the engine work the decisions imply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ...protocol import Finish, FinishReason, SamplingParams, TokenLogprobs
from ..cache.ram_cache import RamEntry, SavedState
from .media import MediaSpan, media_at, text_until
from .queueing import DEFAULT_TENANT
from .strategies import BatchPlan, SlotPhase, SlotView
from .think_budget import ThinkBudget

if TYPE_CHECKING:
    import numpy as np

RequestKey = tuple[bytes, str]  # (gateway identity, request id): ids are unique per gateway

KEEPS_CACHE = (FinishReason.STOP, FinishReason.LENGTH)  # the slot's KV is sound for reuse


class TokenSampler(Protocol):
    """What the loop asks of a request's sampler (sampling/samplers.py's HostSampler,
    sampling/backend_sampling.py's BackendSampler); the scheduler only carries it."""

    failure: str | None  # after sample(): why the request must end with an error
    grammar_complete: bool  # after sample(): the grammar allows only an end-of-generation

    @property
    def verifies_drafts(self) -> bool:
        """Whether it can verify drafted tokens (speculation.py): it samples each row in
        turn."""
        ...

    @property
    def plain_greedy(self) -> bool: ...

    @property
    def drawn_in_graph(self) -> bool:
        """Whether the last pass drew its token inside llama_decode: sample() then reads that
        token and no row of logits."""
        ...

    def sample(self, batch_index: int, logits: np.ndarray) -> int: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class Request:
    """One accepted Generate, from acceptance to its Finish."""

    key: RequestKey
    prompt: list[int]
    params: SamplingParams
    arrived_at: float  # time.monotonic() at acceptance
    # The engine's sampler chain, built at acceptance (None only where a test of the
    # scheduler builds requests without an engine): `chain` reads it.
    sampler: TokenSampler | None = None
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
    saved_state: SavedState | None = None
    saved_tokens: int = 0  # the tokens the saved state holds
    saved_bytes: int = 0
    preemptions: int = 0
    # For its spans (tick/tracing.py): the W3C context its gateway sent (Generate.trace), the
    # seconds its sampler chain took to build before it arrived (a grammar's compiling), and
    # the drafted tokens its slot verified and how many of them it accepted.
    trace: str = ""
    trace_state: str = ""
    sampler_seconds: float = 0.0
    drafted: int = 0
    drafts_accepted: int = 0
    # Its thinking budget (think_budget.py), which the loop's sampling steers through.
    think: ThinkBudget | None = None
    # Its images, in prompt order: their positions in `prompt` hold placeholders (media.py),
    # and the seconds from its arrival to their encoding's end (before arrived_at).
    media: tuple[MediaSpan, ...] = ()
    media_seconds: float = 0.0

    @property
    def request_id(self) -> str:
        return self.key[1]

    @property
    def gateway(self) -> bytes:
        return self.key[0]

    @property
    def chain(self) -> TokenSampler:
        """Its sampler; every request the loop accepted has one."""
        if self.sampler is None:
            raise RuntimeError(f"request {self.request_id!r} has no sampler")
        return self.sampler

    def finished(self, reason: FinishReason, message: str, now: float, code: str = "") -> Finish:
        """The Finish that ends it, for its gateway."""
        started = self.admitted_at or now
        return Finish(
            request_id=self.request_id,
            reason=reason.value,
            prompt_tokens=len(self.prompt),
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            queue_seconds=started - self.arrived_at,
            message=message,
            code=code,
        )


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
    finish_code: str = ""  # an ErrorCode value: the request's own settings failed it

    @property
    def prompt_remaining(self) -> int:
        """Prompt positions a token run may take next: up to the next image that goes in
        passes of its own, whose positions the loop fills instead (Scheduler.media_due)."""
        if self.phase is not SlotPhase.PREFILLING:
            return 0
        media = self.request.media if self.request is not None else ()
        if not media:
            return self.n_prompt - self.n_in_cache
        span = media_at(media, self.n_in_cache)
        if span is not None and not span.in_token_pass:
            return 0
        return text_until(media, self.n_in_cache, self.n_prompt) - self.n_in_cache

    @property
    def busy(self) -> bool:
        return self.request is not None

    @property
    def occupant(self) -> Request:
        """The request of a busy slot; reading it on an idle slot is a scheduler bug."""
        if self.request is None:
            raise RuntimeError(f"slot {self.index} is idle: it has no request")
        return self.request

    def view(self) -> SlotView:
        request = self.request
        return SlotView(
            index=self.index,
            phase=self.phase,
            prompt_remaining=self.prompt_remaining,
            generated=request.completion_tokens if request else 0,
            admitted_tick=self.admitted_tick,
        )

    def finish(self, reason: FinishReason, message: str = "", code: str = "") -> None:
        """Mark the request over (the first reason wins); release_finished frees the slot."""
        if self.finish_reason is None:
            self.finish_reason = reason
            self.finish_message = message
            self.finish_code = code


@dataclass(slots=True)
class Sampled:
    """What one slot's sampler gave after a forward pass, for Scheduler.update: its new
    tokens in order (with drafts: the drafts it agreed with, then its own next token)."""

    slot: Slot
    tokens: list[int]
    end_of_generation: list[bool]  # per token: an end-of-generation token of the model
    logprobs: list[TokenLogprobs] | None = None  # per token, when the request asked
    failure: str | None = None  # its grammar failed: the request ends with an error
    grammar_complete: bool = False  # its grammar allows nothing more after these tokens


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
    restore: SavedState | None = None
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


def set_phase(slot: Slot) -> None:
    """A slot decodes once everything but its last token is cached and a token was
    generated (a resumed request); otherwise it prefills the rest of its sequence."""
    resumed = slot.occupant.completion_tokens > 0
    decoding = resumed and slot.n_in_cache == len(slot.tokens) - 1
    slot.phase = SlotPhase.GENERATING if decoding else SlotPhase.PREFILLING
