"""The model's text to content and tool calls, incrementally, in one ToolFormat's syntax.

Pure: feed `push` the text as it comes and call `finish` once. A call is announced (id and
name) as soon as `{"name": "...", "arguments":` has been seen, and its arguments follow as
fragments of their JSON text, the way OpenAI streams tool calls. An object whose keys come in
another order is announced whole when it closes. Text that turns out not to be a call (no
name, broken JSON) is given back as content, unless part of it was already sent as a call.

A call that repeats an earlier call of the same reply word for word is dropped: it is held
while its text is a prefix of the earlier call's, and sent only once it differs. A reply cut
by max_tokens (`finish(cut=True)`) never gives a call's beginning back as content: a call
whose name is whole is sent with the arguments written so far (vLLM's shape for a cut call),
unless it was cut while, so far, it repeated an earlier call word for word (then it is
dropped: a cut duplicate is no call); the rest of an unfinished call or call marker is
dropped. A reply cut where nothing but such a duplicate (or a marker) was lost reports
`tool_calls`, as if it had ended at its calls (`finish_reason`).

After a family's `code_marker` (Llama 3.1's <|python_tag|>), text that does not start as JSON
is a built-in tool's call, read whole when the reply ends: `brave_search.call(query="x")` a
call of `brave_search` with {"query": "x"} (python_call.py reads the arguments), any other
text code, a call of `python` with {"code": text}. Cut by max_tokens, a `NAME.call(` keeps
its whole keyword arguments, and code what was written.

Each JSON object is read by call_object.py's CallObject, which finds a call's name and
arguments in it; this module decides what the text is: content, a call, or a repeat.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Protocol

from .call_object import CallObject, as_call, decoded_string
from .format import ToolFormat
from .python_call import leading_keywords, python_arguments

_BETWEEN_CALLS = " \t\r\n,;["  # what may separate calls in a run
# A built-in tool's call after the code marker: NAME.call(ARGUMENTS)
_BUILTIN_CALL = re.compile(r"\s*([A-Za-z_]\w*)\s*\.\s*call\s*\((.*)", re.DOTALL)


@dataclass(slots=True)
class ContentDelta:
    text: str


@dataclass(slots=True)
class CallStart:
    """A new call: its index among this reply's calls, id and function name."""

    index: int
    id: str
    name: str


@dataclass(slots=True)
class ArgumentsDelta:
    """More of the arguments' JSON text of call `index`."""

    index: int
    text: str


ToolEvent = ContentDelta | CallStart | ArgumentsDelta


def add_content(events: list[ToolEvent], text: str) -> None:
    """Content onto a parser's pending events, merged into the last one where it is content."""
    last = events[-1] if events else None
    if isinstance(last, ContentDelta):
        last.text += text
    else:
        events.append(ContentDelta(text))


def add_arguments(events: list[ToolEvent], index: int, text: str) -> None:
    """More of call `index`'s arguments, merged into the last event where it is that call's."""
    last = events[-1] if events else None
    if isinstance(last, ArgumentsDelta) and last.index == index:
        last.text += text
    else:
        events.append(ArgumentsDelta(index, text))


