"""One request body into one GenerationRequest: every parameter decided once, here.

The heavy part (a JSON schema's grammar, the tools' grammar, the chat template, the
tokenizer) needs only the model's text, and runs in a thread unless the body is too small
for it to be heavy; what the workers' context leaves for each prompt is known only after,
so each prompt's SamplingParams is made then, once, with its max_tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..api.errors import invalid_request
from ..api.schemas import ChatCompletionRequest
from ..config import DEFAULT_TENANT, PriorityRange
from ..models.catalogue import ServedModel
from ..request import limits, prompts, thinking
from ..request.generation_request import (
    ApiBody,
    GenerationRequest,
    Prompt,
    ReplyReasoning,
)
from ..request.images import image_tokens
from ..request.params import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    MAX_CHOICES,
    max_new_tokens,
    reject_unsupported,
    request_priority,
    sampling_fields,
    score_only,
    stop_strings,
    user_tenant,
    with_max_tokens,
)
from ..text.think_grammar import after_thinking
from ..tools.checks import ToolRequest, tool_request

# A body this small (its JSON, every field) with no grammar to compile is drafted on the
# event loop: for a short prompt the hop to a thread and back cost more than the work itself
# (0.35 ms of the gateway's 3.9 ms of CPU for a short streamed completion, on the tiny model).
INLINE_BODY_BYTES = 8 * 1024


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent the request: the HTTP layer's part of it."""

    request_id: str  # X-Request-Id, or one made up
    tenant: str | None = None  # the authorising API key's
    priorities: PriorityRange | None = None  # what that key may claim
    body_bytes: int | None = None  # its Content-Length, when it gave one


@dataclass(frozen=True, slots=True)
class Drafted:
    """A body's prompts, tools and sampling fields: everything but what the context decides."""

    fields: dict[str, Any]  # sampling_fields: every SamplingParams field but max_tokens
    tools: ToolRequest | None
    texts: list[tuple[list[int], str]]  # each prompt's token ids and its echo text
    reasoning: ReplyReasoning | None = None  # chat: how its reply's think block is split
    # A chat's images (request/images.py) and where each goes in its prompt's tokens.
    images: list[bytes] = field(default_factory=list)
    image_at: list[int] = field(default_factory=list)


def check_body(body: ApiBody, served: ServedModel, slot_context: int | None) -> None:
    """The cheap 400s, before any thread work: unsupported features, stop strings, text no
    context can hold (slot_context None: no worker to ask; the 503 comes soon enough)."""
    reject_unsupported(body)
    stop_strings(body.stop)
    if isinstance(body, ChatCompletionRequest):  # their 400s before any thread work
        thinking.splits_reasoning(body)
        thinking.template_kwargs(body, served.template_kwargs)
        thinking.thinking_budget(body, served.reasoning_budget)
    if slot_context is None:
        return
    if isinstance(body, ChatCompletionRequest):
        chars, param = limits.chat_chars(body.messages), "messages"
    else:
        chars, param = limits.prompt_chars(body.prompt), "prompt"
    limits.check_text(chars, slot_context, served.vocab.longest_token, param)


def drafts_inline(body: ApiBody, body_bytes: int | None) -> bool:
    """Whether draft(body) is cheap enough for the event loop: a body of at most
    INLINE_BODY_BYTES (None: its size is not known) with no grammar to compile (its own, a
    JSON response_format's or its tools')."""
    if body_bytes is None or body_bytes > INLINE_BODY_BYTES:
        return False
    fmt = body.response_format
    if body.grammar or (fmt is not None and fmt.type != "text"):
        return False
    return not (isinstance(body, ChatCompletionRequest) and body.tools)


def draft(served: ServedModel, body: ApiBody, images: list[bytes] | None = None) -> Drafted:
    """The thread's part (drafts_inline says when it need not be): grammars, the chat
    template, the tokenizer. images: a vision model's chat's images, read and checked
    (request/images.py); None: the model reads none."""
    vocab = served.vocab
    fields = sampling_fields(body, vocab, served.sampling_defaults)
    if not isinstance(body, ChatCompletionRequest):
        texts = prompts.completion_prompts(vocab, body.prompt, bool(body.echo))
        return Drafted(fields, None, texts)
    tools = tool_request(body, served.template_tools, vocab)
    if tools is not None and tools.grammar:
        fields["grammar"] = tools.grammar
    text = prompts.chat_text(
        served.template,
        body.messages,
        served.template_tools,
        tools.definitions if tools else None,
        thinking.template_kwargs(body, served.template_kwargs),
        images=images is not None,
    )
    image_at: list[int] = []
    if images:
        tokens, image_at = image_tokens(vocab, text, len(images))
    else:
        tokens = prompts.chat_tokens(vocab, text)
    reasoning = None
    family = served.reasoning
    inside = family is not None and family.starts_inside(text)
    budget = thinking.thinking_budget(body, served.reasoning_budget)
    fields |= thinking.budget_fields(budget, family, inside, fields["grammar"], vocab)
    if family is not None:
        if fields["grammar"] and not body.grammar:
            # A JSON format's or a forced call's grammar: the model thinks first (a request's
            # own GBNF is taken as it is, think block and all).
            fields["grammar"] = after_thinking(fields["grammar"], family, inside)
        if thinking.splits_reasoning(body):
            reasoning = ReplyReasoning(family, inside)
    return Drafted(fields, tools, [(tokens, "")], reasoning, images or [], image_at)


def requested_tokens(body: ApiBody) -> tuple[int | None, int | None]:
    """(max_tokens asked for, the default when none is): chat says it in
    max_completion_tokens or max_tokens, with no default (the context's room);
    completions in max_tokens, 16 by default."""
    if isinstance(body, ChatCompletionRequest):
        asked = body.max_completion_tokens
        return (body.max_tokens if asked is None else asked), None
    if score_only(body):  # the worker generates at least one token: the gateway drops it
        return 1, None
    return body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS


def build(
    served: ServedModel,
    body: ApiBody,
    drafted: Drafted,
    slot_context: int,
    caller: Caller,
    arrived: float,
) -> GenerationRequest:
    """The GenerationRequest: each prompt's max_tokens (and so its SamplingParams) decided
    once, from what it asked and what the slot's context leaves it."""
    n = body.n or 1
    if len(drafted.texts) * n > MAX_CHOICES:
        raise invalid_request(f"at most {MAX_CHOICES} choices (prompts × n) per request", "n")
    requested, default = requested_tokens(body)
    request_prompts = [
        Prompt(
            tokens=tokens,
            params=with_max_tokens(
                drafted.fields, max_new_tokens(requested, default, len(tokens), slot_context)
            ),
            text=text,
            images=drafted.images,
            image_at=drafted.image_at,
        )
        for tokens, text in drafted.texts
    ]
    priority = request_priority(body.priority)
    if caller.priorities is not None:
        priority = caller.priorities.clamp(priority)
    id_prefix = "chatcmpl" if isinstance(body, ChatCompletionRequest) else "cmpl"
    return GenerationRequest(
        id=f"{id_prefix}-{caller.request_id}",
        body=body,
        prompts=request_prompts,
        n=n,
        stops=stop_strings(body.stop),
        model=served.name,
        arrived_at=arrived,
        created=int(time.time()),
        tools=drafted.tools,
        reasoning=drafted.reasoning,
        score_only=score_only(body),
        priority=priority,
        tenant=caller.tenant or user_tenant(body.user) or DEFAULT_TENANT,
    )
