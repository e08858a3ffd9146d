"""Lazy grammar sampling on the tiny model: the same greedy tokens as masking first.

The reference is the eager chain the worker used before (logit bias, penalties, the grammar
over the whole vocabulary, then greedy), built here from llama.cpp's own samplers and run
through the same tick loop; the worker's lazy sampler must pick the same token every time.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import llama_cpp as llama
import numpy as np
import pytest
from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

from loomserve.protocol import ErrorCode, FinishReason, Generate, SamplingParams
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine import grammar_state
from loomserve.worker.engine.engine import Engine
from loomserve.worker.engine.grammar_state import MAX_STACKS, grammar_vocab
from loomserve.worker.engine.sampling import build_sampler
from loomserve.worker.tick.loop import TickLoop
from tests.worker.test_engine import GW, Collector, drain
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
GRAMMARS = {
    "json": JSON_GBNF,
    "schema": json_schema_to_gbnf(json.dumps(SCHEMA)),
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
    """The worker's sampler before lazy sampling: the grammar in the chain, over every token."""

    failure = None
    grammar_complete = False
    plain_greedy = False
    verifies_drafts = True

    def __init__(self, params: SamplingParams, engine: Engine) -> None:
        self.ctx = engine.ctx
        self.chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
        if params.logit_bias:
            biases = (llama.llama_logit_bias * len(params.logit_bias))(
                *(llama.llama_logit_bias(t, b) for t, b in params.logit_bias.items())
            )
            bias = llama.llama_sampler_init_logit_bias(engine.n_vocab, len(biases), biases)
            llama.llama_sampler_chain_add(self.chain, bias)
        if params.repeat_penalty != 1.0 or params.presence_penalty != 0.0:
            args = (
                params.repeat_last_n,
                params.repeat_penalty,
                params.frequency_penalty,
                params.presence_penalty,
            )
            if len(llama.llama_sampler_init_penalties.argtypes) == 5:  # with n_vocab first
                args = (engine.n_vocab, *args)
            penalties = llama.llama_sampler_init_penalties(*args)
            llama.llama_sampler_chain_add(self.chain, penalties)
        grammar = llama.llama_sampler_init_grammar(engine.vocab, params.grammar.encode(), b"root")
        llama.llama_sampler_chain_add(self.chain, grammar)
        llama.llama_sampler_chain_add(self.chain, llama.llama_sampler_init_greedy())

    def sample(self, batch_index: int, logits: np.ndarray) -> int:
        return llama.llama_sampler_sample(self.chain, self.ctx, batch_index)

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
        engine.new_sampler = lambda params: EagerSampler(params, engine)  # type: ignore[method-assign]
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
        engine.ctx,
        engine.vocab,
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
        SamplingParams(temperature=0.0, grammar='root ::= "{" [a-z]+ "}"'),
        engine.ctx,
        engine.vocab,
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
    """Every allowed token scores below the tied best: the scan cannot settle it, the mask
    over the whole vocabulary does, and picks the first maximum among the allowed."""
    grammar = 'root ::= "{" [a-z]+ "}"'

    def sampler():
        params = SamplingParams(temperature=0.0, grammar=grammar)
        return build_sampler(params, engine.ctx, engine.vocab, engine.n_vocab, 256)

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


def test_the_stack_layout_reads_on_this_build(engine):
    """The bound and the completion check read llama.cpp's stacks; this build must allow it."""
    shared = grammar_vocab(engine.vocab, engine.n_vocab)
    assert shared.stacks_readable and shared.bounded


@pytest.mark.parametrize(
    "grammar", ['root ::= "yes" | "no"', 'root ::= "{\\"a\\": " [0-9] "}"', "root ::= [a-c]{3}"]
)
def test_a_completed_grammar_ends_the_request_with_stop(engine, config, grammar):
    loop = TickLoop(engine, config, collector := Collector())
    params = SamplingParams(max_tokens=40, temperature=0.0, grammar=grammar, ignore_eos=True)
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
    params = SamplingParams(max_tokens=3, temperature=0.0, grammar="root ::= [a-c]{3}")
    loop.inbox.submit(GW, Generate("exact", [1, 40, 41], params))
    drain(loop)
    assert collector.finishes()["exact"].reason == FinishReason.STOP
    assert len(collector.tokens()["exact"]) == 3


