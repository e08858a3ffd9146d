"""Prompts to token ids: completion prompts, chat messages through the template, checks.

Rendering and tokenizing are plain functions that the HTTP layer runs in a thread
(in_thread), so that one huge prompt does not stall every other stream of this gateway and
its heartbeats to the workers. At most PREPARE_THREADS requests are prepared at once; the
rest wait for a thread without holding the event loop.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import anyio.to_thread

from ..api.errors import invalid_request
from ..api.schemas import ChatMessage, ToolCall
from ..text.chat_template import ChatTemplateError, Renderer
from ..text.tokenizer import Vocab
from ..tools.template import TemplateTools
from .images import IMAGE_PART_TYPES, MEDIA_MARKER

OFF_LOOP_SIZE = 32_768  # characters or tokens; more than this goes to a thread
# Requests prepared at once (templates, tools' grammars, tokenizing). Python work holds the
# GIL, so more threads would not prepare faster, only delay the event loop's turns: with four
# busy ones /health took 0.3 s, each of the loop's GIL hand-offs waiting behind all four.
PREPARE_THREADS = 2
T = TypeVar("T")

_limiters: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.CapacityLimiter] = (
    weakref.WeakKeyDictionary()
)


async def in_thread(work: Callable[[], T]) -> T:
    """work() in one of PREPARE_THREADS threads, the event loop free meanwhile."""
    loop = asyncio.get_running_loop()
    limiter = _limiters.get(loop)
    if limiter is None:  # one per event loop: a limiter belongs to the loop it waits on
        limiter = _limiters[loop] = anyio.CapacityLimiter(PREPARE_THREADS)
    return await anyio.to_thread.run_sync(work, limiter=limiter)


async def tokenize(vocab: Vocab, text: str, add_special: bool, parse_special: bool) -> list[int]:
    """vocab.tokenize, off the event loop for long texts."""
    return await off_loop(len(text), lambda: vocab.tokenize(text, add_special, parse_special))


async def off_loop(size: int, work: Callable[[], T]) -> T:
    """work(), in a thread when size says it is big enough to stall the other streams."""
    if size > OFF_LOOP_SIZE:
        return await in_thread(work)
    return work()


def check_token_ids(vocab: Vocab, tokens: list[int], param: str) -> None:
    """400 naming the first id that is not in the vocabulary."""
    bad = next((t for t in tokens if not vocab.is_valid(t)), None)
    if bad is not None:
        last = vocab.n_tokens - 1
        raise invalid_request(f"token id {bad} is not in the vocabulary (0..{last})", param)


def completion_prompts(vocab: Vocab, prompt: Any, echo: bool) -> list[tuple[list[int], str]]:
    """Each prompt's token ids, and its text when echo wants it ("" otherwise), from a
    string, token ids, or a list of either. Long work: call it in a thread."""
    many = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    result = []
    for one in prompt if many else [prompt]:
        if isinstance(one, str):
            tokens = vocab.tokenize(one, add_special=True, parse_special=True)
            text = one
        else:
            check_token_ids(vocab, one, "prompt")
            tokens, text = one, ""
            if echo:
                text = vocab.detokenize(one)
        if not tokens:
            raise invalid_request("the prompt is empty", "prompt")
        result.append((tokens, text))
    if not result:
        raise invalid_request("the prompt is empty", "prompt")
    return result


def chat_prompt(
    vocab: Vocab,
    template: Renderer,
    messages: list[ChatMessage],
    template_tools: TemplateTools,
    tools: list[dict[str, Any]] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of the chat template rendered over the messages (and tools), with BOS once.

    Long work (Jinja, tokenizing): call it in a thread."""
    return chat_tokens(vocab, chat_text(template, messages, template_tools, tools, kwargs))


def chat_text(
    template: Renderer,
    messages: list[ChatMessage],
    template_tools: TemplateTools,
    tools: list[dict[str, Any]] | None = None,
    kwargs: dict[str, Any] | None = None,
    images: bool = False,
) -> str:
    """The chat template rendered over the messages (and tools), with chat_template_kwargs.
    With images, each image part renders as the media marker (request/images.py); without,
    an image part is a 400."""
    dicts = [_message_dict(m, images) for m in messages]
    dicts, tools = template_tools.prepare(dicts, tools)
    try:
        return template.render(dicts, tools=tools, kwargs=kwargs)
    except ChatTemplateError as exc:
        raise invalid_request(str(exc), "messages") from exc


def chat_tokens(vocab: Vocab, text: str) -> list[int]:
    """A rendered chat's token ids, with BOS once."""
    tokens = vocab.tokenize(text, add_special=False, parse_special=True)
    # Templates usually write the BOS text themselves; add it only where they did not.
    if vocab.add_bos and vocab.bos_id >= 0 and (not tokens or tokens[0] != vocab.bos_id):
        tokens.insert(0, vocab.bos_id)
    if not tokens:
        raise invalid_request("the messages render to an empty prompt", "messages")
    return tokens


def _message_dict(message: ChatMessage, images: bool = False) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        parts = []
        for part in content:
            if images and part.type in IMAGE_PART_TYPES:
                parts.append(MEDIA_MARKER)
                continue
            if part.type != "text" or part.text is None:
                raise invalid_request(
                    f"content parts of type {part.type!r} are not supported; send text",
                    "messages",
                )
            parts.append(part.text)
        content = "".join(parts)
    result: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name:
        result["name"] = message.name
    if message.tool_calls:
        # HF templates take the arguments as a mapping (they write them with tojson).
        result["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                "function": {"name": call.function.name, "arguments": _arguments(call)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id:
        result["tool_call_id"] = message.tool_call_id
    thought = message.reasoning_content or message.reasoning
    if thought and message.role == "assistant":
        # Qwen3, DeepSeek, MiniMax, Seed-OSS templates read reasoning_content; gpt-oss's thinking.
        result["reasoning_content"] = result["thinking"] = thought
    return result


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return call.function.arguments
