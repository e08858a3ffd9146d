"""Ending a reply with tools where its calls end: a stop rule beside the stop strings.

A small model asked for calls (most often with a forced tool_choice and parallel calls
allowed, where the grammar lets it write call after call) tends to repeat its call until
max_tokens. ToolCallEnd reads the reply's text as the worker writes it, with a tool parser of
its own, and ends the generation (as a stop string would: the worker's sequence is cancelled,
the finish is "stop", which the response reports as "tool_calls") when:

- a call repeats an earlier call of the same reply word for word (the response's parser drops
  that call too), or
- the reply may hold one call only (parallel_tool_calls false) and that call is whole.

PromptEcho guards the other failure of small models: a model whose template cannot show
tools gets them in its system message (template.py: the request's own system text, then the
tools' prompt), and under `auto` may start its reply by copying that message. The start of
the reply is held while it is word for word the message's start; once it has copied ECHO_CHARS
characters the copy is dropped and the reply ends there (finish "stop", no content): the
prompt is ours, never the model's answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..text.stop import StopMatch, StopMatcher, TextMatcher
from .framed import ToolParser

ECHO_CHARS = 24  # a reply that starts with this much of the injected tool prompt copies it


@dataclass(slots=True)
class ToolCallEnd:
    """StopMatcher's interface (push, flush): the request's stop strings, then the calls."""

    stops: StopMatcher
    parser: ToolParser
    _ended: bool = field(default=False, init=False)

    def push(self, text: str) -> StopMatch:
        """The text that may be sent; matched once a stop string or the calls ended it."""
        if self._ended:
            return StopMatch("", True)
        match = self.stops.push(text)
        if self._calls_end(match.text):
            self._ended = True
            return StopMatch(match.text, True)
        return match

    def flush(self) -> str:
        """Text the stop strings held back, once generation ended without a match."""
        return self.stops.flush()

    def _calls_end(self, text: str) -> bool:
        parser = self.parser
        before = parser.repeats
        parser.push(text)  # its events are the response's job, not this one's
        if parser.repeats > before:
            return True
        return parser.max_calls is not None and parser.whole_calls >= parser.max_calls


@dataclass(slots=True)
class PromptEcho:
    """StopMatcher's interface around another matcher: ends a reply that copies `prompt`."""

    inner: TextMatcher
    prompt: str
    _held: str = field(default="", init=False)
    _checking: bool = field(default=True, init=False)  # the reply's start is still read

    def push(self, text: str) -> StopMatch:
        """The text that may be sent; matched (with nothing sent) once it copies the prompt."""
        match = self.inner.push(text)
        if not self._checking:
            return match
        held = self._held + match.text
        start = held.lstrip()
        if self.prompt.startswith(start):
            if len(start) >= min(ECHO_CHARS, len(self.prompt)):
                self._checking, self._held = False, ""
                return StopMatch("", True)  # a copy of our prompt: none of it is sent
            if not match.matched:
                self._held = held
                return StopMatch("", False)
        self._checking, self._held = False, ""
        return StopMatch(held, match.matched)

    def flush(self) -> str:
        """What was held back, once generation ended without a match."""
        held, self._held = self._held, ""
        self._checking = False
        return held + self.inner.flush()
