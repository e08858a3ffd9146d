"""Grammars compiled off the tick (worker/sampling/grammar_compiler.py), on the tiny model.

With a compiler the loop queues a grammar request only once its grammar is compiled and its
first mask computed on the compiler's thread: the same tokens as compiling in the tick, a
grammar that cannot be used or whose first step is over its limits refused before anything
is queued, and a request cancelled while its grammar compiles gone without a trace.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from llguidance.gbnf_to_lark import any_to_lark

from loomserve.protocol import Accepted, ErrorCode, FinishReason, Generate, SamplingParams
from loomserve.protocol.limits import GRAMMAR_LIMITS
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine
from loomserve.worker.io.channels import Inbox
from loomserve.worker.sampling.grammar_compiler import GrammarCompiler
from loomserve.worker.tick.loop import TickLoop
from tests.worker.engine.test_engine import GW, Collector

GRAMMARS = [
    any_to_lark("root ::= [0-9]+"),
    any_to_lark('root ::= "yes" | "no" | "maybe so"'),
    any_to_lark('root ::= word (" " word){2,6}\nword ::= [a-z]+'),
]


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> Iterator[Engine]:
    engine = Engine(config_for(tiny_model_path))
    yield engine
    engine.close()


def config_for(model: Path) -> WorkerConfig:
    return WorkerConfig(
        model_path=model, slots=4, ctx_size=256, max_queue=32, batch_tokens=32, threads=1
    )


def run(
    engine: Engine, requests: list[Generate], off_tick: bool, cancel: str | None = None
) -> Collector:
    """Serve the requests (cancelling `cancel` right after it is submitted) until all are
    done, grammars compiled off the tick or in it."""
    inbox, collector = Inbox(), Collector()
    compiler = GrammarCompiler(engine.grammars, inbox.compiled) if off_tick else None
    loop = TickLoop(
        engine, config_for(engine.config.model_path), collector, inbox=inbox, grammars=compiler
    )
    try:
        for request in requests:
            inbox.submit(GW, request)
            if request.request_id == cancel:
                inbox.abort(GW, cancel)
        deadline = time.monotonic() + 60
        while loop.scheduler.has_work() or not inbox.empty() or loop._compiling:
            assert time.monotonic() < deadline, "the loop did not finish its requests"
            loop.tick(block=False)
            if not loop.scheduler.has_work() and inbox.empty():
                time.sleep(0.001)  # a grammar compiling: nothing else to do
    finally:
        if compiler is not None:
            compiler.close()
    assert not loop._compiling
    return collector


def grammar_requests() -> list[Generate]:
    return [
        Generate(
            f"g{i}", [1, 40 + i, 41], SamplingParams(max_tokens=12, temperature=0.0, grammar=g)
        )
        for i, g in enumerate(GRAMMARS)
    ] + [Generate("plain", [1, 50, 51], SamplingParams(max_tokens=12, temperature=0.0))]


def test_grammars_compiled_off_the_tick_give_the_same_tokens(engine: Engine) -> None:
    in_tick = run(engine, grammar_requests(), off_tick=False)
    off_tick = run(engine, grammar_requests(), off_tick=True)
    assert off_tick.tokens() == in_tick.tokens()
    assert {r: f.reason for r, f in off_tick.finishes().items()} == {
        r: f.reason for r, f in in_tick.finishes().items()
    }
    assert len(off_tick.of_type(Accepted)) == 4


def test_a_grammar_that_does_not_compile_is_refused_before_it_is_queued(engine: Engine) -> None:
    bad = Generate("bad", [1, 40], SamplingParams(max_tokens=4, grammar='start: "a" | ('))
    collector = run(engine, [bad, *grammar_requests()], off_tick=True)
    assert collector.rejected() == {"bad": ErrorCode.INVALID_REQUEST.value}
    assert "bad" not in collector.finishes()
    assert collector.finishes()["plain"].reason == FinishReason.LENGTH


def test_a_first_step_over_its_limits_is_refused_before_any_token(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiled in the tick, such a grammar ends its request at its first token (an error
    finish); off the tick its first mask is computed before the request is queued, and the
    gateway hears a Rejected: a 400 before any token."""
    monkeypatch.setitem(GRAMMAR_LIMITS, "step_lexer_fuel", 1)
    heavy = Generate("heavy", [1, 40], SamplingParams(max_tokens=8, grammar=GRAMMARS[2]))
    plain = Generate("plain", [1, 50, 51], SamplingParams(max_tokens=12, temperature=0.0))
    collector = run(engine, [heavy, plain], off_tick=True)
    assert collector.rejected() == {"heavy": ErrorCode.INVALID_REQUEST.value}
    (rejected,) = [m for m in collector.messages if getattr(m[1], "request_id", "") == "heavy"]
    assert "the grammar cannot go on" in rejected[1].message
    assert collector.finishes()["plain"].reason == FinishReason.LENGTH
    assert collector.tokens().get("heavy") is None


def test_a_request_cancelled_while_its_grammar_compiles_leaves_nothing(engine: Engine) -> None:
    collector = run(engine, grammar_requests(), off_tick=True, cancel="g1")
    assert "g1" not in collector.rejected()
    assert "g1" not in {m.request_id for m in collector.of_type(Accepted)}
    assert "g1" not in collector.finishes()
    assert collector.finishes()["g0"].reason in (FinishReason.STOP, FinishReason.LENGTH)
