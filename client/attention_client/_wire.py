"""Response decoding: AttentionResponse bytes -> OutputSlice (data as a memoryview) or stats.

upb protobuf copies a ``bytes`` field into a new object on every access (about 0.5 GiB/s
here), so the hot path reads OutputChunk's wire format by hand and keeps ``data`` as a
memoryview into the received message: the only copy left is the one into the result array.
The small parts (TensorSpec, RequestStats) still go through the generated classes.
``tests/client`` checks this parser against protobuf's, unknown fields included.
"""

from __future__ import annotations

from dataclasses import dataclass

from attention_client.pb import attention_pb2 as pb

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class WireError(ValueError):
    """The message is not valid protobuf."""


@dataclass(frozen=True)
class OutputSlice:
    field: int  # pb.OutputField
    dtype: int  # pb.DType of the whole tensor
    shape: tuple[int, ...]  # shape of the whole tensor
    row_start: int
    row_count: int
    data: memoryview


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
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


def iter_fields(buf: memoryview):  # also the server's request parser
    """Yield (field number, wire type, value): an int, or a memoryview for LEN fields."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, pos = _varint(buf, pos)
        elif wire_type == _LEN:
            size, pos = _varint(buf, pos)
            if pos + size > end:
                raise WireError("truncated length-delimited field")
            value, pos = buf[pos : pos + size], pos + size
        elif wire_type in (_I64, _I32):
            pos += 8 if wire_type == _I64 else 4
            value = 0
        else:
            raise WireError(f"unsupported wire type {wire_type}")
        if pos > end:
            raise WireError("truncated field")
        yield number, wire_type, value


def _int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value  # two's complement


def _parse_chunk(buf: memoryview) -> OutputSlice:
    field = row_start = row_count = 0
    spec = pb.TensorSpec()
    data = memoryview(b"")
    for number, wire_type, value in iter_fields(buf):
        if number == 1 and wire_type == _VARINT:
            field = value
        elif number == 2 and wire_type == _LEN:
            spec.MergeFromString(bytes(value))  # repeated occurrences merge, as in protobuf
        elif number == 3 and wire_type == _VARINT:
            row_start = _int64(value)
        elif number == 4 and wire_type == _VARINT:
            row_count = _int64(value)
        elif number == 5 and wire_type == _LEN:
            data = value
    return OutputSlice(field, spec.dtype, tuple(spec.shape), row_start, row_count, data)


def parse_response(message: bytes) -> OutputSlice | pb.RequestStats | None:
    """One AttentionResponse: its chunk, its stats, or None when no payload is set."""
    payload: OutputSlice | pb.RequestStats | None = None
    for number, wire_type, value in iter_fields(memoryview(message)):
        if number == 1 and wire_type == _LEN:
            payload = _parse_chunk(value)
        elif number == 2 and wire_type == _LEN:
            payload = pb.RequestStats.FromString(bytes(value))
    return payload
