"""msgpack codec for the wire messages: two frames per message, a one-byte type and a body.

The body is a msgpack array of the dataclass's fields in declaration order; nested
dataclasses are arrays too. Decoding checks every field against its annotation, so a
peer's bad bytes end as a DecodeError, never as a crash further in. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, cast

import msgpack

from . import messages as m

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
    0x0B: m.ImageTokensQuery,
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
    0x8B: m.ImageTokens,
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


# Each message type's encoder and each annotation's decoder are built once (at import, at the
# end of this module) from the dataclass's fields and type hints. A tick's Outputs carries a
# chunk per running request; walking the annotations again for every value had cost ~10 µs
# a chunk to encode and ~30 µs to decode, on the worker's IO thread and the gateway's event
# loop, both beside the tick's forward pass (now ~1.5 and ~4.5: benchmarks/bench_codec.py).
Decoder = Callable[[Any], Any]


def _to_wire(message: Any) -> list[Any]:
    """A message as msgpack arrays: a dataclass's fields in order, nested ones converted."""
    cls: type = type(message)
    return _dataclass_encoder(cls)(message)


@functools.cache
def _dataclass_encoder(cls: type) -> Callable[[Any], list[Any]]:
    fields = _fields(cls)
    names = [name for name, _ in fields]
    if len(names) > 1:
        attributes = operator.attrgetter(*names)

        def values_of(value: Any) -> list[Any]:
            return list(attributes(value))
    else:  # attrgetter gives a bare value for one name, a tuple for more, nothing for none

        def values_of(value: Any) -> list[Any]:
            return [getattr(value, name) for name in names]

    nested = [(i, convert) for i, (_, hint) in enumerate(fields) if (convert := _encoder(hint))]
    if not nested:
        return values_of

    def encode_dataclass(value: Any) -> list[Any]:
        values = values_of(value)
        for i, convert in nested:
            values[i] = convert(values[i])
        return values

    return encode_dataclass


@functools.cache
def _encoder(hint: Any) -> Callable[[Any], Any] | None:
    """How a value annotated `hint` becomes msgpack's: None where it already is (no dataclass
    can be inside it)."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _dataclass_encoder(hint)
    args = typing.get_args(hint)
    converting = [convert for convert in map(_encoder, args) if convert is not None]
    if not converting:
        return None
    origin = typing.get_origin(hint)
    if origin is list:
        (convert,) = converting
        return lambda value: [convert(item) for item in value]
    if origin in (types.UnionType, typing.Union) and len(args) == 2 and type(None) in args:
        (convert,) = converting  # X | None
        return lambda value: None if value is None else convert(value)
    raise TypeError(f"the codec cannot encode {hint}")


def _from_wire(cls: type, body: Any) -> Any:
    return _dataclass_decoder(cls)(body)


@functools.cache
def _dataclass_decoder(cls: type) -> Decoder:
    fields = _fields(cls)
    checks = [_decoder(hint, name) for name, hint in fields]
    n_fields = len(fields)

    def decode_dataclass(body: Any) -> Any:
        if not isinstance(body, list) or len(body) != n_fields:
            raise DecodeError(f"{cls.__name__} needs {n_fields} fields")
        return cls(*[check(value) for check, value in zip(checks, body, strict=True)])

    return decode_dataclass


@functools.cache
@typing.no_type_check
def _decoder(hint: Any, name: str) -> Decoder:
    """A function that returns a value, converted where it is a nested dataclass, if it
    matches the annotation, and raises DecodeError naming the field if it does not."""

    def wrong() -> typing.NoReturn:
        raise DecodeError(f"field {name!r} has a value of the wrong type")

    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        # None is tried first: no other annotation takes it, and a failed try costs a raise.
        nullable = type(None) in typing.get_args(hint)
        options = [_decoder(option, name) for option in typing.get_args(hint)]

        def decode_union(value: Any) -> Any:
            if value is None and nullable:
                return None
            for option in options:
                try:
                    return option(value)
                except DecodeError:
                    continue
            wrong()

        return decode_union
    if hint is type(None):
        return lambda value: None if value is None else wrong()
    if dataclasses.is_dataclass(hint):
        return _dataclass_decoder(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        check_item = _decoder(item, name)

        def decode_list(value: Any) -> Any:
            if not isinstance(value, list):
                wrong()
            # Token ids: a type scan in C, not a call per id (a prompt has many thousands).
            if item is int and _only(value, {int}):
                return value
            return [check_item(v) for v in value]

        return decode_list
    if origin is dict:
        key, item = typing.get_args(hint)
        check_key, check_value = _decoder(key, name), _decoder(item, name)

        def decode_dict(value: Any) -> Any:
            if not isinstance(value, dict):
                wrong()
            if (key, item) == (int, float) and _only(value, {int}):  # logit_bias
                if _only(value.values(), {float}):
                    return value
                if _only(value.values(), {int, float}):
                    return {k: float(v) for k, v in value.items()}
            return {check_key(k): check_value(v) for k, v in value.items()}

        return decode_dict
    if hint is float:
        return lambda value: float(value) if type(value) in (int, float) else wrong()
    if hint is int:
        return lambda value: value if type(value) is int else wrong()
    return lambda value: value if isinstance(value, hint) else wrong()


def _only(values: Any, types_: set[type]) -> bool:
    """Whether every value's exact type is one of types_ (so no bool passes for an int)."""
    return set(map(type, values)) <= types_


@functools.cache
def _fields(cls: type) -> list[tuple[str, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]


# Built at import, so an annotation the codec cannot carry fails at once, not mid-stream.
for _cls in _TYPE_BY_TAG.values():
    _dataclass_encoder(_cls)
    _dataclass_decoder(_cls)
