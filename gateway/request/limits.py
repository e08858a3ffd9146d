"""What one request may hold, checked before any work is done on it: tools, messages, text.

Preparing a request (its template, its tools' grammar, its tokens) runs in a thread, but it
still costs seconds for a request far beyond what the server can serve: 5,000 tools, or
megabytes of text that no context holds. These caps refuse such a request at once, in
microseconds, with a 400 that says which cap it broke.
"""

from __future__ import annotations

from typing import Any

from ..api.errors import APIError, invalid_request
from ..api.schemas import MAX_MESSAGES, MAX_TOOLS, ChatMessage

# The body fields that hold a conversation's turns: chat's and the Messages API's `messages`,
# the Responses API's `input` (the embeddings' `input`, inputs not turns, has its own cap).
TURNS = ("messages", "input")


def check_counts(body: Any, turns: tuple[str, ...] = TURNS) -> None:
    """400 for a JSON body with more tools or messages than a request may have.

    Checked on the parsed JSON, before it is validated into a request object: validating
    5,000 tools is itself work the event loop should not do for a request bound to fail.
    """
    if not isinstance(body, dict):
        return
    tools = body.get("tools")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise invalid_request(f"at most {MAX_TOOLS} tools per request (got {len(tools)})", "tools")
    for name in turns:
        items = body.get(name)
        if isinstance(items, list) and len(items) > MAX_MESSAGES:
            raise invalid_request(
                f"at most {MAX_MESSAGES} {name} items per request (got {len(items)})", name
            )


def text_cap(slot_context: int, longest_token: int) -> int:
    """Characters of text that surely make more tokens than a slot's context holds.

    No token stands for more than longest_token bytes, and a character is at least one
    byte: text of n characters is at least n / longest_token tokens.
    """
    return slot_context * max(1, longest_token)


def check_text(chars: int, slot_context: int, longest_token: int, param: str) -> None:
    """400 (context_length_exceeded) for text too long for the context whatever its tokens."""
    cap = text_cap(slot_context, longest_token)
    if chars > cap:
        raise APIError(
            400,
            f"This model's maximum context length is {slot_context} tokens; the request's "
            f"{chars} characters of text make more tokens than that (at most {cap} characters "
            "can fit). Shorten the prompt.",
            param=param,
            code="context_length_exceeded",
        )


def count_context(context_train: int, slot_context: int | None) -> int:
    """Tokens a count-only request's text (count_tokens, input_tokens, /tokenize) may make.

    Counting a prompt longer than a slot is a fair question (will it fit elsewhere?), so the
    cap is the larger of the model's training context and the slot's; 0: neither is known.
    Without a cap, megabytes of text would be tokenized in the gateway for nothing.
    """
    return max(context_train, slot_context or 0)


def chat_chars(messages: list[ChatMessage]) -> int:
    """Characters of text in a chat's messages: contents and tool calls' arguments."""
    total = 0
    for message in messages:
        content = message.content
        if isinstance(content, str):
            total += len(content)
        elif content:
            total += sum(len(part.text or "") for part in content)
        total += sum(len(call.function.arguments) for call in message.tool_calls or ())
    return total


def prompt_chars(prompt: Any) -> int:
    """Characters of the longest text prompt of a completion (each has a context of its own)."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return max((len(one) for one in prompt if isinstance(one, str)), default=0)
    return 0
