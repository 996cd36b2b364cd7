"""Request stream encoding: hand-written wire format, chunk sizes and boundaries."""

from __future__ import annotations

import numpy as np
import pytest

from attention_client._channel import check_chunk_bytes
from attention_client._decode import prepare_decode
from attention_client._prefill import prepare_prefill
from attention_client._requests import MAX_HEADER_BYTES
from attention_client._tensors import WireTensor
from attention_wire.messages import (
    DATA_ALIGN,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    encode_messages,
    message_frame,
    read_request,
    single_message,
    step_timeout,
    varint,
)
from attention_wire.pb import attention_pb2 as pb

FOUR_MIB = 4 * 1024 * 1024


def _tensor(name: str, nbytes: int) -> WireTensor:
    arr = (np.arange(nbytes) % 251).astype(np.uint8).view(np.uint8)
    return WireTensor(name, arr, pb.FLOAT16)


def _decode_stream(messages: list[bytes], cls=pb.PrefillRequest):
    """Parse with the generated classes and reassemble each tensor, checking offsets."""
    parsed = [cls.FromString(m) for m in messages]
    data = {pb.Q: bytearray(), pb.K: bytearray(), pb.V: bytearray()}
    for i, msg in enumerate(parsed):
        assert msg.HasField("header") == (i == 0)
        for c in msg.chunks:
            assert c.offset == len(data[c.field]), "chunks of a tensor must arrive in order"
            data[c.field] += c.data
    return parsed, data


@pytest.mark.parametrize("n", [0, 1, 127, 128, 300, 2**14, 2**21, 2**35, 2**63])
def test_varint_matches_protobuf(n):
    assert pb.TensorChunk.FromString(b"\x10" + varint(n)).offset == n


