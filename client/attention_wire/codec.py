"""Protobuf wire-format primitives for the hand-written codecs of the tensor-carrying messages.

upb's generated classes copy a ``bytes`` field on every access and refuse memoryviews
(protobuf#6782), so the messages that carry tensor bytes are read and written by hand on both
sides: requests by the client's encoder and the server's parser, responses by the server's
encoder and the client's parser. Those codecs are built from what is here: varints, a field
iterator that yields length-delimited values as memoryviews, and field keys derived from the
generated descriptors (never typed in as literal tag bytes).

The iterator is as strict as protobuf: field numbers 0 and above 2**29 - 1 and the group wire
types (3, 4; absent from proto3) are errors.
"""

from __future__ import annotations

from collections.abc import Iterator

from google.protobuf.descriptor import Descriptor, FieldDescriptor

VARINT, I64, LEN, I32 = 0, 1, 2, 5
MAX_FIELD_NUMBER = (1 << 29) - 1

_WIRE_TYPES = {
    FieldDescriptor.TYPE_MESSAGE: LEN,
    FieldDescriptor.TYPE_BYTES: LEN,
    FieldDescriptor.TYPE_STRING: LEN,
    FieldDescriptor.TYPE_ENUM: VARINT,
    FieldDescriptor.TYPE_UINT64: VARINT,
    FieldDescriptor.TYPE_INT64: VARINT,
    FieldDescriptor.TYPE_INT32: VARINT,
    FieldDescriptor.TYPE_UINT32: VARINT,
    FieldDescriptor.TYPE_BOOL: VARINT,
}


class WireError(ValueError):
    """The bytes are not a valid protobuf message."""


def varint(n: int) -> bytes:
    """Unsigned LEB128 of ``n`` (>= 0)."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field_number(message: Descriptor, name: str) -> int:
    return int(message.fields_by_name[name].number)


def field_key(message: Descriptor, name: str) -> bytes:
    """The tag bytes that precede field ``name`` of ``message`` (non-packed encoding)."""
    field = message.fields_by_name[name]
    return varint(field.number << 3 | _WIRE_TYPES[field.type])


def _varint_at(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise WireError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def iter_fields(buf: memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """Yield (field number, wire type, value): an int for VARINT, a memoryview into ``buf``
    for LEN, 0 for the fixed-width types (skipped: none of our hot fields use them)."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _varint_at(buf, pos)
        number, wire_type = key >> 3, key & 7
        if not 1 <= number <= MAX_FIELD_NUMBER:
            raise WireError(f"invalid field number {number}")
        value: int | memoryview
        if wire_type == VARINT:
            value, pos = _varint_at(buf, pos)
        elif wire_type == LEN:
            size, pos = _varint_at(buf, pos)
            if pos + size > end:
                raise WireError("truncated length-delimited field")
            value, pos = buf[pos : pos + size], pos + size
        elif wire_type in (I64, I32):
            pos += 8 if wire_type == I64 else 4
            value = 0
        else:
            raise WireError(f"unsupported wire type {wire_type}")
        if pos > end:
            raise WireError("truncated field")
        yield number, wire_type, value


def as_int64(value: int) -> int:
    """A varint read as a signed int64 (two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value
