"""The tensor-carrying messages, encoded and decoded by hand in both directions: requests
(PrefillRequest and DecodeRequest: one layout, ``header = 1``, ``repeated TensorChunk chunks =
2``), which the client writes (``encode_messages``, ``single_message``, ``step_timeout``) and
the server reads (``read_request``); and responses (AttentionResponse, and AttentionResult: the
same field numbers), which the server writes (``chunk_head``, ``output_chunk_parts``) and the
client reads (``parse_response``, ``parse_result``). At the top, the protobuf wire-format
primitives both are built from: varints, a field iterator that yields length-delimited values
as memoryviews, and field keys derived from the generated descriptors (never typed in as
literal tag bytes).

Why by hand: upb's generated classes copy a ``bytes`` field on every access and refuse
memoryviews (protobuf#6782). Writing a request, the tensor bytes go from a memoryview of the
caller's array into the message with a single copy (the join), where building TensorChunk
objects would copy each slice twice; messages are produced one at a time (a generator), so a
1 GiB request never exists twice. Reading a request chunk through upb cost a parse plus a copy
on every ``data`` access (0.2 ms per MiB, measured on the server), against none here: ``data``
stays a memoryview into the received message until its one copy into the input buffer. Writing
a response through upb cost a ``tobytes``, a copy into the message and a serialization
(0.4-1.7 ms per MiB out), against the single copy of the tensor bytes into the reply that
``output_chunk_parts`` leaves; the output is byte for byte what ``SerializeToString`` gives.
Reading a response, ``data`` stays a memoryview into the received message and the only copy
left is the one into the result array. The small parts (TensorSpec, RequestStats) go through
the generated classes.

The readers are as strict as protobuf about field numbers (0 and above 2**29 - 1 are errors),
and stricter in corners a conforming sender never reaches, where they refuse rather than
guess: groups (wire types 3/4, absent from proto3), and enum values above 32 bits (protobuf
truncates them). Tests check both directions against protobuf, unknown fields included.
"""

from __future__ import annotations

import contextlib
import functools
import math
import socket
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from attention_wire.pb import attention_pb2 as pb

# ---- protobuf wire-format primitives --------------------------------------------------------

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


class HasBytes(Protocol):
    """A tensor as the writer takes it: its bytes, as a flat memoryview."""

    def byte_view(self) -> memoryview: ...


# ---- requests, writing (the client) ---------------------------------------------------------

MIN_CHUNK_BYTES = 4 * 1024
MAX_CHUNK_BYTES = 3 * 1024 * 1024 + 512 * 1024  # with the ~100 B framing, under 4 MiB
DEFAULT_CHUNK_BYTES = 1024 * 1024
# Chunks that do not end a tensor end on this boundary, so every chunk holds whole elements.
_ALIGN = 64

# PrefillRequest and DecodeRequest number these fields alike (a test checks it), so these
# keys, and the field numbers the server reads them by (below), serve both.
_HEADER_KEY = field_key(pb.PrefillRequest.DESCRIPTOR, "header")
_CHUNKS_KEY = field_key(pb.PrefillRequest.DESCRIPTOR, "chunks")
_FIELD_KEY = field_key(pb.TensorChunk.DESCRIPTOR, "field")
_OFFSET_KEY = field_key(pb.TensorChunk.DESCRIPTOR, "offset")
_CHUNK_DATA_KEY = field_key(pb.TensorChunk.DESCRIPTOR, "data")
_PADDING_KEY = field_key(pb.TensorChunk.DESCRIPTOR, "padding")
# Where ``message_frame`` starts each tensor's bytes in its message (TensorChunk.padding).
DATA_ALIGN = 16
_STEP_TIMEOUT_KEY = field_key(pb.PrefillRequest.DESCRIPTOR, "step_timeout_ms")
_MAX_STEP_TIMEOUT_MS = 2**32 - 1  # uint32

_FIELDS = (pb.Q, pb.K, pb.V)


@functools.lru_cache(maxsize=1024)
def _tensor_chunk_head(field: int, offset: int, size: int, pad: int | None = None) -> bytes:
    """A TensorChunk's bytes before its data, its key and length included: the same few
    heads repeat call after call (a decode loop's), and building one took ~8 us. ``pad``:
    a ``padding`` field of that many bytes goes first."""
    prefix = _FIELD_KEY + varint(field)
    if offset:  # proto3 leaves zero out
        prefix += _OFFSET_KEY + varint(offset)
    if pad is not None:
        prefix += _PADDING_KEY + varint(pad) + bytes(pad)
    prefix += _CHUNK_DATA_KEY + varint(size)
    return _CHUNKS_KEY + varint(len(prefix) + size) + prefix


