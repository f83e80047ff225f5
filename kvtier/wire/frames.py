"""A copy-lean codec for the bulk messages: ``GetFrame``/``GetBatch`` and ``PutFrame``/``PutBatch``.

Block bytes cross the wire inside these messages. Going through the
generated protobuf classes costs an extra copy of every data field in each
direction (``bytes`` into the message, the message into its serialization,
and the same again when parsing), which is a large share of the time of a
loopback transfer. This module reads and writes the same protobuf wire format
by hand:

* **encoding** collects the few header bytes of each frame and views of the
  block data, and joins a whole batch once (``b"".join``) — the one copy
  gRPC's Python API needs anyway;
* **decoding** returns the data fields as ``memoryview`` slices of the
  received message, so the receiver copies block bytes exactly once, when it
  joins a block's pieces.

Frames are packed into batches of at most ``budget`` data bytes (or a single
frame), so many small blocks share one gRPC message: each message costs
thread hand-offs in gRPC's Python runtime, whatever its size.

The output is byte-for-byte what ``SerializeToString`` of the generated
classes produces (proto3: default values omitted, fields in number order),
and the parser accepts any valid encoding (fields in any order, repeated
scalars — last wins — and unknown fields, which are skipped). Tests check
both against the generated classes. Clients in other languages use the
``.proto`` as usual.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

# field numbers, from kvtier_cache.proto
_GET_INDEX, _GET_FOUND, _GET_SIZE, _GET_OFFSET, _GET_DATA = 1, 2, 3, 4, 5
_PUT_KEY, _PUT_SIZE, _PUT_DATA = 1, 2, 3
_BATCH_FRAMES = 1

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1

_EMPTY = memoryview(b"")

Buffer = bytes | memoryview


class FrameError(ValueError):
    """The bytes are not a valid encoding of the expected message."""


@dataclass(frozen=True, slots=True)
class GetFrameView:
    """A decoded ``GetFrame``; ``data`` views the message buffer.

    A dataclass, not a NamedTuple: its ``index`` field would shadow ``tuple.index``.
    """

    index: int
    found: bool
    size: int
    offset: int
    data: memoryview


class PutFrameView(NamedTuple):
    """A decoded ``PutFrame``; ``key`` and ``data`` view the message buffer."""

    key: memoryview
    size: int
    data: memoryview


class FrameParts(NamedTuple):
    """One encoded frame, not yet joined: ``head`` (every field but the data's bytes) and ``data``."""

    head: bytes
    data: Buffer


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


_T_GET_INDEX = _tag(_GET_INDEX, _VARINT)
_T_GET_FOUND = _tag(_GET_FOUND, _VARINT)
_T_GET_SIZE = _tag(_GET_SIZE, _VARINT)
_T_GET_OFFSET = _tag(_GET_OFFSET, _VARINT)
_T_GET_DATA = _tag(_GET_DATA, _LEN)
_T_PUT_KEY = _tag(_PUT_KEY, _LEN)
_T_PUT_SIZE = _tag(_PUT_SIZE, _VARINT)
_T_PUT_DATA = _tag(_PUT_DATA, _LEN)
_T_BATCH_FRAMES = _tag(_BATCH_FRAMES, _LEN)


def get_frame(
    index: int, found: bool, size: int = 0, offset: int = 0, data: Buffer = b""
) -> FrameParts:
    """A ``GetFrame``, unjoined."""
    head = bytearray()
    if index:
        head += _T_GET_INDEX + _varint(index)
    if found:
        head += _T_GET_FOUND + b"\x01"
    if size:
        head += _T_GET_SIZE + _varint(size)
    if offset:
        head += _T_GET_OFFSET + _varint(offset)
    if len(data):
        head += _T_GET_DATA + _varint(len(data))
    return FrameParts(bytes(head), data)


def put_frame(key: Buffer = b"", size: int = 0, data: Buffer = b"") -> FrameParts:
    """A ``PutFrame``, unjoined."""
    head = bytearray()
    if len(key):
        head += _T_PUT_KEY + _varint(len(key)) + key
    if size:
        head += _T_PUT_SIZE + _varint(size)
    if len(data):
        head += _T_PUT_DATA + _varint(len(data))
    return FrameParts(bytes(head), data)


def encode_frame(frame: FrameParts) -> bytes:
    """One frame as a message of its own (a ``GetFrame`` or ``PutFrame``)."""
    return b"".join(frame) if len(frame.data) else frame.head


def encode_batch(frames: Iterable[FrameParts]) -> bytes:
    """A ``GetBatch``/``PutBatch`` of ``frames`` (same wire format for both), joined once."""
    parts: list[Buffer] = []
    for f in frames:
        parts.append(_T_BATCH_FRAMES + _varint(len(f.head) + len(f.data)) + f.head)
        if len(f.data):
            parts.append(f.data)
    return b"".join(parts)


def batches(frames: Iterable[FrameParts], budget: int) -> Iterator[bytes]:
    """Encoded batches of consecutive ``frames``, each with at most ``budget`` data bytes (or one frame)."""
    pending: list[FrameParts] = []
    held = 0
    for f in frames:
        n = len(f.data)
        if pending and held + n > budget:
            yield encode_batch(pending)
            pending, held = [], 0
        pending.append(f)
        held += n
    if pending:
        yield encode_batch(pending)


def _read_varint(buf: Buffer, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise FrameError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise FrameError("varint longer than 10 bytes")


def _fields(buf: Buffer) -> list[tuple[int, int, int, int]]:
    """``(field, wire_type, value_or_start, end)`` for each field of a message.

    For varints ``value_or_start`` is the value (``end`` unused); for
    length-delimited fields it is the start of the payload.
    """
    out: list[tuple[int, int, int, int]] = []
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise FrameError("field number 0")
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos, end)
            out.append((field, wire_type, value, pos))
        elif wire_type == _LEN:
            length, pos = _read_varint(buf, pos, end)
            if length > end - pos:
                raise FrameError(f"field {field} declares {length} bytes, {end - pos} remain")
            out.append((field, wire_type, pos, pos + length))
            pos += length
        elif wire_type == _I64:
            if pos + 8 > end:
                raise FrameError("truncated fixed64")
            pos += 8
            out.append((field, wire_type, 0, pos))
        elif wire_type == _I32:
            if pos + 4 > end:
                raise FrameError("truncated fixed32")
            pos += 4
            out.append((field, wire_type, 0, pos))
        else:
            raise FrameError(f"unsupported wire type {wire_type} (field {field})")
    return out


def _expect(field: int, got: int, want: int) -> None:
    if got != want:
        raise FrameError(f"field {field} has wire type {got}, expected {want}")


def decode_get_frame(buf: Buffer) -> GetFrameView:
    """Parse a serialised ``GetFrame``.

    Raises:
        FrameError: ``buf`` is not a valid ``GetFrame``.
    """
    index = size = offset = 0
    found = False
    data = _EMPTY
    for field, wt, a, b in _fields(buf):
        if field == _GET_DATA:
            _expect(field, wt, _LEN)
            data = memoryview(buf)[a:b]
        elif field in (_GET_INDEX, _GET_FOUND, _GET_SIZE, _GET_OFFSET):
            _expect(field, wt, _VARINT)
            if field == _GET_INDEX:
                index = a & _U32_MAX
            elif field == _GET_FOUND:
                found = a != 0
            elif field == _GET_SIZE:
                size = a & _U64_MAX
            else:
                offset = a & _U64_MAX
    return GetFrameView(index, found, size, offset, data)


def decode_put_frame(buf: Buffer) -> PutFrameView:
    """Parse a serialised ``PutFrame``.

    Raises:
        FrameError: ``buf`` is not a valid ``PutFrame``.
    """
    key = data = _EMPTY
    size = 0
    for field, wt, a, b in _fields(buf):
        if field == _PUT_KEY:
            _expect(field, wt, _LEN)
            key = memoryview(buf)[a:b]
        elif field == _PUT_DATA:
            _expect(field, wt, _LEN)
            data = memoryview(buf)[a:b]
        elif field == _PUT_SIZE:
            _expect(field, wt, _VARINT)
            size = a & _U64_MAX
    return PutFrameView(key, size, data)


def _batch_items(buf: Buffer) -> Iterator[memoryview]:
    view = memoryview(buf)
    for field, wt, a, b in _fields(buf):
        if field == _BATCH_FRAMES:
            _expect(field, wt, _LEN)
            yield view[a:b]


def decode_get_batch(buf: Buffer) -> list[GetFrameView]:
    """Parse a serialised ``GetBatch``.

    Raises:
        FrameError: ``buf`` is not a valid ``GetBatch``.
    """
    return [decode_get_frame(item) for item in _batch_items(buf)]


def decode_put_batch(buf: Buffer) -> list[PutFrameView]:
    """Parse a serialised ``PutBatch``.

    Raises:
        FrameError: ``buf`` is not a valid ``PutBatch``.
    """
    return [decode_put_frame(item) for item in _batch_items(buf)]
