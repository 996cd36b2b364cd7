"""ScoreOptions end to end (raw stubs, cpu backend): sliding window, softcap and ALiBi on
Prefill, Decode, CachePrefill and CacheDecode against the float64 reference; calls with
different options batched together each get their own answer; bad options are refused with
INVALID_ARGUMENT naming the field; the work a call reports counts only the pairs its window
leaves visible."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch

from attention_service.params import visible_pairs
from attention_wire.pb import attention_pb2 as pb

from ..kv_helpers import append_messages, cache_decode_messages, cache_prefill_messages, layout
from ..svc_helpers import (
    TOLERANCE,
    ServerHandle,
    collect,
    cu_from_lengths,
    decode_messages,
    decode_oracle,
    make_config,
    prefill_messages,
    prefill_oracle,
    random_qkv,
)

pytestmark = pytest.mark.timeout(60)
HEADS, KV_HEADS, DIM = 4, 2, 16


def _with_score(msgs: Any, *, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                slopes: torch.Tensor | None = None) -> list[Any]:
    msgs = list(msgs)
    score = msgs[0].header.score
    if window[0] != -1:
        score.window_left = window[0]
    if window[1] != -1:
        score.window_right = window[1]
    score.softcap = softcap
    if slopes is not None:
        score.alibi_slopes.extend(slopes.flatten().tolist())
    return msgs


def _kw(window: tuple[int, int], softcap: float, slopes: torch.Tensor | None) -> dict[str, Any]:
    return {"window_size": window, "softcap": softcap, "alibi_slopes": slopes}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert not got.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


@pytest.fixture(scope="module")
def srv() -> Any:
    handle = ServerHandle(make_config(kv_cache_bytes=1 << 20, kv_page_bytes=4096,
                                      max_queue_delay_ms=20))
    yield handle
    handle.close()


CASES = [
    ((3, -1), 0.0, None, True),
    ((-1, 2), 0.0, None, False),
    ((2, 1), 0.0, "heads", False),
    ((-1, -1), 1.5, "batch", True),
    ((4, 0), 2.0, "heads", True),
    ((0, 0), 0.0, None, False),
]


@pytest.mark.parametrize(("window", "softcap", "alibi", "causal"), CASES)
def test_prefill_with_score_options_matches_the_reference(
    srv: ServerHandle, window: tuple[int, int], softcap: float, alibi: str | None, causal: bool
) -> None:
    len_q, len_k = [5, 0, 17, 9], [8, 3, 17, 4]  # q longer than k in the last sequence
    cu_q, cu_k = cu_from_lengths(len_q), cu_from_lengths(len_k)
    q, k, v = random_qkv(cu_q[-1], cu_k[-1], HEADS, KV_HEADS, DIM, torch.float32, seed=3)
    slopes = {None: None, "heads": torch.rand(HEADS),
              "batch": torch.rand(len(len_q), HEADS)}[alibi]
    msgs = _with_score(prefill_messages(q, k, v, cu_q, cu_k, causal=causal, return_lse=True),
                       window=window, softcap=softcap, slopes=slopes)
    r = collect(srv.stub().Prefill(iter(msgs), timeout=30))
    want, want_lse = prefill_oracle(q, k, v, cu_q, cu_k, causal=causal,
                                    **_kw(window, softcap, slopes))
    _close(r.out, want, torch.float32)
    torch.testing.assert_close(r.tensors[pb.LSE].double(), want_lse.double(), atol=1e-4,
                               rtol=1e-4)
    assert r.stats.flops == 4 * visible_pairs(len_q, len_k, causal, window) * HEADS * DIM


@pytest.mark.parametrize(("window", "softcap", "alibi", "causal"), CASES)
def test_decode_with_score_options_matches_the_reference(
    srv: ServerHandle, window: tuple[int, int], softcap: float, alibi: str | None, causal: bool
) -> None:
    len_k = [9, 0, 30, 1]
    cu_k = cu_from_lengths(len_k)
    q, k, v = random_qkv(len(len_k), cu_k[-1], HEADS, KV_HEADS, DIM, torch.float32, seed=5)
    slopes = {None: None, "heads": torch.rand(HEADS),
              "batch": torch.rand(len(len_k), HEADS)}[alibi]
    msgs = _with_score(decode_messages(q, k, v, cu_k, return_lse=True), window=window,
                       softcap=softcap, slopes=slopes)
    r = collect(srv.stub().Decode(iter(msgs), timeout=30))
    want, want_lse = decode_oracle(q, k, v, cu_k, **_kw(window, softcap, slopes))
    _close(r.out, want, torch.float32)
    torch.testing.assert_close(r.tensors[pb.LSE].double(), want_lse.double(), atol=1e-4,
                               rtol=1e-4)


def test_cached_calls_take_score_options(srv: ServerHandle) -> None:
    # A window over a cached prefix: positions count the cached keys (bottom-right aligned).
    stub = srv.stub()
    ids, lens = ["w0", "w1"], [11, 6]
    stub.CreateCaches(pb.CreateCachesRequest(cache_ids=ids,
                                             layout=layout(torch.float32, KV_HEADS, DIM)),
                      timeout=10)
    _, k0, v0 = random_qkv(0, sum(lens), HEADS, KV_HEADS, DIM, torch.float32, seed=7)
    collect(stub.AppendKV(append_messages(ids, k0, v0, lens), timeout=30))
    slopes = torch.rand(2, HEADS)
    # CachePrefill of 3 + 2 new tokens, window (4, 0), ALiBi, softcap; new tokens not stored.
    q, k, v = random_qkv(5, 5, HEADS, KV_HEADS, DIM, torch.float32, seed=8)
    msgs = _with_score(cache_prefill_messages(ids, q, k, v, [3, 2], [3, 2], store=False),
                       window=(4, 0), softcap=1.5, slopes=slopes)
    r = collect(stub.CachePrefill(iter(msgs), timeout=30))
    kk = torch.cat([k0[:11], k[:3], k0[11:], k[3:]])
    vv = torch.cat([v0[:11], v[:3], v0[11:], v[3:]])
    want, _ = prefill_oracle(q, kk, vv, [0, 3, 5], [0, 14, 22], causal=True,
                             **_kw((4, 0), 1.5, slopes))
    _close(r.out, want, torch.float32)
    # CacheDecode with one new token each, window (5, -1), per-head ALiBi, stored.
    q, k, v = random_qkv(2, 2, HEADS, KV_HEADS, DIM, torch.float32, seed=9)
    msgs = _with_score(cache_decode_messages(ids, q, k, v), window=(5, -1),
                       slopes=slopes[0])
    r = collect(stub.CacheDecode(iter(msgs), timeout=30))
    kk = torch.cat([k0[:11], k[:1], k0[11:], k[1:]])
    vv = torch.cat([v0[:11], v[:1], v0[11:], v[1:]])
    want, _ = decode_oracle(q, kk, vv, [0, 12, 19], **_kw((5, -1), 0.0, slopes[0]))
    _close(r.out, want, torch.float32)
    assert list(r.stats.cache_lengths) == [12, 7]


def test_calls_with_different_options_batch_apart_or_together_correctly(
    start_server: Any,
) -> None:
    # Concurrent calls on a batching server with a long window: same-window ALiBi calls may
    # share a launch (slopes per sequence), other windows may not; each answer is its own.
    srv = start_server(max_queue_delay_ms=50)
    jobs = []
    for i in range(12):
        window = [(-1, -1), (3, 0), (3, 0)][i % 3]
        slopes = torch.rand(HEADS, generator=torch.Generator().manual_seed(i)) if i % 2 else None
        len_q = [3 + i % 4, 6]
        cu = cu_from_lengths(len_q)
        q, k, v = random_qkv(cu[-1], cu[-1], HEADS, KV_HEADS, DIM, torch.float32, seed=20 + i)
        jobs.append((q, k, v, cu, window, slopes))

    def run(job: Any) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, cu, window, slopes = job
        msgs = _with_score(prefill_messages(q, k, v, cu, causal=True), window=window,
                           slopes=slopes)
        got = collect(srv.stub().Prefill(iter(msgs), timeout=30)).out
        want, _ = prefill_oracle(q, k, v, cu, causal=True, **_kw(window, 0.0, slopes))
        return got, want

    with ThreadPoolExecutor(12) as pool:
        for got, want in pool.map(run, jobs):
            _close(got, want, torch.float32)


@pytest.mark.parametrize(("field", "set_it", "needle"), [
    ("header.score.window_left", lambda s: setattr(s, "window_left", -2), "must be >= -1"),
    ("header.score.window_right", lambda s: setattr(s, "window_right", -7), "must be >= -1"),
    ("header.score.softcap", lambda s: setattr(s, "softcap", -1.0), "finite and >= 0"),
    ("header.score.softcap", lambda s: setattr(s, "softcap", float("inf")), "finite"),
    ("header.score.alibi_slopes", lambda s: s.alibi_slopes.extend([0.5] * 3), "3 slopes"),
    ("header.score.alibi_slopes[1]",
     lambda s: s.alibi_slopes.extend([0.5, float("nan"), 0.5, 0.5]), "finite"),
])
def test_bad_options_are_invalid_argument_naming_the_field(
    srv: ServerHandle, field: str, set_it: Any, needle: str
) -> None:
    q, k, v = random_qkv(6, 6, HEADS, KV_HEADS, DIM, torch.float32)
    msgs = list(prefill_messages(q, k, v, [0, 6]))
    set_it(msgs[0].header.score)
    with pytest.raises(grpc.RpcError) as info:
        list(srv.stub().Prefill(iter(msgs), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field + ": ") and needle in info.value.details()


def test_append_kv_refuses_score_options(srv: ServerHandle) -> None:
    stub = srv.stub()
    stub.CreateCaches(pb.CreateCachesRequest(cache_ids=["a0"],
                                             layout=layout(torch.float32, KV_HEADS, DIM)),
                      timeout=10)
    _, k, v = random_qkv(0, 3, HEADS, KV_HEADS, DIM, torch.float32)
    msgs = _with_score(append_messages(["a0"], k, v, [3]), softcap=2.0)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.AppendKV(iter(msgs), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("header.score: ")
