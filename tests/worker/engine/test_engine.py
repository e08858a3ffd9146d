"""The tick loop in-process on the real llama.cpp and the tiny model: no sockets, no mocks."""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import replace
from pathlib import Path

import llama_cpp as llama
import pytest
import structlog
from llguidance.gbnf_to_lark import any_to_lark
from structlog.testing import capture_logs

from loomserve.protocol import (
    Accepted,
    ErrorCode,
    Finish,
    FinishReason,
    Generate,
    Message,
    Outputs,
    Rejected,
    SamplingParams,
)
from loomserve.worker.cache.prefix_cache import usable_prefix
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine import llama_logs
from loomserve.worker.engine.engine import Engine, EngineError, float_weights
from loomserve.worker.engine.llama_logs import (
    GGML_LOG_CONT,
    GGML_LOG_ERROR,
    GGML_LOG_INFO,
    GGML_LOG_WARN,
    PROGRESS_EVERY_S,
    LlamaLogLines,
    LoadProgress,
)
from loomserve.worker.sched.strategies import BatchPlan
from loomserve.worker.tick.loop import TickLoop
from tests.tiny_model import TINY, write_tiny_model
from tests.worker.text import detokenize

GW = b"gw-1"


class Collector:
    """A Sink that keeps every message, per gateway, in order."""

    def __init__(self) -> None:
        self.messages: list[tuple[bytes, Message]] = []
        self.changed = threading.Condition()

    def send(self, gateway: bytes, message: Message) -> None:
        with self.changed:
            self.messages.append((gateway, message))
            self.changed.notify_all()

    def flush(self) -> None:
        pass

    def of_type(self, cls, gateway: bytes = GW) -> list:
        return [m for g, m in self.messages if g == gateway and isinstance(m, cls)]

    def tokens(self, gateway: bytes = GW) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for outputs in self.of_type(Outputs, gateway):
            for chunk in outputs.tokens:
                out.setdefault(chunk.request_id, []).extend(chunk.token_ids)
        return out

    def finishes(self, gateway: bytes = GW) -> dict[str, Finish]:
        out: dict[str, Finish] = {}
        for outputs in self.of_type(Outputs, gateway):
            for finish in outputs.finishes:
                assert finish.request_id not in out, "a request finished twice"
                out[finish.request_id] = finish
        return out

    def rejected(self, gateway: bytes = GW) -> dict[str, str]:
        return {m.request_id: m.code for m in self.of_type(Rejected, gateway)}


@pytest.fixture
def config(tiny_model_path: Path) -> WorkerConfig:
    return WorkerConfig(
        model_path=tiny_model_path,
        slots=8,
        ctx_size=256,
        max_queue=64,
        batch_tokens=32,
        prefill_chunk=7,
        # One thread: the tiny model gains nothing from two, and on a busy machine
        # threads spinning at ggml's barriers make thousands of tiny decodes crawl.
        threads=1,
    )


@pytest.fixture
def engine(config: WorkerConfig):
    engine = Engine(config)
    yield engine
    engine.close()


def new_loop(engine: Engine, config: WorkerConfig, **changes) -> tuple[TickLoop, Collector]:
    collector = Collector()
    return TickLoop(engine, replace(config, **changes), collector), collector


def drain(loop: TickLoop, max_ticks: int = 20_000) -> None:
    """Tick until every request has finished."""
    for _ in range(max_ticks):
        if not loop.scheduler.has_work() and loop.inbox.empty():
            return
        loop.tick(block=False)
    raise AssertionError("the worker did not finish its requests")


def greedy(request_id: str, prompt: list[int], max_tokens: int, **params) -> Generate:
    params.setdefault("temperature", 0.0)
    return Generate(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params))


def random_requests(n: int, n_vocab: int, seed: int) -> list[Generate]:
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        prompt = [1] + [rng.randrange(3, n_vocab) for _ in range(rng.randrange(0, 70))]
        max_tokens = rng.randrange(4, 40)
        requests.append(greedy(f"r{i}", prompt, max_tokens, ignore_eos=i % 2 == 0))
    return requests


def run_alone(engine: Engine, config: WorkerConfig, request: Generate) -> list[int]:
    loop, collector = new_loop(engine, config)
    loop.inbox.submit(GW, request)
    drain(loop)
    return collector.tokens().get(request.request_id, [])


