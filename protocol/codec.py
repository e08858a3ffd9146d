"""msgpack codec for the wire messages: two frames per message, a one-byte type and a body.

The body is a msgpack array of the dataclass's fields in declaration order; nested
dataclasses are arrays too. Decoding checks every field against its annotation, so a
peer's bad bytes end as a DecodeError, never as a crash further in. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence
from typing import Any, cast

import msgpack

from loomserve.protocol import messages as m

# Large enough for a prompt of a million token ids; ZMQ_MAXMSGSIZE uses the same cap.
MAX_FRAME_BYTES = 16 * 1024 * 1024

# A received frame: bytes, or a view of the buffer libzmq received it in (copy=False).
Frame = bytes | memoryview

_TYPE_BY_TAG: dict[int, type] = {
    0x01: m.Hello,
    0x02: m.Generate,
    0x03: m.Cancel,
    0x04: m.Ping,
    0x05: m.Embed,
    0x06: m.SlotsQuery,
    0x07: m.VocabQuery,
    0x08: m.LoadModel,
    0x09: m.UnloadModel,
    0x0A: m.ModelsQuery,
    0x81: m.ModelInfo,
    0x82: m.Accepted,
    0x83: m.Rejected,
    0x84: m.Outputs,
    0x85: m.Heartbeat,
    0x86: m.WorkerError,
    0x87: m.Embeddings,
    0x88: m.SlotsReport,
    0x89: m.VocabFile,
    0x8A: m.ModelStates,
}
_TAG_BY_TYPE = {cls: bytes([tag]) for tag, cls in _TYPE_BY_TAG.items()}


class DecodeError(ValueError):
    """The frames are not a valid message. Callers count, log and drop them."""


class TooLong(DecodeError):
    """An array in the body is longer than the receiver's max_items: for a worker, a prompt or
    an input longer than any context it has."""


def encode(message: m.Message) -> list[bytes]:
    """The frames for one message."""
    # packb returns None only when it writes to a stream, which it is not given here.
    body = cast(bytes, msgpack.packb(_to_wire(message), use_bin_type=True))
    return [_TAG_BY_TYPE[type(message)], body]


def decode(
    frames: Sequence[Frame], max_items: int | None = None, max_containers: int | None = None
) -> m.Message:
    """The message in the frames; raises DecodeError for anything malformed.

    A receiver that knows what it can take passes limits, so a hostile body fails while it
    is unpacked instead of after it has been built: max_items caps every array and map,
    max_containers how many arrays and maps the body holds in all (a body of nested empty
    arrays would otherwise grow fifty-fold in memory before any field is checked).
    """
    if len(frames) != 2 or len(frames[0]) != 1:
        raise DecodeError(f"expected a type frame and a body frame, got {len(frames)} frames")
    cls = _TYPE_BY_TAG.get(frames[0][0])
    if cls is None:
        raise DecodeError(f"unknown message type 0x{frames[0][0]:02x}")
    if len(frames[1]) > MAX_FRAME_BYTES:
        raise DecodeError("body larger than MAX_FRAME_BYTES")
    try:
        # unpackb caps every array, map and string at the body's own length, so a
        # header claiming four billion items fails at once instead of allocating.
        limits: dict[str, Any] = {}
        if max_items is not None:
            limits.update(max_array_len=max_items, max_map_len=max_items)
        if max_containers is not None:
            budget = _ContainerBudget(max_containers)
            limits.update(list_hook=budget, object_hook=budget)
        body = msgpack.unpackb(frames[1], raw=False, strict_map_key=False, **limits)
        return _from_wire(cls, body)
    except DecodeError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        # msgpack says "N exceeds max_array_len(M)" for an array over the limit.
        error = TooLong if "max_array_len" in str(exc) else DecodeError
        raise error(f"bad {cls.__name__} body: {exc}") from exc


def request_id_of(frames: Sequence[Frame]) -> str | None:
    """The request id of a Generate or Embed that did not decode, read without unpacking the
    rest, so the receiver can reject it by name; None when there is none to read."""
    if len(frames) != 2 or len(frames[0]) != 1:
        return None
    cls = _TYPE_BY_TAG.get(frames[0][0])
    if cls not in (m.Generate, m.Embed):
        return None
    # Only the id is unpacked, and it may hold nothing larger than an id: no containers.
    unpacker = msgpack.Unpacker(
        raw=False, max_str_len=256, max_bin_len=0, max_array_len=0, max_map_len=0, max_ext_len=0
    )
    unpacker.feed(frames[1])
    try:
        if unpacker.read_array_header() != len(_fields(cls)):
            return None
        request_id = unpacker.unpack()
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    return request_id if isinstance(request_id, str) else None


class _ContainerBudget:
    """msgpack's hook for each finished array and map: fails the unpacking past the budget."""

    __slots__ = ("left",)

    def __init__(self, budget: int) -> None:
        self.left = budget

    def __call__(self, container: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise DecodeError("too many arrays and maps in one body")
        return container


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return [_to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, list):
        return [_to_wire(v) for v in value]
    return value


def _from_wire(cls: type, body: Any) -> Any:
    fields = _fields(cls)
    if not isinstance(body, list) or len(body) != len(fields):
        raise DecodeError(f"{cls.__name__} needs {len(fields)} fields")
    values = zip(fields, body, strict=True)
    return cls(*(_check(value, hint, name) for (name, hint), value in values))


@typing.no_type_check
def _check(value: Any, hint: Any, name: str) -> Any:
    """Value, converted where it is a nested dataclass, if it matches the annotation."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        for option in typing.get_args(hint):
            try:
                return _check(value, option, name)
            except DecodeError:
                continue
        raise DecodeError(f"field {name!r} has a value of the wrong type")
    if hint is type(None):
        if value is None:
            return None
    elif dataclasses.is_dataclass(hint):
        return _from_wire(hint, value)
    elif origin is list:
        if isinstance(value, list):
            (item,) = typing.get_args(hint)
            # Token ids: a type scan in C, not a call per id (a prompt has many thousands).
            if item is int and _only(value, {int}):
                return value
            return [_check(v, item, name) for v in value]
    elif origin is dict:
        if isinstance(value, dict):
            key, item = typing.get_args(hint)
            if (key, item) == (int, float) and _only(value, {int}):  # logit_bias
                if _only(value.values(), {float}):
                    return value
                if _only(value.values(), {int, float}):
                    return {k: float(v) for k, v in value.items()}
            return {_check(k, key, name): _check(v, item, name) for k, v in value.items()}
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, hint):
        return value
    raise DecodeError(f"field {name!r} has a value of the wrong type")


def _only(values: Any, types_: set[type]) -> bool:
    """Whether every value's exact type is one of types_ (so no bool passes for an int)."""
    return set(map(type, values)) <= types_


_FIELDS_CACHE: dict[type, list[tuple[str, Any]]] = {}


def _fields(cls: type) -> list[tuple[str, Any]]:
    if cls not in _FIELDS_CACHE:
        hints = typing.get_type_hints(cls)
        _FIELDS_CACHE[cls] = [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]
    return _FIELDS_CACHE[cls]
