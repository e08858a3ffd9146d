"""The tick loop: one llama_decode per tick over every slot with work (ADR 006).

A Worker owns the engine, the scheduler and the strategy, and runs on one thread. Other
threads hand it work through submit(), cancel(), gateway_gone() and stop(), which only put
items on a queue.Queue; it blocks on that queue whenever it has nothing to do. Everything it
says goes to a Sink: Accepted and Rejected at once, and per tick one Outputs per gateway with
that gateway's new tokens and finishes. No socket here (io.py owns those), so the loop runs
and is tested in-process.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

from loomserve.protocol import (
    Accepted,
    ErrorCode,
    Finish,
    FinishReason,
    Generate,
    Message,
    Outputs,
    Rejected,
    TokenChunk,
)
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine import Engine
from loomserve.worker.sampling import InvalidSampling
from loomserve.worker.scheduler import Request, RequestKey, Scheduler, Slot
from loomserve.worker.strategies import (
    BatchPlan,
    DecodeMaximal,
    SlotPhase,
    check_plan,
    load_strategy,
)

log = structlog.get_logger(__name__)

KEEPS_CACHE = (FinishReason.STOP, FinishReason.LENGTH)  # the slot's KV is sound for reuse


class Sink(Protocol):
    """Where the loop's messages go: the IO thread, or a list in a test."""

    def send(self, gateway: bytes, message: Message) -> None: ...

    def flush(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Load:
    """The loop's load after its latest tick; the IO thread reads it for heartbeats."""

    queue_depth: int
    free_slots: int
    running: int


@dataclass(frozen=True, slots=True)
class TickRecord:
    """What one tick did: for the tick log line and the metrics."""

    tick: int
    decode_tokens: int  # one per generating slot in the batch
    prefill_tokens: int  # prompt tokens evaluated
    sampled_tokens: int  # new tokens produced
    budget: int  # the batch's token budget
    slots_active: int
    queue_depth: int
    seconds: float


@dataclass(frozen=True, slots=True)
class FinishRecord:
    """One finished request with its timings: for its log line and the metrics."""

    finish: Finish
    ttft_seconds: float | None  # None when no token was produced
    decode_seconds: float  # from the first token to the finish


# --- inbox items -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Submit:
    gateway: bytes
    generate: Generate


@dataclass(frozen=True, slots=True)
class _Cancel:
    gateway: bytes
    request_id: str


@dataclass(frozen=True, slots=True)
class _GatewayGone:
    gateway: bytes


_STOP = object()


class Worker:
    """The continuous-batching loop over one engine."""

    def __init__(
        self,
        engine: Engine,
        config: WorkerConfig,
        sink: Sink,
        on_tick: Callable[[TickRecord], None] | None = None,
        on_finish: Callable[[FinishRecord], None] | None = None,
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.sink = sink
        self.strategy = load_strategy(config.strategy)
        self.scheduler = Scheduler(
            config.slots, config.max_queue, engine.slot_context, engine.min_copy_tokens
        )
        self.inbox: queue.Queue = queue.Queue()
        self.tick_count = 0
        self.load = Load(queue_depth=0, free_slots=config.slots, running=0)
        self._on_tick = on_tick
        self._on_finish = on_finish
        self._on_reject = on_reject
        self._stopping = False
        self._outputs: dict[bytes, Outputs] = {}
        self._fallback = DecodeMaximal()
        self._strategy_failures = 0
        engine.clear_cache()  # the scheduler starts with empty slots; so must the cache

    # --- any thread ------------------------------------------------------------------

    def submit(self, gateway: bytes, generate: Generate) -> None:
        self.inbox.put(_Submit(gateway, generate))

    def cancel(self, gateway: bytes, request_id: str) -> None:
        self.inbox.put(_Cancel(gateway, request_id))

    def gateway_gone(self, gateway: bytes) -> None:
        """The gateway vanished: cancel its queued and running requests."""
        self.inbox.put(_GatewayGone(gateway))

    def stop(self) -> None:
        self.inbox.put(_STOP)

    # --- the loop thread -------------------------------------------------------------

    def run(self) -> None:
        """Tick until stop(); then cancel whatever is left so every request finishes once."""
        while not self._stopping:
            try:
                self.tick()
            except Exception:
                # A bug must not take the other requests down with it: fail the running
                # ones, whose state may be half-updated, and keep serving.
                log.exception("tick failed; failing the running requests")
                for slot in self.scheduler.busy_slots():
                    slot.finish(FinishReason.ERROR, "internal error in the worker's tick")
                self._retire_finished()
                self._send_outputs()
        for key in list(self.scheduler.live):
            self._cancel(key)
        self._retire_finished()
        self._send_outputs()

    def tick(self, block: bool = True) -> None:
        """One pass of the loop; with block, waits for input when there is nothing to do."""
        # 1. New requests and cancellations (blocking only when there is nothing else).
        self._take_input(block=block and not self.scheduler.has_work())
        started = time.perf_counter()
        # 2. Free slots whose requests ended (cancelled, failed), then fill free slots.
        self._retire_finished()
        self._admit()
        # 3. The strategy splits the token budget; the batch is built from its plan.
        plan = self._plan()
        if not plan.n_tokens:  # nothing to run: only finishes to send, if anything
            self._send_outputs()
            return
        sampled = self._build_batch(plan)
        # 4. One forward pass. 5. Each slot samples at its own batch index.
        n_sampled = self._sample(sampled) if self._forward(plan) else 0
        # 6. Requests that just ended free their slots; each gateway gets one Outputs.
        self._retire_finished()
        self._send_outputs()
        self._after_tick(plan, n_sampled, started)

    # --- 1: input ----------------------------------------------------------------------

    def _take_input(self, block: bool) -> None:
        try:
            item = self.inbox.get(block=block)
        except queue.Empty:
            return
        while True:
            if item is _STOP:
                self._stopping = True
            elif isinstance(item, _Submit):
                self._accept(item.gateway, item.generate)
            elif isinstance(item, _Cancel):
                self._cancel((item.gateway, item.request_id))
            elif isinstance(item, _GatewayGone):
                for key in self.scheduler.keys_of(item.gateway):
                    self._cancel(key)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
        # Accepted and Rejected go out now, not after this tick's forward pass.
        self.sink.flush()

    def _accept(self, gateway: bytes, generate: Generate) -> None:
        key = (gateway, generate.request_id)
        error = self._refusal(key, generate)
        sampler = None
        if error is None:
            try:
                sampler = self.engine.new_sampler(generate.params)
            except InvalidSampling as exc:
                error = (ErrorCode.INVALID_REQUEST, str(exc))
        if error is not None:
            code, message = error
            log.debug("request rejected", request_id=generate.request_id, code=code.value)
            self.sink.send(gateway, Rejected(generate.request_id, code.value, message))
            if self._on_reject:
                self._on_reject(code.value)
            return
        request = Request(
            key=key,
            prompt=generate.prompt_tokens,
            params=generate.params,
            arrived_at=time.monotonic(),
            sampler=sampler,
        )
        ahead = self.scheduler.enqueue(request)
        self.sink.send(gateway, Accepted(generate.request_id, ahead))

    def _refusal(self, key: RequestKey, generate: Generate) -> tuple[ErrorCode, str] | None:
        """Why this request cannot be taken, cheapest checks first; None when it can."""
        if key in self.scheduler.live:
            return ErrorCode.DUPLICATE_REQUEST, f"request {key[1]!r} is already running"
        n_vocab = self.engine.n_vocab
        if max(generate.prompt_tokens) >= n_vocab:
            return ErrorCode.INVALID_REQUEST, f"prompt token ids must be below {n_vocab}"
        n_prompt, limit = len(generate.prompt_tokens), self.engine.slot_context
        if n_prompt >= limit:
            return (
                ErrorCode.PROMPT_TOO_LONG,
                f"the prompt has {n_prompt} tokens; a slot holds {limit} tokens "
                f"including at least one generated token",
            )
        if not self.scheduler.can_enqueue():
            return ErrorCode.QUEUE_FULL, f"all slots are busy and {self.config.max_queue} wait"
        return None

    def _cancel(self, key: RequestKey) -> None:
        request = self.scheduler.cancel(key)
        if request is not None:  # it was still queued; a running one finishes in phase 2
            self._finished(request, FinishReason.CANCELLED, "")

    # --- 2: finish and admit -------------------------------------------------------

    def _retire_finished(self) -> None:
        for slot in self.scheduler.finished_slots():
            reason, message = slot.finish_reason, slot.finish_message
            keep = reason in KEEPS_CACHE
            if not keep:
                self.engine.drop_sequence(slot.index)
            request = self.scheduler.release(slot, self.tick_count, keep_cache=keep)
            self._finished(request, reason, message)

    def _finished(self, request: Request, reason: FinishReason, message: str) -> None:
        request.sampler.close()
        now = time.monotonic()
        started = request.admitted_at or now
        finish = Finish(
            request_id=request.request_id,
            reason=reason.value,
            prompt_tokens=len(request.prompt),
            completion_tokens=request.completion_tokens,
            cached_tokens=request.cached_tokens,
            queue_seconds=started - request.arrived_at,
            message=message,
        )
        self._outputs_for(request.key[0]).finishes.append(finish)
        first = request.first_token_at
        record = FinishRecord(
            finish=finish,
            ttft_seconds=first - request.arrived_at if first else None,
            decode_seconds=now - first if first else 0.0,
        )
        _log_finish(record)
        if self._on_finish:
            self._on_finish(record)

    def _admit(self) -> None:
        for admission in self.scheduler.admit(self.tick_count, time.monotonic()):
            slot, reused = admission.slot, admission.reused
            if admission.source is not None:
                self.engine.drop_sequence(slot.index)
                self.engine.copy_prefix(admission.source.index, slot.index, reused)
            elif not self.engine.keep_prefix(slot.index, reused):
                # This cache cannot keep a part of a sequence: evaluate the whole prompt.
                self.engine.drop_sequence(slot.index)
                slot.n_cached = admission.request.cached_tokens = 0

    # --- 3: plan and build the batch -------------------------------------------------

    def _plan(self) -> BatchPlan:
        views = self.scheduler.views()
        if not views:
            return BatchPlan()
        budget, chunk = self.config.batch_tokens, self.config.prefill_chunk
        depth = self.scheduler.queue_depth
        try:
            plan = self.strategy.plan(views, budget, chunk, depth)
            check_plan(plan, views, budget)
        except Exception as exc:  # InvalidPlan, or anything a user's strategy raises
            self._strategy_failures += 1
            if self._strategy_failures % 1000 == 1:  # the first, then every 1000th
                log.error(
                    "strategy failed; decode-maximal plans this tick",
                    strategy=self.config.strategy,
                    error=str(exc),
                    failures=self._strategy_failures,
                )
            plan = self._fallback.plan(views, budget, chunk, depth)
        return plan

    def _build_batch(self, plan: BatchPlan) -> list[tuple[Slot, int]]:
        """Fill the engine's batch; return the slots to sample and their batch indices."""
        batch, slots = self.engine.batch, self.scheduler.slots
        batch.clear()
        sampled = []
        for index in plan.decode:
            slot = slots[index]
            sampled.append((slot, batch.add(slot.tokens[-1], slot.n_cached, index, True)))
        for index, n_tokens in plan.prefill.items():
            slot = slots[index]
            start, end = slot.n_cached, slot.n_cached + n_tokens
            # Logits only where a token is sampled: the last prompt token.
            last = batch.add_run(slot.tokens[start:end], start, index, end == slot.n_prompt)
            if end == slot.n_prompt:
                sampled.append((slot, last))
        return sampled

    # --- 4: forward --------------------------------------------------------------------

    def _forward(self, plan: BatchPlan) -> bool:
        code = self.engine.decode(self.engine.batch)
        slots = self.scheduler.slots
        if code != 0:
            message = f"llama_decode failed with code {code}"
            log.error("decode failed", code=code, slots=[*plan.decode, *plan.prefill])
            for index in (*plan.decode, *plan.prefill):
                slots[index].finish(FinishReason.ERROR, message)
            return False
        for index in plan.decode:
            slots[index].n_cached += 1
        for index, n_tokens in plan.prefill.items():
            slots[index].n_cached += n_tokens
        return True

    # --- 5: sample ----------------------------------------------------------------------

    def _sample(self, sampled: list[tuple[Slot, int]]) -> int:
        """Sample, record and check each slot's new token; return how many were sampled."""
        if not sampled:  # only prompt chunks that end mid-prompt: no logits were asked for
            return 0
        now = time.monotonic()
        limit = self.engine.slot_context
        # Logits were asked for exactly where a token is sampled, so output row i belongs to
        # sampled[i]: one view of them all instead of one per slot.
        logits = self.engine.output_logits(len(sampled))
        for row, (slot, batch_index) in enumerate(sampled):
            request = slot.request
            token = request.sampler.sample(batch_index, logits[row])
            request.completion_tokens += 1
            if not request.first_token_at:
                request.first_token_at = now
            slot.phase = SlotPhase.GENERATING
            slot.tokens.append(token)
            params = request.params
            if not params.ignore_eos and self.engine.is_eog(token):
                # The end-of-generation token is counted but never sent: it is not text.
                slot.finish(FinishReason.STOP)
                continue
            self._outputs_for(request.key[0]).tokens.append(TokenChunk(request.request_id, [token]))
            if request.completion_tokens >= params.max_tokens or len(slot.tokens) >= limit:
                slot.finish(FinishReason.LENGTH)
        return len(sampled)

    # --- 6: emit -----------------------------------------------------------------------

    def _outputs_for(self, gateway: bytes) -> Outputs:
        outputs = self._outputs.get(gateway)
        if outputs is None:
            outputs = self._outputs[gateway] = Outputs(tokens=[], finishes=[])
        return outputs

    def _send_outputs(self) -> None:
        if self._outputs:
            for gateway, outputs in self._outputs.items():
                self.sink.send(gateway, outputs)
            self._outputs = {}
            self.sink.flush()
        scheduler = self.scheduler
        self.load = Load(scheduler.queue_depth, scheduler.free_slots, scheduler.running)

    def _after_tick(self, plan: BatchPlan, n_sampled: int, started: float) -> None:
        self.tick_count += 1
        if not (self.config.log_ticks or self._on_tick):
            return
        record = TickRecord(
            tick=self.tick_count,
            decode_tokens=len(plan.decode),
            prefill_tokens=plan.n_tokens - len(plan.decode),
            sampled_tokens=n_sampled,
            budget=self.config.batch_tokens,
            slots_active=self.scheduler.running,
            queue_depth=self.scheduler.queue_depth,
            seconds=time.perf_counter() - started,
        )
        if self.config.log_ticks:
            log.info(
                "tick",
                tick=record.tick,
                batch_tokens=plan.n_tokens,
                decode_tokens=record.decode_tokens,
                prefill_tokens=record.prefill_tokens,
                slots_active=record.slots_active,
                queue_depth=record.queue_depth,
                tick_ms=round(record.seconds * 1000, 3),
            )
        if self._on_tick:
            self._on_tick(record)


def _log_finish(record: FinishRecord) -> None:
    finish = record.finish
    decoded = finish.completion_tokens - 1
    log.info(
        "request finished",
        request_id=finish.request_id,
        reason=finish.reason,
        prompt_tokens=finish.prompt_tokens,
        completion_tokens=finish.completion_tokens,
        cached_tokens=finish.cached_tokens,
        queue_ms=round(finish.queue_seconds * 1000, 3),
        ttft_ms=None if record.ttft_seconds is None else round(record.ttft_seconds * 1000, 3),
        tokens_per_second=(
            round(decoded / record.decode_seconds, 2)
            if decoded > 0 and record.decode_seconds > 0
            else None
        ),
        message=finish.message or None,
    )