@functools.lru_cache(maxsize=1024)
def _aligned_chunk_head(field: int, size: int, at: int) -> bytes:
    """``_tensor_chunk_head`` of a whole tensor that starts ``at`` bytes into its message,
    padded so that its data starts at a multiple of DATA_ALIGN."""
    head = _tensor_chunk_head(field, 0, size)
    pad = None
    while (at + len(head)) % DATA_ALIGN:
        pad = 0 if pad is None else pad + 1
        head = _tensor_chunk_head(field, 0, size, pad)
    return head


# The metadata a client opens a step stream (``<Op>Steps``) with to have a failed call
# answered in-band (AttentionResult.error) instead of ending the stream, and to send calls
# before earlier ones are answered (ServerInfo.steps_in_flight of them run at once).
STEP_ERRORS_HEADER = "x-attention-step-errors"
IN_BAND = "in-band"

# The step socket (ServerInfo.step_socket, a Unix socket of the engine process): frames of a
# 4-byte little-endian length and the payload, both ways. The client's first frame is this
# and its ``authorization`` value; then each frame is one CacheDecodeSteps message and each
# answer that step's AttentionResult, in order (attention_service.step_socket).
STEP_SOCKET_HELLO = b"attention-step-socket/1\n"
SOCKET_FRAME = struct.Struct("<I")
# Each end's send buffer on the step socket (the kernel caps it at twice net.core.wmem_max):
# a B=64 step's 770 KiB out and 512 KiB back through the default 208 KiB took ~450 us a round
# trip on the dev box, ~190 us through 4 MiB (a Unix socketpair, two processes).
STEP_SOCKET_BUFFER = 4 << 20


