"""Stop strings: find them in streamed text, and never emit text that may start one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class StopMatch:
    """What one push of text gives: the text safe to emit, and whether a stop string matched."""

    text: str
    matched: bool


class TextMatcher(Protocol):
    """What ends a reply on its text: StopMatcher, or tool_end.ToolCallEnd around one."""

    def push(self, text: str) -> StopMatch: ...

    def flush(self) -> str: ...


@dataclass(slots=True)
class StopMatcher:
    """Matches stop strings across chunk boundaries; the matched stop string itself is dropped."""

    stops: tuple[str, ...]
    _held: str = field(default="", init=False)
    _longest: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.stops = tuple(s for s in self.stops if s)
        self._longest = max((len(s) for s in self.stops), default=0)

    def push(self, text: str) -> StopMatch:
        """Feed newly generated text; after a match, the caller stops generating."""
        if not self.stops:
            return StopMatch(text, False)
        pending = self._held + text
        cut = min((i for i in (pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return StopMatch(pending[:cut], True)
        keep = self._prefix_tail(pending)
        self._held = pending[len(pending) - keep :]
        return StopMatch(pending[: len(pending) - keep], False)

    def flush(self) -> str:
        """The held-back text, once generation ended without a match."""
        held, self._held = self._held, ""
        return held

    def _prefix_tail(self, text: str) -> int:
        """Length of the longest tail of text that some stop string starts with."""
        for size in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0
