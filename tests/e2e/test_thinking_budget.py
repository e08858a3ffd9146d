"""A thinking budget end to end on the tiny model and the real engine: served with Qwen3.5's
template (which opens the think block in the prompt), a reply with thinking_token_budget N
thinks exactly its first N greedy tokens, then the worker writes `</think>` and the model
answers; bad budgets are 400s naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.procs import Proc, start_gateway, start_worker

TEMPLATES = Path(__file__).resolve().parent.parent / "data" / "templates"
QWEN35 = TEMPLATES / "Qwen3.5-4B.jinja"
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def gateways(tiny_model_path: Path) -> Iterator[tuple[Proc, Proc, Proc]]:
    """A worker; a gateway with Qwen3.5's template, one with a server budget of 4, and one
    with the same budget and the model's stand-in template, which marks no thinking."""
    with (
        start_worker(tiny_model_path, slots=4, ctx_size=2048) as worker,
        start_gateway(tiny_model_path, worker.endpoint, chat_template=QWEN35) as qwen35,
        start_gateway(
            tiny_model_path, worker.endpoint, chat_template=QWEN35, reasoning_budget=4
        ) as budgeted,
        start_gateway(tiny_model_path, worker.endpoint, reasoning_budget=4) as plain,
    ):
        yield qwen35, budgeted, plain


def chat(gateway: Proc, **fields: Any) -> httpx.Response:
    body = {"messages": MESSAGES, "max_tokens": 24, "temperature": 0, **fields}
    return httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=60)


def raw_text(gateway: Proc, **fields: Any) -> str:
    reply = chat(gateway, reasoning_format="none", **fields)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def closed_after(raw: str, thought: str) -> bool:
    """Whether the raw reply is `thought`, then the end marker, then more (the answer). The
    tiny model's tokenizer writes a SentencePiece space before `</think>`, which it has no
    token for; a real Qwen model's `</think>` is one token, written as it is."""
    rest = raw.removeprefix(thought)
    return rest != raw and rest.lstrip().startswith("</think>") and rest.strip() != "</think>"


@pytest.mark.parametrize("field", ["thinking_token_budget", "reasoning_budget"])
def test_the_block_ends_after_the_budget_and_the_answer_comes(gateways, field) -> None:
    qwen35 = gateways[0]
    thought = raw_text(qwen35, max_tokens=5)  # the first 5 greedy tokens, unbudgeted
    assert "</think>" not in raw_text(qwen35)  # left alone, the tiny model never closes it
    raw = raw_text(qwen35, **{field: 5})
    assert closed_after(raw, thought)
    reply = chat(qwen35, **{field: 5}).json()
    message = reply["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"]
    assert "</think>" not in message["content"] + message["reasoning_content"]
    assert reply["usage"]["completion_tokens"] == 24  # thinking, marker and answer


def test_the_server_budget_applies_and_a_request_overrides_it(gateways) -> None:
    qwen35, budgeted, _ = gateways
    four, six = raw_text(qwen35, max_tokens=4), raw_text(qwen35, max_tokens=6)
    assert closed_after(raw_text(budgeted), four)
    assert closed_after(raw_text(budgeted, thinking_token_budget=6), six)


@pytest.mark.parametrize(
    ("which", "fields", "param"),
    [
        (0, {"thinking_token_budget": 0}, "thinking_token_budget"),
        (0, {"reasoning_budget": -3}, "reasoning_budget"),
        (0, {"thinking_token_budget": 4, "grammar": 'root ::= "a"'}, "thinking_token_budget"),
        (
            0,
            {"thinking_token_budget": 4, "response_format": {"type": "json_object"}},
            "thinking_token_budget",
        ),
        (2, {"thinking_token_budget": 4}, "thinking_token_budget"),  # no reasoning family
    ],
)
def test_bad_budgets_are_400s_naming_the_field(gateways, which, fields, param) -> None:
    reply = chat(gateways[which], **fields)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_the_server_budget_leaves_a_model_without_thinking_alone(gateways) -> None:
    reply = chat(gateways[2])
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 24
