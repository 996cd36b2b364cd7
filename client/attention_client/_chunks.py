"""Request stream encoder: header + tensor bytes -> serialized request messages, lazily.

PrefillRequest and DecodeRequest share one layout (``header = 1``, ``repeated TensorChunk
chunks = 2``), so messages are written here in protobuf wire format by hand: the tensor bytes
go from a memoryview of the caller's array into the message with a single copy (the join),
where building TensorChunk objects would copy each slice twice (protobuf's ``bytes`` fields do
not take memoryviews). ``tests/client`` checks the output parses as the generated messages.

Messages are produced one at a time (a generator), so a 1 GiB request never exists twice.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from attention_client._tensors import WireTensor
from attention_client.pb import attention_pb2 as pb

MIN_CHUNK_BYTES = 4 * 1024
MAX_CHUNK_BYTES = 3 * 1024 * 1024 + 512 * 1024  # with the ~100 B framing, under 4 MiB
DEFAULT_CHUNK_BYTES = 1024 * 1024
# Chunks that do not end a tensor end on this boundary, so every chunk holds whole elements.
_ALIGN = 64

_HEADER_KEY = b"\x0a"  # field 1 (header), wire type 2 (length-delimited)
_CHUNKS_KEY = b"\x12"  # field 2 (chunks), wire type 2
_FIELD_KEY = b"\x08"  # TensorChunk.field = 1, varint
_OFFSET_KEY = b"\x10"  # TensorChunk.offset = 2, varint
_DATA_KEY = b"\x1a"  # TensorChunk.data = 3, length-delimited

_FIELDS = (pb.Q, pb.K, pb.V)


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def check_chunk_bytes(max_chunk_bytes: int) -> int:
    n = int(max_chunk_bytes)
    if not MIN_CHUNK_BYTES <= n <= MAX_CHUNK_BYTES:
        raise ValueError(
            f"max_chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {n}"
        )
    return n


def _chunk(field: int, offset: int, data: memoryview) -> list[bytes | memoryview]:
    prefix = _FIELD_KEY + varint(field)
    if offset:  # proto3 leaves zero out
        prefix += _OFFSET_KEY + varint(offset)
    prefix += _DATA_KEY + varint(len(data))
    return [_CHUNKS_KEY, varint(len(prefix) + len(data)), prefix, data]


def encode_messages(
    header: bytes, tensors: Sequence[WireTensor], max_chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[bytes]:
    """Yield serialized request messages: the header first, with as many bytes as fit.

    Each message carries at most ``max_chunk_bytes`` of tensor bytes (the first one
    ``max_chunk_bytes - len(header)``); small tensors share a message.
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
    if parts:
        yield b"".join(parts)
