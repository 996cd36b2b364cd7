"""Response assembly: row slices into place, every row exactly once, stats last."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from attention_client import AttentionError, ProtocolError
from attention_client._requests import PreparedRequest
from attention_client._responses import server_info_dict
from attention_wire.messages import parse_response
from attention_wire.pb import attention_pb2 as pb

SHAPE = (10, 2, 8)


def expecting(method, out_shape, out_dtype, lse_shape) -> PreparedRequest:
    """A request whose reply streams OUT of ``out_shape`` (and LSE of ``lse_shape``)."""
    prep = PreparedRequest(method, b"", (), out_shape, out_dtype, lse_shape, None, None,
                           out_shape or (), lambda lse: lse)  # type: ignore[arg-type]
    prep.expect_reply()
    return prep


def feed(asm: PreparedRequest, msg: pb.AttentionResponse) -> None:
    """Through the wire, as the clients do: serialize, then the client's own parser."""
    asm.add_reply(parse_response(msg.SerializeToString()))


def _out_chunk(arr, start, count, *, shape=SHAPE, dtype=pb.FLOAT16, field=pb.OUT):
    return pb.AttentionResponse(
        chunk=pb.OutputChunk(
            field=field, spec=pb.TensorSpec(dtype=dtype, shape=shape), row_start=start,
            row_count=count, data=arr[start : start + count].tobytes(),
        )
    )


def _stats():
    return pb.AttentionResponse(stats=pb.RequestStats(bytes_in=7, flops=2.0, batch_requests=3))


def _expected():
    return np.random.default_rng(1).standard_normal(SHAPE).astype(np.float16)


def test_out_of_order_slices_and_lse():
    out = _expected()
    lse = np.arange(2 * 10, dtype=np.float32).reshape(2, 10)
    asm = expecting("Prefill", SHAPE, pb.FLOAT16, (2, 10))
    for start, count in [(7, 3), (0, 4), (4, 3)]:
        feed(asm, _out_chunk(out, start, count))
    feed(asm, _out_chunk(lse, 1, 1, shape=(2, 10), dtype=pb.FLOAT32, field=pb.LSE))
    feed(asm, _out_chunk(lse, 0, 1, shape=(2, 10), dtype=pb.FLOAT32, field=pb.LSE))
    feed(asm, _stats())
    got, got_lse, stats = asm.reply()
    assert np.array_equal(got, out) and np.array_equal(got_lse, lse)
    assert stats["bytes_in"] == 7 and stats["batch_requests"] == 3 and stats["kernel_seconds"] == 0


def test_bf16_storage_is_raw_bits():
    bits = np.arange(np.prod(SHAPE), dtype=np.int16).reshape(SHAPE)
    asm = expecting("Prefill", SHAPE, pb.BFLOAT16, None)
    feed(asm, _out_chunk(bits, 0, 10, dtype=pb.BFLOAT16))
    feed(asm, _stats())
    got, lse, _ = asm.reply()
    assert got.dtype == np.int16 and np.array_equal(got, bits) and lse is None


def test_missing_rows_detected():
    out = _expected()
    asm = expecting("Prefill", SHAPE, pb.FLOAT16, None)
    feed(asm, _out_chunk(out, 0, 4))
    feed(asm, _out_chunk(out, 6, 4))
    feed(asm, _stats())
    with pytest.raises(ProtocolError, match=r"OUT is missing 2 of 10 rows \(first missing row 4"):
        asm.reply()


def test_missing_lse_detected():
    out = _expected()
    asm = expecting("Decode", SHAPE, pb.FLOAT16, (10, 2))
    feed(asm, _out_chunk(out, 0, 10))
    feed(asm, _stats())
    with pytest.raises(ProtocolError, match="LSE is missing 10 of 10 rows"):
        asm.reply()


def test_duplicate_rows_detected():
    out = _expected()
    asm = expecting("Prefill", SHAPE, pb.FLOAT16, None)
    feed(asm, _out_chunk(out, 0, 5))
    with pytest.raises(ProtocolError, match="rows \\[4, 6\\) arrived more than once"):
        feed(asm, _out_chunk(out, 4, 2))


