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

from loomserve.gateway.api.errors import invalid_request
from loomserve.gateway.api.schemas import ChatCompletionRequest

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


def check_budget(body: ChatCompletionRequest) -> None:
    """A thinking budget is a 400 naming its field: the worker cannot yet end a think block
    after N tokens, and a budget silently ignored would let a reply think to max_tokens."""
    for name in ("thinking_token_budget", "reasoning_budget"):
        budget = getattr(body, name)
        if budget is None:
            continue
        if budget <= 0:
            raise invalid_request(f"{name} must be a positive number of tokens", name)
        raise invalid_request(
            f"{name} is not supported yet: bound the whole reply with max_tokens", name
        )


def splits_reasoning(body: ChatCompletionRequest) -> bool:
    """Whether the reply's think block goes to reasoning_content (False: `reasoning_format`
    "none", the raw text in content); 400 for a value llama-server does not take."""
    wanted = body.reasoning_format
    if wanted is not None and wanted not in REASONING_FORMATS:
        raise invalid_request(
            f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}", "reasoning_format"
        )
    return wanted != "none"
