"""Response decoding: AttentionResponse bytes -> OutputSlice (data as a memoryview) or stats.

upb protobuf copies a ``bytes`` field into a new object on every access (about 0.5 GiB/s
here), so the hot path reads OutputChunk's wire format by hand (``attention_wire.codec``) and
keeps ``data`` as a memoryview into the received message: the only copy left is the one into
the result array. The small parts (TensorSpec, RequestStats) still go through the generated
classes. ``tests/client`` checks this parser against protobuf's, unknown fields included.
"""

from __future__ import annotations

from dataclasses import dataclass

from attention_wire.codec import LEN, VARINT, WireError, as_int64, field_number, iter_fields
from attention_wire.pb import attention_pb2 as pb

__all__ = ["OutputSlice", "WireError", "parse_response", "parse_result"]

_OC = pb.OutputChunk.DESCRIPTOR
_FIELD, _SPEC, _ROW_START, _ROW_COUNT, _DATA = (
    field_number(_OC, n) for n in ("field", "spec", "row_start", "row_count", "data")
)
_CHUNK = field_number(pb.AttentionResponse.DESCRIPTOR, "chunk")
_STATS = field_number(pb.AttentionResponse.DESCRIPTOR, "stats")


@dataclass(frozen=True)
class OutputSlice:
    field: int  # pb.OutputField
    dtype: int  # pb.DType of the whole tensor
    shape: tuple[int, ...]  # shape of the whole tensor
    row_start: int
    row_count: int
    data: memoryview


def _parse_chunk(buf: memoryview) -> OutputSlice:
    field = row_start = row_count = 0
    spec = pb.TensorSpec()
    data = memoryview(b"")
    for number, wire_type, value in iter_fields(buf):
        # Last occurrence wins and a mismatched wire type is an unknown field, as in protobuf.
        if number == _FIELD and wire_type == VARINT:
            field = value
        elif number == _SPEC and wire_type == LEN:
            spec.MergeFromString(bytes(value))  # repeated occurrences merge, as in protobuf
        elif number == _ROW_START and wire_type == VARINT:
            row_start = as_int64(value)
        elif number == _ROW_COUNT and wire_type == VARINT:
            row_count = as_int64(value)
        elif number == _DATA and wire_type == LEN:
            data = value
    return OutputSlice(field, spec.dtype, tuple(spec.shape), row_start, row_count, data)


def parse_response(message: bytes) -> OutputSlice | pb.RequestStats | None:
    """One AttentionResponse: its chunk, its stats, or None when no payload is set."""
    payload: OutputSlice | pb.RequestStats | None = None
    for number, wire_type, value in iter_fields(memoryview(message)):
        if number == _CHUNK and wire_type == LEN:
            payload = _parse_chunk(value)
        elif number == _STATS and wire_type == LEN:
            payload = pb.RequestStats.FromString(bytes(value))
    return payload


def parse_result(message: bytes) -> list[OutputSlice | pb.RequestStats]:
    """One AttentionResult (a unary compute rpc's answer): its chunks in order, then its
    stats when present (repeated occurrences merge, as in protobuf). Same field numbers as
    AttentionResponse, so the same parser reads both."""
    chunks: list[OutputSlice | pb.RequestStats] = []
    stats: pb.RequestStats | None = None
    for number, wire_type, value in iter_fields(memoryview(message)):
        if number == _CHUNK and wire_type == LEN:
            chunks.append(_parse_chunk(value))
        elif number == _STATS and wire_type == LEN:
            stats = stats or pb.RequestStats()
            stats.MergeFromString(bytes(value))
    if stats is not None:
        chunks.append(stats)
    return chunks