def test_an_ambiguous_grammar_fails_its_request_alone(engine, config):
    """Stacks that double per character end the request with an error before they freeze the
    tick; the request beside it runs to the end with the tokens it gets alone."""
    ambiguous = 'root ::= x\nx ::= "a" x "b" | "a" x "c" | "a"'
    letter_a = 3 + ord("a")
    loop = TickLoop(engine, config, collector := Collector())
    forced = SamplingParams(
        max_tokens=64, temperature=0.0, grammar=ambiguous, logit_bias={letter_a: 100.0}
    )
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    loop.inbox.submit(GW, Generate("ambiguous", [1, 40, 41], forced))
    loop.inbox.submit(GW, Generate("beside", [1, 50, 51, 52], plain))
    drain(loop)
    finishes, tokens = collector.finishes(), collector.tokens()
    assert finishes["ambiguous"].reason == FinishReason.ERROR
    assert "too ambiguous" in finishes["ambiguous"].message
    assert str(MAX_STACKS) in finishes["ambiguous"].message
    assert len(tokens["ambiguous"]) < 12  # 2, 4, ... stacks: it stops near 2**10
    assert finishes["beside"].reason == FinishReason.LENGTH
    alone = TickLoop(engine, config, alone_collector := Collector())
    alone.inbox.submit(GW, Generate("beside", [1, 50, 51, 52], plain))
    drain(alone)
    assert tokens["beside"] == alone_collector.tokens()["beside"]


def test_a_grammar_over_its_time_budget_fails_its_request_alone(
    engine, config, monkeypatch: pytest.MonkeyPatch
):
    """Grammar work past the per-token budget (here a budget nothing meets: 500 alternatives
    cost seconds a token on a 262k vocabulary) ends that request with an error saying so;
    the request beside it runs to the end as alone."""
    monkeypatch.setattr(grammar_state, "TOKEN_BUDGET_S", 1e-9)
    alternatives = " | ".join(f'"word{i} "' for i in range(500))
    loop = TickLoop(engine, config, collector := Collector())
    slow = SamplingParams(max_tokens=16, temperature=0.0, grammar=f"root ::= ({alternatives})+")
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    loop.inbox.submit(GW, Generate("slow", [1, 40, 41], slow))
    loop.inbox.submit(GW, Generate("beside", [1, 50, 51, 52], plain))
    drain(loop)
    finishes, tokens = collector.finishes(), collector.tokens()
    assert finishes["slow"].reason == FinishReason.ERROR
    assert "the grammar is too slow" in finishes["slow"].message
    assert finishes["slow"].code == ErrorCode.INVALID_REQUEST  # the gateway answers 400
    assert len(tokens.get("slow", [])) <= 1
    assert finishes["beside"].reason == FinishReason.LENGTH
    assert len(tokens["beside"]) == 24


def test_a_mask_that_would_break_the_budget_is_not_done(
    engine, config, monkeypatch: pytest.MonkeyPatch
):
    """Stacks x vocabulary x the floor of a check's cost over the budget: the request fails
    before the mask starts (on Gemma's vocabulary 500 alternatives took 5.3 s a mask); the
    same grammar with a budget that holds runs to its end."""
    alternatives = " | ".join(f'"w{i} "' for i in range(500))
    grammar = f"root ::= ({alternatives}){{2}}"
    # As if each check took a second: 500 stacks cannot be masked within any budget.
    monkeypatch.setattr(grammar_state, "SECONDS_PER_CHECK", 1.0)
    loop = TickLoop(engine, config, collector := Collector())
    params = SamplingParams(max_tokens=16, temperature=0.0, grammar=grammar)
    loop.inbox.submit(GW, Generate("refused", [1, 40, 41], params))
    drain(loop)
    finish = collector.finishes()["refused"]
    assert finish.reason == FinishReason.ERROR
    assert "would take at least" in finish.message
    monkeypatch.setattr(grammar_state, "SECONDS_PER_CHECK", 0.0)
    loop = TickLoop(engine, config, collector := Collector())
    loop.inbox.submit(GW, Generate("masked", [1, 40, 41], params))
    drain(loop)
    assert collector.finishes()["masked"].reason == FinishReason.STOP


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_greedy_picks_the_first_maximum_among_allowed_tokens(engine, name):
    """Against brute force, with many ties (logits rounded): the scan of the best tokens and
    the mask behind it give the token masking first would."""
    params = SamplingParams(temperature=0.0, grammar=GRAMMARS[name])

    def sampler():
        return build_sampler(params, engine.ctx, engine.vocab, engine.n_vocab, 256)

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