@pytest.mark.parametrize(
    ("start", "count", "match"),
    [(8, 3, "outside"), (-1, 1, "outside"), (0, -1, "outside")],
)
def test_rows_out_of_range(start, count, match):
    asm = expecting("Prefill", SHAPE, pb.FLOAT16, None)
    chunk = _out_chunk(_expected(), 0, 0)
    chunk.chunk.row_start, chunk.chunk.row_count = start, count
    with pytest.raises(ProtocolError, match=match):
        feed(asm, chunk)


def test_wrong_byte_count_spec_and_field():
    out = _expected()
    asm = expecting("Prefill", SHAPE, pb.FLOAT16, None)
    bad = _out_chunk(out, 0, 2)
    bad.chunk.data = bad.chunk.data[:-1]
    with pytest.raises(ProtocolError, match="carry 63 bytes, expected 64"):
        feed(asm, bad)
    with pytest.raises(ProtocolError, match="spec FLOAT32\\[10, 2, 8\\], expected FLOAT16"):
        feed(asm, _out_chunk(out, 0, 2, dtype=pb.FLOAT32))
    with pytest.raises(ProtocolError, match="expected FLOAT16\\[10, 2, 8\\]"):
        feed(asm, _out_chunk(out, 0, 2, shape=(10, 16)))
    with pytest.raises(ProtocolError, match="unexpected output field LSE"):
        feed(asm, _out_chunk(out, 0, 2, field=pb.LSE))
    with pytest.raises(ProtocolError, match="unknown output field 9"):
        feed(asm, _out_chunk(out, 0, 2, field=9))
    with pytest.raises(ProtocolError, match="no payload"):
        feed(asm, pb.AttentionResponse())


def test_stats_must_be_last_and_present():
    out = _expected()
    asm = expecting("Prefill", SHAPE, pb.FLOAT16, None)
    feed(asm, _out_chunk(out, 0, 10))
    with pytest.raises(ProtocolError, match="ended without RequestStats"):
        asm.reply()
    feed(asm, _stats())
    with pytest.raises(ProtocolError, match="after the final RequestStats"):
        feed(asm, _out_chunk(out, 0, 1))


def test_empty_output_needs_no_chunks():
    asm = expecting("Prefill", (0, 2, 8), pb.FLOAT32, (2, 0))
    feed(asm, _stats())
    out, lse, _ = asm.reply()
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)


def test_protocol_error_is_an_attention_error():
    err = ProtocolError("boom", "Decode")
    assert isinstance(err, AttentionError) and err.code == grpc.StatusCode.DATA_LOSS
    assert str(err) == "Decode failed: DATA_LOSS: boom"
    plain = AttentionError(grpc.StatusCode.INVALID_ARGUMENT, "head_dim 7", "Prefill")
    assert str(plain) == "Prefill failed: INVALID_ARGUMENT: head_dim 7"
    import pickle

    again = pickle.loads(pickle.dumps(plain))
    assert again.code == plain.code and again.details == plain.details


def test_server_info_dict():
    info = pb.ServerInfo(device="cpu", dtypes=[pb.FLOAT16, pb.FLOAT32], head_dims=[64],
                         max_request_bytes=2**40, batching=True)
    d = server_info_dict(info)
    assert d["dtypes"] == ["FLOAT16", "FLOAT32"] and d["head_dims"] == [64]
    assert d["max_request_bytes"] == 2**40 and d["batching"] is True and d["triton_version"] == ""


def test_a_reply_is_read_once_and_a_call_sent_again_starts_over():
    """The request holds its reply only while it is read (a request kept as a step template
    must not hold the outputs it returned), and ``expect_reply`` starts a resent call anew:
    rows that came for the first attempt do not count for the second."""
    out = _expected()
    asm = expecting("Prefill", SHAPE, pb.FLOAT16, None)
    feed(asm, _out_chunk(out, 0, 4))
    asm.expect_reply()  # sent again: the 4 rows above are forgotten
    feed(asm, _out_chunk(out, 4, 6))
    feed(asm, _stats())
    with pytest.raises(ProtocolError, match="missing 4 of 10 rows"):
        asm.reply()
    asm.expect_reply()
    feed(asm, _out_chunk(out, 0, 10))
    feed(asm, _stats())
    got, _, _ = asm.reply()
    assert np.array_equal(got, out) and not asm.expecting_reply
