"""Thinking controls of a chat request: the chat template's variables (chat_template_kwargs,
reasoning_effort, and what the Anthropic and Responses translations set), and whether the
reply's think block is split from its answer (reasoning_format).

Every template reads its own switch: Qwen3 and most `<think>` templates `enable_thinking`,
DeepSeek-V3.1 and Seed-OSS `thinking`, gpt-oss `reasoning_effort`. A request's effort sets
all of them, so that one field works whatever the template; its own chat_template_kwargs
come last and win.
"""

from __future__ import annotations

from typing import Any

from ..api.errors import invalid_request
from ..api.schemas import ChatCompletionRequest
from ..text.reasoning import ReasoningFamily
from ..text.tokenizer import Vocab

# OpenAI's reasoning_effort values; "none" turns thinking off.
EFFORTS = ("none", "minimal", "low", "medium", "high")
# reasoning_format values llama-server takes: "none" keeps the raw text, the others split it.
REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy", "parsed")


def effort_kwargs(effort: str | None) -> dict[str, Any]:
    """The template variables a reasoning_effort means; 400 naming the field for one that
    is not OpenAI's."""
    if effort is None:
        return {}
    if effort not in EFFORTS:
        raise invalid_request(
            f"reasoning_effort must be one of {', '.join(EFFORTS)}", "reasoning_effort"
        )
    if effort == "none":
        return {"enable_thinking": False, "thinking": False}
    return {"enable_thinking": True, "thinking": True, "reasoning_effort": effort}


def template_kwargs(body: ChatCompletionRequest, defaults: dict[str, Any]) -> dict[str, Any]:
    """The variables the chat template renders this request with: the server's
    (--chat-template-kwargs), then its reasoning_effort's, then its own chat_template_kwargs."""
    own = body.chat_template_kwargs
    if own is not None and not isinstance(own, dict):  # the schema says so too
        raise invalid_request("chat_template_kwargs must be a JSON object", "chat_template_kwargs")
    return {**defaults, **effort_kwargs(body.reasoning_effort), **(own or {})}


BUDGET_FIELDS = ("thinking_token_budget", "reasoning_budget")  # vLLM's name, llama-server's


def thinking_budget(body: ChatCompletionRequest, default: int) -> tuple[int, str] | None:
    """The reply's thinking budget in tokens and the field it came from (the request's, else
    the server's --reasoning-budget; None: no budget); 400 naming the field for a budget
    under 1."""
    for name in BUDGET_FIELDS:
        budget = getattr(body, name)
        if budget is None:
            continue
        if budget <= 0:
            raise invalid_request(f"{name} must be a positive number of tokens", name)
        return budget, name
    return (default, "--reasoning-budget") if default >= 0 else None


def budget_fields(
    budget: tuple[int, str] | None,
    family: ReasoningFamily | None,
    inside: bool,
    grammar: str | None,
    vocab: Vocab,
) -> dict[str, Any]:
    """The SamplingParams fields that make the worker close the think block after the budget
    (the family's markers as the model's tokens); 400 naming the field where it cannot."""
    if budget is None:
        return {}
    tokens, name = budget
    if family is None:
        if name == "--reasoning-budget":
            return {}  # the server's default: for the models that think
        raise invalid_request(
            f"{name}: this model's chat template marks no thinking (--reasoning-parser)", name
        )
    if grammar:
        # The worker writes the marker over what the sampler drew; a grammar would not see it.
        raise invalid_request(
            f"{name} cannot be combined with a grammar, a JSON response_format or a forced "
            "tool call",
            name,
        )

    def marker(text: str) -> list[int]:
        return vocab.tokenize(text, add_special=False, parse_special=True)

    return {
        "think_budget": tokens,
        "think_start": [] if inside else marker(family.start),
        "think_end": marker(family.end),
        "speculative": False,
    }


def splits_reasoning(body: ChatCompletionRequest) -> bool:
    """Whether the reply's think block goes to reasoning_content (False: `reasoning_format`
    "none", the raw text in content); 400 for a value llama-server does not take."""
    wanted = body.reasoning_format
    if wanted is not None and wanted not in REASONING_FORMATS:
        raise invalid_request(
            f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}", "reasoning_format"
        )
    return wanted != "none"