def run_staggered(loop: TickLoop, requests: list[Generate], seed: int) -> None:
    """Submit the requests in waves, a few ticks apart, then run them all to the end."""
    rng = random.Random(seed)
    pending = list(requests)
    while pending:
        for _ in range(rng.randrange(1, 5)):
            if pending:
                loop.inbox.submit(GW, pending.pop(0))
        for _ in range(rng.randrange(0, 4)):
            loop.tick(block=False)
    drain(loop)


# --- batch invariance ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "flash_attn"),
    [
        ("decode-maximal", "off"),
        ("prefill-priority", "off"),
        ("balanced", "off"),
        ("decode-maximal", "on"),
    ],
)
def test_greedy_output_is_the_same_alone_and_batched(engine, config, strategy, flash_attn):
    if flash_attn != config.flash_attn:
        config = replace(config, flash_attn=flash_attn)
        engine = Engine(config)
    requests = random_requests(16, engine.n_vocab, seed=7)
    alone = {r.request_id: run_alone(engine, config, r) for r in requests}

    loop, collector = new_loop(engine, config, strategy=strategy)
    run_staggered(loop, requests, seed=3)

    assert collector.tokens() == {rid: toks for rid, toks in alone.items() if toks}
    finishes = collector.finishes()
    assert set(finishes) == set(alone)
    for request in requests:
        finish = finishes[request.request_id]
        assert finish.prompt_tokens == len(request.prompt_tokens)
        sent = len(alone[request.request_id])
        if finish.reason == FinishReason.STOP:
            assert finish.completion_tokens == sent + 1  # the end token, counted, not sent
        else:
            assert finish.reason == FinishReason.LENGTH
            assert finish.completion_tokens == sent == request.params.max_tokens
    # The batches really mixed prefill chunks and decode tokens of many requests.
    assert loop.tick_count < sum(len(t) for t in alone.values())


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_prefix_reuse_keeps_outputs_identical(engine, config, batch_invariant):
    if batch_invariant != config.batch_invariant:
        config = replace(config, batch_invariant=batch_invariant)
        engine = Engine(config)
    rng = random.Random(11)
    bases = [[1] + [rng.randrange(3, engine.n_vocab) for _ in range(40)] for _ in range(4)]
    first = [greedy(f"a{i}", [*base, 5 + i], 12) for i, base in enumerate(bases)]
    # Extensions of the first prompts, an exact repeat, and strangers, mixed in one wave.
    second = [greedy(f"b{i}", [*base, 5 + i, 9, 10, 11], 12) for i, base in enumerate(bases)]
    second.append(greedy("repeat", [*bases[0], 5], 12))
    second += [greedy(f"new{i}", [1, 30 + i, 40 + i], 12) for i in range(3)]

    alone = {r.request_id: run_alone(engine, config, r) for r in first + second}

    loop, collector = new_loop(engine, config)
    run_staggered(loop, first, seed=1)
    run_staggered(loop, second, seed=2)

    assert collector.tokens() == alone
    finishes = collector.finishes()
    for i in range(4):
        # The whole first prompt plus the tokens generated after it were cached.
        assert finishes[f"b{i}"].cached_tokens >= len(bases[i]) + 1
    # b0 holds the slot that cached a0's prompt when the repeat arrives: the repeat copies
    # it from there (with a KV stream per slot, a copy of b0's whole stream, then cut back).
    # All but the tail whose kernels must run as they did cold (usable_prefix): the last
    # prompt token, or with batch invariance the last 2 (a last pass of 2 to 63 rows).
    repeat = len(bases[0]) + 1
    expected = usable_prefix(repeat, repeat, engine.split_rules.prompt_chunk)
    assert expected == repeat - (2 if batch_invariant else 1)
    assert finishes["repeat"].cached_tokens == expected
    assert all(finishes[f"new{i}"].cached_tokens <= 1 for i in range(3))


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_prefix_reuse_while_others_run(engine, config, batch_invariant):
    """Prefixes copied from busy slots, by whole KV stream or by shared cells: either way
    the outputs are those of each request alone."""
    if batch_invariant != config.batch_invariant:
        config = replace(config, batch_invariant=batch_invariant)
        engine = Engine(config)
    shared = [1, *range(100, 160)]
    requests = [greedy(f"r{i}", [*shared, 200 + i], 20, ignore_eos=True) for i in range(12)]
    alone = {r.request_id: run_alone(engine, config, r) for r in requests}
    loop, collector = new_loop(engine, config, slots=3)
    run_staggered(loop, requests, seed=5)
    assert collector.tokens() == alone
    assert sum(f.cached_tokens for f in collector.finishes().values()) > 0


