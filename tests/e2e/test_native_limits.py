"""Input that reaches a native or recursive parser is bounded first, in the gateway and the worker.

A grammar nested 20,000 groups deep used to overflow llama.cpp's C++ parser's stack and kill
the process that parsed it: the gateway through HTTP, the worker through a raw Generate
frame. The gateway bounds a request's GBNF before converting it; the worker sends what it is
given to llguidance, which bounds its own nesting, after a bound on its size.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

from loomserve.gateway.api.errors import APIError
from loomserve.gateway.request.params import MAX_STOP_CHARS, stop_strings
from loomserve.gateway.text.grammar import MAX_SCHEMA_DEPTH, MAX_SCHEMA_REPEAT, schema_problem
from loomserve.protocol import Rejected, SamplingParams
from loomserve.protocol.limits import (
    MAX_GRAMMAR_BYTES,
    MAX_GRAMMAR_ELEMENTS,
    MAX_GRAMMAR_NESTING,
    MAX_GUIDANCE_GRAMMAR_BYTES,
    MAX_LOGIT_BIAS,
    grammar_problem,
)
from loomserve.worker.sampling.samplers import InvalidSampling, build_sampler
from tests.procs import Proc, start_gateway, start_worker
from tests.worker.test_server import Gateway, greedy

NESTED = "root ::= " + "(" * 20000 + '"a"' + ")" * 20000  # 40 KB, 20,000 levels deep


def nested(depth: int) -> str:
    return "root ::= " + "(" * depth + '"a"' + ")" * depth


# --- the checks themselves ------------------------------------------------------------


def test_deep_nesting_is_refused_and_the_limit_itself_is_allowed() -> None:
    assert "deeper" in grammar_problem(NESTED)
    assert grammar_problem(nested(MAX_GRAMMAR_NESTING)) is None
    assert "deeper" in grammar_problem(nested(MAX_GRAMMAR_NESTING + 1))


def test_parens_in_literals_classes_and_comments_do_not_count() -> None:
    opens = "(" * (MAX_GRAMMAR_NESTING + 5)
    assert grammar_problem(f'root ::= "{opens}" [{opens}] # {opens}\n') is None
    # A closing paren inside a literal must not hide the real groups that follow it.
    hidden = 'root ::= ")))))" [)] ' + nested(MAX_GRAMMAR_NESTING + 1)[len("root ::= ") :]
    assert "deeper" in grammar_problem(hidden)
    escaped = 'root ::= "\\")))" ' + nested(MAX_GRAMMAR_NESTING + 1)[len("root ::= ") :]
    assert "deeper" in grammar_problem(escaped)


def test_repetitions_that_expand_to_millions_of_rules_are_refused() -> None:
    # About 11 s and a gigabyte in llama.cpp for 64 KB of these, before the limit.
    many = "root ::= " + " ".join(['"a"{0,1999}'] * 200)
    assert "expand" in grammar_problem(many)
    assert grammar_problem("root ::= " + " ".join(['"a"{0,1999}'] * 20)) is None
    long_literal = 'root ::= "' + "a" * 200 + '"{1999}'
    assert "expand" in grammar_problem(long_literal)
    spaced = "root ::= (" + " ".join(['"a"{ # count\n 0 , 1999 }'] * 200) + ")"
    assert "expand" in grammar_problem(spaced)
    assert "expand" in grammar_problem('root ::= "a"{' + "9" * 5000 + "}")


def test_size_and_encoding() -> None:
    assert "bytes" in grammar_problem('root ::= "' + "a" * MAX_GRAMMAR_BYTES + '"')
    assert "UTF-8" in grammar_problem('root ::= "\ud800"')
    assert MAX_GRAMMAR_ELEMENTS > 0


def test_real_grammars_pass() -> None:
    schema = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "maxLength": 200} for i in range(40)},
    }
    assert grammar_problem(JSON_GBNF) is None
    assert grammar_problem(json_schema_to_gbnf(json.dumps(schema))) is None
    longest = {"type": "string", "maxLength": MAX_SCHEMA_REPEAT}
    assert grammar_problem(json_schema_to_gbnf(json.dumps(longest))) is None


def test_schema_limits() -> None:
    deep: dict = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    assert "deeper" in schema_problem(deep)
    assert "maxLength" in schema_problem({"type": "string", "maxLength": 10**7})
    assert "pattern" in schema_problem({"type": "string", "pattern": "a{100000000}"})
    assert "pattern" in schema_problem({"type": "string", "pattern": "a{2,99999}"})
    assert schema_problem({"type": "string", "pattern": "^[a-z]{2,8}$", "maxLength": 8}) is None


def test_stop_strings_are_bounded_in_length() -> None:
    assert stop_strings(["x" * MAX_STOP_CHARS]) == ("x" * MAX_STOP_CHARS,)
    with pytest.raises(APIError) as raised:
        stop_strings(["x" * (MAX_STOP_CHARS + 1)])
    assert raised.value.status == 400


NESTED_LARK = "start: " + "(" * 20000 + '"a"' + ")" * 20000


def test_the_worker_checks_what_it_is_sent_before_llguidance_does() -> None:
    # Refused before any native call: no context or vocabulary is needed to get here.
    huge = 'start: "' + "a" * MAX_GUIDANCE_GRAMMAR_BYTES + '"'
    with pytest.raises(InvalidSampling, match="bytes"):
        build_sampler(SamplingParams(grammar=huge), None, 1000, 512)
    bias = {t: 1.0 for t in range(MAX_LOGIT_BIAS + 1)}
    with pytest.raises(InvalidSampling, match="logit_bias"):
        build_sampler(SamplingParams(logit_bias=bias), None, 1000, 512)


# --- through real processes ---------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny_model_path: Path) -> Iterator[tuple[Proc, Proc]]:
    with (
        start_worker(tiny_model_path, slots=2, ctx_size=512) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        yield worker, gateway


def test_a_nested_grammar_gets_a_400_and_a_stream_in_flight_finishes(
    served: tuple[Proc, Proc],
) -> None:
    worker, gateway = served
    streamed: dict[str, object] = {}

    def stream() -> None:
        body = {"prompt": "once upon", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=60) as r:
            streamed["status"] = r.status_code
            streamed["events"] = [line for line in r.iter_lines() if line.startswith("data:")]

    thread = threading.Thread(target=stream)
    thread.start()
    response = httpx.post(
        gateway.url + "/v1/completions", json={"prompt": "hi", "grammar": NESTED}, timeout=30
    )
    thread.join(60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "grammar" and "deeper" in error["message"]
    assert streamed["status"] == 200 and streamed["events"][-1] == "data: [DONE]"
    finish = json.loads(streamed["events"][-2][len("data: ") :])
    assert finish["choices"][0]["finish_reason"] == "length"
    assert gateway.alive() and worker.alive()
    after = httpx.post(gateway.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert after.status_code == 200


def test_a_nested_grammar_in_a_raw_frame_is_rejected_by_the_worker(
    served: tuple[Proc, Proc],
) -> None:
    worker, _ = served
    peer = Gateway(worker.endpoint, f"hostile-{os.getpid()}")
    try:
        peer.hello()
        peer.send(greedy("nested", [1, 7], 2, grammar=NESTED_LARK))
        rejected = peer.wait_for(lambda m: isinstance(m, Rejected))
        assert rejected.request_id == "nested" and rejected.code == "invalid_request"
        assert "nested" in rejected.message
        tokens, finish = peer.run(greedy("after", [1, 7], 3))
        assert len(tokens) == 3 and finish.reason == "length"
        assert worker.alive()
    finally:
        peer.close()
