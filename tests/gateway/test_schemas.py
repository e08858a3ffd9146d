"""Request bodies' types: integral floats are the integers JSON Schema says they are, nothing
else is coerced, and a million token ids still validate at strict speed. No model."""

from __future__ import annotations

import time

import pytest
from pydantic import TypeAdapter, ValidationError

from loomserve.gateway.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
)
from loomserve.gateway.translate.messages_schemas import MessagesRequest
from loomserve.gateway.translate.responses_schemas import ResponsesRequest

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
INTEGER_FIELDS = [
    (CompletionRequest, {"prompt": "hi"}, name)
    for name in ("n", "seed", "priority", "logprobs", "top_k", "repeat_last_n", "max_tokens")
] + [
    (CompletionRequest, {"prompt": "hi"}, "best_of"),
    (ChatCompletionRequest, CHAT, "top_logprobs"),
    (ChatCompletionRequest, CHAT, "max_completion_tokens"),
    (ChatCompletionRequest, CHAT, "max_tokens"),
    (MessagesRequest, MESSAGES, "max_tokens"),
    (MessagesRequest, MESSAGES, "top_k"),
    (ResponsesRequest, {"input": "hi"}, "max_output_tokens"),
    (ResponsesRequest, {"input": "hi"}, "top_logprobs"),
]


@pytest.mark.parametrize(("model", "base", "name"), INTEGER_FIELDS)
def test_an_integral_float_is_the_integer_it_is(model, base, name) -> None:
    parsed = getattr(model.model_validate({**base, name: 2.0}), name)
    assert parsed == 2 and type(parsed) is int


@pytest.mark.parametrize(("model", "base", "name"), INTEGER_FIELDS)
@pytest.mark.parametrize("value", [2.5, "2", True, float("inf"), float("nan")])
def test_anything_else_is_no_integer(model, base, name, value) -> None:
    if value is True and name == "logprobs":  # bool | int: chat's true (params.py checks)
        return
    with pytest.raises(ValidationError) as caught:
        model.model_validate({**base, name: value})
    assert caught.value.errors()[0]["loc"][0] == name


def test_logprobs_true_stays_a_boolean() -> None:
    assert CompletionRequest.model_validate({"prompt": "hi", "logprobs": True}).logprobs is True


@pytest.mark.parametrize(
    ("prompt", "ids"),
    [
        ([1, 2.0, 3], [1, 2, 3]),
        ([[1.0], [2, 3.0]], [[1], [2, 3]]),
        ([1, 2, 3], [1, 2, 3]),
    ],
)
def test_token_ids_may_be_integral_floats(prompt, ids) -> None:
    parsed = CompletionRequest.model_validate({"prompt": prompt}).prompt
    assert parsed == ids
    assert all(type(t) is int for t in (parsed[0] if isinstance(parsed[0], list) else parsed))
    assert DetokenizeRequest.model_validate({"tokens": [5.0, 6]}).tokens == [5, 6]


@pytest.mark.parametrize("prompt", [[1, 2.5], [[1], [2.5]], [1.0, "x"], [1, True]])
def test_token_ids_that_are_no_integers_are_refused(prompt) -> None:
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate({"prompt": prompt})
    assert caught.value.errors()[0]["loc"][0] == "prompt"


def test_a_million_token_ids_validate_at_strict_speed() -> None:
    """The wrap that takes integral floats must cost nothing on the usual body: ints only."""
    ids = [i % 50_000 for i in range(1_000_000)]
    strict = TypeAdapter(list[int], config={"strict": True})

    def best_of_five(validate) -> float:
        times = []
        for _ in range(5):
            started = time.perf_counter()
            validate()
            times.append(time.perf_counter() - started)
        return min(times)

    plain = best_of_five(lambda: strict.validate_python(ids))
    ours = best_of_five(lambda: CompletionRequest.model_validate({"prompt": ids}))
    print(f"1M ids: strict list[int] {plain * 1000:.1f} ms, CompletionRequest {ours * 1000:.1f} ms")
    assert ours < 1.5 * plain + 0.01


def test_a_million_bad_token_ids_make_one_error_not_millions() -> None:
    """Each list stops at its first bad item: FastAPI turns every error into a dict, and two
    million of them (one per id for two members of the prompt's union) held the event loop
    for most of a minute."""
    ids = [i % 50_000 for i in range(1_000_000)]
    for prompt in ([*ids[:-1], 2.5], [*ids[:-1], "x"], [float(i) + 0.5 for i in ids]):
        with pytest.raises(ValidationError) as caught:
            CompletionRequest.model_validate({"prompt": prompt})
        assert caught.value.error_count() <= 4
    floats = CompletionRequest.model_validate({"prompt": [float(i) for i in ids]}).prompt
    assert floats == ids
    with pytest.raises(ValidationError) as caught:  # /v1/embeddings: 10 s of errors before
        EmbeddingRequest.model_validate({"input": [*ids[:-1], 2.5]})
    assert caught.value.error_count() <= 4
    assert EmbeddingRequest.model_validate({"input": ids}).input == ids