# --- queue, cancellation, limits ------------------------------------------------------------


def test_a_full_queue_rejects_at_once(engine, config):
    loop, collector = new_loop(engine, config, slots=2, max_queue=3)
    for i in range(7):
        loop.inbox.submit(GW, greedy(f"r{i}", [1, 5, 6], 4))
    loop.tick(block=False)
    accepted = collector.of_type(Accepted)
    assert [a.request_id for a in accepted] == ["r0", "r1", "r2", "r3", "r4"]
    assert [a.queue_depth for a in accepted] == [0, 0, 1, 2, 3]
    assert collector.rejected() == {"r5": "queue_full", "r6": "queue_full"}
    drain(loop)
    assert set(collector.finishes()) == {"r0", "r1", "r2", "r3", "r4"}
    # Once the queue drained, new requests are taken again.
    loop.inbox.submit(GW, greedy("late", [1, 5], 2))
    drain(loop)
    assert collector.finishes()["late"].reason == FinishReason.LENGTH


def test_cancelling_a_running_request_frees_its_slot_and_cells(engine, config):
    loop, collector = new_loop(engine, config, slots=2)
    loop.inbox.submit(GW, greedy("long", [1, *range(10, 50)], 200, ignore_eos=True))
    loop.inbox.submit(GW, greedy("other", [1, 7, 8], 30, ignore_eos=True))
    for _ in range(10):
        loop.tick(block=False)
    slot = next(s for s in loop.scheduler.slots if s.request and s.request.request_id == "long")
    assert engine.seq_pos_max(slot.index) >= 40
    loop.inbox.abort(GW, "long")
    loop.tick(block=False)
    finish = collector.finishes()["long"]
    assert finish.reason == FinishReason.CANCELLED and 0 < finish.completion_tokens < 200
    assert engine.seq_pos_max(slot.index) == -1 and not slot.busy
    assert loop.scheduler.free_slots == 1
    drain(loop)
    assert collector.finishes()["other"].completion_tokens == 30


def test_cancelling_a_queued_request_never_runs_it(engine, config):
    loop, collector = new_loop(engine, config, slots=1)
    loop.inbox.submit(GW, greedy("first", [1, 5, 6], 20, ignore_eos=True))
    loop.inbox.submit(GW, greedy("waiting", [1, 7], 20))
    loop.tick(block=False)
    loop.inbox.abort(GW, "waiting")
    loop.inbox.abort(GW, "no-such-request")  # ignored: it may have just finished
    drain(loop)
    finishes = collector.finishes()
    assert finishes["waiting"].reason == FinishReason.CANCELLED
    assert finishes["waiting"].completion_tokens == 0
    assert "waiting" not in collector.tokens()
    assert finishes["first"].completion_tokens == 20


def test_a_vanished_gateway_loses_all_its_requests(engine, config):
    loop, collector = new_loop(engine, config, slots=2)
    for i in range(4):
        loop.inbox.submit(b"gone", greedy(f"g{i}", [1, 5 + i], 50, ignore_eos=True))
    loop.inbox.submit(GW, greedy("stays", [1, 9], 30, ignore_eos=True))
    loop.tick(block=False)
    loop.tick(block=False)
    loop.inbox.gateway_gone(b"gone", "it disconnected")
    drain(loop)
    gone = collector.finishes(b"gone")
    assert {f.reason for f in gone.values()} == {FinishReason.CANCELLED}
    assert len(gone) == 4
    assert collector.finishes()["stays"].completion_tokens == 30
    assert all(engine.seq_pos_max(s.index) == s.n_in_cache - 1 for s in loop.scheduler.slots)