@pytest.mark.parametrize("chunk", [MIN_CHUNK_BYTES, 4096 + 64, 65536])
@pytest.mark.parametrize(
    "sizes",
    [
        (0, 0, 0),
        (10, 20, 20),
        (4096, 4096, 4096),  # exactly one budget each
        (4095, 4097, 8192),
        (100_000, 3, 100_001),
        (1, 0, 1),
    ],
)
def test_stream_reassembles_and_respects_budget(sizes, chunk):
    tensors = [_tensor(n, s) for n, s in zip("qkv", sizes, strict=True)]
    header = pb.PrefillHeader(q=pb.TensorSpec(dtype=pb.FLOAT16, shape=[7])).SerializeToString()
    messages = list(encode_messages(header, tensors, chunk))
    parsed, data = _decode_stream(messages)
    for field, t in zip((pb.Q, pb.K, pb.V), tensors, strict=True):
        assert bytes(data[field]) == t.array.tobytes()
    assert parsed[0].header.SerializeToString() == header
    for i, msg in enumerate(parsed):
        payload = sum(len(c.data) for c in msg.chunks)
        assert payload <= (chunk - len(header) if i == 0 else chunk)
        assert payload > 0 or i == 0, "no empty messages after the first"
        for c in msg.chunks:
            t = tensors[c.field - 1]
            if c.offset + len(c.data) < t.nbytes:
                assert len(c.data) % 64 == 0, "non-final chunks end on whole elements"
    # Packing is tight: no message could have taken more of the next one's bytes.
    total = sum(sizes)
    assert len(messages) <= 1 + -(-total // (chunk - 64)) + 3


def test_big_tensor_messages_stay_under_four_mib():
    tensors = [_tensor("q", 9_000_000), _tensor("k", 5), _tensor("v", 5)]
    header = b"h" * 1000
    sizes = [len(m) for m in encode_messages(header, tensors, MAX_CHUNK_BYTES)]
    assert len(sizes) == 3
    assert max(sizes) < FOUR_MIB - 1024


def test_header_larger_than_budget_goes_alone():
    header = pb.PrefillHeader(cu_seqlens_q=list(range(3000))).SerializeToString()
    assert len(header) > MIN_CHUNK_BYTES
    messages = list(encode_messages(header, [_tensor(n, 10) for n in "qkv"], MIN_CHUNK_BYTES))
    parsed, _ = _decode_stream(messages)
    assert len(parsed[0].chunks) == 0 and len(parsed) == 2


def test_stream_is_lazy():
    tensors = [_tensor("q", 10 * MIN_CHUNK_BYTES), _tensor("k", 1), _tensor("v", 1)]
    gen = encode_messages(b"", tensors, MIN_CHUNK_BYTES)
    assert len(next(gen)) < 2 * MIN_CHUNK_BYTES  # one message built, not all of them


def test_prepared_request_streams_parse_as_generated_messages():
    q = np.random.default_rng(0).standard_normal((33, 4, 64)).astype(np.float16)
    prep = prepare_decode(q, q, q, np.arange(34, dtype=np.int32), num_splits=3)
    parsed, data = _decode_stream(
        list(encode_messages(prep.header, prep.tensors, MIN_CHUNK_BYTES)), pb.DecodeRequest
    )
    assert parsed[0].header.num_splits == 3
    assert list(parsed[0].header.q.shape) == [33, 4, 64]
    assert bytes(data[pb.K]) == q.tobytes()


def test_a_step_carries_its_deadline_in_the_same_message():
    import time

    q = np.random.default_rng(1).standard_normal((5, 2, 8)).astype(np.float16)
    prep = prepare_decode(q, q, q, np.arange(6, dtype=np.int32))
    assert step_timeout(None) == b""
    tail = step_timeout(time.monotonic() + 0.25)
    raw = single_message(prep.header, prep.tensors, tail=tail)
    msg = pb.DecodeRequest.FromString(raw)
    assert 200 < msg.step_timeout_ms <= 250
    assert list(msg.header.q.shape) == [5, 2, 8]
    assert b"".join(c.data for c in msg.chunks if c.field == pb.Q) == q.tobytes()
    assert raw.startswith(single_message(prep.header, prep.tensors))  # only the tail added
    for past in (0.0, -5.0):  # already due: the least the field says, not "no deadline"
        due = pb.DecodeRequest.FromString(step_timeout(time.monotonic() + past))
        assert due.step_timeout_ms == 1
    far = pb.DecodeRequest.FromString(step_timeout(time.monotonic() + 1e9))
    assert far.step_timeout_ms == 2**32 - 1  # uint32


@pytest.mark.parametrize("bad", [MIN_CHUNK_BYTES - 1, MAX_CHUNK_BYTES + 1, 0, -5])
def test_chunk_bytes_bounds(bad):
    with pytest.raises(ValueError, match="max_chunk_bytes"):
        check_chunk_bytes(bad)


def test_oversized_header_is_a_clear_value_error():
    q = np.zeros((4, 1, 8), np.float16)
    cu = np.full(MAX_HEADER_BYTES // 4, 2**30, dtype=np.int64)  # ~5 bytes a value on the wire
    with pytest.raises(ValueError, match="header is .* bytes"):
        prepare_prefill(q, q, q, cu)


@pytest.mark.parametrize("header_bytes", [0, 1, 5, 54, 1495, 6070])
@pytest.mark.parametrize("sizes", [(8192, 2048, 2048), (3, 0, 17), (98_304, 24_576, 24_575)])
def test_whole_tensors_start_aligned_in_their_message(header_bytes, sizes):
    """A tensor sent whole in one chunk starts at a multiple of DATA_ALIGN of its message
    (TensorChunk.padding before it; the step socket reads such tensors in place), in
    ``encode_messages`` and in a decode loop's ``message_frame`` alike, byte for byte the
    same message, which protobuf parses to the same tensors."""
    header = pb.DecodeHeader(cache=pb.CacheTarget(
        cache_ids=["x" * max(0, header_bytes - 4)] if header_bytes else [])).SerializeToString()
    tensors = [_tensor(n, s) for n, s in zip("qkv", sizes, strict=True)]
    (message,) = encode_messages(header, tensors, MAX_CHUNK_BYTES)
    frame = message_frame(header, list(sizes))
    joined = b"".join(x for pair in zip(frame, (t.byte_view() for t in tensors), strict=True)
                      for x in pair)
    assert joined == message
    base = np.frombuffer(message, np.uint8).ctypes.data
    got = read_request(message, pb.DecodeHeader.FromString)
    assert [field for field, _, _ in got.chunks] == [
        f for f, s in zip((pb.Q, pb.K, pb.V), sizes, strict=True) if s]
    for _, _, data in got.chunks:
        assert (np.frombuffer(data, np.uint8).ctypes.data - base) % DATA_ALIGN == 0
    parsed, data = _decode_stream([message], pb.DecodeRequest)
    assert parsed[0].header.SerializeToString() == header
    assert [bytes(data[f]) for f in (pb.Q, pb.K, pb.V)] == [bytes(t.byte_view())
                                                            for t in tensors]