def widen_step_socket(sock: socket.socket) -> None:
    """``sock``'s send buffer raised to STEP_SOCKET_BUFFER, as far as the kernel allows
    (twice ``net.core.wmem_max``: 416 KiB with the stock 208 KiB, under a B=64 answer's
    512 KiB, which then leaves in two sends); best effort."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STEP_SOCKET_BUFFER)


def step_timeout(deadline: float | None) -> bytes:
    """The ``step_timeout_ms`` field of a call sent on a step stream whose deadline
    (``time.monotonic()``) is ``deadline``: the server then counts the call, when its client
    gives up on it (cancelling the stream), as DEADLINE_EXCEEDED rather than CANCELLED.
    Nothing without a deadline."""
    if deadline is None:
        return b""
    ms = math.ceil(max(deadline - time.monotonic(), 0.0) * 1e3)
    return _STEP_TIMEOUT_KEY + varint(min(max(ms, 1), _MAX_STEP_TIMEOUT_MS))


def message_frame(header: bytes, sizes: Sequence[int]) -> tuple[bytes, ...]:
    """The fixed bytes of a one-message request (``single_message``) whose q, k, v hold
    ``sizes`` bytes: ``frame[i]`` goes before tensor i's bytes (the header field in front of
    q's chunk; b"" for an empty tensor, which sends no chunk), so that joining
    ``frame[0], q, frame[1], k, frame[2], v, tail`` gives that message. A decode loop's steps
    repeat one frame: joining it took 6-9 us a step, ``encode_messages`` 25-30 (dev box).
    Each tensor's bytes start at a multiple of DATA_ALIGN in the message, so that a reader
    may use them where they lie (the step socket)."""
    frame = []
    at = 0  # the message's bytes so far
    for field, size in zip(_FIELDS, sizes, strict=True):
        piece = _HEADER_KEY + varint(len(header)) + header if not frame else b""
        if size:
            piece += _aligned_chunk_head(field, size, at + len(piece))
        frame.append(piece)
        at += len(piece) + size
    return tuple(frame)


def single_message(
    header: bytes, tensors: Sequence[HasBytes], max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    tail: bytes = b"",
) -> bytes | None:
    """The request as one message when ``encode_messages`` would send it in one (its tensor
    bytes fit beside the header), else None. ``tail``: more fields (``step_timeout``), in
    the same join."""
    size = sum(t.byte_view().nbytes for t in tensors)
    if size > max(0, max_chunk_bytes - len(header)):
        return None
    return next(encode_messages(header, tensors, max_chunk_bytes, tail))


def encode_messages(
    header: bytes, tensors: Sequence[HasBytes], max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    tail: bytes = b"",
) -> Iterator[bytes]:
    """Yield serialized request messages: the header first, with as many bytes as fit.

    Each message carries at most ``max_chunk_bytes`` of tensor bytes (the first one
    ``max_chunk_bytes - len(header)``); small tensors share a message. A tensor that fits
    whole in one chunk starts at a multiple of DATA_ALIGN of its message, as in
    ``message_frame``. ``tail`` (serialized fields) ends the last message.
    """
    parts: list[bytes | memoryview] = [_HEADER_KEY, varint(len(header)), header]
    at = sum(map(len, parts))  # the current message's bytes so far
    budget = max(0, max_chunk_bytes - len(header))
    for field, tensor in zip(_FIELDS, tensors, strict=True):
        view = tensor.byte_view()
        size, offset = len(view), 0
        while offset < size:
            take = min(budget, size - offset)
            if offset + take < size:
                take -= take % _ALIGN
            if take == 0:
                yield b"".join(parts)
                parts, budget, at = [], max_chunk_bytes, 0
                continue
            head = (_aligned_chunk_head(field, size, at) if take == size
                    else _tensor_chunk_head(field, offset, take))
            parts += (head, view[offset : offset + take])
            at += len(head) + take
            offset += take
            budget -= take
    if parts or tail:
        parts.append(tail)
        yield b"".join(parts)


# ---- requests, reading (the server) ---------------------------------------------------------

_HEADER = field_number(pb.PrefillRequest.DESCRIPTOR, "header")
_CHUNKS = field_number(pb.PrefillRequest.DESCRIPTOR, "chunks")
_STEP_TIMEOUT = field_number(pb.PrefillRequest.DESCRIPTOR, "step_timeout_ms")
_TC = pb.TensorChunk.DESCRIPTOR
_TC_FIELD, _TC_OFFSET, _TC_DATA = (field_number(_TC, n) for n in ("field", "offset", "data"))


# A TensorChunk as ``(field, offset, data)``: its pb.InputField value, its byte offset, and its
# bytes as a view into the received message (no copy). A plain tuple: a request's chunks are
# unpacked where they are used, and a NamedTuple's ``__new__`` is a Python call per chunk.
RawChunk = tuple[int, int, memoryview]


class RawRequest(NamedTuple):
    """One PrefillRequest/DecodeRequest message: its header (if present) and chunks."""

    header: Any  # pb.PrefillHeader | pb.DecodeHeader | None
    chunks: list[RawChunk]
    header_bytes: bytes | None = None  # the header's wire bytes (its occurrences joined)
    step_timeout_ms: int = 0  # a step stream's call: how long its client waits (0: none)


# Fields per message and per chunk the parser reads before it refuses the message: a 4 MiB
# message of millions of empty fields must not hold the event loop for seconds. A real
# message has a header and a few chunks (attention_client: at most 3) of 3 fields each.
MAX_FIELDS_PER_MESSAGE = 1024
MAX_FIELDS_PER_CHUNK = 16


def _read_chunk(buf: memoryview) -> RawChunk:
    field = offset = 0
    data = memoryview(b"")
    for n, (number, wire_type, value) in enumerate(iter_fields(buf)):
        if n == MAX_FIELDS_PER_CHUNK:
            raise WireError(f"a chunk with more than {MAX_FIELDS_PER_CHUNK} fields")
        # Last occurrence wins and a mismatched wire type is an unknown field, as in protobuf.
        if number == _TC_FIELD and wire_type == VARINT:
            field = value
        elif number == _TC_OFFSET and wire_type == VARINT:
            offset = value
        elif number == _TC_DATA and wire_type == LEN:
            data = value
    return field, offset, data


def _fields(message: bytes) -> Any:
    """The message's fields, as ``iter_fields`` reads them; WireError past
    MAX_FIELDS_PER_MESSAGE of them."""
    for n, field in enumerate(iter_fields(memoryview(message))):
        if n == MAX_FIELDS_PER_MESSAGE:
            raise WireError(f"more than {MAX_FIELDS_PER_MESSAGE} fields in one message "
                            "(send fewer, larger chunks)")
        yield field


def request_header(message: bytes) -> bytes | None:
    """The header's wire bytes of a PrefillRequest / DecodeRequest (occurrences joined, as
    ``read_request`` joins them; its chunks are not read), or None; WireError as
    ``read_request`` raises it for the message."""
    parts = [value for number, wire_type, value in _fields(message)
             if number == _HEADER and wire_type == LEN]
    return b"".join(parts) if parts else None


def read_request(message: bytes, parse_header: Callable[[bytes], Any]) -> RawRequest:
    """``message`` as a PrefillRequest / DecodeRequest, its header's wire bytes (occurrences
    joined, as protobuf merges them) parsed by ``parse_header``; WireError (or protobuf's
    DecodeError from ``parse_header``) if it is not valid."""
    header_parts: list[memoryview] = []
    chunks: list[RawChunk] = []
    step_timeout_ms = 0
    for number, wire_type, value in _fields(message):
        if wire_type != LEN:
            if number == _STEP_TIMEOUT and wire_type == VARINT:
                step_timeout_ms = value & 0xFFFFFFFF  # uint32, as protobuf reads it
            continue  # else unknown
        if number == _HEADER:
            header_parts.append(value)  # repeated occurrences merge, as in protobuf
        elif number == _CHUNKS:
            chunks.append(_read_chunk(value))
    header_bytes = b"".join(header_parts) if header_parts else None
    header = parse_header(header_bytes) if header_bytes is not None else None
    return RawRequest(header, chunks, header_bytes, step_timeout_ms)


def leading_header(message: memoryview) -> memoryview | None:
    """The header's bytes when ``message`` starts with its header field as ``message_frame``
    writes it (its length in the shortest varint); else None (the message may still be valid:
    ``read_request`` reads any order and encoding)."""
    if not message or message[0] != _HEADER_KEY[0]:
        return None
    try:
        size, pos = _varint_at(message, len(_HEADER_KEY))
    except WireError:
        return None
    if pos != len(_HEADER_KEY) + len(varint(size)):  # an overlong length: not the writer's
        return None
    return message[pos : pos + size] if pos + size <= len(message) else None


def tail_step_timeout(tail: memoryview) -> int | None:
    """The ``step_timeout_ms`` of a message whose bytes after its last chunk are ``tail``: 0
    when there are none, the value when they are that one field (``step_timeout``), None for
    anything else (which ``read_request`` reads)."""
    if not tail:
        return 0
    if tail[: len(_STEP_TIMEOUT_KEY)] != _STEP_TIMEOUT_KEY:
        return None
    try:
        value, pos = _varint_at(tail, len(_STEP_TIMEOUT_KEY))
    except WireError:
        return None
    return value & 0xFFFFFFFF if pos == len(tail) else None  # uint32, as protobuf reads it


def out_dtype(q_dtype: int) -> int:
    """OUT's pb.DType for queries in ``q_dtype``: theirs, BFLOAT16 for FLOAT8_E4M3 queries (as
    FlashAttention-3's FP8 forward). The one rule both sides size and type the output by."""
    return pb.BFLOAT16 if q_dtype == pb.FLOAT8_E4M3 else q_dtype


# ---- responses, writing (the server) --------------------------------------------------------

_CHUNK_KEY = field_key(pb.AttentionResponse.DESCRIPTOR, "chunk")
_OUTPUT_DATA_KEY = field_key(pb.OutputChunk.DESCRIPTOR, "data")


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
        return (_CHUNK_KEY, varint(inner), head, _OUTPUT_DATA_KEY, varint(size))
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


# ---- responses, reading (the client) --------------------------------------------------------

_OC = pb.OutputChunk.DESCRIPTOR
_OC_FIELD, _OC_SPEC, _OC_ROW_START, _OC_ROW_COUNT, _OC_DATA = (
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
        if number == _OC_FIELD and wire_type == VARINT:
            field = value
        elif number == _OC_SPEC and wire_type == LEN:
            spec.MergeFromString(bytes(value))  # repeated occurrences merge, as in protobuf
        elif number == _OC_ROW_START and wire_type == VARINT:
            row_start = as_int64(value)
        elif number == _OC_ROW_COUNT and wire_type == VARINT:
            row_count = as_int64(value)
        elif number == _OC_DATA and wire_type == LEN:
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