def test_a_thousand_short_requests_leave_nothing_behind(engine, config):
    loop, collector = new_loop(engine, config, slots=4, max_queue=1000)
    rng = random.Random(2)
    for i in range(1000):
        prompt = [1] + [rng.randrange(3, engine.n_vocab) for _ in range(rng.randrange(0, 6))]
        loop.inbox.submit(GW, greedy(f"r{i}", prompt, rng.randrange(1, 5)))
    drain(loop)
    finishes = collector.finishes()
    assert len(finishes) == 1000 and not collector.rejected()
    assert loop.scheduler.live == {} and loop.scheduler.free_slots == 4
    for slot in loop.scheduler.slots:
        # Only the finished request's reusable prefix stays: positions 0..n_in_cache-1.
        assert not slot.busy and slot.phase.value == "idle"
        assert engine.seq_pos_max(slot.index) == slot.n_in_cache - 1
        assert llama.llama_memory_seq_pos_min(engine.memory, slot.index) in (0, -1)
    assert sum(f.cached_tokens for f in finishes.values()) > 0


def test_prompt_too_long_is_refused_before_it_takes_a_slot(engine, config):
    loop, collector = new_loop(engine, config)
    limit = engine.slot_context
    loop.inbox.submit(GW, greedy("too-long", [1] * limit, 4))
    loop.inbox.submit(GW, greedy("just-fits", [1] * (limit - 1), 4))
    drain(loop)
    assert collector.rejected() == {"too-long": "prompt_too_long"}
    finish = collector.finishes()["just-fits"]
    assert finish.reason == FinishReason.LENGTH and finish.completion_tokens == 1


def test_the_slot_context_limits_generation(engine, config):
    loop, collector = new_loop(engine, config)
    prompt = [1, *range(10, 10 + engine.slot_context - 6)]
    loop.inbox.submit(GW, greedy("r", prompt, 100, ignore_eos=True))
    drain(loop)
    finish = collector.finishes()["r"]
    assert finish.reason == FinishReason.LENGTH
    assert finish.prompt_tokens + finish.completion_tokens == engine.slot_context


@pytest.mark.parametrize(
    ("generate", "code"),
    [
        (greedy("bad-token", [1, 10**6], 4), ErrorCode.INVALID_REQUEST),
        (greedy("bad-bias", [1, 2], 4, logit_bias={10**6: 1.0}), ErrorCode.INVALID_REQUEST),
        (greedy("bad-grammar", [1, 2], 4, grammar="root ::= ("), ErrorCode.INVALID_REQUEST),
        (greedy("no-start", [1, 2], 4, grammar='root: "a"'), ErrorCode.INVALID_REQUEST),
    ],
)
def test_invalid_requests_are_rejected(engine, config, generate, code):
    loop, collector = new_loop(engine, config)
    loop.inbox.submit(GW, generate)
    drain(loop)
    assert collector.rejected() == {generate.request_id: code.value}
    assert collector.finishes() == {} and loop.scheduler.free_slots == config.slots


def test_request_ids_are_per_gateway_and_unique_while_live(engine, config):
    loop, collector = new_loop(engine, config)
    loop.inbox.submit(GW, greedy("same", [1, 5], 5))
    loop.inbox.submit(GW, greedy("same", [1, 6], 5))
    loop.inbox.submit(b"gw-2", greedy("same", [1, 5], 5))
    drain(loop)
    assert collector.rejected() == {"same": "duplicate_request"}
    assert collector.tokens()["same"] == collector.tokens(b"gw-2")["same"]
    loop.inbox.submit(GW, greedy("same", [1, 5], 5))  # finished ids may be used again
    drain(loop)
    assert len(collector.of_type(Accepted)) == 2


# --- sampling ---------------------------------------------------------------------------------


def test_an_end_of_generation_token_stops_and_is_not_sent(engine, config):
    loop, collector = new_loop(engine, config)
    loop.inbox.submit(GW, greedy("eos", [1, 5], 10, logit_bias={2: 100.0}))
    loop.inbox.submit(GW, greedy("ignored", [1, 5], 4, logit_bias={2: 100.0}, ignore_eos=True))
    drain(loop)
    finishes = collector.finishes()
    assert finishes["eos"].reason == FinishReason.STOP and finishes["eos"].completion_tokens == 1
    assert "eos" not in collector.tokens()
    assert collector.tokens()["ignored"] == [2, 2, 2, 2]


