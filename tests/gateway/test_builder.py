"""Where a body is drafted (serving/builder.py): on the event loop when it is small and
compiles no grammar, in a thread otherwise."""

from __future__ import annotations

import pytest

from loomserve.gateway.api.schemas import ChatCompletionRequest, CompletionRequest
from loomserve.gateway.request.generation_request import ApiBody
from loomserve.gateway.serving.builder import INLINE_BODY_BYTES, drafts_inline

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
COMPLETION = {"model": "m", "prompt": "hello"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({**CHAT, **fields})


def completion(**fields: object) -> CompletionRequest:
    return CompletionRequest.model_validate({**COMPLETION, **fields})


@pytest.mark.parametrize("body", [chat(), completion(), chat(response_format={"type": "text"})])
def test_a_small_plain_body_is_drafted_on_the_loop(body: ApiBody) -> None:
    assert drafts_inline(body, 200)
    assert drafts_inline(body, INLINE_BODY_BYTES)


@pytest.mark.parametrize("body", [chat(), completion()])
def test_a_big_body_or_one_of_unknown_size_goes_to_a_thread(body: ApiBody) -> None:
    assert not drafts_inline(body, INLINE_BODY_BYTES + 1)
    assert not drafts_inline(body, None)  # chunked: no Content-Length


@pytest.mark.parametrize(
    "body",
    [
        chat(tools=[TOOL]),
        chat(response_format={"type": "json_object"}),
        completion(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        completion(grammar='root ::= "a"'),
    ],
)
def test_a_grammar_to_compile_goes_to_a_thread_however_small(body: ApiBody) -> None:
    assert not drafts_inline(body, 200)
