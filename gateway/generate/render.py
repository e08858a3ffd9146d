"""OpenAI response bodies and server-sent-event chunks, for completions and chat completions."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import version
from typing import Any

from ..api.errors import APIError
from ..api.response_bodies import (
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    TopLogprob,
    Usage,
)
from ..request.generation_request import GenerationRequest
from ..tools.framed import ToolParser
from ..tools.parser import ContentDelta, ToolEvent
from ..tools.replies import assistant_message, tool_call_delta
from .assembly import Done, PromptScores, TextDelta, TokenLogprob

DONE_EVENT = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


@cache
def system_fingerprint(model: str) -> str:
    """OpenAI's `system_fingerprint`: what served the answer, the same until loomserve's
    version or the model changes (clients log it, or key caches of answers on it)."""
    served_by = f"loomserve {version('loomserve')} {model}".encode()
    return "fp_" + hashlib.sha256(served_by).hexdigest()[:10]


def error_event(error: APIError) -> str:
    """The event that ends a stream which failed after it started."""
    return sse(error.body())


@dataclass(slots=True)
class StreamChunks:
    """The chunks of one streamed response: per choice its opening (the role for chat, the
    prompt for an echoing completion), text deltas and finish; then the usage.

    With tools, each choice's answer goes through its own tool parser and becomes content and
    tool-call deltas; a chunk may then be several events, or "" while the parser holds text.
    A delta's thinking (split from the answer in assembly.py) goes out as reasoning deltas.
    """

    request: GenerationRequest
    _parsers: dict[int, ToolParser | None] = field(default_factory=dict)
    # Completions' text_offset: characters each choice has sent so far.
    _offsets: dict[int, int] = field(default_factory=dict)

    def opening(self, index: int) -> str | None:
        """Chat choices open with the assistant's role, as OpenAI's do; echo with the prompt
        (with logprobs, not before the worker scored it: see `echo`)."""
        if self.request.chat:
            return self._choice(index, {"delta": {"role": "assistant", "content": ""}}, None)
        if self.request.echo and not self.request.logprobs:
            return self.text(index, TextDelta(self.request.prompt_of(index).text))
        return None

    def echo(self, index: int, scores: PromptScores) -> str:
        """The prompt of an echoing choice with its tokens' logprobs; the text_offset of the
        tokens that follow counts on from its tokens' text, as in the whole response."""
        logprobs = completion_logprobs(scores.logprobs, 0)
        self._offsets[index] = sum(len(_text(entry.token)) for entry in scores.logprobs)
        text = self.request.prompt_of(index).text
        return self._choice(index, {"text": text}, None, logprobs.model_dump())

    def text(self, index: int, delta: TextDelta) -> str:
        if self.request.chat:
            return self._chat_text(index, delta)
        logprobs = None
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + len(delta.text)
        if self.request.logprobs and delta.logprobs:
            logprobs = completion_logprobs(delta.logprobs, offset).model_dump()
        return self._choice(index, {"text": delta.text}, None, logprobs)

    def finish(self, index: int, reason: str) -> str:
        held = ""
        parser = self._parser(index)
        if parser is not None:
            events = parser.finish(cut=reason == "length")
            held += "".join(self._tool_event(index, e) for e in events)
            reason = parser.finish_reason(reason)
        body: dict[str, Any] = {"delta": {}} if self.request.chat else {"text": ""}
        return held + self._choice(index, body, reason)

    def usage(self, usage: Usage) -> str:
        return sse({**self._head(), "choices": [], "usage": usage.model_dump()})

    def _chat_text(self, index: int, delta: TextDelta) -> str:
        logprobs = None
        if self.request.logprobs:
            logprobs = chat_logprobs(delta.logprobs).model_dump()
        if not delta.reasoning:
            return self._answer(index, delta.text, logprobs, bool(delta.logprobs))
        # The tokens' logprobs go with the reasoning, which comes first.
        first = self._reasoning_delta(index, delta.reasoning, logprobs)
        return first + (self._answer(index, delta.text, None, False) if delta.text else "")

    def _answer(self, index: int, text: str, logprobs: Any, scored: bool) -> str:
        """The answer's text as content and tool-call deltas."""
        parser = self._parser(index)
        if parser is None:
            if not text and logprobs is None and self.request.reasoning is not None:
                return ""  # a delta of thinking only, or of held text: no content to send
            return self._choice(index, {"delta": {"content": text}}, None, logprobs)
        events = [self._tool_event(index, e) for e in parser.push(text)]
        if logprobs is not None and scored:
            # The tokens' logprobs go out at once, in a delta of their own.
            events.insert(0, self._choice(index, {"delta": {"content": ""}}, None, logprobs))
        return "".join(events)

    def _reasoning_delta(self, index: int, text: str, logprobs: Any = None) -> str:
        delta = {"reasoning_content": text, "reasoning": text}
        return self._choice(index, {"delta": delta}, None, logprobs)

    def _parser(self, index: int) -> ToolParser | None:
        if index not in self._parsers:
            self._parsers[index] = self.request.tool_parser()
        return self._parsers[index]

    def _tool_event(self, index: int, event: ToolEvent) -> str:
        if isinstance(event, ContentDelta):
            return self._choice(index, {"delta": {"content": event.text}}, None)
        return self._choice(index, {"delta": {"tool_calls": [tool_call_delta(event)]}}, None)

    def _choice(
        self, index: int, body: dict[str, Any], reason: str | None, logprobs: Any = None
    ) -> str:
        choice = {"index": index, **body, "logprobs": logprobs, "finish_reason": reason}
        payload = {**self._head(), "choices": [choice]}
        if self.request.include_usage:
            payload["usage"] = None
        return sse(payload)

    def _head(self) -> dict[str, Any]:
        r = self.request
        if not r.chat:
            return {"id": r.id, "object": "text_completion", "created": r.created, "model": r.model}
        return {
            "id": r.id,
            "object": "chat.completion.chunk",
            "created": r.created,
            "model": r.model,
            "system_fingerprint": system_fingerprint(r.model),
        }