def test_prompt_logprobs_score_every_prompt_token_across_chunks(engine, config):
    """A scoring request's prompt is evaluated in chunks (prefill_chunk 7): each chunk's rows
    score the tokens after them, in order, and its sampled tokens are what it samples alone."""
    prompt = [1, *range(10, 30)]
    loop, collector = new_loop(engine, config)
    loop.inbox.submit(GW, greedy("plain", [1, 7, 8], 4, ignore_eos=True))
    loop.inbox.submit(GW, greedy("scored", prompt, 6, ignore_eos=True, prompt_logprobs=2))
    drain(loop)
    scored = [
        chunk.prompt_logprobs
        for outputs in collector.of_type(Outputs)
        for chunk in outputs.tokens
        if chunk.request_id == "scored" and chunk.prompt_logprobs is not None
    ]
    assert len(scored) > 1  # one per chunk of the prompt
    positions = [p.first + i for p in scored for i in range(len(p.logprobs))]
    assert positions == list(range(1, len(prompt)))
    assert all(
        len(entry.top_ids) == 2 and entry.logprob <= 0.0 for p in scored for entry in p.logprobs
    )
    alone = run_alone(engine, config, greedy("scored", prompt, 6, ignore_eos=True))
    assert collector.tokens()["scored"] == alone
    assert len(collector.tokens()["plain"]) == 4


def test_seeded_sampling_repeats_alone_and_batched(engine, config):
    def sampled(request_id: str, seed: int) -> Generate:
        params = SamplingParams(max_tokens=24, temperature=1.3, top_k=50, top_p=0.95, seed=seed)
        return Generate(request_id, [1, 40, 41, 42], params)

    alone = run_alone(engine, config, sampled("x", 1234))
    loop, collector = new_loop(engine, config)
    requests = [sampled("again", 1234), sampled("other-seed", 99)]
    requests += [greedy(f"noise{i}", [1, 7 + i], 20) for i in range(6)]
    run_staggered(loop, requests, seed=4)
    tokens = collector.tokens()
    assert tokens["again"] == alone
    assert tokens["other-seed"] != alone


def test_seeded_sampling_repeats_after_a_restart(engine, config):
    """A new engine (a worker started again) gives a seeded request the same text."""
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, min_p=0.02, seed=7)
    request = Generate("seeded", [1, 40, 41, 42], params)
    before = run_alone(engine, config, request)
    restarted = Engine(config)
    try:
        assert run_alone(restarted, config, request) == before
    finally:
        restarted.close()


def test_unseeded_sampling_differs_between_requests(engine, config):
    loop, collector = new_loop(engine, config)
    params = SamplingParams(max_tokens=24, temperature=1.5)
    for i in range(4):
        loop.inbox.submit(GW, Generate(f"r{i}", [1, 40, 41], params))
    drain(loop)
    assert len({tuple(t) for t in collector.tokens().values()}) > 1


def test_grammar_constrains_the_output(engine, config):
    grammar = any_to_lark(r"""
root   ::= "{" ws "\"count\"" ws ":" ws number ws "," ws "\"name\"" ws ":" ws string ws "}"
number ::= [1-9] [0-9]{0,4}
string ::= "\"" [a-z]{1,8} "\""
ws     ::= [ ]?
""")
    loop, collector = new_loop(engine, config)
    for seed in range(4):
        params = SamplingParams(max_tokens=60, temperature=1.0, seed=seed, grammar=grammar)
        loop.inbox.submit(GW, Generate(f"json{seed}", [1, 40, 41], params))
    digits = SamplingParams(max_tokens=5, temperature=0.0, grammar="start: /[0-9]+/")
    loop.inbox.submit(GW, Generate("digits", [1, 40], digits))
    drain(loop)
    tokens, finishes = collector.tokens(), collector.finishes()
    for seed in range(4):
        document = json.loads(detokenize(engine, tokens[f"json{seed}"]))
        assert set(document) == {"count", "name"} and document["count"] >= 1
        assert finishes[f"json{seed}"].reason == FinishReason.STOP  # the grammar completed
    assert detokenize(engine, tokens["digits"]).strip().isdigit()


