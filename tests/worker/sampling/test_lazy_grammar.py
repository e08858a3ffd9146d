"""Lazy grammar sampling on the tiny model: the same greedy tokens as masking first.

The reference is an eager sampler (the grammar's mask over the whole vocabulary, then logit
bias, penalties and greedy from llama.cpp's own samplers) run through the same tick loop;
the worker's lazy sampler (check the pick, mask only when refused) must pick the same token
every time. The grammars are llguidance's (worker/sampling/guidance.py): bounded per step by
its limits, never by time.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import llama_cpp as llama
import numpy as np
import pytest
from llguidance.gbnf_to_lark import any_to_lark

from loomserve.gateway.text.grammar import json_schema_lark
from loomserve.protocol import ErrorCode, FinishReason, Generate, SamplingParams
from loomserve.protocol.limits import GRAMMAR_LIMITS
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine
from loomserve.worker.sampling.guidance import compile_grammar
from loomserve.worker.sampling.samplers import HostSampler, build_sampler
from loomserve.worker.tick.loop import TickLoop
from tests.worker.engine.test_engine import GW, Collector, drain
from tests.worker.llama_oracle import Candidates, llama_chain
from tests.worker.sampling.test_draw import _chi_square_p
from tests.worker.text import tokenize

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "cat"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "count"],
}
GBNF = {
    "digits": "root ::= [0-9]+",
    "choice": 'root ::= "yes" | "no" | "maybe so"',
    "words": 'root ::= word (" " word){2,6}\nword ::= [a-z]+',
    "call": (
        'root ::= "<tool_call>" ws "{\\"name\\": \\"" name "\\"}" ws "</tool_call>"\n'
        'name ::= "get_time" | "get_weather" | "search"\nws ::= [ \\n]?'
    ),
    "upper": "root ::= [A-Z] [a-zA-Z ,.]{3,40}",
    "list": 'root ::= "[" item ("," item)* "]"\nitem ::= [0-9]{1,3}',
}
GRAMMARS = {
    "json": json_schema_lark({"type": "object"}),
    "schema": json_schema_lark(SCHEMA),
    **{name: any_to_lark(grammar) for name, grammar in GBNF.items()},
}


@pytest.fixture(scope="module")
def config(tiny_model_path: Path) -> WorkerConfig:
    return WorkerConfig(
        model_path=tiny_model_path,
        slots=8,
        ctx_size=256,
        max_queue=256,
        batch_tokens=64,
        prefill_chunk=16,
        threads=1,
    )


@pytest.fixture(scope="module")
def engine(config: WorkerConfig):
    engine = Engine(config)
    yield engine
    engine.close()


class EagerSampler:
    """Masking first: the grammar's mask over every token, then the request's chain."""

    failure = None
    plain_greedy = False
    verifies_drafts = True
    drawn_in_graph = False  # its row is on the host

    def __init__(self, params: SamplingParams, engine: Engine) -> None:
        assert params.grammar is not None
        self.grammar = compile_grammar(params.grammar, engine.grammars)
        self.candidates = Candidates(engine.n_vocab)
        self.grammar_complete = False
        self.chain = llama_chain(params, engine.n_vocab, engine.slot_context)

    def sample(self, batch_index: int, logits: np.ndarray) -> int:
        candidates = self.candidates
        candidates.fill(logits)
        refused = np.ones(len(logits), dtype=bool)
        refused[self.grammar.allowed()] = False
        candidates.logits()[refused] = -np.inf
        llama.llama_sampler_apply(self.chain, candidates.pointer)
        token = candidates.selected()
        self.grammar.accept(token)
        llama.llama_sampler_accept(self.chain, token)
        self.grammar_complete = self.grammar.complete()
        return token

    def close(self) -> None:
        llama.llama_sampler_free(self.chain)


def requests(n_vocab: int, seed: int) -> list[Generate]:
    """Every grammar with several random prompts; some with a bias or penalties, so that the
    chain (not only the argmax) meets the grammar."""
    rng = random.Random(seed)
    out = []
    for name, grammar in GRAMMARS.items():
        for i in range(5):
            prompt = [1] + [rng.randrange(3, n_vocab) for _ in range(rng.randrange(1, 40))]
            extra: dict = {}
            if i == 3:
                extra = {"logit_bias": {rng.randrange(3, n_vocab): 5.0 for _ in range(20)}}
            elif i == 4:
                extra = {"repeat_penalty": 1.5, "presence_penalty": 0.5}
            params = SamplingParams(max_tokens=48, temperature=0.0, grammar=grammar, **extra)
            out.append(Generate(f"{name}-{i}", prompt, params))
    return out


def run(engine: Engine, config: WorkerConfig, batch: list[Generate], eager: bool):
    loop = TickLoop(engine, replace(config), collector := Collector())
    if eager:  # the same engine; only its samplers differ
        original = engine.new_sampler
        engine.new_sampler = lambda params, _=None: EagerSampler(params, engine)  # type: ignore[method-assign]
    try:
        for request in batch:
            loop.inbox.submit(GW, request)
        drain(loop)
    finally:
        if eager:
            engine.new_sampler = original  # type: ignore[method-assign]
    return collector.tokens(), collector.finishes()


@pytest.mark.parametrize("seed", [0, 1])
def test_lazy_sampling_picks_the_same_greedy_tokens_as_masking_first(engine, config, seed):
    batch = requests(engine.n_vocab, seed)
    eager_tokens, eager_finishes = run(engine, config, batch, eager=True)
    lazy_tokens, lazy_finishes = run(engine, config, batch, eager=False)
    for request in batch:
        rid = request.request_id
        assert lazy_tokens.get(rid) == eager_tokens.get(rid), rid
        assert lazy_finishes[rid].reason == eager_finishes[rid].reason, rid
    # The comparison means something only if the grammars steered the output.
    stopped = [rid for rid, finish in lazy_finishes.items() if finish.reason == FinishReason.STOP]
    assert len(stopped) >= len(batch) // 2


def test_both_paths_are_taken_the_check_and_the_mask(engine, config):
    """On a random model the argmax often breaks the grammar: both branches must be met."""
    grammar = GRAMMARS["schema"]
    sampler = build_sampler(
        SamplingParams(temperature=0.0, grammar=grammar),
        engine.grammars,
        engine.n_vocab,
        engine.slot_context,
    )
    rng = np.random.default_rng(0)
    allowed = refused = 0
    try:
        for _ in range(40):
            logits = rng.standard_normal(engine.n_vocab).astype(np.float32)
            argmax = int(logits.argmax())
            token = sampler.sample(0, logits)
            if token == argmax:
                allowed += 1
            else:
                refused += 1
            if sampler.grammar_complete:
                break
    finally:
        sampler.close()
    assert allowed > 0 and refused > 0


def test_the_grammar_advances_only_by_the_token_kept(engine):
    """A refused first pick never reaches the grammar: the next check still starts at `{`."""
    sampler = build_sampler(
        SamplingParams(temperature=0.0, grammar=any_to_lark('root ::= "{" [a-z]+ "}"')),
        engine.grammars,
        engine.n_vocab,
        engine.slot_context,
    )
    brace = tokenize(engine, "{", add_special=False)[-1]
    letter_x = 3 + ord("x")  # the byte token <0x78>
    try:
        logits = np.zeros(engine.n_vocab, dtype=np.float32)
        logits[letter_x] = 10.0  # the argmax: refused at the start
        logits[brace] = 5.0
        assert sampler.sample(0, logits) == brace
        logits[:] = 0.0
        logits[letter_x] = 10.0  # now allowed
        assert sampler.sample(0, logits) == letter_x
        assert not sampler.grammar_complete and sampler.failure is None
    finally:
        sampler.close()


def test_a_token_beyond_the_best_is_found_by_the_mask(engine):
    """Every allowed token scores below the tied best: the mask over the whole vocabulary
    finds it, the first maximum among the allowed."""
    grammar = any_to_lark('root ::= "{" [a-z]+ "}"')

    def sampler():
        params = SamplingParams(temperature=0.0, grammar=grammar)
        return build_sampler(params, engine.grammars, engine.n_vocab, 256)

    probe = sampler()
    try:
        allowed = [t for t in range(engine.n_vocab) if probe._grammar.allows(t)]
    finally:
        probe.close()
    assert allowed
    rng = np.random.default_rng(1)
    logits = np.zeros(engine.n_vocab, dtype=np.float32)
    logits[allowed] = rng.uniform(-9.0, -5.0, len(allowed)).astype(np.float32)
    expected = min(allowed, key=lambda t: (-logits[t], t))
    kept = sampler()
    try:
        assert kept.sample(0, logits) == expected
        assert kept.failure is None
    finally:
        kept.close()


@pytest.mark.parametrize(
    "grammar", ['root ::= "yes" | "no"', 'root ::= "{\\"a\\": " [0-9] "}"', "root ::= [a-c]{3}"]
)
def test_a_completed_grammar_ends_the_request_with_stop(engine, config, grammar):
    loop = TickLoop(engine, config, collector := Collector())
    params = SamplingParams(
        max_tokens=40, temperature=0.0, grammar=any_to_lark(grammar), ignore_eos=True
    )
    loop.inbox.submit(GW, Generate("done", [1, 40, 41], params))
    # Forced to the end of the grammar by `ignore_eos`: without the completion check the
    # request would run to max_tokens (EOS is the only token the grammar then allows).
    drain(loop)
    finish = collector.finishes()["done"]
    tokens = collector.tokens()["done"]
    assert finish.reason == FinishReason.STOP
    assert finish.completion_tokens == len(tokens) < 40
    assert not any(engine.is_eog(t) for t in tokens)


def test_completion_beats_max_tokens_on_the_same_token(engine, config):
    """A grammar completed by the last allowed token ends with stop, not length."""
    loop = TickLoop(engine, config, collector := Collector())
    params = SamplingParams(max_tokens=3, temperature=0.0, grammar=any_to_lark("root ::= [a-c]{3}"))
    loop.inbox.submit(GW, Generate("exact", [1, 40, 41], params))
    drain(loop)
    assert collector.finishes()["exact"].reason == FinishReason.STOP
    assert len(collector.tokens()["exact"]) == 3


def test_an_ambiguous_grammar_runs_to_its_end_beside_others(engine, config):
    """`x ::= "a" x "b" | "a" x "c" | "a"` doubled llama.cpp's parse stacks per character;
    llguidance's Earley parser takes it in bounded steps: the request runs to max_tokens,
    and the one beside it gets the tokens it gets alone."""
    ambiguous = any_to_lark('root ::= x\nx ::= "a" x "b" | "a" x "c" | "a"')
    # Both tokens that spell `a`: the byte token <0x61> and the piece (a grammar's mask
    # keeps one of tokens that spell the same text).
    tokenizer = engine.grammars.tokenizer
    spellings = {t for t in range(engine.n_vocab) if tokenizer.decode_bytes([t]) == b"a"}
    assert len(spellings) == 2
    loop = TickLoop(engine, config, collector := Collector())
    bias = dict.fromkeys(spellings, 100.0)
    forced = SamplingParams(max_tokens=48, temperature=0.0, grammar=ambiguous, logit_bias=bias)
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    loop.inbox.submit(GW, Generate("ambiguous", [1, 40, 41], forced))
    loop.inbox.submit(GW, Generate("beside", [1, 50, 51, 52], plain))
    drain(loop)
    finishes, tokens = collector.finishes(), collector.tokens()
    assert finishes["ambiguous"].reason == FinishReason.LENGTH
    assert len(tokens["ambiguous"]) == 48 and set(tokens["ambiguous"]) <= spellings
    assert finishes["beside"].reason == FinishReason.LENGTH
    alone = TickLoop(engine, config, alone_collector := Collector())
    alone.inbox.submit(GW, Generate("beside", [1, 50, 51, 52], plain))
    drain(alone)
    assert tokens["beside"] == alone_collector.tokens()["beside"]


def test_a_grammar_over_its_step_limit_fails_its_request_alone(
    engine, config, monkeypatch: pytest.MonkeyPatch
):
    """A step that needs more lexer work than the limits allow (here a limit nothing meets)
    ends that request with llguidance's reason, as a 400's code; the request beside it runs
    to the end. Counted in work, never in time: the machine's speed changes nothing."""
    monkeypatch.setitem(GRAMMAR_LIMITS, "step_lexer_fuel", 1)
    alternatives = " | ".join(f'"word{i} "' for i in range(500))
    loop = TickLoop(engine, config, collector := Collector())
    grammar = any_to_lark(f"root ::= ({alternatives})+")
    heavy = SamplingParams(max_tokens=16, temperature=0.0, grammar=grammar)
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    loop.inbox.submit(GW, Generate("heavy", [1, 40, 41], heavy))
    loop.inbox.submit(GW, Generate("beside", [1, 50, 51, 52], plain))
    drain(loop)
    finishes, tokens = collector.finishes(), collector.tokens()
    assert finishes["heavy"].reason == FinishReason.ERROR
    assert "the grammar cannot go on" in finishes["heavy"].message
    assert finishes["heavy"].code == ErrorCode.INVALID_REQUEST  # the gateway answers 400
    assert len(tokens.get("heavy", [])) < 16  # ended at the step over the limit
    assert finishes["beside"].reason == FinishReason.LENGTH
    assert len(tokens["beside"]) == 24


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_greedy_picks_the_first_maximum_among_allowed_tokens(engine, name):
    """Against brute force, with many ties (logits rounded): the check of the pick and the
    mask behind it give the token masking first would."""
    params = SamplingParams(temperature=0.0, grammar=GRAMMARS[name])

    def sampler():
        return build_sampler(params, engine.grammars, engine.n_vocab, 256)

    probe = sampler()
    try:
        allowed = np.array([t for t in range(engine.n_vocab) if probe._grammar.allows(t)])
    finally:
        probe.close()
    rng = np.random.default_rng(len(name))
    for _ in range(30):
        logits = np.round(rng.standard_normal(engine.n_vocab), 1).astype(np.float32)
        best = logits[allowed].max()
        expected = int(allowed[logits[allowed] == best].min())
        fresh = sampler()
        try:
            assert fresh.sample(0, logits) == expected
        finally:
            fresh.close()


