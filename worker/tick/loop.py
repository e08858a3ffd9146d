"""The tick loop: one llama_decode per tick over every slot with work (ADR 006).

ADR 006 and 008 are summarised in docs/life-of-a-request.md.

A TickLoop owns the engine and the scheduler, and runs on one thread. Other threads hand it
work through its Inbox (io/channels.py: a Generate or an Embed, cancellations, a lost
gateway, stop), which only puts items on a queue; it blocks on that queue whenever it has
nothing to do. Everything it says goes to a Sink (io/channels.py): Accepted and Rejected at
once, and per tick one Outputs per gateway with that gateway's new tokens and finishes; after
each tick it publishes its SchedulerStats on the StatsBoard, the only view other threads have
of it (stats.py). No socket here (io/sockets.py owns those), so the loop runs and is tested
in-process. It keeps no slot state: the scheduler decides and records every change of a
request's state; the loop hands the engine what those decisions need, with helpers for the
parts that are not the tick's order itself: intake.py (refusals), kv_moves.py (cells moved for
admissions), drafting.py (speculation), engine/batch.py (the engine's batch), engine/media.py
(images: encoded on a thread of their own, their embeddings put in passes of their own),
sampling/logprobs.py (logprobs), sched/records.py (the stats, tick and finish records and their
log lines).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import structlog

from ...protocol import (
    Accepted,
    Embed,
    ErrorCode,
    Generate,
    Rejected,
)
from ..cache.prefix_cache import AdvertisedPrefixes
from ..config import WorkerConfig
from ..engine.batch import Filled, embed_rows, fill_batch, holds_image_rows
from ..engine.embeddings import Embedder
from ..engine.engine import Engine
from ..engine.media import EmbeddingBatch, EncodedPrompt, MediaEncoder
from ..io.channels import (
    STOP,
    Abort,
    Compiled,
    Encoded,
    GatewayGone,
    Inbox,
    Sink,
    StatsBoard,
    Submit,
)
from ..sampling.grammar_compiler import GrammarCompiler
from ..sampling.guidance import GrammarState
from ..sampling.logprobs import sampled, score_prompts
from ..sampling.samplers import InvalidSampling, SamplingThreads, sample_rows
from ..sched.media import rope_position
from ..sched.preemption import GIB
from ..sched.queueing import WaitingQueue
from ..sched.records import (
    finish_record,
    log_finish,
    log_tick,
    scheduler_stats,
    tick_record,
)
from ..sched.scheduler import PendingOutputs, Scheduler
from ..sched.slots import Release, RequestKey, Sampled, Step
from ..sched.strategies import load_strategy
from ..sched.tick_cost import LatencyTarget, TickCostModel
from ..stats import FinishRecord, MediaRecord, SchedulerStats, TickRecord
from .drafting import Drafting, make_speculator
from .faults import DecodeFaults
from .intake import (
    NO_EMBEDDINGS,
    NO_IMAGES,
    media_refusal,
    new_request,
    refusal,
)
from .kv_moves import KvMoves

if TYPE_CHECKING:  # imported by server.py only when tracing is on
    from .tracing import RequestTracer

log = structlog.get_logger(__name__)

# Between changes of the load, the stats other threads read (/slots, heartbeats, metrics) are
# at most this old: their per-token counters.
STATS_EVERY = 0.05  # seconds


class TickLoop:
    """The continuous-batching loop over one engine."""

    def __init__(
        self,
        engine: Engine,
        config: WorkerConfig,
        sink: Sink,
        on_tick: Callable[[TickRecord], None] | None = None,
        on_finish: Callable[[FinishRecord], None] | None = None,
        on_reject: Callable[[str], None] | None = None,
        embedder: Embedder | None = None,
        inbox: Inbox | None = None,
        board: StatsBoard | None = None,
        tracer: RequestTracer | None = None,
        media: MediaEncoder | None = None,
        on_media: Callable[[MediaRecord], None] | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.sink = sink
        self.tick_cost = TickCostModel()  # learned from every tick; the latency target uses it
        self.scheduler = Scheduler(
            config.slots,
            config.max_queue,
            engine.slot_context,
            engine.min_copy_tokens,
            load_strategy(config.strategy),
            engine.split_rules,
            WaitingQueue(
                config.scheduling_policy, config.tenant_weights, config.max_slots_per_tenant
            ),
            swap_bytes=int(config.swap_space * GIB),
            latency=self._latency_target(config),
            ram_cache_bytes=config.ram_cache_bytes,
        )
        self.inbox = inbox if inbox is not None else Inbox()  # IO (or a test) writes it
        self.tick_count = 0
        # Other threads read the scheduler only through the stats published here (stats.py).
        self.board = board if board is not None else StatsBoard(config.slots)
        self._prefixes = AdvertisedPrefixes(config.heartbeat_interval)
        # (queued, free slots, preemptions) when the stats were last published
        self._published_load: tuple[int, int, int] | None = None
        self._published_at = -float("inf")
        self._on_tick = on_tick
        self._on_finish = on_finish
        self._on_reject = on_reject
        self._tracer = tracer  # None: tracing off, and not one span is made
        self.embedder = embedder  # None: this worker computes no embeddings
        self.media = media  # None: this worker reads no images
        self.media_batch = (
            EmbeddingBatch(engine.ctx, config.batch_tokens, media.n_embd) if media else None
        )
        # An image's rows ride in the ticks' token passes, planned as prompt rows, where the
        # engine writes tokens as exact embedding rows and the image needs nothing more than
        # its positions (a non-causal one goes whole into a pass of its own, M-RoPE takes
        # four positions a row).
        self.images_in_token_passes = (
            media is not None
            and engine.token_rows is not None
            and not media.non_causal
            and not media.mrope
        )
        # Generates whose images are being encoded, and when they went to the encoder.
        self._encoding: dict[RequestKey, float] = {}
        # None: grammars compile in the tick, as they are accepted (tests that drive the loop).
        self.grammars = grammars
        self._compiling: dict[RequestKey, float] = {}  # Generates whose grammar compiles
        self._on_media = on_media
        self._stop_by: float | None = None  # set by STOP (Inbox.stop): when the last are cut
        self.failed_ticks = 0  # consecutive ticks that failed; a good forward pass resets it
        self.dead: str | None = None  # why the engine was given up on, once it was
        self._faults = DecodeFaults.from_env()  # tests only: see faults.py
        self.outputs = PendingOutputs()  # this tick's, sent at its end
        self.busy_since: float | None = None  # when this tick's work began (watchdog.py)
        self.kv_moves = KvMoves(engine, self.scheduler)
        # The forward pass is over when rows are sampled: its threads draw them, unless the
        # operator chose how many.
        chosen = config.sampling_threads
        self.sampling_threads = (
            SamplingThreads(chosen, limit=chosen) if chosen else SamplingThreads(config.n_threads)
        )
        self.speculator = make_speculator(config, engine.split_rules)
        # Drafts ride in the tick's pass and are verified as it samples (drafting.py).
        self.drafting = Drafting(engine, self.scheduler, self.speculator, self.tick_cost, config)
        engine.clear_cache()  # the scheduler starts with empty slots; so must the cache

    def _latency_target(self, config: WorkerConfig) -> LatencyTarget | None:
        if config.itl_target_ms is None:
            return None
        return LatencyTarget(config.itl_target_ms / 1000, self.tick_cost)

    @property
    def images_pending(self) -> int:
        """Generates whose images the media encoder has not given back yet."""
        return len(self._encoding)

    @property
    def stats(self) -> SchedulerStats:
        """The scheduler after the latest tick, as heartbeats, /slots and metrics see it."""
        return self.board.latest

    # --- the loop thread -------------------------------------------------------------

    def run(self) -> None:
        """Tick until a STOP (Inbox.stop) has drained the requests, or until the engine is dead.

        A failing tick fails the requests it ran and the loop serves on; max_failed_ticks
        failures in a row mean the engine itself is broken: `dead` says why and run returns,
        leaving the queued requests for the server to fail (as vLLM's EngineDeadError).
        """
        while not self._drained():
            try:
                self.tick(block=self._stop_by is None)
            except Exception:
                # A bug must not take the other requests down with it: fail the running
                # ones, whose state may be half-updated, and keep serving.
                log.exception("tick failed; failing the running requests")
                self.failed_ticks += 1
                self.scheduler.fail_running("internal error in the worker's tick")
                self._release_finished()
                self._send_outputs()
            if self.failed_ticks >= self.config.max_failed_ticks:
                self.dead = f"{self.failed_ticks} ticks in a row failed"
                log.error("engine dead: giving up", reason=self.dead)
                return
        self.scheduler.cancel_all("the worker is shutting down")
        self._release_finished()
        self._send_outputs()
        self.sampling_threads.close()
        if self.media_batch is not None:
            self.media_batch.close()

    def _drained(self) -> bool:
        """After a STOP: whether every request has finished, or the time for them is up."""
        if self._stop_by is None:
            return False
        embedding = self.embedder is not None and self.embedder.pending
        pending = bool(self._encoding) or bool(self._compiling)
        busy = self.scheduler.has_work() or embedding or pending
        return not busy or time.monotonic() >= self._stop_by

    def tick(self, block: bool = True) -> None:
        """One pass of the loop; with block, waits for input when there is nothing to do."""
        # 1. New requests and cancellations (blocking only when there is nothing else).
        self.busy_since = None  # waiting for work is not being stuck
        embedding = self.embedder is not None and self.embedder.pending
        self._take_input(block=block and not (self.scheduler.has_work() or embedding))
        self.busy_since = time.monotonic()
        if self._stop_by is not None and not (self.scheduler.has_work() or embedding):
            return
        started = time.perf_counter()
        # 1b. Embeddings: one batch of waiting inputs, in their own context (embeddings.py).
        self._embed()
        # 2. Release requests that ended (cancelled, failed), then fill free slots.
        self._release_finished()
        self._admit()
        # 2b. Images next in a prompt: their embeddings go in passes of their own, not
        # counted as the token pass's cost.
        started += self._decode_media()
        # 3. The scheduler's strategy splits the token budget into runs of slot tokens.
        step = self.scheduler.schedule(self.config.batch_tokens, self.config.prefill_chunk)
        if not step.n_tokens:  # nothing to run: only finishes to send, if anything
            self._send_outputs()
            return
        # 3b. Generating slots may draft tokens that ride in the same pass (drafting.py).
        self.drafting.speculate(step)
        filled = fill_batch(self.engine.batch, step)
        if self.images_in_token_passes:  # an image's rows in the pass: all go as embeddings
            self._embed_image_rows(step)
        self.engine.bind_graph_samplers(step.runs)  # backend sampling: chains onto their sequences
        # 4. One forward pass; the scheduler advances each slot's cache.
        # 5. Each slot samples at its own batch index (and verifies its drafts).
        sampled_now = self._sample(filled) if self._forward(step) else []
        # 6. The scheduler records every sampled token and ends the requests that must end.
        n_sampled = self._update(sampled_now)
        # 7. Requests that just ended free their slots; each gateway gets one Outputs.
        self._release_finished()
        self._send_outputs()
        self._after_tick(step, n_sampled, started)

    # --- 1: input ----------------------------------------------------------------------

    def _take_input(self, block: bool) -> None:
        item = self.inbox.get(block=block)
        if item is None:
            return  # nothing came in: nothing to flush
        while item is not None:
            if item is STOP:
                if self._stop_by is None:
                    self._stop_by = time.monotonic() + self.config.shutdown_timeout
            elif isinstance(item, Encoded):
                self._encoded(item)
            elif isinstance(item, Compiled):
                self._compiled(item)
            elif isinstance(item, Submit):
                if isinstance(item.message, Embed):  # the embedder's work, not the tick's
                    self._accept_embed(item.gateway, item.message)
                else:
                    self._accept(item.gateway, item.message)
            elif isinstance(item, Abort):
                # Unknown ids are ignored: the request may have just finished.
                self.scheduler.cancel((item.gateway, item.request_id), reason=item.reason)
                self._encoding.pop((item.gateway, item.request_id), None)
                self._compiling.pop((item.gateway, item.request_id), None)
                if self.embedder is not None:
                    self.embedder.cancel(item.gateway, item.request_id)
            elif isinstance(item, GatewayGone):
                for key in self.scheduler.keys_of(item.gateway):
                    self.scheduler.cancel(key, item.why)
                self._encoding = {
                    key: at for key, at in self._encoding.items() if key[0] != item.gateway
                }
                self._compiling = {
                    key: at for key, at in self._compiling.items() if key[0] != item.gateway
                }
                if self.embedder is not None:
                    self.embedder.cancel(item.gateway)
            item = self.inbox.get(block=False)
        # Accepted and Rejected go out now, not after this tick's forward pass.
        self.sink.flush()

    def _accept(
        self,
        gateway: bytes,
        generate: Generate,
        encoded: EncodedPrompt | None = None,
        media_seconds: float = 0.0,
        grammar: GrammarState | None = None,
        grammar_seconds: float = 0.0,
    ) -> None:
        """Queue a Generate or refuse it; one with images goes to the media encoder first,
        and comes back here with them encoded (_encoded); one with a grammar then goes to
        the grammar compiler, and comes back with it compiled (_compiled)."""
        key = (gateway, generate.request_id)
        engine = self.engine
        stopping = self._stop_by is not None
        error = refusal(
            key,
            generate,
            self.scheduler,
            engine.n_vocab,
            engine.slot_context,
            stopping,
            self._encoding.keys() | self._compiling.keys(),
        )
        if error is None and generate.images:
            if self.media is None:
                error = (ErrorCode.INVALID_REQUEST, NO_IMAGES)
            elif encoded is None:  # Accepted or Rejected once they are encoded
                self._encoding[key] = time.monotonic()
                self.media.submit(gateway, generate)
                return
            else:
                whole = self.config.batch_tokens if self.media.non_causal else None
                error = media_refusal(
                    encoded.tokens, encoded.media, generate, engine.slot_context, whole
                )
        if error is None and generate.params.grammar and grammar is None and self.grammars:
            self._compiling[key] = time.monotonic()  # Accepted or Rejected once compiled
            self.grammars.submit(gateway, generate, (encoded, media_seconds))
            return
        sampler = None
        building = time.monotonic()  # a grammar compiles here, unless it did off the tick
        if error is None:
            try:
                sampler = self.engine.new_sampler(generate.params, grammar)
            except InvalidSampling as exc:
                error = (ErrorCode.INVALID_REQUEST, str(exc))
        if error is not None:
            code, message = error
            log.debug("request rejected", request_id=generate.request_id, code=code.value)
            self._reject(gateway, Rejected(generate.request_id, code.value, message))
            return
        prompt, media = (encoded.tokens, encoded.media) if encoded else (None, ())
        sampler_seconds = grammar_seconds if grammar else time.monotonic() - building
        request = new_request(key, generate, sampler, sampler_seconds, prompt, media, media_seconds)
        ahead = self.scheduler.enqueue(request)
        self.sink.send(gateway, Accepted(generate.request_id, ahead))

    def _encoded(self, item: Encoded) -> None:
        """The media encoder is done with a Generate's images: queue it, or say why not."""
        key = (item.gateway, item.message.request_id)
        submitted = self._encoding.pop(key, None)
        if submitted is None:
            return  # cancelled, or its gateway went, while its images were encoded
        encoded = item.prompt
        if not isinstance(encoded, EncodedPrompt):
            code = ErrorCode.INVALID_REQUEST.value
            self._reject(item.gateway, Rejected(item.message.request_id, code, item.why))
            return
        log.debug(
            "images encoded",
            request_id=key[1],
            images=len(encoded.media),
            image_tokens=sum(span.n_tokens for span in encoded.media),
            cached_images=encoded.cached_images,
            seconds=round(encoded.encode_seconds, 4),
        )
        if self._on_media:
            self._on_media(
                MediaRecord(
                    images=len(encoded.media),
                    cached_images=encoded.cached_images,
                    image_tokens=sum(span.n_tokens for span in encoded.media),
                    encode_seconds=encoded.encode_seconds,
                )
            )
        if self.images_in_token_passes:
            shared = tuple(replace(span, in_token_pass=True) for span in encoded.media)
            encoded = replace(encoded, media=shared)
        self._accept(item.gateway, item.message, encoded, time.monotonic() - submitted)

    def _compiled(self, item: Compiled) -> None:
        """The grammar compiler is done with a Generate's grammar: queue it, or say why not."""
        key = (item.gateway, item.message.request_id)
        if self._compiling.pop(key, None) is None:
            return  # cancelled, or its gateway went, while its grammar compiled
        if not isinstance(item.grammar, GrammarState):
            code = ErrorCode.INVALID_REQUEST.value
            self._reject(item.gateway, Rejected(item.message.request_id, code, item.why))
            return
        encoded: EncodedPrompt | None
        media_seconds: float
        encoded, media_seconds = item.carry  # type: ignore[misc]  # _accept's own pair
        self._accept(item.gateway, item.message, encoded, media_seconds, item.grammar, item.seconds)

    def _accept_embed(self, gateway: bytes, embed: Embed) -> None:
        rejected: Rejected | None
        if self.embedder is None:
            rejected = Rejected(embed.request_id, ErrorCode.INVALID_REQUEST.value, NO_EMBEDDINGS)
        else:
            rejected = self.embedder.offer(gateway, embed)
        if rejected is not None:
            self._reject(gateway, rejected)

    def _reject(self, gateway: bytes, rejected: Rejected) -> None:
        """A Generate or an Embed refused: the gateway hears why, the metrics count it."""
        self.sink.send(gateway, rejected)
        if self._on_reject:
            self._on_reject(rejected.code)

    def _embed(self) -> None:
        if self.embedder is None or not self.embedder.pending:
            return
        for gateway, reply in self.embedder.run():
            self.sink.send(gateway, reply)
        self.sink.flush()

    # --- 2: release and admit -------------------------------------------------------

    def _release_finished(self) -> None:
        now = time.monotonic()
        for release in self.scheduler.release_finished(self.tick_count, now):
            if release.drop_sequence is not None:
                self.engine.drop_sequence(release.drop_sequence)
            release.request.chain.close()
            self.outputs.to(release.request.gateway).finishes.append(release.finish)
            self._finished(release, now)

    def _finished(self, release: Release, now: float) -> None:
        record = finish_record(release, now)
        log_finish(record)
        if self._on_finish:
            self._on_finish(record)
        if self._tracer is not None:
            self._tracer.finished(release.request, release.finish, now)

    def _admit(self) -> None:
        for admission in self.scheduler.admit(self.tick_count, time.monotonic()):
            self.kv_moves.place(admission)

    # --- 2b: images -------------------------------------------------------------------

    def _decode_media(self) -> float:
        """Every image due next in a prefilling slot into its cells, in embedding-only passes;
        return the seconds they took."""
        if self.media is None or self.media_batch is None:
            return 0.0
        started = time.perf_counter()
        scheduler = self.scheduler
        non_causal = self.media.non_causal
        passes = 0  # images now whole in their cells
        # Under a latency target the streams that generate wait for one image a tick at most,
        # and of a causal one for the rows the target leaves room for (the rest next ticks;
        # a reused prefix never ends inside an image: sched/admission.py).
        limit = 1 if self.config.itl_target_ms is not None and scheduler.generating() else None
        cap = None if limit is None or non_causal else scheduler.media_rows_cap()
        taken = 0  # images a pass went into
        # Bounded: each pass moves its slot past an image, or ends the loop (limit).
        while (due := scheduler.media_due()) and (limit is None or taken < limit):
            for slot, span in due[: None if limit is None else limit - taken]:
                taken += 1
                media = slot.request.media if slot.request else ()
                offset = slot.n_in_cache - span.start
                rows = span.embeddings[offset : None if cap is None else offset + cap]
                first = rope_position(media, span.start)
                rope = None
                if span.rope is not None:  # M-RoPE: each row's (t, y, x, z) from `first`
                    rope = (span.rope[0] + first * span.rope[1])[offset : offset + len(rows)]
                with self.engine.pass_running():
                    code = self.media_batch.decode(
                        rows, first + offset, slot.index, non_causal, rope
                    )
                if code != 0:
                    log.error("image decode failed", code=code, slot=slot.index)
                    scheduler.media_failed(
                        slot, f"llama_decode of an image failed with code {code}"
                    )
                    continue
                if offset + len(rows) < span.n_tokens:
                    scheduler.media_progressed(slot, len(rows))
                else:
                    scheduler.media_decoded(slot, span)
                    passes += 1
        seconds = time.perf_counter() - started
        if taken and self._on_media:  # partial passes took their seconds too
            self._on_media(MediaRecord(passes=passes, pass_seconds=seconds))
        return seconds

    def _embed_image_rows(self, step: Step) -> None:
        """Where runs take an image's positions, write the batch as embedding rows (tokens
        as their rows); count the image rows and the images whose last rows go in."""
        if not holds_image_rows(step):
            return
        assert self.engine.token_rows is not None
        rows, images = embed_rows(self.engine.batch, step, self.engine.token_rows)
        if self._on_media:
            self._on_media(MediaRecord(passes=images, shared_rows=rows))

    # --- 4: forward --------------------------------------------------------------------

    def _forward(self, step: Step) -> bool:
        if self._faults is not None:
            self._faults.before_forward()
        code = self.engine.decode(self.engine.batch)
        if step.n_pad:  # padding only joined the pass: its slots never had those cells
            for run in step.runs:
                if run.pad:
                    media = run.slot.request.media if run.slot.request else ()
                    self.engine.keep_prefix(run.slot.index, run.start, media)
        if code != 0:
            log.error("decode failed", code=code, slots=[run.slot.index for run in step.runs])
            self.scheduler.fail(step, f"llama_decode failed with code {code}")
            self.failed_ticks += 1
            return False
        self.failed_ticks = 0
        self.scheduler.advance(step)
        return True

    # --- 5: sample ----------------------------------------------------------------------

    def _sample(self, filled: Filled) -> list[Sampled]:
        """Each sampling slot's new tokens, for the scheduler's update."""
        scored, sampling = None, filled.sampled
        if filled.scoring is not None:
            scored = score_prompts(filled.scoring, self.engine.output_logits, self.outputs.to)
        if not sampling:  # only prompt chunks that end mid-prompt: no logits were asked for
            return []
        if filled.verified:
            return self.drafting.sample_verified(sampling, filled.verified)
        samplers = [slot.occupant.chain for slot, _ in sampling]
        indices = [index for _, index in sampling]
        if scored is None and all(sampler.drawn_in_graph for sampler in samplers):
            # Every token was drawn inside the pass (graph_draw.py, backend_sampling.py):
            # llama.cpp copied no logits and none is read (no such request asks logprobs).
            # The view alone cost 50-70 µs a tick, a tenth of the loop's time around a pass.
            logits = self.engine.output_logits(0)  # no rows
            tokens = [
                sampler.sample(i, logits) for sampler, i in zip(samplers, indices, strict=True)
            ]
        else:
            # Logits were asked for exactly where a token is sampled, so output row i belongs
            # to sampling[i]: one view of them all instead of one per slot. Unless a prompt
            # was scored: then its rows are picked out.
            logits = self.engine.output_logits(len(sampling)) if scored is None else scored
            tokens = sample_rows(samplers, indices, logits, self.sampling_threads)
        for i, (slot, _) in enumerate(sampling):
            if slot.occupant.think is not None:  # a thinking budget may close the block
                tokens[i] = slot.occupant.think.steer(tokens[i])
        is_eog, context = self.engine.is_eog, self.engine.slot_context
        return [
            sampled(slot, logits[row : row + 1], [token], is_eog, context)
            for row, ((slot, _), token) in enumerate(zip(sampling, tokens, strict=True))
        ]

    def _update(self, sampled_now: list[Sampled]) -> int:
        """The scheduler records what was sampled; its chunks go out; return the tokens."""
        self.scheduler.update(sampled_now, time.monotonic(), self.outputs)
        self.drafting.settle()
        return sum(len(entry.tokens) for entry in sampled_now if entry.failure is None)

    # --- 7: emit -----------------------------------------------------------------------

    def _send_outputs(self) -> None:
        # The stats first: a heartbeat that follows these Outputs must not predate them.
        self._publish_stats()
        self.outputs.send(self.sink)

    def _publish_stats(self) -> None:
        """The stats for other threads, when the load changed (a request queued, admitted,
        ended, preempted) and otherwise at most every STATS_EVERY: at one stream, building
        them each tick was a sixth of the loop's time around the pass, for counters (a
        slot's tokens, the KV cells used) that nobody reads that often."""
        scheduler = self.scheduler
        load = (scheduler.queue_depth, scheduler.free_slots, scheduler.preemptions)
        now = time.monotonic()
        if load == self._published_load and now - self._published_at < STATS_EVERY:
            return
        self._published_load, self._published_at = load, now
        prefixes = self._prefixes.keys(scheduler.slots, scheduler.ram)
        self.board.publish(scheduler_stats(scheduler, self.tick_cost.coefficients(), prefixes))

    def _after_tick(self, step: Step, n_sampled: int, started: float) -> None:
        self.tick_count += 1
        seconds = time.perf_counter() - started
        plan = step.plan
        decode_tokens, prefill_tokens = len(plan.decode), plan.n_tokens - len(plan.decode)
        if step.n_extra and self.speculator is not None:
            # What the drafts added to the tick, beyond the model's price for the rest.
            surcharge = seconds - self.tick_cost.predict(decode_tokens, prefill_tokens)
            self.speculator.cost.observe(step.n_extra, surcharge)
        else:
            self.tick_cost.observe(decode_tokens, prefill_tokens, seconds)
        counts = self.drafting.take_counts()
        if not (self.config.log_ticks or self._on_tick):
            return
        scheduler, budget = self.scheduler, self.config.batch_tokens
        record = tick_record(self.tick_count, step, n_sampled, budget, scheduler, seconds, counts)
        if self.config.log_ticks:
            log_tick(record, step.n_tokens)
        if self._on_tick:
            self._on_tick(record)