def test_penalties_and_bias_shape_sampling(engine, config):
    loop, collector = new_loop(engine, config)
    banned = run_alone(engine, config, greedy("plain", [1, 40, 41], 8))[0]
    loop.inbox.submit(GW, greedy("biased", [1, 40, 41], 8, logit_bias={banned: float("-inf")}))
    loop.inbox.submit(
        GW,
        greedy(
            "penalised", [1, 40, 41], 30, repeat_penalty=10.0, repeat_last_n=-1, ignore_eos=True
        ),
    )
    loop.inbox.submit(
        GW, greedy("present", [1, 40, 41], 30, presence_penalty=2.0, frequency_penalty=2.0)
    )
    drain(loop)
    tokens = collector.tokens()
    assert banned not in tokens["biased"]
    assert len(tokens["penalised"]) == 30
    assert tokens["present"]


def test_a_requests_bias_and_penalties_change_its_own_tokens_only(engine, config):
    """A tick writes a request's bias and penalties into that request's own row of logits
    and puts them back after (sample_rows): the requests beside it, greedy and seeded, give
    what they give alone, and it gives alone and batched the same tokens and logprobs (read
    from its row after the draw), which its bias and penalties did change."""
    plain = greedy("plain", [1, 40, 41, 42], 24, ignore_eos=True)
    seeded = greedy("seeded", [1, 50, 51], 24, temperature=0.9, seed=7, ignore_eos=True)
    shaped = {"logprobs": 3, "ignore_eos": True}
    adjusted = [
        greedy(
            "adjusted",
            [1, 40, 41, 42],
            24,
            frequency_penalty=1.5,
            presence_penalty=0.5,
            logit_bias={60: 4.0, 61: 4.0},
            **shaped,
        ),
        greedy(
            "adjusted-seeded",
            [1, 50, 51],
            24,
            temperature=0.9,
            seed=7,
            repeat_penalty=1.3,
            logit_bias={5: -float("inf")},
            **shaped,
        ),
    ]

    def outputs(requests: list[Generate]) -> dict[str, tuple[list[int], list]]:
        loop, collector = new_loop(engine, config)
        for request in requests:
            loop.inbox.submit(GW, request)
        drain(loop)
        found: dict[str, tuple[list[int], list]] = {}
        for outputs in collector.of_type(Outputs, GW):
            for chunk in outputs.tokens:
                tokens, logprobs = found.setdefault(chunk.request_id, ([], []))
                tokens.extend(chunk.token_ids)
                logprobs.extend(chunk.logprobs or [])
        return found

    alone = {}
    for request in [plain, seeded, *adjusted]:
        alone.update(outputs([request]))
    together = outputs([plain, *adjusted, seeded])
    assert {rid: tokens for rid, (tokens, _) in together.items()} == {
        rid: tokens for rid, (tokens, _) in alone.items()
    }
    # The tokens are the promise; the logits alone and batched agree to about 1e-4 on an
    # AVX-512 Xeon and 1.3e-3 on an AVX2-only EPYC (this F32 model's one-row dot product and
    # many-row sgemm sum in other orders), a plain request's as much as these (its logprobs
    # differ from the second token on, by 1e-7, growing along the sequence).
    for rid in ("adjusted", "adjusted-seeded"):
        for batched, lone in zip(together[rid][1], alone[rid][1], strict=True):
            assert batched.top_ids == lone.top_ids
            assert [batched.logprob, *batched.top_logprobs] == pytest.approx(
                [lone.logprob, *lone.top_logprobs], rel=5e-3, abs=1e-4
            )
    assert alone["adjusted"][0] != alone["plain"][0]
    assert alone["adjusted-seeded"][0] != alone["seeded"][0]
    assert len(alone["adjusted"][1]) == 24 and 5 not in alone["adjusted-seeded"][0]


# --- failures -------------------------------------------------------------------------------


def test_a_failed_decode_fails_its_requests_and_the_worker_serves_on(engine, config):
    loop, collector = new_loop(engine, config)
    real_decode = engine.decode
    failures = iter([-1])

    def failing_once(batch):
        code = next(failures, None)
        return real_decode(batch) if code is None else code

    engine.decode = failing_once
    loop.inbox.submit(GW, greedy("unlucky", [1, 5, 6], 5))
    loop.inbox.submit(GW, greedy("also-unlucky", [1, 7], 5))
    drain(loop)
    finishes = collector.finishes()
    for rid in ("unlucky", "also-unlucky"):
        assert finishes[rid].reason == FinishReason.ERROR
        assert "llama_decode failed" in finishes[rid].message
    assert all(engine.seq_pos_max(s.index) == -1 for s in loop.scheduler.slots)
    loop.inbox.submit(GW, greedy("later", [1, 5, 6], 5))
    drain(loop)
    assert collector.finishes()["later"].completion_tokens == 5