def _text(token: bytes) -> str:
    return token.decode("utf-8", errors="replace")


def chat_logprobs(entries: list[TokenLogprob]) -> ChatLogprobs:
    """Chat's logprobs shape: each token with its bytes and its top alternatives. Chat never
    scores its prompt, so every entry is a sampled token's, with its logprob."""
    return ChatLogprobs(content=[_chat_token_logprob(e.token, *e.scored()) for e in entries])


def _chat_token_logprob(
    token: bytes, logprob: float, top: list[tuple[bytes, float]]
) -> ChatTokenLogprob:
    return ChatTokenLogprob(
        token=_text(token),
        logprob=logprob,
        bytes=list(token),
        top_logprobs=[TopLogprob(token=_text(t), logprob=v, bytes=list(t)) for t, v in top],
    )


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    """Completions' logprobs shape: parallel lists, text_offset counted from `offset` (a
    prompt's first token, scored by nothing, has None for its logprob and top)."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(_text(entry.token))
    return CompletionLogprobs(
        tokens=[_text(e.token) for e in entries],
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=[None if e.top is None else _top_dict(e.top) for e in entries],
        text_offset=offsets,
    )


def _top_dict(top: list[tuple[bytes, float]]) -> dict[str, float]:
    # Tokens whose bytes are not whole characters may share a text: keep the likeliest.
    result: dict[str, float] = {}
    for token, logprob in top:
        result.setdefault(_text(token), logprob)
    return result


def response_body(
    request: GenerationRequest,
    texts: list[str],
    dones: list[Done],
    logprobs: list[list[TokenLogprob]],
    usage: Usage,
    reasonings: list[str] | None = None,
) -> Completion | ChatCompletion:
    """The whole response of a request that does not stream: one choice per text, in order
    (with reasoning, each choice's answer, and in `reasonings` its thinking)."""
    asked = request.logprobs
    if request.chat:
        chat_choices = []
        thoughts = reasonings or [""] * len(texts)
        for i, (text, done, lp) in enumerate(zip(texts, dones, logprobs, strict=True)):
            message, reason = assistant_message(request.tools, text, done.finish_reason)
            if thoughts[i]:
                message.reasoning_content = message.reasoning = thoughts[i]
            chat_choices.append(
                ChatChoice(
                    index=i,
                    message=message,
                    logprobs=chat_logprobs(lp) if asked else None,
                    finish_reason=reason,
                )
            )
        return ChatCompletion(
            id=request.id,
            created=request.created,
            model=request.model,
            system_fingerprint=system_fingerprint(request.model),
            choices=chat_choices,
            usage=usage,
        )
    choices = []
    for i, (text, done, lp) in enumerate(zip(texts, dones, logprobs, strict=True)):
        prefix = request.prompt_of(i).text if request.echo else ""
        choices.append(
            CompletionChoice(
                index=i,
                text=prefix + text,
                # With echo, lp starts with the prompt's tokens: offsets count from 0.
                logprobs=completion_logprobs(lp, 0) if asked else None,
                finish_reason=done.finish_reason,
            )
        )
    return Completion(
        id=request.id, created=request.created, model=request.model, choices=choices, usage=usage
    )