def test_a_sampled_token_refused_and_drawn_again_follows_the_masked_distribution(engine):
    """Drawn from the whole row, then again from the allowed tokens when refused: each
    allowed token comes as often as softmax over the allowed tokens alone says (chi-square
    over 20,000 draws), though the refused tokens hold most of the row's mass."""
    grammar = any_to_lark("root ::= [a-e] [a-e]")
    params = SamplingParams(temperature=1.0, seed=11, grammar=grammar)
    sampler = build_sampler(params, engine.grammars, engine.n_vocab, 256)
    assert isinstance(sampler, HostSampler) and sampler._grammar is not None
    matcher = sampler._grammar.matcher
    allowed = sampler._grammar.allowed()
    logits = np.random.default_rng(4).normal(0.0, 1.0, engine.n_vocab).astype(np.float32)
    refused = np.ones(engine.n_vocab, dtype=bool)
    refused[allowed] = False
    logits[refused] += 3.0  # most draws from the whole row are refused
    weights = np.exp(logits[allowed].astype(np.float64) - logits[allowed].max())
    expected = weights / weights.sum()
    draws = 20_000
    counts = np.zeros(len(allowed))
    position = {int(token): i for i, token in enumerate(allowed)}
    try:
        for _ in range(draws):
            token = sampler.sample(0, logits)
            counts[position[token]] += 1
            matcher.rollback(1)  # back to the first step: every draw is from the same row
    finally:
        sampler.close()
    assert _chi_square_p(counts, expected * draws) > 1e-3