class OverBudget:
    """A broken user strategy: asks for more tokens than the budget."""

    def plan(self, slots, budget, chunk_size, queue_depth):
        return BatchPlan(prefill={s.index: s.prompt_remaining for s in slots if s.prompt_remaining})


def test_an_invalid_plan_falls_back_to_decode_maximal(engine, config, monkeypatch):
    loop, collector = new_loop(engine, config)
    loop.scheduler.strategy = OverBudget()
    loop.inbox.submit(GW, greedy("r", [1, *range(10, 80)], 6))
    drain(loop)
    assert collector.finishes()["r"].completion_tokens == 6


def test_stop_past_its_timeout_cancels_every_live_request_with_a_reason(engine, config):
    loop, collector = new_loop(engine, config, slots=1, shutdown_timeout=0.0)
    for i in range(3):
        loop.inbox.submit(GW, greedy(f"r{i}", [1, 5], 10_000, ignore_eos=True))
    thread = threading.Thread(target=loop.run)
    thread.start()
    with collector.changed:
        collector.changed.wait_for(lambda: len(collector.tokens().get("r0", [])) >= 5, timeout=30)
    loop.inbox.stop()
    thread.join(timeout=30)
    assert not thread.is_alive()
    finishes = collector.finishes()
    assert {f.reason for f in finishes.values()} == {FinishReason.CANCELLED}
    assert {f.message for f in finishes.values()} == {"the worker is shutting down"}
    assert len(finishes) == 3


def test_stop_lets_running_requests_finish_and_refuses_new_ones(engine, config):
    loop, collector = new_loop(engine, config, slots=1, shutdown_timeout=60.0)
    for i in range(2):
        loop.inbox.submit(GW, greedy(f"r{i}", [1, 5], 40, ignore_eos=True))
    loop.tick(block=False)
    loop.inbox.stop()
    loop.inbox.submit(GW, greedy("late", [1, 5], 4))
    started = time.monotonic()
    loop.run()  # returns once both have finished, long before the timeout
    assert time.monotonic() - started < 30
    finishes = collector.finishes()
    assert {f.reason for f in finishes.values()} == {FinishReason.LENGTH}
    assert all(len(collector.tokens()[f"r{i}"]) == 40 for i in range(2))
    assert collector.rejected() == {"late": ErrorCode.NOT_READY}


def test_ticks_failing_in_a_row_declare_the_engine_dead(engine, config, monkeypatch):
    monkeypatch.setenv("LOOMSERVE_TEST_FAIL_DECODE", "every")
    loop, collector = new_loop(engine, config, slots=1, max_failed_ticks=3)
    for i in range(4):
        loop.inbox.submit(GW, greedy(f"r{i}", [1, 5], 4))
    loop.run()  # one slot: each tick runs one request, and each tick raises
    assert loop.dead == "3 ticks in a row failed"
    finishes = collector.finishes()
    assert {f"r{i}": finishes[f"r{i}"].reason for i in range(3)} == dict.fromkeys(
        ("r0", "r1", "r2"), FinishReason.ERROR
    )
    assert "r3" not in finishes  # still queued: the server tells the gateways it is dead


def test_a_failing_tick_fails_its_requests_alone(engine, config, monkeypatch):
    monkeypatch.setenv("LOOMSERVE_TEST_FAIL_DECODE", "once")
    loop, collector = new_loop(engine, config, slots=1, max_failed_ticks=2)
    loop.inbox.submit(GW, greedy("poison", [1, 5], 4))
    loop.inbox.submit(GW, greedy("fine", [1, 5], 4, ignore_eos=True))
    loop.inbox.stop()  # drains: returns when both have finished
    loop.run()
    assert loop.dead is None and loop.failed_ticks == 0
    finishes = collector.finishes()
    assert finishes["poison"].reason == FinishReason.ERROR
    assert finishes["poison"].message == "internal error in the worker's tick"
    assert finishes["fine"].reason == FinishReason.LENGTH


