"""Every malformed request is refused with its status and a message naming the field."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch

from attention_service.params import causal_pairs as _causal_pairs
from attention_wire.pb import attention_pb2 as pb

from ..kv_helpers import cache_decode_messages, cache_prefill_messages
from ..svc_helpers import decode_messages, prefill_messages, random_qkv

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("no_tracebacks")]
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _prefill(**header_changes: Any) -> list[pb.PrefillRequest]:
    """A valid small prefill (2 sequences, 8 tokens, 2 heads / 1 kv head, d=8), then edited."""
    q, k, v = random_qkv(8, 8, 2, 1, 8, torch.float32)
    msgs = list(prefill_messages(q, k, v, [0, 3, 8], chunk=40))
    _edit(msgs[0].header, header_changes)
    return msgs


def _decode(**header_changes: Any) -> list[pb.DecodeRequest]:
    q, k, v = random_qkv(2, 8, 2, 1, 8, torch.float32)
    msgs = list(decode_messages(q, k, v, [0, 3, 8], chunk=40))
    _edit(msgs[0].header, header_changes)
    return msgs


def _edit(h: Any, changes: dict[str, Any]) -> None:
    """Set header fields: a TensorSpec copied in, a list replacing a repeated field."""
    for key, value in changes.items():
        if key in ("q", "k", "v", "kv_scales"):
            getattr(h, key).CopyFrom(value)
        elif isinstance(value, list):
            field = getattr(h, key)
            del field[:]
            field.extend(value)
        else:
            setattr(h, key, value)


def _spec(shape: list[int], dtype: int = pb.FLOAT32) -> pb.TensorSpec:
    return pb.TensorSpec(dtype=dtype, shape=shape)


def _edit_chunks(msgs: list[Any], fn: Callable[[list[Any]], list[Any]]) -> list[Any]:
    return msgs[:1] + fn(msgs[1:])


def _chunk(field: int, offset: int, data: bytes, cls: type = pb.PrefillRequest) -> Any:
    return cls(chunks=[pb.TensorChunk(field=field, offset=offset, data=data)])


def _repeat_header(msgs: list[Any]) -> list[Any]:
    return msgs[:2] + [type(msgs[0])(header=msgs[0].header)] + msgs[2:]


def _first_q_chunk_index(msgs: list[Any]) -> int:
    return next(i for i, m in enumerate(msgs) if m.chunks and m.chunks[0].field == pb.Q)


def _drop_last_k_chunk(msgs: list[Any]) -> list[Any]:
    last_k = max(i for i, m in enumerate(msgs) if m.chunks and m.chunks[0].field == pb.K)
    return msgs[:last_k] + msgs[last_k + 1 :]


def _skip_q_chunk(msgs: list[Any]) -> list[Any]:
    i = _first_q_chunk_index(msgs)
    return msgs[:i] + msgs[i + 1 :]  # second q chunk arrives at offset 40 before 0


def _overlap_q(msgs: list[Any]) -> list[Any]:
    i = _first_q_chunk_index(msgs)
    return msgs[: i + 1] + [msgs[i]] + msgs[i + 1 :]  # offset 0 again


def _extra_v_bytes(msgs: list[Any]) -> list[Any]:
    return msgs + [_chunk(pb.V, 8 * 1 * 8 * 4, b"\0" * 4)]  # one float past the end of v


# (id, rpc, messages, expected status, text the details must contain)
CASES: list[tuple[str, str, list[Any], grpc.StatusCode, str]] = [
    ("unspecified_dtype", "Prefill", _prefill(q=_spec([8, 2, 8], pb.DTYPE_UNSPECIFIED)),
     INVALID, "header.q.dtype"),
    ("unknown_dtype_value", "Prefill", _prefill(k=_spec([8, 1, 8], 42)), INVALID,
     "header.k.dtype"),
    ("dtype_mismatch", "Prefill", _prefill(v=_spec([8, 1, 8], pb.FLOAT16)), INVALID,
     "header.v.dtype"),
    ("q_wrong_rank", "Prefill", _prefill(q=_spec([8, 16])), INVALID, "header.q.shape"),
    ("k_wrong_rank", "Prefill", _prefill(k=_spec([8, 1, 8, 1])), INVALID, "header.k.shape"),
    ("zero_heads", "Prefill", _prefill(q=_spec([8, 0, 8])), INVALID, "header.q.shape[1]"),
    ("negative_tokens", "Prefill", _prefill(k=_spec([-8, 1, 8])), INVALID, "header.k.shape[0]"),
    ("head_dim_mismatch", "Prefill", _prefill(k=_spec([8, 1, 16]), v=_spec([8, 1, 16])),
     INVALID, "header.k.shape[2]"),
    ("kv_heads_mismatch", "Prefill", _prefill(v=_spec([8, 2, 8])), INVALID, "header.v.shape"),
    ("heads_not_multiple", "Prefill",
     _prefill(q=_spec([8, 3, 8]), k=_spec([8, 2, 8]), v=_spec([8, 2, 8])), INVALID,
     "header.k.shape[1]"),
    ("head_dim_over_256", "Prefill",
     _prefill(q=_spec([8, 2, 264]), k=_spec([8, 1, 264]), v=_spec([8, 1, 264])), INVALID,
     "header.q.shape[2]"),
    # q's head dim unsupported and k's different: q's is named (it was k's mismatch).
    ("huge_q_head_dim", "Prefill", _prefill(q=_spec([8, 2, 1 << 40])), INVALID,
     "header.q.shape[2]"),
    ("row_over_message_limit", "Prefill",
     _prefill(q=_spec([8, 8192, 256]), k=_spec([8, 1, 256]), v=_spec([8, 1, 256])), INVALID,
     "header.q.shape[1]"),
    ("missing_k_spec", "Prefill", [pb.PrefillRequest(header=pb.PrefillHeader(
        q=_spec([8, 2, 8]), v=_spec([8, 1, 8]), cu_seqlens_q=[0, 8]))], INVALID, "header.k"),
    ("cu_q_not_starting_at_0", "Prefill", _prefill(cu_seqlens_q=[1, 3, 8]), INVALID,
     "cu_seqlens_q"),
    ("cu_q_decreasing", "Prefill", _prefill(cu_seqlens_q=[0, 5, 3, 8],
                                            cu_seqlens_k=[0, 3, 3, 8]), INVALID, "cu_seqlens_q"),
    ("cu_q_negative", "Prefill", _prefill(cu_seqlens_q=[0, -2, 8]), INVALID, "cu_seqlens_q"),
    ("cu_q_last_not_total", "Prefill", _prefill(cu_seqlens_q=[0, 3, 7]), INVALID,
     "cu_seqlens_q"),
    ("cu_q_too_short", "Prefill", _prefill(cu_seqlens_q=[0]), INVALID, "cu_seqlens_q"),
    ("cu_k_batch_mismatch", "Prefill", _prefill(cu_seqlens_k=[0, 8]), INVALID, "cu_seqlens_k"),
    # FP8 scales with a row per sequence are counted against the checked batch: the batch
    # mismatch is what is named, not the rows (2 = cu_seqlens_q's sequences, not k's 3).
    ("cu_k_batch_mismatch_with_scale_rows", "Prefill", _prefill(
        q=_spec([8, 2, 8], pb.FLOAT16), k=_spec([8, 1, 8], pb.FLOAT8_E4M3),
        v=_spec([8, 1, 8], pb.FLOAT8_E4M3), cu_seqlens_k=[0, 2, 5, 8],
        kv_scales=pb.KvScales(k=[1.0, 2.0], v=[1.0, 2.0])), INVALID,
     "cu_seqlens_k: q/k batch mismatch"),
    ("cu_k_last_not_total", "Prefill", _prefill(cu_seqlens_k=[0, 3, 9]), INVALID,
     "cu_seqlens_k"),
    ("cu_k_huge_value", "Prefill", _prefill(cu_seqlens_k=[0, 2_000_000_000, 8]), INVALID,
     "cu_seqlens_k"),
    ("cu_k_empty_but_k_differs", "Prefill", _prefill(k=_spec([9, 1, 8]), v=_spec([9, 1, 8])),
     INVALID, "cu_seqlens_k"),
    ("scale_nan", "Prefill", _prefill(softmax_scale=float("nan")), INVALID,
     "header.softmax_scale"),
    ("scale_inf", "Decode", _decode(softmax_scale=float("-inf")), INVALID,
     "header.softmax_scale"),
    ("lse_row_over_message_limit", "Prefill",
     _prefill(q=_spec([2_000_000, 2, 8]), cu_seqlens_q=[0, 2_000_000], return_lse=True),
     INVALID, "header.return_lse"),
    ("decode_cu_k_wrong_length", "Decode", _decode(cu_seqlens_k=[0, 8]), INVALID,
     "cu_seqlens_k"),
    ("decode_cu_k_empty", "Decode", _decode(cu_seqlens_k=[]), INVALID, "cu_seqlens_k"),
    ("decode_cu_k_decreasing", "Decode", _decode(cu_seqlens_k=[0, 9, 8]), INVALID,
     "cu_seqlens_k"),
    ("decode_negative_num_splits", "Decode", _decode(num_splits=-1), INVALID,
     "header.num_splits"),
    # An empty batch is answered (test_process_group), but not by the cached ops, whose
    # requests name one cache per sequence.
    ("cache_decode_empty_batch", "CacheDecode",
     list(cache_decode_messages([], *random_qkv(0, 0, 2, 1, 8, torch.float32))), INVALID,
     "header.q.shape[0]"),
    ("cache_prefill_no_queries", "CachePrefill",
     list(cache_prefill_messages(["a"], *random_qkv(0, 0, 2, 1, 8, torch.float32), [0, 0],
                                 [0, 0])), INVALID, "header.q.shape[0]"),
    ("empty_batch_k_past_cu_k", "Prefill",
     _prefill(q=_spec([0, 2, 8]), cu_seqlens_q=[0], cu_seqlens_k=[0]), INVALID,
     "cu_seqlens_k"),
    ("empty_stream", "Prefill", [], INVALID, "header"),
    ("missing_header", "Prefill", _prefill()[1:], INVALID, "header"),
    ("header_repeated", "Prefill", _repeat_header(_prefill()), INVALID, "header"),
    ("decode_header_repeated", "Decode", _repeat_header(_decode()), INVALID, "header"),
    ("chunk_unspecified_field", "Prefill",
     _prefill() + [_chunk(pb.INPUT_FIELD_UNSPECIFIED, 0, b"\0")], INVALID, "chunks.field"),
    ("chunk_unknown_field", "Decode",
     _decode() + [_chunk(9, 0, b"\0", pb.DecodeRequest)], INVALID, "chunks.field"),
    ("chunk_out_of_order", "Prefill", _skip_q_chunk(_prefill()), INVALID, "chunks[q].offset"),
    ("chunk_overlapping", "Prefill", _overlap_q(_prefill()), INVALID, "chunks[q].offset"),
    ("chunk_past_the_end", "Prefill", _extra_v_bytes(_prefill()), INVALID, "chunks[v]"),
    ("missing_bytes_at_end", "Prefill", _drop_last_k_chunk(_prefill()), INVALID, "chunks[k]"),
    ("decode_missing_bytes", "Decode", _drop_last_k_chunk(_decode()), INVALID, "chunks[k]"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_invalid_request_is_refused(server, case) -> None:  # type: ignore[no-untyped-def]
    _, rpc, msgs, code, field = case
    call = getattr(server.stub(), rpc)
    with pytest.raises(grpc.RpcError) as info:
        list(call(iter(msgs), timeout=10))
    assert info.value.code() == code, info.value.details()
    assert field in info.value.details()


def test_server_keeps_serving_after_refusals(server) -> None:  # type: ignore[no-untyped-def]
    resp = list(server.stub().Prefill(iter(_prefill()), timeout=10))
    assert resp[-1].HasField("stats")


def _header_then_block(
    msgs: list[Any], release: threading.Event, pulled: list[int]
) -> Iterator[Any]:
    """Yield the header, then hold the stream open (no bytes) until released."""
    pulled.append(1)
    yield msgs[0]
    release.wait(20)
    for m in msgs[1:]:
        pulled.append(1)
        yield m


def test_over_limit_refused_before_bytes_are_sent(start_server) -> None:  # type: ignore[no-untyped-def]
    srv = start_server(max_request_bytes=4096)
    q, k, v = random_qkv(64, 64, 2, 1, 8, torch.float32)  # 4096 + 2048 + 2048 bytes
    msgs = list(prefill_messages(q, k, v, [0, 64]))
    release, pulled = threading.Event(), []
    t0 = time.monotonic()
    try:
        with pytest.raises(grpc.RpcError) as info:
            list(srv.stub().Prefill(_header_then_block(msgs, release, pulled), timeout=15))
    finally:
        release.set()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "header" in info.value.details() and "4096" in info.value.details()
    assert "--max-request-bytes" in info.value.details()
    # Answered from the header alone, while the client still held back every byte.
    assert time.monotonic() - t0 < 10
    assert len(pulled) == 1


def test_exactly_at_limit_is_accepted(start_server) -> None:  # type: ignore[no-untyped-def]
    q, k, v = random_qkv(16, 16, 2, 1, 8, torch.float32)
    srv = start_server(max_request_bytes=q.nbytes + k.nbytes + v.nbytes)
    resp = list(srv.stub().Prefill(prefill_messages(q, k, v, [0, 16]), timeout=10))
    assert resp[-1].HasField("stats")


@pytest.mark.parametrize("sq,sk", [(1, 1), (4, 4), (3, 9), (9, 3), (5, 0), (0, 5), (7, 6)])
def test_causal_pairs_counts_visible_keys(sq: int, sk: int) -> None:
    brute = sum(1 for i in range(sq) for j in range(sk) if j <= i + sk - sq)
    assert _causal_pairs(sq, sk) == brute


def test_front_end_head_dim_rule_is_the_kernels() -> None:
    """validation.py repeats the kernels' rule (front ends do not import torch): keep them equal."""
    from attention_kernels._checks import supported_head_dim as kernels_rule
    from attention_service.frontend.validation import supported_head_dim

    assert all(supported_head_dim(d) == kernels_rule(d) for d in range(-8, 300))
