"""The hand-written response parser agrees with protobuf's, on valid and odd messages."""

from __future__ import annotations

import numpy as np
import pytest

from attention_wire.messages import OutputSlice, WireError, parse_response, parse_result, varint
from attention_wire.pb import attention_pb2 as pb


def _chunk(**kw) -> pb.AttentionResponse:
    return pb.AttentionResponse(chunk=pb.OutputChunk(**kw))


@pytest.mark.parametrize(
    "msg",
    [
        _chunk(field=pb.OUT, spec=pb.TensorSpec(dtype=pb.BFLOAT16, shape=[7, 3, 64]),
               row_start=5, row_count=2, data=np.random.default_rng(0).bytes(768)),
        _chunk(field=pb.LSE, spec=pb.TensorSpec(dtype=pb.FLOAT32, shape=[3, 2**40]),
               row_start=2**40 - 1, row_count=1, data=b"\x00" * 4),
        _chunk(field=pb.OUT, row_start=-3, row_count=-1),  # negative int64: 10-byte varints
        _chunk(),  # all defaults: an empty chunk is still a chunk
    ],
)
def test_chunk_matches_protobuf(msg):
    got = parse_response(msg.SerializeToString())
    c = msg.chunk
    assert isinstance(got, OutputSlice)
    assert (got.field, got.dtype, got.shape, got.row_start, got.row_count) == (
        c.field, c.spec.dtype, tuple(c.spec.shape), c.row_start, c.row_count
    )
    assert bytes(got.data) == c.data and isinstance(got.data, memoryview)


def test_stats_and_empty():
    stats = pb.RequestStats(queue_seconds=0.5, bytes_in=2**50, flops=1e15, batch_requests=3)
    assert parse_response(pb.AttentionResponse(stats=stats).SerializeToString()) == stats
    assert parse_response(b"") is None


def test_unknown_fields_are_skipped():
    msg = _chunk(field=pb.OUT, row_start=4, row_count=1, data=b"abcd")
    extra = (
        b"\x38" + varint(99)  # field 7 varint
        + b"\x41" + b"\x00" * 8  # field 8 fixed64
        + b"\x4d" + b"\x00" * 4  # field 9 fixed32
        + b"\x52" + varint(3) + b"xyz"  # field 10 bytes
    )
    inner = msg.chunk.SerializeToString() + extra
    raw = b"\x0a" + varint(len(inner)) + inner + extra
    got = parse_response(raw)
    assert pb.AttentionResponse.FromString(raw).chunk.data == b"abcd"
    assert (got.row_start, got.row_count, bytes(got.data)) == (4, 1, b"abcd")


def test_oneof_last_wins_like_protobuf():
    raw = (pb.AttentionResponse(stats=pb.RequestStats(flops=1.0)).SerializeToString()
           + _chunk(field=pb.LSE).SerializeToString())
    assert pb.AttentionResponse.FromString(raw).WhichOneof("payload") == "chunk"
    assert isinstance(parse_response(raw), OutputSlice)


@pytest.mark.parametrize(
    "raw", [b"\x0a\x05ab", b"\x08", b"\x08\xff", b"\x0b", b"\x0a" + b"\xff" * 11]
)
def test_malformed_raises(raw):
    with pytest.raises(WireError):
        parse_response(raw)


def test_result_is_the_stream_concatenated():
    """AttentionResult (a unary compute rpc's answer) numbers its fields as AttentionResponse
    does: the stream's messages joined parse as one result, and parse_result reads it as
    protobuf does, the stats last."""
    rng = np.random.default_rng(1)
    stream = [
        _chunk(field=pb.OUT, spec=pb.TensorSpec(dtype=pb.FLOAT16, shape=[2, 1, 8]),
               row_start=0, row_count=2, data=rng.bytes(32)),
        _chunk(field=pb.LSE, spec=pb.TensorSpec(dtype=pb.FLOAT32, shape=[2, 1]),
               row_start=0, row_count=2, data=rng.bytes(8)),
        pb.AttentionResponse(stats=pb.RequestStats(flops=7.0, cache_lengths=[3, 4])),
    ]
    joined = b"".join(m.SerializeToString() for m in stream)
    result = pb.AttentionResult.FromString(joined)
    assert list(result.chunks) == [stream[0].chunk, stream[1].chunk]
    assert result.stats == stream[2].stats
    parsed = parse_result(joined)
    assert parsed == [parse_response(m.SerializeToString()) for m in stream]
    assert parse_result(result.SerializeToString()) == parsed
    assert parse_result(b"") == []  # no stats: the assembler refuses it


def test_request_header_joins_its_occurrences_and_skips_the_chunks() -> None:
    """``request_header``: the header's bytes as protobuf merges them (two occurrences around
    a chunk), None without one, and a message of countless fields refused as read_request
    refuses it."""
    from attention_wire.messages import MAX_FIELDS_PER_MESSAGE, request_header

    first = pb.DecodeRequest(header=pb.DecodeHeader(q=pb.TensorSpec(dtype=pb.FLOAT16,
                                                                    shape=[2, 4, 8])))
    chunk = pb.DecodeRequest(chunks=[pb.TensorChunk(field=pb.Q, offset=0, data=b"\1" * 64)])
    second = pb.DecodeRequest(header=pb.DecodeHeader(cache=pb.CacheTarget(cache_ids=["a", "b"])))
    message = b"".join(m.SerializeToString() for m in (first, chunk, second))
    got = pb.DecodeHeader.FromString(request_header(message))
    assert got == pb.DecodeRequest.FromString(message).header
    assert list(got.cache.cache_ids) == ["a", "b"] and list(got.q.shape) == [2, 4, 8]
    assert request_header(chunk.SerializeToString()) is None
    junk = (varint(15 << 3) + b"\x00") * (MAX_FIELDS_PER_MESSAGE + 1)
    with pytest.raises(WireError, match="fields"):
        request_header(first.SerializeToString() + junk)