def test_a_quantized_kv_cache_needs_flash_attention(config):
    with pytest.raises(EngineError, match="needs --flash-attn"):
        Engine(replace(config, kv_cache_type="q8_0", flash_attn="off"))


def test_llama_cpps_log_reaches_structlog_as_whole_lines_at_its_level(monkeypatch) -> None:
    """Its warnings and errors at their level, a line cut across CONT calls joined, its info
    chatter and the warnings with nothing to act on (a model's token types) at debug."""
    # A test before this one may have configured structlog at info and cached the module's
    # logger with that filter: a fresh logger under the default configuration sees debug.
    saved = structlog.get_config()
    structlog.reset_defaults()
    try:
        _llama_lines_at_their_levels(monkeypatch)
    finally:
        structlog.configure(**saved)


def _llama_lines_at_their_levels(monkeypatch) -> None:
    monkeypatch.setattr(llama_logs, "_llama_log", structlog.get_logger("llama.cpp"))
    lines = LlamaLogLines()
    with capture_logs() as logs:
        lines.feed(GGML_LOG_INFO, "llama_model_loader: loaded meta data\n")
        lines.feed(
            GGML_LOG_WARN,
            "load: control-looking token:    106 '<end_of_turn>' was not control-type; this is "
            "probably a bug in the model. its type will be overridden\n",
        )
        lines.feed(GGML_LOG_WARN, "llama_kv_cache_iswa: using full-size SWA cache (ref: x)\n")
        lines.feed(GGML_LOG_WARN, "something ")
        lines.feed(GGML_LOG_CONT, "to look at\n")
        lines.feed(GGML_LOG_ERROR, "failed to read\n")
        lines.feed(GGML_LOG_WARN, "n_ctx_seq exceeds: possible training context overflow\n")
    assert [(log["log_level"], log["event"]) for log in logs] == [
        ("debug", "llama_model_loader: loaded meta data"),
        ("debug", logs[1]["event"]),
        ("debug", "llama_kv_cache_iswa: using full-size SWA cache (ref: x)"),
        ("warning", "something to look at"),
        ("error", "failed to read"),
    ]
    assert "control-looking token" in logs[1]["event"]


def test_a_quick_model_load_logs_its_start_only_and_a_slow_one_its_progress(
    tiny_model_path: Path,
) -> None:
    with capture_logs() as logs:
        quick = LoadProgress(tiny_model_path)
        for quarter in range(5):
            quick._on_progress(quarter / 4, None)
        slow = LoadProgress(tiny_model_path)
        slow.logged_at -= PROGRESS_EVERY_S  # as if the load had been running that long
        slow._on_progress(0.5, None)
        slow._on_progress(0.75, None)  # within PROGRESS_EVERY_S of the last line
    assert [log.get("percent") for log in logs if log["event"] == "loading model"] == [
        None,
        None,
        50,
    ]


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_float_weights_say_at_start_that_batch_invariance_is_not_exact(
    config: WorkerConfig, batch_invariant: bool
) -> None:
    """F32, F16 and BF16 matmuls take llamafile's sgemm from two rows and ggml's dot product
    for one, summing in another order: the tiny model (F32) says so when it loads with batch
    invariance on. (Gemma's quantized weights agree alone and batched to the bit.)"""
    with capture_logs() as logs:
        engine = Engine(replace(config, batch_invariant=batch_invariant))
    engine.close()
    said = [log for log in logs if "batch invariance is exact" in log["event"]]
    assert len(said) == batch_invariant
    assert all(log["log_level"] == "warning" and "are F32" in log["event"] for log in said)


def test_the_float_type_of_the_weights_comes_from_the_file_type(tmp_path: Path) -> None:
    llama.llama_backend_init()
    for shape, expected in ((TINY, "F32"), (replace(TINY, f16=True), "F16")):
        path = write_tiny_model(tmp_path / f"{expected}.gguf", shape=shape)
        params = llama.llama_model_default_params()
        model = llama.llama_model_load_from_file(str(path).encode(), params)
        try:
            assert float_weights(model) == expected
        finally:
            llama.llama_model_free(model)
