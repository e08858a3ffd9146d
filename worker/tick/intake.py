"""Whether the loop takes a request it was handed, and the Request it becomes. Plain Python.

The checks run cheapest first, so a flood of requests that cannot be served costs little; a
request that passes them is refused only when its sampler cannot be built (the engine's
part, in the loop).
"""

from __future__ import annotations

import time
from collections.abc import Container

from ...protocol import ErrorCode, Generate
from ..sched.media import MediaSpan
from ..sched.queueing import DEFAULT_TENANT
from ..sched.scheduler import Scheduler
from ..sched.slots import Request, RequestKey, TokenSampler
from ..sched.think_budget import ThinkBudget

NO_IMAGES = "this model reads no images: its worker has no vision projector (--mmproj)"
NO_EMBEDDINGS = (
    "this server computes no embeddings: the model has no pooling head; "
    "start the worker with --embeddings for mean-pooled ones"
)


def refusal(
    key: RequestKey,
    generate: Generate,
    scheduler: Scheduler,
    n_vocab: int,
    slot_context: int,
    stopping: bool,
    encoding: Container[RequestKey] = frozenset(),
) -> tuple[ErrorCode, str] | None:
    """Why this request cannot be taken, cheapest checks first; None when it can.
    `encoding`: the requests whose images are being encoded (they are live too)."""
    if stopping:
        return ErrorCode.NOT_READY, "the worker is shutting down"
    if key in scheduler.live or key in encoding:
        return ErrorCode.DUPLICATE_REQUEST, f"request {key[1]!r} is already running"
    if max(generate.prompt_tokens) >= n_vocab:
        return ErrorCode.INVALID_REQUEST, f"prompt token ids must be below {n_vocab}"
    n_prompt = len(generate.prompt_tokens)
    if n_prompt >= slot_context:
        return (
            ErrorCode.PROMPT_TOO_LONG,
            f"the prompt has {n_prompt} tokens; a slot holds {slot_context} tokens "
            f"including at least one generated token",
        )
    if not scheduler.can_enqueue():
        return ErrorCode.QUEUE_FULL, f"all slots are busy and {scheduler.max_queue} wait"
    return None


def media_refusal(
    tokens: list[int],
    media: tuple[MediaSpan, ...],
    generate: Generate,
    slot_context: int,
    whole_image_rows: int | None,
) -> tuple[ErrorCode, str] | None:
    """Why a prompt with its images in place (worker/engine/media.py) cannot run; None when
    it can. whole_image_rows: the most an image may take when it must go into one pass."""
    n_prompt = len(tokens)
    if n_prompt >= slot_context:
        n_image = sum(span.n_tokens for span in media)
        return (
            ErrorCode.PROMPT_TOO_LONG,
            f"the prompt has {n_prompt} tokens ({n_image} of them its images'); a slot holds "
            f"{slot_context} tokens including at least one generated token",
        )
    if media and media[-1].end >= n_prompt:
        return ErrorCode.INVALID_REQUEST, "an image cannot end the prompt: text must follow it"
    if generate.params.prompt_logprobs is not None:
        return ErrorCode.INVALID_REQUEST, "prompt_logprobs cannot score a prompt with images"
    for index, span in enumerate(media):
        if whole_image_rows is not None and span.n_tokens > whole_image_rows:
            return (
                ErrorCode.INVALID_REQUEST,
                f"image {index} takes {span.n_tokens} positions; this projector needs an "
                f"image in one pass, of at most {whole_image_rows} (--batch-tokens)",
            )
    return None


def new_request(
    key: RequestKey,
    generate: Generate,
    sampler: TokenSampler | None,
    sampler_seconds: float = 0.0,
    prompt: list[int] | None = None,
    media: tuple[MediaSpan, ...] = (),
    media_seconds: float = 0.0,
) -> Request:
    """The accepted Generate as the scheduler queues it, arriving now; with images, `prompt`
    is the one with them in place and `media` the images."""
    params = generate.params
    think = (
        ThinkBudget(params.think_budget, params.think_start, params.think_end)
        if params.think_budget
        else None
    )
    return Request(
        key=key,
        think=think,
        prompt=generate.prompt_tokens if prompt is None else prompt,
        media=media,
        media_seconds=media_seconds,
        params=generate.params,
        arrived_at=time.monotonic(),
        sampler=sampler,
        priority=generate.priority,
        tenant=generate.tenant or DEFAULT_TENANT,
        trace=generate.trace,
        trace_state=generate.trace_state,
        sampler_seconds=sampler_seconds,
    )
