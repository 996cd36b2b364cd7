"""attention_wire.messages: the hand-written request parser and response
encoder agree with protobuf, and bytes that are not protobuf are refused with INVALID_ARGUMENT
naming the message."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from attention_service.errors import RequestError
from attention_service.frontend.streams import output_messages
from attention_service.frontend.validation import parse_request
from attention_service.params import Op
from attention_wire.messages import chunk_head, encode_output_chunk, output_chunk_parts, varint
from attention_wire.pb import attention_pb2 as pb

from ..svc_helpers import ServerHandle, prefill_messages, random_qkv

pytestmark = pytest.mark.timeout(30)

# Fields this schema does not have, one of each wire type: parsers must skip them.
UNKNOWN = (
    varint(15 << 3 | 0) + varint(300)
    + varint(16 << 3 | 2) + varint(3) + b"abc"
    + varint(17 << 3 | 1) + bytes(8)
    + varint(18 << 3 | 5) + bytes(4)
)


def _chunk(field: int, offset: int, data: bytes) -> pb.TensorChunk:
    return pb.TensorChunk(field=field, offset=offset, data=data)


@pytest.mark.parametrize("size", [0, 1, 127, 128, 70_000])
@pytest.mark.parametrize("row_start", [0, 5])
@pytest.mark.parametrize("field", [pb.OUT, pb.LSE])
def test_output_chunk_bytes_equal_protobufs(size: int, row_start: int, field: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    spec = pb.TensorSpec(dtype=pb.BFLOAT16, shape=[9, 3, 70])
    head = chunk_head(field, pb.BFLOAT16, (9, 3, 70), row_start, size // 7)
    assert chunk_head(field, pb.BFLOAT16, (9, 3, 70), row_start, size // 7) is head  # memo
    mine = encode_output_chunk(head, memoryview(data))
    parts = output_chunk_parts(head, memoryview(data))
    assert b"".join(parts) == mine
    if size:  # the data travels as the caller's view (joined once per call), not a copy
        assert isinstance(parts[-1], memoryview) and parts[-1].obj is data
    theirs = pb.AttentionResponse(chunk=pb.OutputChunk(
        field=field, spec=spec, row_start=row_start, row_count=size // 7, data=data,
    )).SerializeToString()
    assert mine == theirs


def test_output_messages_cover_every_row_once() -> None:
    t = torch.randn(37, 3, 5)  # 60-byte rows, 128-byte chunks: 2 rows per message
    seen = b""
    data = t.view(-1).view(torch.uint8).numpy()
    for nbytes, parts in output_messages(pb.OUT, pb.FLOAT32, tuple(t.shape), data, 128):
        chunk = pb.AttentionResponse.FromString(b"".join(parts)).chunk
        assert nbytes == len(chunk.data) <= 128
        assert chunk.row_start * 60 == len(seen) and chunk.row_count * 60 == nbytes
        assert list(chunk.spec.shape) == [37, 3, 5]
        seen += chunk.data
    assert seen == t.numpy().tobytes()


def test_request_parse_matches_protobuf_unknown_fields_included() -> None:
    q, k, v = random_qkv(6, 6, 2, 1, 8, torch.float32)
    header, *rest = prefill_messages(q, k, v, [0, 2, 6], causal=True, chunk=40)
    first = pb.PrefillRequest(header=header.header, chunks=[_chunk(pb.Q, 0, b"xyz")])
    raw = first.SerializeToString() + UNKNOWN
    parsed = parse_request(raw, Op.PREFILL)
    assert parsed.header == pb.PrefillRequest.FromString(raw).header
    assert [(f, o, bytes(d)) for f, o, d in parsed.chunks] == [(pb.Q, 0, b"xyz")]
    for msg in rest:
        parsed = parse_request(msg.SerializeToString(), Op.PREFILL)
        assert parsed.header is None
        assert [(f, o, bytes(d)) for f, o, d in parsed.chunks] == [
            (c.field, c.offset, c.data) for c in msg.chunks
        ]


def test_repeated_occurrences_merge_like_protobuf() -> None:
    # A chunk sent as two concatenated halves: scalars and bytes take the last value.
    a = _chunk(pb.K, 8, b"first").SerializeToString()
    b = _chunk(pb.V, 16, b"second").SerializeToString() + UNKNOWN
    inner = a + b
    raw = varint(2 << 3 | 2) + varint(len(inner)) + inner
    # The header split over two occurrences merges too.
    h1 = pb.DecodeHeader(num_splits=3).SerializeToString()
    h2 = pb.DecodeHeader(return_lse=True).SerializeToString()
    raw += b"\x0a" + varint(len(h1)) + h1 + b"\x0a" + varint(len(h2)) + h2
    theirs = pb.DecodeRequest.FromString(raw)
    mine = parse_request(raw, Op.DECODE)
    assert mine.header == theirs.header and mine.header.num_splits == 3
    ((field, offset, data),) = mine.chunks
    assert (field, offset, bytes(data)) == (pb.V, 16, b"second") == (
        theirs.chunks[0].field, theirs.chunks[0].offset, theirs.chunks[0].data)


@pytest.mark.parametrize("raw", [
    b"\x12\x05abc",  # length past the end
    b"\x12",  # length missing
    b"\x0a\x02\xff\xff",  # a header that is not a DecodeHeader
    b"\x13",  # a group (wire type 3), which proto3 does not have
    b"\x12\x03\x1a\x05a",  # a chunk whose data runs past the chunk
    b"\x80" * 11,  # an overlong varint
    b"\x02\x00",  # field number 0, which protobuf rejects
    varint((1 << 29) << 3 | 2) + b"\x00",  # field number 2**29, past protobuf's largest
])
def test_malformed_messages_are_invalid_argument(raw: bytes) -> None:
    with pytest.raises(RequestError) as info:
        parse_request(raw, Op.DECODE)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details.startswith("message: not a valid DecodeRequest")


def test_parser_strictness_matches_protobuf() -> None:
    from google.protobuf.message import DecodeError

    for raw in (b"\x02\x00", varint((1 << 29) << 3 | 2) + b"\x00"):
        with pytest.raises(DecodeError):
            pb.DecodeRequest.FromString(raw)
    largest = varint(((1 << 29) - 1) << 3 | 2) + b"\x00"  # the largest legal number: unknown
    assert not pb.DecodeRequest.FromString(largest).HasField("header")
    assert parse_request(largest, Op.DECODE) == (None, [], None, 0)


def test_step_timeout_is_read_as_protobuf_reads_it() -> None:
    """``step_timeout_ms`` (a varint) comes out of the hand parser as from protobuf, in any
    position, the last occurrence winning; as another wire type it is an unknown field."""
    header = pb.DecodeHeader(q=pb.TensorSpec(dtype=pb.FLOAT32, shape=[1, 1, 4]))
    for ms in (1, 300, 2**32 - 1):
        msg = pb.DecodeRequest(header=header, step_timeout_ms=ms)
        raw = msg.SerializeToString()
        assert parse_request(raw, Op.DECODE).step_timeout_ms == ms
        assert pb.DecodeRequest.FromString(raw).step_timeout_ms == ms
    first = pb.DecodeRequest(step_timeout_ms=7).SerializeToString()
    both = first + pb.DecodeRequest(header=header, step_timeout_ms=9).SerializeToString()
    assert parse_request(both, Op.DECODE).step_timeout_ms == 9
    assert pb.DecodeRequest.FromString(both).step_timeout_ms == 9
    assert parse_request(pb.DecodeRequest(header=header).SerializeToString(),
                         Op.DECODE).step_timeout_ms == 0
    as_bytes = varint(3 << 3 | 2) + varint(1) + b"\x05"  # field 3, length-delimited
    assert parse_request(as_bytes, Op.DECODE).step_timeout_ms == 0


def test_request_layouts_number_their_fields_alike() -> None:
    for name in ("header", "chunks", "step_timeout_ms"):
        assert (pb.PrefillRequest.DESCRIPTOR.fields_by_name[name].number
                == pb.DecodeRequest.DESCRIPTOR.fields_by_name[name].number)


def test_garbage_over_grpc_is_refused_naming_the_message(server: ServerHandle) -> None:
    call = server.channel().stream_stream("/attention.v1.AttentionService/Prefill")
    with pytest.raises(grpc.RpcError) as info:
        list(call(iter([b"\x12\x7fnot protobuf"]), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "message: not a valid PrefillRequest" in info.value.details()


def test_repeated_headers_are_parsed_and_checked_once() -> None:
    """A header seen before (same op, bytes and limits) is answered from the memos: the same
    parsed message and the same checked params. Another op, other limits or a refused header
    are not served from them."""
    from attention_service.config import ServerConfig
    from attention_service.frontend import validation

    q, k, v = random_qkv(6, 6, 2, 1, 8, torch.float32)
    header = next(iter(prefill_messages(q, k, v, [0, 2, 6], chunk=40))).header
    raw = pb.PrefillRequest(header=header).SerializeToString()
    limits = validation.Limits.of(ServerConfig())
    first, again = parse_request(raw, Op.PREFILL), parse_request(raw, Op.PREFILL)
    assert first.header_bytes == header.SerializeToString()
    assert again.header is first.header
    checked = validation.checked_header(Op.PREFILL, first.header, first.header_bytes, limits)
    params, regions = validation.validate_header(Op.PREFILL, header, limits)
    assert checked[0] == params and dict(checked[1]) == regions
    with pytest.raises(TypeError):  # shared between calls: read-only
        checked[1]["q"] = None  # type: ignore[index]
    assert validation.checked_header(
        Op.PREFILL, again.header, again.header_bytes, limits) is checked
    tight = limits._replace(max_request_bytes=1)
    with pytest.raises(RequestError, match="header"):
        validation.checked_header(Op.PREFILL, again.header, again.header_bytes, tight)
    with pytest.raises(RequestError, match="header"):  # refused again, not remembered
        validation.checked_header(Op.PREFILL, again.header, again.header_bytes, tight)
    decode_raw = pb.DecodeRequest(header=pb.DecodeHeader(num_splits=2)).SerializeToString()
    assert isinstance(parse_request(decode_raw, Op.DECODE).header, pb.DecodeHeader)
    assert isinstance(parse_request(decode_raw, Op.PREFILL).header, pb.PrefillHeader)
    big = pb.DecodeRequest(header=pb.DecodeHeader(cu_seqlens_k=list(range(0, 1 << 21, 128))))
    raw_big = big.SerializeToString()
    assert len(big.header.SerializeToString()) > validation.MEMO_HEADER_BYTES
    assert parse_request(raw_big, Op.DECODE).header is not parse_request(raw_big, Op.DECODE).header
    memo: dict[int, int] = {}
    for i in range(validation.MEMO_ENTRIES + 5):  # bounded: a full memo starts over
        assert validation.memoized(memo, i, lambda i=i: i + 1) == i + 1
        assert len(memo) <= validation.MEMO_ENTRIES
    sized = validation.Memo()  # and by its keys' bytes
    for i in range(5):
        validation.memoized(sized, i, lambda: 0, validation.MEMO_BYTES // 2)
        assert sized.nbytes <= validation.MEMO_BYTES and len(sized) <= 2
