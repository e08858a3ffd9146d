"""One JSON object that may be a tool call, read a character at a time (parser.py drives it).

CallObject follows the object's nesting and strings, and finds where a call written name first
(`{"name": "...", "arguments": ...}`) has its name and its arguments' JSON text, so that the
parser can announce the call and stream its arguments before the object closes. The functions
below read a whole object's parts: a call in another key order, arguments written as a string.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# The head of a call written name first (after Command-R's "tool_call_id", if any); the
# arguments' JSON starts right after it.
_ID = r'(?:"tool_call_id"\s*:\s*"(?:[^"\\]|\\.)*"\s*,\s*)?'
_NAME = r"\{\s*" + _ID + r'"(?:name|tool_name)"\s*:\s*"((?:[^"\\]|\\.)*)"'
_CALL_HEAD = re.compile(_NAME + r'\s*,\s*"(?:arguments|parameters)"\s*:')
# The head of a call cut short before its arguments: only its name is known.
_CALL_NAME = re.compile(_NAME)
_HEAD_LIMIT = 512  # characters; past this an object is not written name first


@dataclass(slots=True)
class CallObject:
    """The JSON object being read: its text and where its arguments are."""

    text: str = ""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    index: int | None = None  # the call's index once announced
    dropped: bool = False  # a call past max_calls: read, never sent
    args_start: int | None = None
    args_end: int | None = None
    args_sent: int = 0  # text[args_start:args_sent] has been sent
    args_quoted: bool = False  # arguments written as a JSON string: sent decoded, at the end
    held: bool = False  # so far word for word an earlier call: not announced (yet)
    name: str = ""

    def read(self, ch: str) -> bool:
        """Take one more character; True when a key or a value starts at it, at the top level."""
        position = len(self.text)
        self.text += ch
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
            return False
        if (
            self.args_start is not None
            and self.args_end is None
            and position > self.args_start
            and self.depth == 1
            and ch in ",}"
        ):
            self.args_end = position
        starts = self.depth == 1 and not ch.isspace() and ch not in ",:}"
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
        return starts

    def find_arguments(self, position: int) -> bool:
        """At the first character of a top-level value: whether it begins the arguments of a
        call written name first; if so, where they start and the call's name are kept."""
        if position > _HEAD_LIMIT:
            return False
        head = _CALL_HEAD.match(self.text)
        if head is None or self.text[head.end() : position].strip():
            return False
        self.args_start = self.args_sent = position
        self.args_quoted = self.text[position] == '"'
        self.name = _unquote(head.group(1))
        return True

    def cut_name(self) -> str | None:
        """The name of a call cut short before its arguments, when its name is whole."""
        named = _CALL_NAME.match(self.text)
        return _unquote(named.group(1)) if named is not None else None


def decoded_string(raw: str) -> str:
    """Arguments written as a JSON string, as the text they hold (raw when not a string)."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return raw
    return value if isinstance(value, str) else raw


def as_call(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of an object that is a call written in another key order."""
    try:
        value: Any = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict):
        return None
    name = value.get("name", value.get("tool_name"))  # Command-R: "tool_name"
    if not isinstance(name, str):
        return None
    key = "arguments" if "arguments" in value else "parameters"
    if key not in value:
        return None
    arguments = value[key]
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return name, arguments


def _unquote(body: str) -> str:
    try:
        return json.loads(f'"{body}"')
    except json.JSONDecodeError:
        return body
