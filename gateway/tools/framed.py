"""Framed tool calls (format.py's `Framed`) to content and calls, incrementally.

The same contract as parser.py's ToolCallParser (push, finish, finish_reason, and the counts
end.py reads), for calls whose name is written outside their arguments: a call is announced
(id and name) as soon as its name is whole, and its arguments follow as fragments of their
JSON text. Arguments written XML-ish (one element per parameter) become a JSON object, one
member per parameter as each closes, its value typed by the function's JSON schema (numbers,
booleans, objects parsed; strings kept; a parameter the schema does not know stays a string).

As in parser.py: text around calls is content; a run of markers that holds no call is given
back as content; a call that repeats an earlier one word for word is held while it does and
dropped when whole; a reply cut by max_tokens (`finish(cut=True)`) keeps a call whose name is
whole with the arguments written so far, and drops a call cut before its name was whole.

Python-style calls (`python_args`: `[get_weather(city="Paris"), get_time()]`) are read
whole: a call is announced with its arguments once its `)` closes them and they parse as
keyword arguments of literal values (Python's ast, never run; JSON's true/false/null are
read too); what does not parse is content. Cut by max_tokens, such a call keeps the
arguments that were whole (followed by a comma). Strings in triple quotes are not read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from .format import Framed, ToolFormat, XmlArguments
from .parser import (
    CallStart,
    ParsedCall,
    ToolCallParser,
    ToolEvent,
    _partial_marker,
    add_arguments,
    add_content,
    read_reply,
)
from .python_call import leading_keywords, python_arguments

MAX_NAME_CHARS = 256  # a "name" longer than this is text, not a call


@dataclass(slots=True)
class _Call:
    """The call being read."""

    raw: str = ""  # its text from its opening marker on (to find repeats)
    name: str = ""
    index: int | None = None  # once announced
    dropped: bool = False  # past max_calls: read, never sent
    held: bool = False  # so far word for word an earlier call
    args: str = ""  # the arguments' JSON text made so far
    sent: int = 0  # args[:sent] has been sent
    depth: int = 0  # JSON arguments: nesting
    in_string: bool = False
    escaped: bool = False
    started: bool = False  # the arguments began
    members: int = 0  # XML arguments: parameters written
    key: str | None = None  # XML arguments: the parameter whose value is read
    quoted: str = ""  # Gemma 4's (or Python-style) arguments as written, until they close
    quote: str = ""  # Python-style arguments: the quote of the string being read


@dataclass(slots=True)
class FramedCallParser:
    """Splits one reply into content and framed calls; max_calls None means any number."""

    format: ToolFormat
    max_calls: int | None = None
    # Each function's parameters schema, by name: XML-ish values are typed by it.
    schemas: dict[str, Any] = field(default_factory=dict)
    calls: int = 0
    repeats: int = 0
    whole_calls: int = 0
    cut_at_repeat: bool = False
    _content_after_call: bool = False
    _buffer: str = ""
    _mode: str = "text"  # text, run, name, to_args, args, after_args
    _at_start: bool = True  # nothing but space read yet (a Python-style list may start)
    _in_list: bool = False  # a Python-style list's `[` or `,` was read: a call may follow
    _run_text: str = ""  # what a run consumed, given back as content if it held no call
    _run_calls: int = 0
    _call: _Call = field(default_factory=_Call)
    _done_calls: list[str] = field(default_factory=list)
    _events: list[ToolEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.format.starts_in_call:  # the prompt wrote the first call's opener
            self._start_run("")
            self._mode, self._call = "name", _Call()

    @property
    def _framed(self) -> Framed:
        assert self.format.framed is not None
        return self.format.framed

    def push(self, text: str) -> list[ToolEvent]:
        """The events this text completes."""
        self._buffer += text
        while self._step():
            pass
        return self._take()

    def finish(self, cut: bool = False) -> list[ToolEvent]:
        """The events of the end of the reply (cut: it ended at max_tokens)."""
        if cut:
            self.cut_at_repeat = self._cut_lost_nothing()
        mode, call = self._mode, self._call
        if mode in ("to_args", "args") and self._framed.python_args and call.index is None:
            self._finish_python(call, cut)
            self._buffer = ""
        elif mode == "name":
            if not cut:  # never a call: its text is content
                self._end_run(call.raw + self._buffer)
            self._buffer = ""
        elif mode in ("to_args", "args", "after_args"):
            if call.index is not None:
                if mode == "args" and self._framed.xml is not None and not cut:
                    self._close_xml(call)
                elif not (cut or call.args):  # ended (not cut) before any arguments: none
                    call.args = "{}"
                self._send(call)
            self._buffer = ""
        elif mode == "run":
            self._end_run(drop=cut)
            if cut:
                self._buffer = ""
        self._mode = "text"
        buffer = self._buffer
        if cut:
            buffer = buffer[: len(buffer) - _partial_marker(buffer, self._starts())]
        if not (self.calls and buffer.isspace()):
            self._content(buffer)
        self._buffer = ""
        return self._take()

    def finish_reason(self, reason: str) -> str:
        """As ToolCallParser.finish_reason: `tool_calls` when the reply ended at its calls."""
        if self.calls and (reason == "stop" or (reason == "length" and self.cut_at_repeat)):
            return "tool_calls"
        return reason

    def _cut_lost_nothing(self) -> bool:
        if not self.calls or self.whole_calls < self.calls or self._content_after_call:
            return False
        if self._mode == "run":
            return True
        if self._mode == "text":
            buffer = self._buffer
            return not buffer[: len(buffer) - _partial_marker(buffer, self._starts())].strip()
        call = self._call
        return call.index is None and (call.held or call.dropped or self._repeats(call.raw))

    # --- states --------------------------------------------------------------------

    def _step(self) -> bool:
        if not self._buffer:
            return False
        return getattr(self, "_step_" + self._mode)()

    def _starts(self) -> tuple[str, ...]:
        """The markers that start a run of calls (or a call) in text."""
        return (*self.format.opens, *self._framed.opens, *self._framed.between)

    def _step_text(self) -> bool:
        buffer = self._buffer
        if self._at_start and self.format.bare_json and self._framed.python_args:
            stripped = buffer.lstrip()
            if not stripped:
                return False  # leading space: held until the first real character
            self._at_start = False
            if stripped.startswith("["):  # a reply that is a list of calls
                self._start_run(buffer[: len(buffer) - len(stripped)])
                self._buffer = stripped
                return True
        self._at_start = False
        found = _earliest(buffer, self._starts())
        if found is not None:
            at, marker = found
            if not (self.calls and buffer[:at].isspace()):
                self._content(buffer[:at])
            self._buffer = buffer[at + len(marker) :]
            self._start_run(marker)
            if marker in self._framed.opens:
                self._run_text = ""
                self._open_call(marker)
            return True
        hold = _partial_marker(buffer, self._starts())
        if self.calls and buffer[: len(buffer) - hold].isspace():
            return False
        self._content(buffer[: len(buffer) - hold])
        self._buffer = buffer[len(buffer) - hold :]
        return False

    def _step_run(self) -> bool:
        buffer = self._buffer
        skip = len(buffer) - len(buffer.lstrip())
        self._run_text += buffer[:skip]
        buffer = self._buffer = buffer[skip:]
        if not buffer:
            return False
        framed = self._framed
        if framed.python_args:
            if buffer[0] in "[,]":  # the list of calls, between calls
                self._in_list = buffer[0] != "]"
                self._run_text += buffer[0]
                self._buffer = buffer[1:]
                return True
            if self._in_list and (buffer[0].isalpha() or buffer[0] == "_"):
                self._in_list = False  # text after the list is no call
                self._open_call("")
                return True
        for marker in sorted(framed.opens, key=len, reverse=True):
            if buffer.startswith(marker):
                self._buffer = buffer[len(marker) :]
                self._open_call(marker)
                return True
        for marker in (*self.format.opens, *framed.between):
            if buffer.startswith(marker):
                self._run_text += marker
                self._buffer = buffer[len(marker) :]
                return True
        if any(m.startswith(buffer) for m in self._starts()):
            return False  # maybe a marker, cut short
        self._end_run()
        return True

    def _step_name(self) -> bool:
        framed, call, buffer = self._framed, self._call, self._buffer
        if framed.python_args:
            # A Python-style name is a dotted identifier: anything else ends it being a call
            # at once, so the text is read alike whole and a piece at a time.
            read = _PYTHON_NAME.match(buffer)
            assert read is not None
            end = read.end()
            if end > MAX_NAME_CHARS:
                pass  # too long for a name: text
            elif end == len(buffer):
                return False  # more of the name may come
            elif buffer[end] == "(":
                return self._python_name(buffer[:end])
            self._mode = "run"
            self._end_run(call.raw)
            return True
        found = _earliest(buffer, framed.name_ends)
        if found is None:
            if len(buffer) > MAX_NAME_CHARS:
                self._mode = "run"
                self._end_run(call.raw)
                return True
            return False
        at = found[0]
        text = buffer[:at]
        self._eat(at)
        if framed.content_name and text.strip() == framed.content_name:
            # Functionary's "all": a message of text, not a call
            self._eat(len(found[1]))
            self._run_calls += 1  # what the run consumed is no content
            self._end_run()
            return True
        name = _name(framed, text)
        if name is None:
            self._mode = "run"
            self._end_run(call.raw)
            return True
        call.name = name
        self._mode = "to_args"
        if self._repeats(call.raw):
            call.held = True
            self._run_calls += 1
        else:
            self._announce(call, text.strip() if framed.name_as_id else "")
        return True

    def _python_name(self, text: str) -> bool:
        """The name of a Python-style call is whole: announced once its arguments parse."""
        call = self._call
        name = _name(self._framed, text)
        self._eat(len(text))
        if name is None:
            self._mode = "run"
            self._end_run(call.raw)
            return True
        call.name = name
        self._mode = "to_args"
        return True

    def _step_to_args(self) -> bool:
        framed, buffer = self._framed, self._buffer
        if framed.args_open:
            found = _earliest(buffer, (framed.args_open, *([framed.close] if framed.close else ())))
            if found is None:
                keep = _partial_marker(buffer, (framed.args_open, framed.close))
                self._eat(len(buffer) - keep)
                return False
            at, marker = found
            self._eat(at)
            if marker == framed.args_open:
                self._eat(len(marker))
        self._mode = "args"
        return True

    def _step_args(self) -> bool:
        if self._framed.python_args:
            return self._step_python()
        if self._framed.xml is not None:
            return self._step_xml()
        call, buffer = self._call, self._buffer
        if not call.started:
            stripped = buffer.lstrip()
            self._eat(len(buffer) - len(stripped))
            if not stripped:
                return False
            if not stripped.startswith("{"):
                # No JSON object: no arguments (what follows is not read as them)
                self._add_args(call, "{}")
                self._mode = "after_args"
                return True
            call.started = True
            buffer = self._buffer
        if self._framed.string_quote:
            return self._step_quoted()
        used = 0
        for ch in buffer:
            used += 1
            if call.in_string:
                if call.escaped:
                    call.escaped = False
                elif ch == "\\":
                    call.escaped = True
                elif ch == '"':
                    call.in_string = False
            elif ch == '"':
                call.in_string = True
            elif ch in "{[":
                call.depth += 1
            elif ch in "}]":
                call.depth -= 1
            if call.depth == 0:
                break
        self._add_args(call, buffer[:used])
        self._eat(used)
        if call.depth == 0:
            self._mode = "after_args"
        return call.depth == 0

    def _step_quoted(self) -> bool:
        """Gemma 4's arguments: an object with bare keys, strings between quote markers; sent
        whole, as JSON, once the object closes."""
        quote, call = self._framed.string_quote, self._call
        while self._buffer:
            buffer = self._buffer
            if call.in_string:
                at = buffer.find(quote)
                if at < 0:
                    keep = _partial_marker(buffer, (quote,))
                    call.quoted += buffer[: len(buffer) - keep]
                    self._eat(len(buffer) - keep)
                    return False
                call.quoted += buffer[: at + len(quote)]
                self._eat(at + len(quote))
                call.in_string = False
                continue
            if buffer.startswith(quote):
                call.quoted += quote
                self._eat(len(quote))
                call.in_string = True
                continue
            if quote.startswith(buffer):
                return False  # maybe a quote marker, cut short
            ch = buffer[0]
            call.quoted += ch
            self._eat(1)
            if ch in "{[":
                call.depth += 1
            elif ch in "}]":
                call.depth -= 1
                if call.depth == 0:
                    self._add_args(call, quoted_to_json(call.quoted, quote))
                    self._mode = "after_args"
                    return True
        return False

    def _step_python(self) -> bool:
        """Python keyword arguments, up to the `)` that closes the call (strings and brackets
        followed); then the call is announced with them as JSON, or given back as content."""
        call, buffer = self._call, self._buffer
        used, closed = 0, False
        for ch in buffer:
            used += 1
            if call.quote:
                if call.escaped:
                    call.escaped = False
                elif ch == "\\":
                    call.escaped = True
                elif ch == call.quote:
                    call.quote = ""
            elif ch in "'\"":
                call.quote = ch
            elif ch in "([{":
                call.depth += 1
            elif ch in ")]}":
                call.depth -= 1
                if call.depth < 0:
                    closed = True
                    break
        call.quoted += buffer[:used]
        self._eat(used)
        if not closed:
            return False
        arguments = python_arguments(call.quoted[:-1])
        if arguments is None:  # not keyword arguments of literals: no call
            self._mode = "run"
            self._end_run(call.raw)
            return True
        if self._repeats(call.raw):
            call.held = True  # a repeat, dropped and counted
            self._run_calls += 1
        else:
            self._announce(call, "")
            self._add_args(call, arguments)
        self._close_call(call)
        return True

    def _finish_python(self, call: _Call, cut: bool) -> None:
        """The reply ended inside a Python-style call's arguments: cut by max_tokens, the
        call with the arguments that were whole (unless it repeats an earlier one); else
        no call, content."""
        if not cut:
            self._end_run(call.raw + self._buffer)
            return
        if self._repeats(call.raw):
            return
        self._announce(call, "")
        arguments = leading_keywords(call.quoted)
        if arguments is not None:
            self._add_args(call, arguments)

    def _step_xml(self) -> bool:
        xml, call, framed = self._framed.xml, self._call, self._framed
        assert xml is not None
        buffer = self._buffer
        if call.key is None:  # between parameters
            stripped = buffer.lstrip()
            self._eat(len(buffer) - len(stripped))
            if not stripped:
                return False
            if stripped.startswith(xml.key_open):
                end = stripped.find(xml.key_close, len(xml.key_open))
                if end < 0:
                    return False
                call.key = _key(xml, stripped[len(xml.key_open) : end])
                self._eat(end + len(xml.key_close))
                return True
            ends = (framed.close, *framed.opens) if framed.close else framed.opens
            if any(stripped.startswith(m) for m in ends if m):
                self._close_xml(call)
                self._mode = "after_args"
                return True
            if any(m.startswith(stripped) for m in (xml.key_open, *ends) if m):
                return False
            self._eat(1)  # stray text between parameters
            return True
        if xml.value_open:
            stripped = buffer.lstrip()
            if stripped.startswith(xml.value_open):
                self._eat(len(buffer) - len(stripped) + len(xml.value_open))
                buffer = self._buffer
            elif xml.value_open.startswith(stripped):
                return False
        end = buffer.find(xml.value_close)
        if end < 0:
            return False
        value = buffer[:end]
        if xml.trim_newline:
            value = value.removeprefix("\n").removesuffix("\n")
        self._eat(end + len(xml.value_close))
        typed = _typed(value, _property(self.schemas.get(call.name), call.key))
        member = json.dumps(call.key, ensure_ascii=False) + ": "
        member += json.dumps(typed, ensure_ascii=False)
        self._add_args(call, ("{" if call.members == 0 else ", ") + member)
        call.members += 1
        call.key = None
        return True

    def _step_after_args(self) -> bool:
        framed, call, buffer = self._framed, self._call, self._buffer
        if framed.close:
            at = buffer.find(framed.close)
            if at < 0:
                keep = _partial_marker(buffer, (framed.close,))
                self._eat(len(buffer) - keep)
                return False
            self._eat(at + len(framed.close))
        self._close_call(call)
        return True

    # --- calls ---------------------------------------------------------------------

    def _open_call(self, marker: str) -> None:
        self._mode, self._call = "name", _Call(raw=marker)

    def _eat(self, count: int) -> None:
        """Move count characters of the buffer into the call's text."""
        call = self._call
        call.raw += self._buffer[:count]
        self._buffer = self._buffer[count:]
        if call.held and not self._repeats(call.raw):
            call.held = False  # it differs from every earlier call: a call of its own
            self._run_calls -= 1
            self._announce(call, "")
            self._send(call)

    def _repeats(self, text: str) -> bool:
        return any(done.startswith(text) for done in self._done_calls)

    def _announce(self, call: _Call, call_id: str) -> None:
        self._run_calls += 1
        if self.max_calls is not None and self.calls >= self.max_calls:
            call.dropped = True
            return
        call.index = self.calls
        self.calls += 1
        self._events.append(CallStart(call.index, call_id or self.format.new_call_id(), call.name))

    def _add_args(self, call: _Call, text: str) -> None:
        call.args += text
        self._send(call)

    def _send(self, call: _Call) -> None:
        if call.index is not None and len(call.args) > call.sent:
            self._arguments(call.index, call.args[call.sent :])
            call.sent = len(call.args)

    def _close_xml(self, call: _Call) -> None:
        self._add_args(call, "}" if call.members else "{}")

    def _close_call(self, call: _Call) -> None:
        self._mode = "run"
        if call.held:
            self.repeats += 1
            return
        if call.index is not None:
            self._done_calls.append(call.raw)
            self.whole_calls += 1
            self._content_after_call = False

    # --- runs and output -------------------------------------------------------------

    def _start_run(self, consumed: str) -> None:
        self._mode, self._run_text, self._run_calls = "run", consumed, 0

    def _end_run(self, trailing: str = "", drop: bool = False) -> None:
        if not drop:
            self._content((self._run_text if self._run_calls == 0 else "") + trailing)
        self._mode, self._run_text, self._run_calls = "text", "", 0

    def _content(self, text: str) -> None:
        if not text:
            return
        if self.calls and not text.isspace():
            self._content_after_call = True
        add_content(self._events, text)

    def _arguments(self, index: int, text: str) -> None:
        add_arguments(self._events, index, text)

    def _take(self) -> list[ToolEvent]:
        events, self._events = self._events, []
        return events


