"""Request messages (PrefillRequest and DecodeRequest: one layout, ``header = 1``, ``repeated
TensorChunk chunks = 2``), both directions in one place: the client writes them
(``encode_messages``, ``single_message``, ``step_timeout``), the server reads them
(``read_request``).

Both sides work on the wire format by hand (``codec``). Writing: the tensor bytes go from a
memoryview of the caller's array into the message with a single copy (the join), where building
TensorChunk objects would copy each slice twice (protobuf's ``bytes`` fields do not take
memoryviews); messages are produced one at a time (a generator), so a 1 GiB request never
exists twice. Reading: a request chunk through upb's classes cost a parse plus a copy on every
``data`` access (0.2 ms per MiB, measured on the server), against none here: ``data`` stays a
memoryview into the received message until its one copy into the input buffer. The parser is
as strict as protobuf about field numbers, and stricter in corners a conforming sender never
reaches, where it refuses rather than guesses: groups (wire types 3/4, absent from proto3),
and enum values above 32 bits (protobuf truncates them). Tests check both sides against
protobuf, unknown fields included.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

from attention_wire.codec import (
    LEN,
    VARINT,
    WireError,
    field_key,
    field_number,
    iter_fields,
    varint,
)
from attention_wire.pb import attention_pb2 as pb


class HasBytes(Protocol):
    """A tensor as the writer takes it: its bytes, as a flat memoryview."""

    def byte_view(self) -> memoryview: ...


# ---- writing (the client) ------------------------------------------------------------------

MIN_CHUNK_BYTES = 4 * 1024
MAX_CHUNK_BYTES = 3 * 1024 * 1024 + 512 * 1024  # with the ~100 B framing, under 4 MiB
DEFAULT_CHUNK_BYTES = 1024 * 1024
# Chunks that do not end a tensor end on this boundary, so every chunk holds whole elements.
_ALIGN = 64

# PrefillRequest and DecodeRequest number these fields alike (a test checks it).
_HEADER_KEY = field_key(pb.PrefillRequest.DESCRIPTOR, "header")
_CHUNKS_KEY = field_key(pb.PrefillRequest.DESCRIPTOR, "chunks")
_FIELD_KEY = field_key(pb.TensorChunk.DESCRIPTOR, "field")
_OFFSET_KEY = field_key(pb.TensorChunk.DESCRIPTOR, "offset")
_DATA_KEY = field_key(pb.TensorChunk.DESCRIPTOR, "data")
_STEP_TIMEOUT_KEY = field_key(pb.PrefillRequest.DESCRIPTOR, "step_timeout_ms")
_MAX_STEP_TIMEOUT_MS = 2**32 - 1  # uint32

_FIELDS = (pb.Q, pb.K, pb.V)


@functools.lru_cache(maxsize=1024)
def _chunk_head(field: int, offset: int, size: int) -> bytes:
    """A TensorChunk's bytes before its data, its key and length included: the same few
    heads repeat call after call (a decode loop's), and building one took ~8 us."""
    prefix = _FIELD_KEY + varint(field)
    if offset:  # proto3 leaves zero out
        prefix += _OFFSET_KEY + varint(offset)
    prefix += _DATA_KEY + varint(size)
    return _CHUNKS_KEY + varint(len(prefix) + size) + prefix


def _chunk(field: int, offset: int, data: memoryview) -> list[bytes | memoryview]:
    return [_chunk_head(field, offset, len(data)), data]


# The metadata a client opens a step stream (``<Op>Steps``) with to have a failed call
# answered in-band (AttentionResult.error) instead of ending the stream, and to send calls
# before earlier ones are answered (ServerInfo.steps_in_flight of them run at once).
STEP_ERRORS_HEADER = "x-attention-step-errors"
IN_BAND = "in-band"


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
    repeat one frame: joining it took 6-9 us a step, ``encode_messages`` 25-30 (dev box)."""
    frame = [_chunk_head(field, 0, size) if size else b""
             for field, size in zip(_FIELDS, sizes, strict=True)]
    frame[0] = _HEADER_KEY + varint(len(header)) + header + frame[0]
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
    ``max_chunk_bytes - len(header)``); small tensors share a message. ``tail`` (serialized
    fields) ends the last message.
    """
    parts: list[bytes | memoryview] = [_HEADER_KEY, varint(len(header)), header]
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
                parts, budget = [], max_chunk_bytes
                continue
            parts += _chunk(field, offset, view[offset : offset + take])
            offset += take
            budget -= take
    if parts or tail:
        parts.append(tail)
        yield b"".join(parts)


# ---- reading (the server) ------------------------------------------------------------------

# PrefillRequest and DecodeRequest number their fields alike (a test checks it).
_HEADER = field_number(pb.PrefillRequest.DESCRIPTOR, "header")
_CHUNKS = field_number(pb.PrefillRequest.DESCRIPTOR, "chunks")
_STEP_TIMEOUT = field_number(pb.PrefillRequest.DESCRIPTOR, "step_timeout_ms")
_TC = pb.TensorChunk.DESCRIPTOR
_TC_FIELD, _TC_OFFSET, _TC_DATA = (field_number(_TC, n) for n in ("field", "offset", "data"))


class RawChunk(NamedTuple):
    """A TensorChunk whose ``data`` is a view into the received message (no copy)."""

    field: int  # pb.InputField value
    offset: int
    data: memoryview


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
    return RawChunk(field, offset, data)


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
