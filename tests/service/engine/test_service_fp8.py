"""FP8 (e4m3) keys and values through the server (cpu backend): stateless Prefill / Decode with
per-kv-head scales in the header, FP8 KV caches (quantized on append, or sent quantized), the
batching rule (one launch, one set of scales) and every refusal naming its field.

The oracle is float64 attention over the dequantized keys and values, so the tolerance is the
queries' dtype's: FP8 changes what is attended to, not how exactly it is computed.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch

from attention_kernels import dequantize_kv, quantize_kv
from attention_service.params import Op
from attention_wire.pb import attention_pb2 as pb

from ..batch_helpers import Req, StepBackend, start_all
from ..kv_helpers import append_messages, cache_decode_messages, cache_prefill_messages
from ..svc_helpers import (
    TOLERANCE,
    Response,
    collect,
    cu_from_lengths,
    decode_messages,
    decode_oracle,
    prefill_messages,
    prefill_oracle,
    random_qkv,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)
FP8 = torch.float8_e4m3fn


def _spread(k: torch.Tensor, spread: float) -> torch.Tensor:
    """kv head h scaled by spread**h: magnitudes that one scale for all heads would get
    wrong."""
    mult = spread ** torch.arange(k.shape[1], dtype=torch.float32)
    return (k.float() * mult[None, :, None]).to(k.dtype)


def _fp8_kv(k: torch.Tensor, v: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """k/v quantized with their own per-head scales."""
    k8, ks = quantize_kv(k)
    v8, vs = quantize_kv(v)
    return k8, v8, ks, vs


def _scales(ks: torch.Tensor, vs: torch.Tensor) -> pb.KvScales:
    return pb.KvScales(k=ks.tolist(), v=vs.tolist())


def _with_scales(msgs: list[Any], ks: torch.Tensor | None, vs: torch.Tensor | None) -> list[Any]:
    if ks is not None and vs is not None:
        msgs[0].header.kv_scales.CopyFrom(_scales(ks, vs))
    return msgs


def _deq(x8: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return dequantize_kv(x8, s, torch.float64)


def fp8_prefill_req(seed: int, lengths: list[int], k_lengths: list[int] | None = None, *,
                    dtype: torch.dtype = torch.bfloat16, heads: int = 4, kv_heads: int = 2,
                    dim: int = 40, causal: bool = True, lse: bool = False,
                    scale_of: tuple[torch.Tensor, torch.Tensor] | None = None) -> Req:
    """A Prefill with FP8 k/v (its own scales, or ``scale_of``) and its float64 answer."""
    cu_q = cu_from_lengths(lengths)
    cu_k = cu_from_lengths(k_lengths) if k_lengths is not None else None
    q, k, v = random_qkv(cu_q[-1], (cu_k or cu_q)[-1], heads, kv_heads, dim, dtype, seed=seed)
    if scale_of is None:
        k8, v8, ks, vs = _fp8_kv(_spread(k, 10.0), v)
    else:
        ks, vs = scale_of
        k8, v8 = quantize_kv(k, ks)[0], quantize_kv(v, vs)[0]
    out, lse_ref = prefill_oracle(q, _deq(k8, ks), _deq(v8, vs), cu_q, cu_k, causal=causal)
    msgs = _with_scales(list(prefill_messages(q, k8, v8, cu_q, cu_k, causal=causal,
                                              return_lse=lse)), ks, vs)
    return Req("Prefill", msgs, out, lse_ref if lse else None, dtype, cu_q[-1])


def fp8_decode_req(seed: int, k_lengths: list[int], *, dtype: torch.dtype = torch.float16,
                   heads: int = 8, kv_heads: int = 2, dim: int = 64, lse: bool = True,
                   num_splits: int = 0) -> Req:
    cu_k = cu_from_lengths(k_lengths)
    q, k, v = random_qkv(len(k_lengths), cu_k[-1], heads, kv_heads, dim, dtype, seed=seed)
    k8, v8, ks, vs = _fp8_kv(_spread(k, 100.0), v)
    out, lse_ref = decode_oracle(q, _deq(k8, ks), _deq(v8, vs), cu_k)
    msgs = _with_scales(list(decode_messages(q, k8, v8, cu_k, num_splits=num_splits,
                                             return_lse=lse)), ks, vs)
    return Req("Decode", msgs, out, lse_ref if lse else None, dtype, cu_k[-1])


def _no_nan(resp: Response) -> None:
    assert not resp.out.isnan().any()
    if resp.lse is not None:
        assert not resp.lse.isnan().any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("lengths", "k_lengths", "causal"), [
    ([37], None, True),
    ([1, 0, 19, 64], [1, 5, 19, 70], True),  # empty query, q shorter than k
    ([7, 33], [0, 41], False),  # a sequence without keys
])
def test_fp8_prefill_matches_float64_on_dequantized_kv(server, dtype, lengths, k_lengths,
                                                       causal) -> None:  # type: ignore[no-untyped-def]
    req = fp8_prefill_req(3, lengths, k_lengths, dtype=dtype, causal=causal, lse=True)
    resp = collect(server.stub().Prefill(iter(req.messages), timeout=30))
    _no_nan(resp)
    req.check(resp)
    # Keys and values travel at one byte per element (q: 4 heads x 40 x 2 bytes a token).
    total_k = sum(k_lengths or lengths)
    assert resp.stats.bytes_in == sum(lengths) * 4 * 40 * 2 + 2 * total_k * 2 * 40


@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_fp8_decode_matches_float64_on_dequantized_kv(server, num_splits) -> None:  # type: ignore[no-untyped-def]
    """GQA 4:1, kv heads whose magnitudes differ 100x, lengths 0, 1 and off the block."""
    req = fp8_decode_req(5, [0, 1, 77, 300], num_splits=num_splits)
    resp = collect(server.stub().Decode(iter(req.messages), timeout=30))
    _no_nan(resp)
    req.check(resp)


def test_fp8_is_close_to_the_unquantized_answer(server) -> None:  # type: ignore[no-untyped-def]
    """What the scales are for: FP8 k/v give nearly the bf16 answer (documented: 0.06 in
    relative norm)."""
    cu = cu_from_lengths([50, 90])
    q, k, v = random_qkv(cu[-1], cu[-1], 4, 2, 64, torch.bfloat16, seed=9)
    k8, v8, ks, vs = _fp8_kv(k, v)  # unit-variance logits (sharper ones amplify FP8's error)
    msgs = _with_scales(list(prefill_messages(q, k8, v8, cu, causal=True)), ks, vs)
    got = collect(server.stub().Prefill(iter(msgs), timeout=30)).out
    exact, _ = prefill_oracle(q, k, v, cu, causal=True)
    # Relative-norm error, as attention_kernels documents FP8's (tests/kernels/test_fp8.py).
    err = ((got.double() - exact).norm() / exact.norm()).item()
    assert err < 0.06, err


def _code(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        collect(call)
    return err.value.code(), err.value.details()


def _prefill_msgs(q_dtype: torch.dtype = torch.bfloat16, k_dtype: Any = FP8,
                  v_dtype: Any = FP8, scales: pb.KvScales | None = None,
                  kv_heads: int = 2) -> list[pb.PrefillRequest]:
    q, k, v = random_qkv(6, 6, 4, kv_heads, 16, torch.float32, seed=1)
    q, k, v = q.to(q_dtype), k.to(k_dtype), v.to(v_dtype)
    msgs = list(prefill_messages(q, k, v, [0, 6]))
    if scales is not None:
        msgs[0].header.kv_scales.CopyFrom(scales)
    return msgs


GOOD = pb.KvScales(k=[0.1, 0.2], v=[0.3, 0.4])


@pytest.mark.parametrize(("msgs", "field", "words"), [
    (_prefill_msgs(), "header.kv_scales", "missing"),
    (_prefill_msgs(scales=pb.KvScales(k=[0.1], v=[0.3, 0.4])), "header.kv_scales.k",
     "1 scales for 2 kv heads"),
    (_prefill_msgs(scales=pb.KvScales(k=[0.1, 0.2], v=[0.3, 0.0])), "header.kv_scales.v[1]",
     "finite and > 0"),
    (_prefill_msgs(scales=pb.KvScales(k=[float("nan"), 0.2], v=[0.3, 0.4])),
     "header.kv_scales.k[0]", "finite"),
    (_prefill_msgs(scales=pb.KvScales(k=[float("inf"), 0.2], v=[0.3, 0.4])),
     "header.kv_scales.k[0]", "finite"),
    (_prefill_msgs(k_dtype=torch.bfloat16, v_dtype=torch.bfloat16, scales=GOOD),
     "header.kv_scales", "scales are for FLOAT8_E4M3"),
    (_prefill_msgs(q_dtype=torch.float32, scales=GOOD), "header.k.dtype",
     "need FLOAT16 or BFLOAT16 queries"),
    (_prefill_msgs(q_dtype=FP8, scales=GOOD), "header.kv_scales.q", "0 scales for 2 kv heads"),
    (_prefill_msgs(q_dtype=FP8, k_dtype=torch.bfloat16, v_dtype=torch.bfloat16),
     "header.k.dtype", "FLOAT8_E4M3 queries need FLOAT8_E4M3 keys and values"),
    (_prefill_msgs(scales=pb.KvScales(k=[0.1, 0.2], v=[0.3, 0.4], q=[1.0, 1.0])),
     "header.kv_scales.q", "the queries are not FLOAT8_E4M3"),
    (_prefill_msgs(q_dtype=FP8, scales=pb.KvScales(k=[0.1, 0.2], v=[0.3, 0.4], q=[0.0, 1.0])),
     "header.kv_scales.q[0]", "finite and > 0"),
    (_prefill_msgs(q_dtype=FP8, scales=pb.KvScales(k=[1e30, 0.2], v=[0.3, 0.4], q=[1e30, 1])),
     "header.kv_scales.q[0]", "leaves float32's range"),
    (_prefill_msgs(v_dtype=torch.bfloat16, scales=GOOD), "header.v.dtype",
     "differs from k's dtype"),
    (_prefill_msgs(q_dtype=torch.float16, k_dtype=torch.bfloat16, v_dtype=torch.bfloat16),
     "header.k.dtype", "use q's dtype"),
])
def test_fp8_refusals_name_the_field(server, msgs, field, words) -> None:  # type: ignore[no-untyped-def]
    code, details = _code(server.stub().Prefill(iter(msgs), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(field + ":") and words in details, details


def test_fp8_decode_refusal_and_info(server) -> None:  # type: ignore[no-untyped-def]
    """FP8 k/v without scales, FP8 q without its own (a k and v scale alone), and FP8 q in a
    cached op (whose scales are its caches', with none for queries) are refused by name."""
    q, k, v = random_qkv(2, 9, 4, 2, 16, torch.float16, seed=2)
    msgs = list(decode_messages(q, k.to(FP8), v.to(FP8), [0, 4, 9]))
    code, details = _code(server.stub().Decode(iter(msgs), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("header.kv_scales:")
    msgs = _with_scales(list(decode_messages(q.to(FP8), k.to(FP8), v.to(FP8), [0, 4, 9])),
                        torch.ones(2), torch.ones(2))
    code, details = _code(server.stub().Decode(iter(msgs), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("header.kv_scales.q:"), details
    msgs = list(cache_decode_messages(["c"], q.to(FP8), k[:2].to(FP8), v[:2].to(FP8)))
    code, details = _code(server.stub().CacheDecode(iter(msgs), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("header.q.dtype:") and "Prefill and Decode only" in details
    info = server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert pb.FLOAT8_E4M3 in info.dtypes


def fp8q_decode_req(seed: int, k_lengths: list[int], *, per_seq: bool = False,
                    heads: int = 8, kv_heads: int = 2, dim: int = 40) -> Req:
    """A Decode of FP8 q, k and v (the query scales in KvScales.q: per kv head, or with
    ``per_seq`` a row per sequence, each sequence's query 10x the next's) and its float64
    answer on the dequantized inputs, in BFLOAT16."""
    from attention_kernels.fp8 import dequantize_queries, quantize_queries

    batch, cu = len(k_lengths), cu_from_lengths(k_lengths)
    q, k, v = random_qkv(batch, cu[-1], heads, kv_heads, dim, torch.float32, seed=seed)
    k8, v8, ks, vs = _fp8_kv(_spread(k, 10.0), v)
    one_each = None  # dequantize_queries' rows: one query per sequence
    if per_seq:
        q = q * torch.tensor([10.0 ** -b for b in range(batch)])[:, None, None]
        rows = [quantize_queries(q[b : b + 1], kv_heads) for b in range(batch)]
        q8, qs = torch.cat([r for r, _ in rows]), torch.stack([s for _, s in rows])
        one_each = torch.arange(batch + 1)
    else:
        q8, qs = quantize_queries(q * 3, kv_heads)
    out, lse_ref = decode_oracle(dequantize_queries(q8, qs, kv_heads, torch.float64, one_each),
                                 _deq(k8, ks), _deq(v8, vs), cu)
    msgs = list(decode_messages(q8, k8, v8, cu, return_lse=True))
    rows_of = (lambda x: x.expand(batch, kv_heads)) if per_seq else (lambda x: x)
    msgs[0].header.kv_scales.CopyFrom(pb.KvScales(k=rows_of(ks).flatten().tolist(),
                                                  v=rows_of(vs).flatten().tolist(),
                                                  q=qs.flatten().tolist()))
    return Req("Decode", msgs, out, lse_ref, torch.bfloat16, cu[-1])


@pytest.mark.parametrize("per_seq", [False, True], ids=["per-head", "per-sequence"])
def test_fp8_queries_decode_matches_float64_and_answers_bf16(server, per_seq) -> None:  # type: ignore[no-untyped-def]
    """FP8 q, k and v in a Decode: a BFLOAT16 output like float64 on the dequantized inputs,
    lse too; q travels at one byte per element."""
    req = fp8q_decode_req(31, [1, 0, 19, 37], per_seq=per_seq)
    resp = collect(server.stub().Decode(iter(req.messages), timeout=30))
    _no_nan(resp)
    req.check(resp)
    assert resp.out.dtype == torch.bfloat16
    assert resp.stats.bytes_in == 4 * 8 * 40 + 2 * 57 * 2 * 40


def fp8q_prefill_req(seed: int, lengths: list[int], *, heads: int = 4, kv_heads: int = 2,
                     dim: int = 40, causal: bool = True, lse: bool = True) -> Req:
    """A Prefill of FP8 q, k and v (the query scales in KvScales.q, per kv head) and its
    float64 answer on the dequantized inputs, in BFLOAT16."""
    from attention_kernels.fp8 import dequantize_queries, quantize_queries

    cu = cu_from_lengths(lengths)
    q, k, v = random_qkv(cu[-1], cu[-1], heads, kv_heads, dim, torch.float32, seed=seed)
    q8, qs = quantize_queries(q * 3, kv_heads)
    k8, v8, ks, vs = _fp8_kv(_spread(k, 10.0), v)
    out, lse_ref = prefill_oracle(dequantize_queries(q8, qs, kv_heads, torch.float64),
                                  _deq(k8, ks), _deq(v8, vs), cu, causal=causal)
    msgs = list(prefill_messages(q8, k8, v8, cu, causal=causal, return_lse=lse))
    msgs[0].header.kv_scales.CopyFrom(pb.KvScales(k=ks.tolist(), v=vs.tolist(), q=qs.tolist()))
    return Req("Prefill", msgs, out, lse_ref if lse else None, torch.bfloat16, cu[-1])


def test_fp8_queries_prefill_matches_float64_and_answers_bf16(server) -> None:  # type: ignore[no-untyped-def]
    """FP8 q, k and v: a BFLOAT16 output like float64 on the dequantized inputs, lse too; q
    travels at one byte per element."""
    lengths = [1, 0, 19, 64]
    req = fp8q_prefill_req(13, lengths)
    resp = collect(server.stub().Prefill(iter(req.messages), timeout=30))
    _no_nan(resp)
    req.check(resp)
    assert resp.out.dtype == torch.bfloat16
    assert resp.stats.bytes_in == 84 * 4 * 40 + 2 * 84 * 2 * 40


def _quantized_per_sequence(x: torch.Tensor, cu: list[int], spread: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` with sequence i scaled by spread**i, quantized with a row of scales per sequence
    (``[batch, H_kv]``): magnitudes one row for all sequences would get wrong."""
    parts, rows = [], []
    for i, (a, b) in enumerate(zip(cu, cu[1:], strict=False)):
        x8, s = quantize_kv(x[a:b].float() * spread ** i)
        parts.append(x8)
        rows.append(s)
    return torch.cat(parts), torch.stack(rows)


def fp8_per_sequence_prefill(stub, fp8_queries: bool, cu: list[int], heads: int, kv_heads: int,
                             dim: int, seed: int = 21
                             ) -> tuple[Any, torch.Tensor, list[Any], torch.Tensor]:
    """A causal FP8 Prefill whose KvScales carry a row per sequence (FlashAttention-3's
    [batch, H_kv] descales; the queries' too with ``fp8_queries``), keys 30x larger per
    sequence, values under one shared row: (the response, the float64 answer, the messages,
    the float64 LSE). Checked here: the answer after the first sequence is measurably not what
    one shared row for the keys would give (30x, 900x larger keys)."""
    from attention_kernels.fp8 import dequantize_queries, quantize_queries

    n = cu[-1]
    q, k, v = random_qkv(n, n, heads, kv_heads, dim, torch.float32, seed=seed)
    k8, ks = _quantized_per_sequence(k, cu, 30.0)
    v8, vs = quantize_kv(v)  # one row for every sequence
    cu_t = torch.tensor(cu)
    kd = dequantize_kv(k8, ks, torch.float64, cu_t)
    scales = pb.KvScales(k=ks.flatten().tolist(), v=vs.tolist())
    if fp8_queries:
        q8, qs = zip(*(quantize_queries(q[a:b] * 4 ** i, kv_heads)
                       for i, (a, b) in enumerate(zip(cu, cu[1:], strict=False))), strict=True)
        q_in, qs = torch.cat(q8), torch.stack(qs)
        qd = dequantize_queries(q_in, qs, kv_heads, torch.float64, cu_t)
        scales.q.extend(qs.flatten().tolist())
    else:
        q_in = q.to(torch.bfloat16)
        qd = q_in.double()
    out, lse_ref = prefill_oracle(qd, kd, _deq(v8, vs), cu, causal=True)
    msgs = list(prefill_messages(q_in, k8, v8, cu, causal=True, return_lse=True))
    msgs[0].header.kv_scales.CopyFrom(scales)
    resp = collect(stub.Prefill(iter(msgs), timeout=120))
    _no_nan(resp)
    wrong = prefill_oracle(qd, _deq(k8, ks[0]), _deq(v8, vs), cu, causal=True)[0]
    assert (resp.out.double()[cu[1]:] - wrong[cu[1]:]).abs().max() > 0.05
    return resp, out, msgs, lse_ref


@pytest.mark.parametrize("fp8_queries", [False, True])
def test_fp8_prefill_takes_a_row_of_scales_per_sequence(server, fp8_queries) -> None:  # type: ignore[no-untyped-def]
    """FlashAttention-3's [batch, H_kv] descales: KvScales with a row per sequence (queries'
    too), each sequence's keys and values dequantized with its own row; rows and one shared
    set mix (k per sequence, v shared)."""
    cu = [0, 5, 22, 31]
    # It checks that one shared row for the keys gets the later sequences wrong.
    resp, out, msgs, lse_ref = fp8_per_sequence_prefill(server.stub(), fp8_queries, cu, 4, 2,
                                                        40)
    Req("Prefill", msgs, out, lse_ref, torch.bfloat16, 31).check(resp)


def test_fp8_decode_takes_a_row_of_scales_per_sequence(server) -> None:  # type: ignore[no-untyped-def]
    cu = [0, 4, 13, 20]
    q, k, v = random_qkv(3, 20, 8, 2, 64, torch.float16, seed=22)
    k8, ks = _quantized_per_sequence(k, cu, 50.0)
    v8, vs = _quantized_per_sequence(v, cu, 0.1)
    cu_t = torch.tensor(cu)
    out, lse_ref = decode_oracle(q, dequantize_kv(k8, ks, torch.float64, cu_t),
                                 dequantize_kv(v8, vs, torch.float64, cu_t), cu)
    msgs = list(decode_messages(q, k8, v8, cu, return_lse=True))
    msgs[0].header.kv_scales.CopyFrom(pb.KvScales(k=ks.flatten().tolist(),
                                                  v=vs.flatten().tolist()))
    resp = collect(server.stub().Decode(iter(msgs), timeout=30))
    _no_nan(resp)
    Req("Decode", msgs, out, lse_ref, torch.float16, 20).check(resp)


def test_a_row_count_that_is_neither_is_refused_naming_both_forms(server) -> None:  # type: ignore[no-untyped-def]
    q, k, v = random_qkv(3, 20, 8, 2, 64, torch.float16, seed=23)
    msgs = list(decode_messages(q, k.to(FP8), v.to(FP8), [0, 4, 13, 20]))
    msgs[0].header.kv_scales.CopyFrom(pb.KvScales(k=[1.0] * 4, v=[1.0] * 6))
    code, details = _code(server.stub().Decode(iter(msgs), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("header.kv_scales.k:") and "3 x 2 (a row per sequence)" in details


# ---- batching -------------------------------------------------------------------------------


def test_fp8_requests_of_any_scales_share_a_launch(start_server) -> None:  # type: ignore[no-untyped-def]
    """Scales are per sequence in the launch: FP8 requests with their own scales merge (and
    each gets its own answer); FP8 and 16-bit k/v do not."""
    backend = StepBackend()
    srv = start_server(backend=backend, batching=True, warmup=False)
    shared = (torch.tensor([0.02, 0.5]), torch.tensor([0.01, 0.03]))
    reqs = [fp8_prefill_req(i, [3 + i, 5], scale_of=shared) for i in range(3)]
    reqs += [fp8_prefill_req(10 + i, [4, 2 + i]) for i in range(2)]  # scales of their own
    reqs += [fp8_prefill_req(20, [6])]
    plain = Req("Prefill", *_plain_prefill(21, [4, 3]))  # same shapes, bf16 k/v: its own key
    blocker = fp8_prefill_req(99, [2])
    with ThreadPoolExecutor(len(reqs) + 2) as pool:
        first = start_all(pool, srv, [blocker])[0]
        assert backend.wait_launches(1)
        futures = start_all(pool, srv, [*reqs, plain])
        assert wait_until(lambda: srv.server.executor.queue_depth(Op.PREFILL) == len(reqs) + 1)
        backend.open_all()
        responses = [f.result(30) for f in futures]
        first.result(30)
    for req, resp in zip([*reqs, plain], responses, strict=True):
        _no_nan(resp)
        req.check(resp)
    assert [r.stats.batch_requests for r in responses] == [6] * 6 + [1]
    assert sorted(backend.batch_sizes()[1:]) == [1, 6]


# ---- FP8 caches -----------------------------------------------------------------------------


def _plain_prefill(seed: int, lengths: list[int]) -> tuple[Any, ...]:
    """A bf16 Prefill (16-bit k/v) of fp8_prefill_req's shapes: (messages, out, lse, dtype,
    tokens) for a Req."""
    cu = cu_from_lengths(lengths)
    q, k, v = random_qkv(cu[-1], cu[-1], 4, 2, 40, torch.bfloat16, seed=seed)
    out, _ = prefill_oracle(q, k, v, cu, causal=True)
    return list(prefill_messages(q, k, v, cu, causal=True)), out, None, torch.bfloat16, cu[-1]


def _fp8_layout(kv_heads: int, dim: int, ks: torch.Tensor, vs: torch.Tensor,
                dtype: int = pb.BFLOAT16) -> pb.CacheLayout:
    return pb.CacheLayout(dtype=dtype, num_kv_heads=kv_heads, head_dim=dim,
                          kv_dtype=pb.FLOAT8_E4M3, kv_scales=_scales(ks, vs))


def test_fp8_cache_quantizes_appends_and_decodes_like_stateless_fp8(server) -> None:  # type: ignore[no-untyped-def]
    """Tokens sent in bf16 (the server quantizes) and tokens sent already quantized are stored
    the same bytes; steps on them equal the stateless FP8 Decode bitwise and the float64 answer
    within bf16's tolerance; the pool holds them at one byte per element."""
    fp8_cache_session(server.stub(), "cpu", _max_err_within(TOLERANCE[torch.bfloat16]))


def _max_err_within(tol: float) -> Callable[[torch.Tensor, torch.Tensor], None]:
    def check(got: torch.Tensor, exact: torch.Tensor) -> None:
        torch.testing.assert_close(got.double(), exact, atol=tol, rtol=tol)
    return check


def fp8_cache_session(stub: Any, prefix: str, close: Callable[[torch.Tensor, torch.Tensor], None],
                      stateless_bitwise: bool = True) -> None:
    """The FP8-cache scenario, on any backend: ``close(got, float64)`` judges the outputs;
    ``stateless_bitwise``: cache steps equal the stateless FP8 Decode bit for bit (the cpu
    backend's one code path; on the GPU paged and contiguous kernels differ in rounding)."""
    heads, kv_heads, dim, lens = 4, 2, 32, [45, 3, 0]
    _, k, v = random_qkv(1, sum(lens), heads, kv_heads, dim, torch.bfloat16, seed=11)
    ks = quantize_kv(k)[1] * 1.5  # headroom: later tokens may be larger than the prompt's
    vs = quantize_kv(v)[1] * 1.5
    ids_a = [f"{prefix}a{i}" for i in range(3)]
    ids_b = [f"{prefix}b{i}" for i in range(3)]
    for ids in (ids_a, ids_b):
        stub.CreateCaches(pb.CreateCachesRequest(cache_ids=ids, layout=_fp8_layout(
            kv_heads, dim, ks, vs)), timeout=10)
    k8, v8 = quantize_kv(k, ks)[0], quantize_kv(v, vs)[0]
    collect(stub.AppendKV(append_messages(ids_a, k, v, lens), timeout=30))  # bf16 in
    collect(stub.AppendKV(append_messages(ids_b, k8, v8, lens), timeout=30))  # fp8 in
    keys, values = [k8], [v8]
    for step in range(3):
        q, kn, vn = random_qkv(3, 3, heads, kv_heads, dim, torch.bfloat16, seed=20 + step)
        kn8, vn8 = quantize_kv(kn, ks)[0], quantize_kv(vn, vs)[0]
        ra = collect(stub.CacheDecode(cache_decode_messages(ids_a, q, kn, vn), timeout=30))
        rb = collect(stub.CacheDecode(cache_decode_messages(ids_b, q, kn8, vn8), timeout=30))
        assert torch.equal(ra.out, rb.out) and torch.equal(ra.lse, rb.lse)
        assert not ra.out.isnan().any()
        # The caches' contents, packed per sequence, as a stateless FP8 Decode sees them.
        keys.append(kn8)
        values.append(vn8)
        cache_lens = [n + step + 1 for n in lens]
        pk, pv = _per_sequence(keys, lens), _per_sequence(values, lens)
        cu = cu_from_lengths(cache_lens)
        if stateless_bitwise:
            msgs = _with_scales(list(decode_messages(q, pk, pv, cu, return_lse=True)), ks, vs)
            assert torch.equal(ra.out, collect(stub.Decode(iter(msgs), timeout=30)).out)
        exact, _ = decode_oracle(q, _deq(pk, ks), _deq(pv, vs), cu)
        close(ra.out, exact)
        assert list(ra.stats.cache_lengths) == cache_lens
    listed = stub.ListCaches(pb.ListCachesRequest(cache_ids=ids_a), timeout=10)
    lay = listed.caches[0].layout
    assert lay.kv_dtype == pb.FLOAT8_E4M3 and list(lay.kv_scales.k) == pytest.approx(ks.tolist())
    # One byte per element: a page holds twice the tokens of a bf16 layout.
    page_tokens = listed.pool.page_bytes // (2 * kv_heads * dim)
    assert listed.caches[0].pages == -(-(lens[0] + 3) // page_tokens)
    stub.ReleaseCaches(pb.ReleaseCachesRequest(cache_ids=ids_a + ids_b), timeout=10)


def _per_sequence(parts: list[torch.Tensor], lens: list[int]) -> torch.Tensor:
    """The prompt (packed by ``lens``) then one token per sequence from each later part,
    regrouped per sequence."""
    prompt, steps = parts[0], parts[1:]
    out, at = [], 0
    for i, n in enumerate(lens):
        out.append(prompt[at : at + n])
        out += [s[i : i + 1] for s in steps]
        at += n
    return torch.cat(out)


def test_fp8_cache_prefill_and_fork(server) -> None:  # type: ignore[no-untyped-def]
    stub = server.stub()
    _, k, v = random_qkv(1, 20, 4, 2, 16, torch.float16, seed=4)
    k8, v8, ks, vs = _fp8_kv(k, v)
    stub.CreateCaches(pb.CreateCachesRequest(cache_ids=["p"], layout=_fp8_layout(
        2, 16, ks, vs, pb.FLOAT16)), timeout=10)
    collect(stub.AppendKV(append_messages(["p"], k8[:12], v8[:12], [12]), timeout=30))
    fork = stub.ForkCache(pb.ForkCacheRequest(source_id="p", target_id="p2", length=7),
                          timeout=10)
    assert fork.layout.kv_dtype == pb.FLOAT8_E4M3 and fork.length == 7
    q, _, _ = random_qkv(8, 1, 4, 2, 16, torch.float16, seed=5)
    r = collect(stub.CachePrefill(cache_prefill_messages(["p"], q, k8[12:], v8[12:], [8], [8]),
                                  timeout=30))
    exact, lse = prefill_oracle(q, _deq(k8, ks), _deq(v8, vs), [0, 8], [0, 20], causal=True)
    tol = TOLERANCE[torch.float16]
    torch.testing.assert_close(r.out.double(), exact, atol=tol, rtol=tol)
    assert list(r.stats.cache_lengths) == [20]
    rf = collect(stub.CachePrefill(cache_prefill_messages(["p2"], q[:1], k8[:0], v8[:0], [1],
                                                          [0]), timeout=30))
    exact_f, _ = prefill_oracle(q[:1], _deq(k8[:7], ks), _deq(v8[:7], vs), [0, 1], [0, 7],
                                causal=True)
    torch.testing.assert_close(rf.out.double(), exact_f, atol=tol, rtol=tol)
    stub.ReleaseCaches(pb.ReleaseCachesRequest(cache_ids=["p", "p2"]), timeout=10)


def _create_code(stub: Any, lay: pb.CacheLayout) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        stub.CreateCaches(pb.CreateCachesRequest(cache_ids=["bad"], layout=lay), timeout=10)
    return err.value.code(), err.value.details()


@pytest.mark.parametrize(("lay", "field"), [
    (pb.CacheLayout(dtype=pb.BFLOAT16, num_kv_heads=2, head_dim=16, kv_dtype=pb.FLOAT8_E4M3),
     "layout.kv_scales"),
    (pb.CacheLayout(dtype=pb.BFLOAT16, num_kv_heads=2, head_dim=16, kv_dtype=pb.FLOAT8_E4M3,
                    kv_scales=pb.KvScales(k=[1.0], v=[1.0, 1.0])), "layout.kv_scales.k"),
    (pb.CacheLayout(dtype=pb.BFLOAT16, num_kv_heads=2, head_dim=16, kv_dtype=pb.FLOAT8_E4M3,
                    kv_scales=pb.KvScales(k=[1.0, -1.0], v=[1.0, 1.0])), "layout.kv_scales.k[1]"),
    (pb.CacheLayout(dtype=pb.FLOAT32, num_kv_heads=2, head_dim=16, kv_dtype=pb.FLOAT8_E4M3,
                    kv_scales=GOOD), "layout.kv_dtype"),
    (pb.CacheLayout(dtype=pb.BFLOAT16, num_kv_heads=2, head_dim=16, kv_dtype=pb.FLOAT16),
     "layout.kv_dtype"),
    (pb.CacheLayout(dtype=pb.BFLOAT16, num_kv_heads=2, head_dim=16, kv_scales=GOOD),
     "layout.kv_scales"),
    (pb.CacheLayout(dtype=pb.FLOAT8_E4M3, num_kv_heads=2, head_dim=16), "layout.dtype"),
])
def test_fp8_cache_layout_refusals(server, lay, field) -> None:  # type: ignore[no-untyped-def]
    code, details = _create_code(server.stub(), lay)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field + ":"), details


def test_fp8_cache_request_refusals(server) -> None:  # type: ignore[no-untyped-def]
    """FP8 tokens for a bf16 cache, scales in a cached header, and one request over an FP8
    and a bf16 cache: refused naming the field, nothing stored."""
    stub = server.stub()
    ks, vs = torch.tensor([0.1, 0.2]), torch.tensor([0.3, 0.4])
    stub.CreateCaches(pb.CreateCachesRequest(cache_ids=["r8"], layout=_fp8_layout(2, 16, ks, vs)),
                      timeout=10)
    stub.CreateCaches(pb.CreateCachesRequest(cache_ids=["r8b"], layout=_fp8_layout(
        2, 16, ks * 2, vs)), timeout=10)
    stub.CreateCaches(pb.CreateCachesRequest(cache_ids=["r16"], layout=pb.CacheLayout(
        dtype=pb.BFLOAT16, num_kv_heads=2, head_dim=16)), timeout=10)
    q, k, v = random_qkv(2, 2, 4, 2, 16, torch.bfloat16, seed=6)
    cases = [
        (["r16"], q[:1], k[:1].to(FP8), v[:1].to(FP8), None, "header.k.dtype"),
        (["r8"], q[:1], k[:1].to(FP8), v[:1].to(FP8), GOOD, "header.kv_scales"),
        (["r8", "r16"], q, k, v, None, "header.cache.cache_ids[1]"),
    ]
    for ids, qq, kk, vv, scales, field in cases:
        msgs = list(cache_decode_messages(ids, qq, kk, vv))
        if scales is not None:
            msgs[0].header.kv_scales.CopyFrom(scales)
        code, details = _code(stub.CacheDecode(iter(msgs), timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.startswith(field + ":"), details
    listed = stub.ListCaches(pb.ListCachesRequest(cache_ids=["r8", "r8b", "r16"]), timeout=10)
    assert [c.length for c in listed.caches] == [0, 0, 0]
    stub.ReleaseCaches(pb.ReleaseCachesRequest(cache_ids=["r8", "r8b", "r16"]), timeout=10)


def test_one_request_over_fp8_caches_of_different_scales(server) -> None:  # type: ignore[no-untyped-def]
    """Each cache's tokens are quantized and read with its own scales: the step equals, per
    sequence and bit for bit, a stateless FP8 Decode of that sequence alone."""
    fp8_mixed_scales_case(server.stub(), "cpu", _max_err_within(TOLERANCE[torch.bfloat16]))


def fp8_mixed_scales_case(stub: Any, prefix: str,
                          close: Callable[[torch.Tensor, torch.Tensor], None],
                          bitwise: bool = True) -> None:
    """Two FP8 caches of scales 40x apart, prompts appended in bf16 (quantized per cache, per
    row), one CacheDecode over both: each sequence within ``close`` of float64 on what its
    cache stores and (``bitwise``, one code path) equal to a stateless FP8 Decode alone."""
    _, k, v = random_qkv(1, 24, 4, 2, 16, torch.bfloat16, seed=12)
    scales = [(quantize_kv(k)[1] * f, quantize_kv(v)[1] * f) for f in (1.0, 40.0)]
    ids = [f"{prefix}d0", f"{prefix}d1"]
    for cid, (ks, vs) in zip(ids, scales, strict=True):
        stub.CreateCaches(pb.CreateCachesRequest(cache_ids=[cid], layout=_fp8_layout(
            2, 16, ks, vs)), timeout=10)
    collect(stub.AppendKV(append_messages(ids, k[:20], v[:20], [9, 11]), timeout=30))
    q, kn, vn = random_qkv(2, 2, 4, 2, 16, torch.bfloat16, seed=13)
    r = collect(stub.CacheDecode(cache_decode_messages(ids, q, kn, vn), timeout=30))
    _no_nan(r)
    rows = ((0, 9), (9, 20))
    for i, ((ks, vs), (a, b)) in enumerate(zip(scales, rows, strict=True)):
        kk = quantize_kv(torch.cat([k[a:b], kn[i : i + 1]]), ks)[0]
        vv = quantize_kv(torch.cat([v[a:b], vn[i : i + 1]]), vs)[0]
        exact, _ = decode_oracle(q[i : i + 1], _deq(kk, ks), _deq(vv, vs), [0, kk.shape[0]])
        close(r.out[i : i + 1], exact)
        if bitwise:
            msgs = _with_scales(list(decode_messages(q[i : i + 1], kk, vv, [0, kk.shape[0]],
                                                     return_lse=True)), ks, vs)
            alone = collect(stub.Decode(iter(msgs), timeout=30))
            assert torch.equal(r.out[i : i + 1], alone.out), i
    stub.ReleaseCaches(pb.ReleaseCachesRequest(cache_ids=ids), timeout=10)


def test_warmup_runs_the_fp8_variants() -> None:
    """The warm-up compiles FP8 beside bf16/fp16 (stateless and cached, alone and merged): on
    the cpu backend its plans run and give finite outputs."""
    from attention_service.engine.backends import CpuBackend
    from attention_service.engine.kv_caches import CacheRegistry
    from attention_service.engine.kv_pool import KvPool
    from attention_service.engine.warmup import tiny_plans, warm_caches

    backend = CpuBackend()
    plans = list(tiny_plans(backend, (torch.float32, torch.bfloat16)))
    assert sum(p.fp8 for p in plans) == 4 and len(plans) == 12
    for plan in plans:
        backend.launch(plan).wait()
        assert all(j.out.isfinite().all() for j in plan.jobs)

    launched = []

    class Recording(CpuBackend):
        def launch(self, plan):  # type: ignore[no-untyped-def]
            launched.append(plan)
            return super().launch(plan)

    caches = CacheRegistry(KvPool(torch.empty(8 * 4096, dtype=torch.uint8), 4096), ttl_seconds=0)
    warm_caches(Recording(), caches, (torch.float16,))
    assert sum(p.fp8 for p in launched) == 6 and len(launched) == 12
    assert caches.gauges()[:3] == (0, 8, 0)  # everything released