@dataclass(slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass(slots=True)
class ToolCallParser:
    """Splits one reply into content and calls; max_calls None means any number."""

    format: ToolFormat
    max_calls: int | None = None
    calls: int = 0  # calls announced so far
    repeats: int = 0  # calls dropped because they repeated an earlier one word for word
    whole_calls: int = 0  # calls announced whose object closed
    # finish(cut=True) found that the cut lost nothing new: after whole calls, only the start
    # of another call that so far repeats an earlier one (or a marker, or space).
    cut_at_repeat: bool = False
    _content_after_call: bool = False  # content was sent since the last whole call
    _buffer: str = ""
    _mode: str = "text"  # "text", "run" (between calls), "object", "tagged", "code"
    _at_start: bool = True
    _run_text: str = ""  # what a run consumed, given back as content if it held no call
    _run_calls: int = 0
    _object: CallObject = field(default_factory=CallObject)
    _done_calls: list[str] = field(default_factory=list)  # the text of each whole call
    _events: list[ToolEvent] = field(default_factory=list)

    def push(self, text: str) -> list[ToolEvent]:
        """The events this text completes."""
        self._buffer += text
        while self._step():
            pass
        return self._take()

    def finish(self, cut: bool = False) -> list[ToolEvent]:
        """The events of the end of the reply: what was held back, as content or arguments.

        cut: the reply ended at max_tokens; an unfinished call is not content then.
        """
        if cut:
            self.cut_at_repeat = self._cut_lost_nothing()
        if self._mode == "code":
            self._code_call(cut)
        elif self._mode == "tagged":
            self._mode = "run"
        if self._mode == "object":
            self._finish_object(cut)
        elif self._mode == "run":
            self._end_run(drop=cut)
            if cut:  # what is left is the start of a closing marker, cut short
                self._buffer = ""
        buffer = self._buffer
        if cut:  # the start of a call marker, cut short
            buffer = buffer[: len(buffer) - _partial_marker(buffer, self.format.opens)]
        if not (self.calls and buffer.isspace()):
            self._content(buffer)
        self._buffer = ""
        return self._take()

    def finish_reason(self, reason: str) -> str:
        """The reply's finish reason as the response reports it (after `finish`): `tool_calls`
        when it made calls and ended at them, or was cut only inside a repeated call."""
        if self.calls and (reason == "stop" or (reason == "length" and self.cut_at_repeat)):
            return "tool_calls"
        return reason

    def _cut_lost_nothing(self) -> bool:
        """Whether what max_tokens cut (the text still held) adds nothing to whole calls."""
        if not self.calls or self.whole_calls < self.calls or self._content_after_call:
            return False
        if self._mode == "object":
            obj = self._object
            if obj.index is not None:
                return False  # a call of its own, cut short
            return obj.held or obj.dropped or self._repeats(obj.text)
        if self._mode == "run":
            return True  # between calls, or in a closing marker
        buffer = self._buffer  # text held back: space, or a call marker cut short
        return not buffer[: len(buffer) - _partial_marker(buffer, self.format.opens)].strip()

    # --- states ------------------------------------------------------------------

    def _step(self) -> bool:
        """Make progress on the buffer; False when it needs more text."""
        if self._mode == "text":
            return self._step_text()
        if self._mode == "run":
            return self._step_run()
        if self._mode == "tagged":
            return self._step_tagged()
        if self._mode == "code":
            return False  # read whole when the reply ends
        return self._step_object()

    def _step_text(self) -> bool:
        buffer, fmt = self._buffer, self.format
        if not buffer:
            return False
        if fmt.bare_json and self._at_start:
            stripped = buffer.lstrip()
            if not stripped:
                return False  # leading whitespace: held until the first real character
            self._at_start = False
            if stripped[0] in "{[":
                self._start_run(buffer[: len(buffer) - len(stripped)])
                self._buffer = stripped
                return True
        self._at_start = False
        found = [(buffer.find(m), m) for m in fmt.opens]
        found = [(i, m) for i, m in found if i >= 0]
        if found:
            at, marker = min(found)
            if not (self.calls and buffer[:at].isspace()):  # else: space between calls
                self._content(buffer[:at])
            self._start_run(marker)
            self._buffer = buffer[at + len(marker) :]
            if marker == fmt.code_marker:
                self._mode = "tagged"
            return True
        hold = _partial_marker(buffer, fmt.opens)
        if self.calls and buffer[: len(buffer) - hold].isspace():
            return False  # after a call: space before another call is no content
        self._content(buffer[: len(buffer) - hold])
        self._buffer = buffer[len(buffer) - hold :]
        return False

    def _step_tagged(self) -> bool:
        """After the code marker: JSON calls, or a built-in tool's call (the rest)."""
        stripped = self._buffer.lstrip()
        if not stripped:
            return False
        self._mode = "run" if stripped[0] in "{[" else "code"
        return True

    def _code_call(self, cut: bool) -> None:
        """The reply ended after the code marker: the built-in tool's call its text is."""
        text, self._buffer = self._buffer, ""
        self._mode = "text"
        found = _BUILTIN_CALL.fullmatch(text)
        if found is not None:
            name, rest = found.groups()
            rest = rest.rstrip()
            whole = rest.endswith(")") and python_arguments(rest[:-1]) is not None
            if whole:
                arguments = python_arguments(rest[:-1])
            elif cut:
                arguments = leading_keywords(rest) or ""
            else:
                arguments = None  # not a call of literal keyword arguments: code
            if arguments is not None:
                self._builtin_call(name, arguments)
                return
        self._builtin_call("python", json.dumps({"code": text.strip()}, ensure_ascii=False))

    def _builtin_call(self, name: str, arguments: str) -> None:
        self._run_calls += 1
        obj = CallObject()
        self._announce(obj, name)
        if obj.index is not None:
            self._whole_call()
            self._arguments(obj.index, arguments)
        self._mode, self._run_text, self._run_calls = "text", "", 0

    def _step_run(self) -> bool:
        buffer = self._buffer
        skip = len(buffer) - len(buffer.lstrip(_BETWEEN_CALLS))
        self._run_text += buffer[:skip]
        buffer = self._buffer = buffer[skip:]
        if not buffer:
            return False
        closes = self.format.closes
        if buffer[0] == "{":
            self._mode, self._object = "object", CallObject()
            return True
        if buffer[0] == "]":  # a list of calls ends (before the closing marker, if any)
            self._run_text += "]"
            self._buffer = buffer[1:]
            if closes is None:
                self._end_run()
            return True
        if closes is not None:
            if buffer.startswith(closes):
                self._run_text += closes
                self._buffer = buffer[len(closes) :]
                self._end_run()
                return True
            if closes.startswith(buffer):
                return False  # maybe the closing marker, cut short
        self._end_run()
        return True

    def _step_object(self) -> bool:
        obj, buffer = self._object, self._buffer
        if not buffer:
            return False
        used = 0
        for ch in buffer:
            used += 1
            position = len(obj.text)
            if obj.read(ch):  # a key or a value starts here
                self._maybe_announce(obj, position)
            if obj.depth == 0:
                break
        self._buffer = buffer[used:]
        if obj.held and not self._repeats(obj.text):
            obj.held = False  # it differs from every earlier call: a call of its own
            self._announce(obj, obj.name)
        self._send_arguments(obj)
        if obj.depth == 0:
            self._close_object(obj)
        return obj.depth == 0

    # --- one object ----------------------------------------------------------------

    def _maybe_announce(self, obj: CallObject, position: int) -> None:
        """At the first character of a value: announce the call if these are its arguments."""
        if obj.index is not None or obj.dropped or not obj.find_arguments(position):
            return
        if self._repeats(obj.text):
            obj.held = True
            return
        self._announce(obj, obj.name)

    def _repeats(self, text: str) -> bool:
        """Whether text is, so far, word for word an earlier call of this reply."""
        return any(done.startswith(text) for done in self._done_calls)

    def _announce(self, obj: CallObject, name: str) -> None:
        self._run_calls += 1
        if self.max_calls is not None and self.calls >= self.max_calls:
            obj.dropped = True
            return
        obj.index = self.calls
        self.calls += 1
        self._events.append(CallStart(obj.index, self.format.new_call_id(), name))

    def _send_arguments(self, obj: CallObject) -> None:
        """Send the arguments' text read so far, holding back what may be trailing space."""
        if obj.index is None or obj.args_start is None or obj.args_quoted:
            return
        end = obj.args_end if obj.args_end is not None else len(obj.text)
        end = obj.args_start + len(obj.text[obj.args_start : end].rstrip())
        if end > obj.args_sent:
            self._arguments(obj.index, obj.text[obj.args_sent : end])
            obj.args_sent = end

    def _close_object(self, obj: CallObject) -> None:
        self._mode = "run"
        if obj.held or (obj.args_start is None and obj.text in self._done_calls):
            self._run_calls += 1  # a call all the same: the run is no content
            self.repeats += 1
            return
        if obj.index is not None:
            self._done_calls.append(obj.text)
            self._whole_call()
        if obj.args_start is not None:  # announced (or dropped) as it came
            if obj.args_quoted and obj.index is not None:
                raw = obj.text[obj.args_start : obj.args_end].strip()
                self._arguments(obj.index, decoded_string(raw))
            return
        call = as_call(obj.text)
        if call is None:
            self._end_run(obj.text)  # not a call: it and what came before are content
            return
        name, arguments = call
        self._announce(obj, name)
        if obj.index is not None:
            self._done_calls.append(obj.text)
            self._whole_call()
            self._arguments(obj.index, arguments)

    def _finish_object(self, cut: bool) -> None:
        """The reply ended inside an object: a call cut short keeps what it sent."""
        obj = self._object
        if obj.held or (cut and obj.index is None and not obj.dropped and self._repeats(obj.text)):
            # Cut while it repeated an earlier call (before or after its arguments began): a
            # duplicate, not a call of its own with empty arguments.
            self._mode = "text"
            return
        if cut and obj.index is None and not obj.dropped:
            # A call whose name is whole, with the arguments written so far; cut before its
            # name was whole, nothing.
            name = obj.cut_name()
            if name is not None:
                self._announce(obj, name)
            self._mode = "text"
            return
        if obj.index is not None or obj.dropped:
            if obj.index is not None and obj.args_quoted and obj.args_start is not None:
                self._arguments(obj.index, obj.text[obj.args_start :].strip())
            else:
                self._send_arguments(obj)
            self._mode = "text"
            return
        self._mode = "run"
        self._end_run(obj.text)

    # --- runs and output -------------------------------------------------------------

    def _start_run(self, consumed: str) -> None:
        self._mode, self._run_text, self._run_calls = "run", consumed, 0

    def _end_run(self, trailing: str = "", drop: bool = False) -> None:
        """Back to text; a run that held no call was content after all (unless dropped: a
        reply cut inside a run)."""
        if not drop:
            self._content((self._run_text if self._run_calls == 0 else "") + trailing)
        self._mode, self._run_text, self._run_calls = "text", "", 0

    def _whole_call(self) -> None:
        self.whole_calls += 1
        self._content_after_call = False

    def _content(self, text: str) -> None:
        if not text:
            return
        if self.calls and not text.isspace():
            self._content_after_call = True
        add_content(self._events, text)

    def _arguments(self, index: int, text: str) -> None:
        if text:
            add_arguments(self._events, index, text)

    def _take(self) -> list[ToolEvent]:
        events, self._events = self._events, []
        return events


def parse_reply(
    fmt: ToolFormat, text: str, max_calls: int | None, cut: bool = False
) -> tuple[str, list[ParsedCall]]:
    """The content and the calls of a whole reply, as the streamed events add up."""
    return read_reply(ToolCallParser(fmt, max_calls), text, cut)


class ReplyParser(Protocol):
    """What read_reply needs of a parser: ToolCallParser, or framed.py's FramedCallParser."""

    def push(self, text: str) -> list[ToolEvent]: ...

    def finish(self, cut: bool = False) -> list[ToolEvent]: ...


def read_reply(parser: ReplyParser, text: str, cut: bool) -> tuple[str, list[ParsedCall]]:
    """parse_reply with a fresh parser of one's own, which then knows the reply's ending."""
    content: list[str] = []
    calls: list[ParsedCall] = []
    for event in [*parser.push(text), *parser.finish(cut)]:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, CallStart):
            calls.append(ParsedCall(event.id, event.name, ""))
        else:
            calls[event.index].arguments += event.text
    return "".join(content), calls


def _partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of text that may be the start of a marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-size:]):
                longest = size
                break
    return longest
