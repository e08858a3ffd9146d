"""Speculation on the real tiny model: drafts never change what a request produces (greedy,
seeded sampling, logprobs, max_tokens), alone or batched, with or without batch invariance;
rejected drafts leave no KV cell behind; the metrics count them; a request can opt out."""

from __future__ import annotations

import random
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import pytest
from llguidance.gbnf_to_lark import any_to_lark

from loomserve.protocol import FinishReason, Generate, Outputs, SamplingParams
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine
from loomserve.worker.metrics import WorkerMetrics
from loomserve.worker.sched.tick_cost import WARM_UP_TICKS
from loomserve.worker.stats import TickRecord
from loomserve.worker.tick.loop import TickLoop
from tests.worker.engine.test_engine import GW, Collector, drain, run_staggered
from tests.worker.text import detokenize


@pytest.fixture
def config(tiny_model_path: Path) -> WorkerConfig:
    return WorkerConfig(
        model_path=tiny_model_path,
        slots=6,
        ctx_size=256,
        batch_tokens=64,
        prefill_chunk=16,
        threads=1,
        # One engine serves runs with drafts and without: the host sampler, which verifies
        # drafts (auto picks it for a worker that drafts; one that does not draws inside
        # llama_decode, and drawn requests do not draft).
        backend_sampling="off",
    )


@pytest.fixture
def engine(config: WorkerConfig):
    engine = Engine(config)
    yield engine
    engine.close()


def always_draft(loop: TickLoop) -> None:
    """Make every tick draft as much as its budget and passes allow, whatever it costs: the
    adaptive choice is tested on its own (test_speculation.py); here drafts must be many."""
    loop.tick_cost.fit.observations = WARM_UP_TICKS

    def longest(proposals, room, tick_seconds, uniform, allowed) -> int:
        length = max((len(p.tokens) for p in proposals), default=0)
        while length and ((uniform * length if uniform else length) > room or not allowed(length)):
            length -= 1
        return length

    loop.speculator.choose = longest


class Run:
    """A loop over the engine with its records, checking the KV cells after every tick."""

    def __init__(self, engine: Engine, config: WorkerConfig, spec: bool, force: bool) -> None:
        self.engine = engine
        self.records: list[TickRecord] = []
        self.collector = Collector()
        self.loop = TickLoop(
            engine, replace(config, spec_ngram=spec), self.collector, on_tick=self.on_tick
        )
        if spec and force:
            always_draft(self.loop)

    def on_tick(self, record: TickRecord) -> None:
        self.records.append(record)
        # No cell beyond what each slot holds: rejected drafts and filler were dropped.
        for slot in self.loop.scheduler.slots:
            assert self.engine.seq_pos_max(slot.index) == slot.n_in_cache - 1, slot.index

    @property
    def drafted(self) -> int:
        return sum(record.draft_tokens for record in self.records)

    @property
    def accepted(self) -> int:
        return sum(record.accepted_tokens for record in self.records)


def repetitive_requests(n: int, n_vocab: int, seed: int, **params) -> list[Generate]:
    """Prompts that repeat a phrase (as an edit of a passage does), and plain random ones."""
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        phrase = [rng.randrange(3, n_vocab) for _ in range(rng.randrange(3, 9))]
        noise = [rng.randrange(3, n_vocab) for _ in range(rng.randrange(0, 6))]
        prompt = [1] + (phrase * rng.randrange(2, 5) + noise if i % 3 else noise + phrase)
        sampling = {"temperature": 0.0, "ignore_eos": i % 2 == 0, **params}
        max_tokens = rng.randrange(5, 60)
        requests.append(
            Generate(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, **sampling))
        )
    return requests


def alone(engine: Engine, config: WorkerConfig, request: Generate, spec: bool) -> Run:
    run = Run(engine, config, spec, force=True)
    run.loop.inbox.submit(GW, request)
    drain(run.loop)
    return run


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_greedy_output_is_the_same_with_drafts_alone_and_batched(engine, config, batch_invariant):
    if not batch_invariant:
        config = replace(config, batch_invariant=False)
        engine = Engine(config)
    requests = repetitive_requests(12, engine.n_vocab, seed=11)
    plain = {
        r.request_id: alone(engine, config, r, spec=False).collector.tokens() for r in requests
    }
    drafted = 0
    for request in requests:
        run = alone(engine, config, request, spec=True)
        assert run.collector.tokens() == plain[request.request_id]
        drafted += run.drafted
    batched = Run(engine, config, spec=True, force=True)
    run_staggered(batched.loop, requests, seed=2)
    expected = {}
    for tokens in plain.values():
        expected.update(tokens)
    assert batched.collector.tokens() == expected
    finishes = batched.collector.finishes()
    for request in requests:
        finish = finishes[request.request_id]
        sent = len(expected.get(request.request_id, []))
        if finish.reason == FinishReason.LENGTH:
            assert finish.completion_tokens == sent == request.params.max_tokens
        else:
            assert finish.reason == FinishReason.STOP and finish.completion_tokens == sent + 1
    # Drafts were really made and some were right (else this tested nothing).
    assert drafted > 0 and batched.drafted > 0
    assert batched.accepted > 0
    assert batched.accepted < batched.drafted
    # Several tokens came from one tick for one slot.
    assert len(batched.records) < sum(len(t) for t in expected.values())


