"""The unary twins of the compute rpcs (PrefillUnary, ..., CacheDecodeUnary): the same calls
with the whole request in one message and the whole answer in one AttentionResult."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest
import torch

from attention_service.frontend.streams import MAX_UNARY_OUTPUT_BYTES
from attention_wire.pb import attention_pb2 as pb

from ..kv_helpers import (
    append_messages,
    cache_decode_messages,
    cache_prefill_messages,
    layout,
    rand,
)
from ..svc_helpers import (
    TOLERANCE,
    collect,
    collect_result,
    cu_from_lengths,
    decode_messages,
    one_message,
    prefill_messages,
    prefill_oracle,
    random_qkv,
    request_codes,
    same_answer,
    spec,
    unary_rpc,
)

pytestmark = pytest.mark.timeout(60)
SERVICE = "/attention.v1.AttentionService/"


def test_prefill_and_decode_unary_equal_their_streams(server) -> None:  # type: ignore[no-untyped-def]
    """Bitwise the stream's answer (cpu backend, batching off), right against the float64
    reference, each output in one slice, the same stats."""
    cu = cu_from_lengths([7, 1, 19])
    q, k, v = random_qkv(cu[-1], cu[-1], 4, 2, 40, torch.float16, seed=5)
    msgs = list(prefill_messages(q, k, v, cu, causal=True, return_lse=True))
    result = unary_rpc(server, "PrefillUnary")(one_message(msgs), timeout=30)
    assert [c.field for c in result.chunks] == [pb.OUT, pb.LSE]
    got = collect_result(result)
    same_answer(got, collect(server.stub().Prefill(iter(msgs), timeout=30)))
    out_ref, _ = prefill_oracle(q, k, v, cu, causal=True)
    tol = TOLERANCE[torch.float16]
    torch.testing.assert_close(got.out.double(), out_ref, atol=tol, rtol=tol)

    cu_k = cu_from_lengths([13, 0, 5])
    q, k, v = random_qkv(3, cu_k[-1], 8, 2, 64, torch.bfloat16, seed=6)
    msgs = list(decode_messages(q, k, v, cu_k, return_lse=True))
    got = collect_result(unary_rpc(server, "DecodeUnary")(one_message(msgs), timeout=30))
    same_answer(got, collect(server.stub().Decode(iter(msgs), timeout=30)))


def test_cache_rpcs_unary_equal_their_streams(server) -> None:  # type: ignore[no-untyped-def]
    """Two identical caches, one driven through the unary twins and one through streams,
    hold and answer the same."""
    stub = server.stub()
    stub.CreateCaches(pb.CreateCachesRequest(
        cache_ids=["u", "s"], layout=layout(torch.float32, 2, 16)), timeout=10)
    try:
        k, v = rand(9, 2, 16, seed=1), rand(9, 2, 16, seed=2)
        append = unary_rpc(server, "AppendKVUnary")
        a = collect_result(append(one_message(append_messages(["u"], k, v, [9]))))
        b = collect(stub.AppendKV(append_messages(["s"], k, v, [9])))
        assert list(a.stats.cache_lengths) == list(b.stats.cache_lengths) == [9]
        assert not a.tensors

        q, kn, vn = rand(3, 4, 16, seed=3), rand(3, 2, 16, seed=4), rand(3, 2, 16, seed=5)
        same_answer(
            collect_result(unary_rpc(server, "CachePrefillUnary")(
                one_message(cache_prefill_messages(["u"], q, kn, vn, [3], [3])))),
            collect(stub.CachePrefill(cache_prefill_messages(["s"], q, kn, vn, [3], [3]))),
        )
        for seed in range(3):  # steps that store a token each
            q, kn, vn = (rand(1, 4, 16, seed=10 + seed), rand(1, 2, 16, seed=20 + seed),
                         rand(1, 2, 16, seed=30 + seed))
            unary = collect_result(unary_rpc(server, "CacheDecodeUnary")(
                one_message(cache_decode_messages(["u"], q, kn, vn, cu_k=[0, 1]))))
            streamed = collect(stub.CacheDecode(
                cache_decode_messages(["s"], q, kn, vn, cu_k=[0, 1])))
            same_answer(unary, streamed)
        assert list(unary.stats.cache_lengths) == [9 + 3 + 3]
    finally:
        stub.ReleaseCaches(pb.ReleaseCachesRequest(cache_ids=["u", "s"]), timeout=10)


def _code_and_details(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def test_unary_refusals_name_the_field(server) -> None:  # type: ignore[no-untyped-def]
    prefill = unary_rpc(server, "PrefillUnary")
    q, k, v = random_qkv(6, 6, 3, 2, 32, torch.float16)  # 3 heads over 2 kv heads
    code, details = _code_and_details(
        lambda: prefill(one_message(prefill_messages(q, k, v, [0, 6])), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "header" in details

    q, k, v = random_qkv(6, 6, 2, 2, 32, torch.float16)
    short = one_message(prefill_messages(q, k, v, [0, 6]))
    del short.chunks[-1]  # v's bytes never come
    code, details = _code_and_details(lambda: prefill(short, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "v" in details

    raw = server.channel().unary_unary(SERVICE + "PrefillUnary")
    code, details = _code_and_details(lambda: raw(b"\xff\xff\xff", timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("message")


def test_outputs_over_one_message_are_refused_before_any_work(server) -> None:  # type: ignore[no-untyped-def]
    """A request under the 4 MiB message limit whose out + lse would be over it: refused
    with INVALID_ARGUMENT naming header.q and the stream rpc to use instead."""
    rows = 7 * (1 << 20) // 32  # q [rows, 1, 8] fp16: 3.5 MiB; out + lse: 4.375 MiB
    q = torch.zeros(rows, 1, 8, dtype=torch.float16)
    kv = torch.zeros(1, 1, 8, dtype=torch.float16)
    header = pb.PrefillHeader(q=spec(q), k=spec(kv), v=spec(kv), cu_seqlens_q=[0, rows],
                              cu_seqlens_k=[0, 1], return_lse=True)
    assert q.nbytes + rows * 4 > MAX_UNARY_OUTPUT_BYTES
    code, details = _code_and_details(
        lambda: unary_rpc(server, "PrefillUnary")(pb.PrefillRequest(header=header), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("header.q") and "Prefill" in details, details


def test_unary_calls_count_under_their_op(start_server) -> None:  # type: ignore[no-untyped-def]
    """Metrics and dashboards see one operation whichever way it travelled."""
    handle = start_server(metrics_port=0)
    q, k, v = random_qkv(4, 4, 2, 2, 16, torch.float32)
    prefill = unary_rpc(handle, "PrefillUnary")
    prefill(one_message(prefill_messages(q, k, v, [0, 4])), timeout=10)
    with pytest.raises(grpc.RpcError):
        prefill(one_message(prefill_messages(q, k, v, [0, 3])), timeout=10)
    assert request_codes(handle, "Prefill") == {"OK", "INVALID_ARGUMENT"}
    assert request_codes(handle, "PrefillUnary") == set()
