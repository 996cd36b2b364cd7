"""Response messages (AttentionResponse, and AttentionResult: the same field numbers), both
directions in one place: the server writes them (``chunk_head``, ``output_chunk_parts``), the
client reads them (``parse_response``, ``parse_result``).

Both sides work on the wire format by hand (``codec``) on the hot path. Writing: a response
built through upb's generated classes cost a ``tobytes``, a copy into the message and a
serialization (0.4-1.7 ms per MiB out, measured on the server), against the single copy of the
tensor bytes into the reply that ``output_chunk_parts`` leaves; the output is byte for byte what
``SerializeToString`` gives. Reading: upb copies a ``bytes`` field on every access (about
0.5 GiB/s), so ``data`` stays a memoryview into the received message and the only copy left is
the one into the result array. The small parts (TensorSpec, RequestStats) go through the
generated classes. Tests check both against protobuf, unknown fields included.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from attention_wire.codec import (
    LEN,
    VARINT,
    WireError,
    as_int64,
    field_key,
    field_number,
    iter_fields,
    varint,
)
from attention_wire.pb import attention_pb2 as pb


def out_dtype(q_dtype: int) -> int:
    """OUT's pb.DType for queries in ``q_dtype``: theirs, BFLOAT16 for FLOAT8_E4M3 queries (as
    FlashAttention-3's FP8 forward). The one rule both sides size and type the output by."""
    return pb.BFLOAT16 if q_dtype == pb.FLOAT8_E4M3 else q_dtype

__all__ = ["OutputSlice", "WireError", "chunk_head", "encode_output_chunk", "output_chunk_lead",
           "output_chunk_parts", "parse_response", "parse_result"]

_CHUNK_KEY = field_key(pb.AttentionResponse.DESCRIPTOR, "chunk")
_DATA_KEY = field_key(pb.OutputChunk.DESCRIPTOR, "data")

# ---- writing (the server) ------------------------------------------------------------------


# Serialized OutputChunk heads (all but ``data``), kept: a session's decode steps answer the
# same shapes call after call, and each output built and serialized two protobuf messages per
# call. With the heads kept (and a request's byte counts summed once), a front end over a null
# engine spent 263-270 instead of 274-277 us of CPU per streamed step (dev box).
@functools.lru_cache(maxsize=1024)
def chunk_head(field: int, dtype: int, shape: tuple[int, ...], row_start: int,
               row_count: int) -> bytes:
    """The serialized OutputChunk of these fields, ``data`` left out."""
    return pb.OutputChunk(
        field=field, spec=pb.TensorSpec(dtype=dtype, shape=list(shape)),
        row_start=row_start, row_count=row_count,
    ).SerializeToString()


def _lead(head: bytes, size: int) -> tuple[bytes, ...]:
    """An AttentionResponse{chunk}'s pieces before ``size`` bytes of data (proto3 leaves an
    empty bytes field out)."""
    if size:
        inner = len(head) + 1 + len(varint(size)) + size
        return (_CHUNK_KEY, varint(inner), head, _DATA_KEY, varint(size))
    return (_CHUNK_KEY, varint(len(head)), head)


def output_chunk_parts(head: bytes, data: memoryview) -> tuple[bytes | memoryview, ...]:
    """An AttentionResponse{chunk} message (``head``: ``chunk_head``'s) as pieces whose
    concatenation is protobuf's serialization; ``data`` is not copied. A one-message call
    joins every piece of its answer once (``data`` straight from the arena into the reply),
    where joining each chunk first copied the outputs twice."""
    lead = _lead(head, len(data))
    return (*lead, data) if len(data) else lead


def output_chunk_lead(head: bytes, size: int) -> bytes:
    """The bytes ``output_chunk_parts`` puts before ``size`` bytes of data: a reader that
    knows a reply's layout (a decode loop's steps) finds its data right after them."""
    return b"".join(_lead(head, size))


def encode_output_chunk(head: bytes, data: memoryview) -> bytes:
    """``output_chunk_parts`` joined: one message, ``data`` copied once."""
    return b"".join(output_chunk_parts(head, data))


# ---- reading (the client) ------------------------------------------------------------------

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


_ERROR = field_number(pb.AttentionResult.DESCRIPTOR, "error")


def call_error(message: bytes) -> pb.CallError | None:
    """A step stream's in-band answer of a failed call (AttentionResult.error), or None."""
    error = None
    for number, wire_type, value in iter_fields(memoryview(message)):
        if number == _ERROR and wire_type == LEN:
            error = error or pb.CallError()
            error.MergeFromString(bytes(value))
    return error


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