def test_seeded_sampling_and_logprobs_are_the_same_with_drafts(engine, config):
    params = {"temperature": 0.8, "top_k": 3, "logprobs": 2}
    requests = [
        replace(r, params=replace(r.params, seed=100 + i))
        for i, r in enumerate(repetitive_requests(6, engine.n_vocab, seed=5, **params))
    ]

    def chunks(run: Run) -> dict[str, list]:
        out: dict[str, list] = {}
        for outputs in run.collector.of_type(Outputs):
            for chunk in outputs.tokens:
                out.setdefault(chunk.request_id, []).append((chunk.token_ids, chunk.logprobs))
        return out

    runs = {}
    for spec in (False, True):
        runs[spec] = Run(engine, config, spec, force=True)
        run_staggered(runs[spec].loop, requests, seed=3)
    assert runs[True].drafted > 0
    with_drafts, without = chunks(runs[True]), chunks(runs[False])
    assert with_drafts.keys() == without.keys()
    for request_id, sent in with_drafts.items():
        assert [tokens for tokens, _ in sent] == [tokens for tokens, _ in without[request_id]]
        # Logprobs to float precision: batch invariance promises the same tokens, and a
        # tick's make-up moves logits in their sixth digit even without drafts.
        for (_, mine), (_, theirs) in zip(sent, without[request_id], strict=True):
            for a, b in zip(mine, theirs, strict=True):
                assert a.top_ids == b.top_ids
                assert a.logprob == pytest.approx(b.logprob, rel=1e-4, abs=1e-5)


def test_max_tokens_cuts_inside_an_accepted_draft(engine, config):
    # A prompt that repeats: the model's continuation is drafted from it, long drafts.
    phrase = [50, 51, 52, 53, 54, 55, 56, 57]
    prompt = [1] + phrase * 6
    for max_tokens in (1, 2, 3, 7):
        request = Generate("cut", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        plain = alone(engine, config, request, spec=False).collector
        drafted = alone(engine, config, request, spec=True)
        assert drafted.collector.tokens() == plain.tokens()
        finish = drafted.collector.finishes()["cut"]
        assert finish.completion_tokens == plain.finishes()["cut"].completion_tokens


def test_metrics_count_drafted_and_accepted_tokens(engine, config):
    metrics = WorkerMetrics()
    run = Run(engine, config, spec=True, force=True)
    run.loop._on_tick = lambda record: (run.on_tick(record), metrics.on_tick(record))
    run_staggered(run.loop, repetitive_requests(8, engine.n_vocab, seed=21), seed=1)
    registry = metrics.registry

    def value(name: str, **labels) -> float:
        return registry.get_sample_value(f"loomserve:{name}", labels) or 0.0

    assert value("spec_decode_num_draft_tokens_total") == run.drafted > 0
    assert value("spec_decode_num_accepted_tokens_total") == run.accepted > 0
    drafts = sum(record.drafts for record in run.records)
    assert value("spec_decode_num_drafts_total") == drafts > 0
    per_position = [
        value("spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(16)
    ]
    assert per_position[0] > 0 and sum(per_position) == run.accepted
    assert all(a >= b for a, b in pairwise(per_position))  # a prefix is accepted
    assert value("batch_tokens_total", kind="draft") == run.drafted


def test_a_request_that_opts_out_gets_no_drafts(engine, config):
    requests = repetitive_requests(6, engine.n_vocab, seed=8, speculative=False)
    plain = Run(engine, config, spec=False, force=False)
    run_staggered(plain.loop, requests, seed=1)
    opted_out = Run(engine, config, spec=True, force=True)
    run_staggered(opted_out.loop, requests, seed=1)
    assert opted_out.drafted == 0
    assert opted_out.collector.tokens() == plain.collector.tokens()
    # The same requests without the opt-out do draft.
    drafting = Run(engine, config, spec=True, force=True)
    run_staggered(drafting.loop, repetitive_requests(6, engine.n_vocab, seed=8), seed=1)
    assert drafting.drafted > 0


def test_the_adaptive_choice_drafts_on_a_repetitive_load_and_keeps_outputs(engine, config):
    """No forcing: the tick-cost model and the acceptance decide."""
    requests = repetitive_requests(4, engine.n_vocab, seed=13)
    requests = [
        replace(r, params=replace(r.params, max_tokens=120, ignore_eos=True)) for r in requests
    ]
    plain = Run(engine, config, spec=False, force=False)
    adaptive = Run(engine, config, spec=True, force=False)
    for run in (plain, adaptive):
        for request in requests:
            run.loop.inbox.submit(GW, request)
        drain(run.loop)
    assert adaptive.collector.tokens() == plain.collector.tokens()
    assert adaptive.drafted > 0


def test_drafts_of_a_grammar_request_are_verified_against_its_grammar(engine, config):
    """Drafted tokens are checked by the grammar as they are verified: the greedy output is
    the one without drafts, every output keeps to the grammar, and drafts were made (the
    constrained outputs repeat, which n-gram drafting feeds on)."""
    grammar = any_to_lark('root ::= ("ab" | "ba" | " ")+')
    requests = repetitive_requests(6, engine.n_vocab, seed=3, grammar=grammar)
    drafted = 0
    for request in requests:
        plain = alone(engine, config, request, spec=False)
        run = alone(engine, config, request, spec=True)
        assert run.collector.tokens() == plain.collector.tokens(), request.request_id
        drafted += run.drafted
        text = detokenize(engine, run.collector.tokens().get(request.request_id, []))
        assert set(text) <= {"a", "b", " "}, text
    assert drafted > 0