ToolParser: TypeAlias = ToolCallParser | FramedCallParser  # either family's parser


def tool_parser(
    fmt: ToolFormat, max_calls: int | None, schemas: dict[str, Any] | None = None
) -> ToolParser:
    """A fresh parser for one reply in fmt's syntax."""
    if fmt.framed is not None:
        return FramedCallParser(fmt, max_calls, schemas or {})
    return ToolCallParser(fmt, max_calls)


def parse_any(
    fmt: ToolFormat,
    text: str,
    max_calls: int | None,
    cut: bool = False,
    schemas: dict[str, Any] | None = None,
) -> tuple[str, list[ParsedCall]]:
    """The content and the calls of a whole reply in any family's syntax."""
    return read_reply(tool_parser(fmt, max_calls, schemas), text, cut)


_BARE_KEY = re.compile(r"([A-Za-z_][A-Za-z0-9_.-]*)(\s*:)")


def quoted_to_json(text: str, quote: str) -> str:
    """Gemma 4's `{key:<|"|>text<|"|>,n:1}` as JSON text: strings between the quote markers
    become JSON strings, bare keys are quoted; numbers, true, false, null stay."""
    parts = text.split(quote)
    out = []
    for i, part in enumerate(parts):
        if i % 2:  # inside a string
            out.append(json.dumps(part, ensure_ascii=False))
        else:
            out.append(_BARE_KEY.sub(lambda m: json.dumps(m.group(1)) + m.group(2), part))
    return "".join(out)


