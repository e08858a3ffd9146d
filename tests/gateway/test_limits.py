"""What one request may hold (request/limits.py): refused before any work on it."""

from __future__ import annotations

import pytest

from loomserve.gateway.api.errors import APIError
from loomserve.gateway.api.schemas import MAX_MESSAGES, MAX_TOOLS, ChatCompletionRequest
from loomserve.gateway.request.limits import (
    chat_chars,
    check_counts,
    check_text,
    count_context,
    prompt_chars,
    text_cap,
)


def tool(i: int) -> dict:
    return {"type": "function", "function": {"name": f"f{i}"}}


def test_counts_are_checked_on_the_raw_json() -> None:
    check_counts({"tools": [tool(i) for i in range(MAX_TOOLS)], "messages": []})
    with pytest.raises(APIError) as refused:
        check_counts({"tools": [tool(i) for i in range(MAX_TOOLS + 1)]})
    assert refused.value.status == 400 and refused.value.param == "tools"
    for field in ("messages", "input"):
        check_counts({field: [{}] * MAX_MESSAGES})
        with pytest.raises(APIError) as refused:
            check_counts({field: [{}] * (MAX_MESSAGES + 1)})
        assert refused.value.param == field
    # The embeddings' inputs are not turns: their route caps them itself.
    check_counts({"input": ["x"] * (MAX_MESSAGES + 1)}, turns=())
    check_counts(["not", "an", "object"])  # left to validation
    check_counts({"tools": "not a list", "input": "text"})


def test_text_no_context_holds_is_a_context_length_error() -> None:
    assert text_cap(slot_context=1024, longest_token=16) == 16_384
    check_text(16_384, 1024, 16, "messages")
    with pytest.raises(APIError) as refused:
        check_text(16_385, 1024, 16, "messages")
    assert refused.value.code == "context_length_exceeded"
    assert refused.value.param == "messages"


def test_the_characters_counted() -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "abc"},
                {"role": "user", "content": [{"type": "text", "text": "de"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
            ]
        }
    )
    assert chat_chars(body.messages) == 3 + 2 + 2
    assert prompt_chars("hello") == 5
    assert prompt_chars(["ab", "abcd"]) == 4
    assert prompt_chars([1, 2, 3]) == 0


def test_the_count_cap_is_the_larger_context_known() -> None:
    # Counting may go past a slot, up to the model's training context; 0: no cap known.
    assert count_context(8192, 512) == 8192
    assert count_context(0, 512) == 512
    assert count_context(4096, None) == 4096
    assert count_context(0, None) == 0
