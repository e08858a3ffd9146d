"""Every output a JSON-schema grammar lets through is JSON the schema accepts.

Property-based: hypothesis writes schemas (objects, arrays, strings, integers, booleans,
nulls, enums, constants, anyOf, nested, required or not), the gateway turns each into its
grammar (gateway/text/grammar.py), and random walks through llguidance's mask on the tiny
model's vocabulary (the worker's tokenizer, tests/grammars.py) write outputs: any allowed
token, the end token where allowed. Each finished output must parse as JSON and validate
against its schema (the `jsonschema` package is the oracle).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loomserve.gateway.text.grammar import grammar_error, json_schema_lark
from loomserve.gateway.text.tokenizer import Vocab
from tests.grammars import grammar_accepts, matcher, tokenizer

MAX_STEPS = 400  # tokens a walk may take before it is given up (never counted as a failure)

WORDS = st.text(alphabet="abcxyz", min_size=1, max_size=4)
SCALARS: st.SearchStrategy[dict[str, Any]] = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(
        lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
        st.integers(-50, 50),
        st.integers(0, 200),
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda words: {"enum": sorted(set(words))}, st.lists(WORDS, min_size=1, max_size=3)),
    st.builds(lambda word: {"const": word}, WORDS),
)


def _object(properties: dict[str, dict[str, Any]], required: list[bool]) -> dict[str, Any]:
    names = list(properties)
    return {
        "type": "object",
        "properties": properties,
        "required": [n for n, r in zip(names, required, strict=False) if r],
    }


SCHEMAS = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.builds(
            lambda items, most: {"type": "array", "items": items, "maxItems": most},
            inner,
            st.integers(0, 3),
        ),
        st.builds(
            _object,
            st.dictionaries(WORDS, inner, min_size=1, max_size=3),
            st.lists(st.booleans(), min_size=3, max_size=3),
        ),
        st.builds(lambda a, b: {"anyOf": [a, b]}, inner, inner),
    ),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def vocab(tiny_model_path: Path) -> Iterator[Vocab]:
    loaded = Vocab(tiny_model_path)
    tokenizer(loaded)  # built once, before hypothesis times the examples
    yield loaded
    loaded.close()


def walk(vocab: Vocab, grammar: str, rng: random.Random) -> bytes | None:
    """A random output the grammar allows, token by token; None when it did not end."""
    compiled = matcher(vocab, grammar)
    ends = {vocab.eos_id}
    bits = np.zeros((vocab.n_tokens + 31) // 32, dtype=np.int32)
    written: list[int] = []
    for _ in range(MAX_STEPS):
        if compiled.is_stopped():
            break
        compiled.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        allowed = np.nonzero(
            np.unpackbits(bits.view(np.uint8), count=vocab.n_tokens, bitorder="little")
        )[0].tolist()
        assert allowed, "the grammar allows nothing, not even the end"
        ending = [t for t in allowed if t in ends]
        if ending and rng.random() < 0.3:
            break
        token = rng.choice([t for t in allowed if t not in ends] or ending)
        if token in ends:
            break
        assert compiled.consume_token(token), compiled.get_error()
        written.append(token)
    else:
        return None
    assert compiled.is_accepting()
    return b"".join(vocab.piece(t) for t in written)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schema=SCHEMAS, seed=st.integers(0, 2**32 - 1))
def test_every_output_the_grammar_allows_validates_against_the_schema(
    vocab: Vocab, schema: dict[str, Any], seed: int
) -> None:
    grammar = json_schema_lark(schema)
    assert grammar_error(grammar) is None
    rng = random.Random(seed)
    finished = 0
    for _ in range(3):
        output = walk(vocab, grammar, rng)
        if output is None:
            continue
        finished += 1
        instance = json.loads(output.decode())
        jsonschema.validate(instance, schema)
    assert finished  # the walks end: what they wrote was checked


def test_outputs_that_break_the_schema_are_refused(vocab: Vocab) -> None:
    """The oracle's other side: a few instances the schema refuses are refused by the
    grammar too (extra keys, a missing required key, a value of another type)."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
        "required": ["a"],
    }
    grammar = json_schema_lark(schema)
    assert grammar_accepts(vocab, grammar, '{"a": 1, "b": "x"}')
    for wrong in ['{"b": "x"}', '{"a": 1, "c": 2}', '{"a": "1"}', '{"a": 1, "b": "z"}']:
        assert not grammar_accepts(vocab, grammar, wrong), wrong