_PYTHON_NAME = re.compile(r"[\w.]*")


def _earliest(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    """The first marker in text (the longest where two start at one place)."""
    found = [(text.find(m), -len(m), m) for m in markers if m]
    found = [f for f in found if f[0] >= 0]
    if not found:
        return None
    at, _, marker = min(found)
    return at, marker


def _name(framed: Framed, text: str) -> str | None:
    """The function's name in the name's text; None when it is no name."""
    if framed.name_pattern:
        match = re.fullmatch(framed.name_pattern, text, re.DOTALL)
        name = match.group(1) if match is not None else ""
    else:
        name = text.strip()
    if not name or any(ch.isspace() or ch in "<>{}[]\"'" for ch in name):
        return None
    return name


def _key(xml: XmlArguments, text: str) -> str:
    """A parameter's key in the text between KEY_OPEN and KEY_CLOSE."""
    if xml.key_pattern:
        match = re.fullmatch(xml.key_pattern, text, re.DOTALL)
        text = match.group(1) if match is not None else text
    return text.strip()


def _property(schema: Any, key: str | None) -> Any:
    """The schema of one parameter of a function's parameters schema (None: unknown)."""
    if not isinstance(schema, dict) or key is None:
        return None
    properties = schema.get("properties")
    return properties.get(key) if isinstance(properties, dict) else None


_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "object": dict,
    "array": list,
    "null": type(None),
}


def _typed(value: str, schema: Any) -> Any:
    """An XML-ish parameter's text as the JSON value its schema asks for; else the text."""
    types = schema_types(schema)
    if not types or types == {"string"}:
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return value
    for name in types:
        kind = _JSON_TYPES.get(name)
        if kind is None:
            continue
        if isinstance(parsed, bool) and name in ("integer", "number"):
            continue  # True is an int to Python, not to JSON
        if isinstance(parsed, kind):
            return parsed
    return value


def schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows (anyOf/oneOf followed one level)."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    found: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            found |= schema_types(option)
    if not found and "properties" in schema:
        return {"object"}
    return found
