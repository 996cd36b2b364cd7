"""Request stream encoder: header + tensor bytes -> serialized request messages, lazily.

PrefillRequest and DecodeRequest share one layout (``header = 1``, ``repeated TensorChunk
chunks = 2``), so messages are written here in protobuf wire format by hand: the tensor bytes
go from a memoryview of the caller's array into the message with a single copy (the join),
where building TensorChunk objects would copy each slice twice (protobuf's ``bytes`` fields do
not take memoryviews). ``tests/client`` checks the output parses as the generated messages.

Messages are produced one at a time (a generator), so a 1 GiB request never exists twice.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator, Sequence

from attention_client._errors import AttentionInputError
from attention_client._tensors import WireTensor
from attention_wire.codec import field_key, varint
from attention_wire.pb import attention_pb2 as pb

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


def check_chunk_bytes(max_chunk_bytes: int) -> int:
    n = int(max_chunk_bytes)
    if not MIN_CHUNK_BYTES <= n <= MAX_CHUNK_BYTES:
        raise AttentionInputError(
            f"max_chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {n}"
        )
    return n


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


def step_timeout(deadline: float | None) -> bytes:
    """The ``step_timeout_ms`` field of a call sent on a step stream whose deadline
    (``time.monotonic()``) is ``deadline``: the server then counts the call, when its client
    gives up on it (cancelling the stream), as DEADLINE_EXCEEDED rather than CANCELLED.
    Nothing without a deadline."""
    if deadline is None:
        return b""
    ms = math.ceil(max(deadline - time.monotonic(), 0.0) * 1e3)
    return _STEP_TIMEOUT_KEY + varint(min(max(ms, 1), _MAX_STEP_TIMEOUT_MS))


def single_message(
    header: bytes, tensors: Sequence[WireTensor], max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
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
    header: bytes, tensors: Sequence[WireTensor], max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
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
