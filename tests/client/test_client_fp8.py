"""FP8 (e4m3) keys and values through the clients: the codec (torch float8_e4m3fn, numpy
ml_dtypes.float8_e4m3fn), the scales in headers and cache layouts, client-side refusals, and
end to end against the real server (cpu backend) vs float64 on the dequantized keys/values."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from attention_client import AsyncAttentionClient, AttentionClient, AttentionInputError
from attention_client._decode import prepare_decode
from attention_client._layouts import KvLayout
from attention_client._prefill import prepare_prefill
from attention_client._requests import kv_scales_of
from attention_client._tensors import as_wire_dtype, to_wire
from attention_wire.pb import attention_pb2 as pb

from .test_client_e2e import check_out, f64

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")
attention_kernels = pytest.importorskip("attention_kernels")
FP8 = torch.float8_e4m3fn


def _qkv(total_q: int, total_k: int, heads: int = 4, kv_heads: int = 2, dim: int = 32,
         dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(total_q, heads, dim, generator=g).to(dtype)
    k = torch.randn(total_k, kv_heads, dim, generator=g)
    v = torch.randn(total_k, kv_heads, dim, generator=g)
    k = k * torch.tensor([0.1, 10.0][:kv_heads])[None, :, None]  # heads need their own scales
    k8, ks = attention_kernels.quantize_kv(k)
    v8, vs = attention_kernels.quantize_kv(v)
    return q, k8, v8, ks, vs


def _deq(x8, s):
    return attention_kernels.dequantize_kv(x8, s, torch.float64)


# ---- codec and request preparation ---------------------------------------------------------


def test_fp8_codec_torch_and_numpy():
    x = torch.randn(5, 2, 8).to(FP8)
    w = to_wire(x, "k")
    assert w.dtype == pb.FLOAT8_E4M3 and w.nbytes == 80
    assert bytes(w.byte_view()) == x.view(torch.uint8).numpy().tobytes()
    a = np.random.default_rng(0).standard_normal((3, 2, 8)).astype(ml_dtypes.float8_e4m3fn)
    w = to_wire(a, "v")
    assert w.dtype == pb.FLOAT8_E4M3 and bytes(w.byte_view()) == a.tobytes()
    for name in ("float8_e4m3fn", "fp8", "FLOAT8_E4M3", "torch.float8_e4m3fn"):
        assert as_wire_dtype(name) == pb.FLOAT8_E4M3
    assert as_wire_dtype(FP8) == pb.FLOAT8_E4M3


def test_fp8_headers_carry_the_scales():
    q, k8, v8, ks, vs = _qkv(6, 9)
    prep = prepare_prefill(q, k8, v8, kv_scales=kv_scales_of(ks, vs))
    h = pb.PrefillHeader.FromString(prep.header)
    assert h.k.dtype == h.v.dtype == pb.FLOAT8_E4M3 and h.q.dtype == pb.BFLOAT16
    assert list(h.kv_scales.k) == pytest.approx(ks.tolist())
    assert list(h.kv_scales.v) == pytest.approx(vs.tolist())
    assert prep.tensors[1].nbytes == 9 * 2 * 32  # one byte per element
    prep = prepare_decode(q[:2], k8, v8, [0, 4, 9], kv_scales=kv_scales_of(ks.numpy(),
                                                                             vs.tolist()))
    h = pb.DecodeHeader.FromString(prep.header)
    assert len(h.kv_scales.k) == 2 and h.k.dtype == pb.FLOAT8_E4M3
    # A row per sequence ([batch, H_kv], FlashAttention-3's descales): sent flattened.
    rows = torch.stack([ks, 2 * ks])
    prep = prepare_decode(q[:2], k8, v8, [0, 4, 9], kv_scales=kv_scales_of(rows, vs))
    h = pb.DecodeHeader.FromString(prep.header)
    assert list(h.kv_scales.k) == pytest.approx(rows.flatten().tolist())
    assert list(h.kv_scales.v) == pytest.approx(vs.tolist())
    # Rows are [batch, H_kv] exactly: not [3, 2] for 2 sequences, not transposed [H_kv, batch].
    for bad, shape in ((torch.stack([ks, ks, ks]), r"\[3, 2\]"),
                       (torch.stack([ks, ks, ks]).T, r"\[2, 3\]")):
        with pytest.raises(AttentionInputError, match=rf"k_scale has shape {shape}: give \[2\] "
                           r"\(one per kv head\) or \[2, 2\] \(a row per sequence\)"):
            prepare_decode(q[:2], k8, v8, [0, 4, 9], kv_scales=kv_scales_of(bad, vs))
    with pytest.raises(AttentionInputError, match=r"k_scale must be \[num_kv_heads\], got "
                       r"shape \(1, 2\)"):  # a cache is one sequence: one row, 1-D
        KvLayout.of(2, 64, "bfloat16", "float8_e4m3fn", ks[None, :], vs)


@pytest.mark.parametrize(("change", "words"), [
    ({"scales": None}, "need k_scale and v_scale"),
    ({"k": "bf16"}, "they are for float8_e4m3fn"),
    ({"q": FP8}, "float8_e4m3fn q needs q_scale"),
    ({"q": torch.float32}, "must share one dtype"),
    ({"v": "bf16"}, "must share one dtype"),
    ({"scales": ((0.1,), (0.2, 0.3))}, "k_scale has 1 entries for 2 kv heads"),
])
def test_fp8_client_refusals(change, words):
    q, k8, v8, ks, vs = _qkv(4, 4)
    scales = kv_scales_of(ks, vs)
    if "q" in change:
        q = q.float().to(change["q"])
    if change.get("k") == "bf16":
        k8, v8 = k8.to(torch.bfloat16), v8.to(torch.bfloat16)
    if change.get("v") == "bf16":
        v8 = v8.to(torch.bfloat16)
    if "scales" in change:
        scales = change["scales"]
    with pytest.raises(AttentionInputError, match=words):
        prepare_prefill(q, k8, v8, kv_scales=scales)


@pytest.mark.parametrize(("k_scale", "v_scale", "words"), [
    ([1.0], None, "v_scale is missing"),
    ([1.0, float("nan")], [1.0, 1.0], "finite and > 0"),
    ([[[1.0]]], [1.0], r"must be \[num_kv_heads\] or \[batch, num_kv_heads\]"),
    ([[]], [1.0], r"got shape \(1, 0\)"),
    (["x"], [1.0], "must hold floats"),
])
def test_fp8_scale_argument_checks(k_scale, v_scale, words):
    with pytest.raises(AttentionInputError, match=words):
        kv_scales_of(k_scale, v_scale)


def test_fp8_cache_layouts():
    lay = KvLayout.of(2, 64, "bfloat16", "float8_e4m3fn", [0.5, 1.0], np.array([1.0, 2.0]))
    assert lay.stored_dtype == pb.FLOAT8_E4M3 and lay.kv_scales == ((0.5, 1.0), (1.0, 2.0))
    assert KvLayout.from_message(lay.message()) == lay
    plain = KvLayout.of(2, 64, torch.float16, torch.float16)
    assert plain.kv_dtype == 0 and KvLayout.from_message(plain.message()) == plain
    for args, words in [
        ((2, 64, "bfloat16", "fp8"), "needs k_scale and v_scale"),
        ((2, 64, "float32", "fp8", [1.0, 1.0], [1.0, 1.0]), "float8_e4m3fn with float16"),
        ((2, 64, "bfloat16", "float16"), "leave kv_dtype unset"),
        ((2, 64, "bfloat16", None, [1.0, 1.0], [1.0, 1.0]), "are for kv_dtype"),
        ((2, 64, "fp8"), "keys and values only"),
        ((2, 64, "bf16", "fp8", [1.0], [1.0]), "k_scale has 1 entries for 2 kv heads"),
    ]:
        with pytest.raises(AttentionInputError, match=words):
            KvLayout.of(*args)


# ---- end to end -----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[True, False], ids=["unary", "stream"])
def client(server, request):
    with AttentionClient(server.target, timeout=60, unary=request.param) as c:
        yield c


def test_fp8_attention_and_decode_torch(client):
    q, k8, v8, ks, vs = _qkv(45, 45, seed=1)
    cu = torch.tensor([0, 1, 20, 45], dtype=torch.int32)
    out = client.attention(q, k8, v8, cu, causal=True, k_scale=ks, v_scale=vs)
    ref = attention_kernels.prefill_ref(q.double(), _deq(k8, ks), _deq(v8, vs), cu, causal=True)
    check_out(out, ref, "bfloat16", q)
    qd = q[:3].half()
    out, lse = client.decode(qd, k8, v8, cu, k_scale=ks, v_scale=vs, return_lse=True)
    ref, ref_lse = attention_kernels.decode_ref(qd.double(), _deq(k8, ks), _deq(v8, vs), cu,
                                                return_lse=True)
    check_out(out, ref, "float16", qd)
    np.testing.assert_allclose(lse.double().numpy(), ref_lse.numpy(), rtol=1e-4, atol=1e-3)


def test_fp8_attention_numpy_ml_dtypes(client):
    q, k8, v8, ks, vs = _qkv(3, 30, kv_heads=1, seed=2, dtype=torch.float16)
    ks, vs = ks[:1], vs[:1]
    qn = q.numpy()
    kn = k8.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    vn = v8.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    out = client.attention(qn, kn, vn, k_scale=ks.numpy(), v_scale=vs.tolist())
    ref = attention_kernels.prefill_ref(q.double(), _deq(k8, ks), _deq(v8, vs),
                                        torch.tensor([0, 3], dtype=torch.int32),
                                        torch.tensor([0, 30], dtype=torch.int32))
    check_out(out, ref, "float16", qn)


def test_fp8_kv_cache_session(client):
    """An FP8 cache fed bf16 tokens (the server quantizes) answers like float64 on what it
    stores: the same tokens quantized with the cache's scales."""
    _, k, v = (torch.randn(40, 2, 32, generator=torch.Generator().manual_seed(s))
               for s in (3, 4, 5))
    ks = attention_kernels.quantize_kv(k)[1] * 2
    vs = attention_kernels.quantize_kv(v)[1] * 2
    with client.kv_cache(2, 32, torch.bfloat16, kv_dtype=FP8, k_scale=ks, v_scale=vs) as cache:
        assert cache.kv_dtype == "FLOAT8_E4M3" and cache.dtype == "BFLOAT16"
        cache.append(["s0", "s1"], k[:30].bfloat16(), v[:30].bfloat16(), [0, 12, 30])
        q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(6)).bfloat16()
        kn8 = attention_kernels.quantize_kv(k[30:32].bfloat16(), ks)[0]
        vn8 = attention_kernels.quantize_kv(v[30:32].bfloat16(), vs)[0]
        out = cache.decode(q, ["s0", "s1"], kn8, vn8)  # already quantized: sent as is
        stored_k = attention_kernels.quantize_kv(k[:30].bfloat16(), ks)[0]
        stored_v = attention_kernels.quantize_kv(v[:30].bfloat16(), vs)[0]
        kk = torch.cat([stored_k[:12], kn8[:1], stored_k[12:], kn8[1:]])
        vv = torch.cat([stored_v[:12], vn8[:1], stored_v[12:], vn8[1:]])
        ref = attention_kernels.decode_ref(q.double(), _deq(kk, ks), _deq(vv, vs),
                                           torch.tensor([0, 13, 32], dtype=torch.int32))
        check_out(out, ref, "bfloat16", q)
        assert cache.lengths == {"s0": 13, "s1": 19}
        info = cache.info()
        assert info[0]["kv_dtype"] == "FLOAT8_E4M3"
        assert info[0]["k_scale"] == pytest.approx(ks.tolist())
        with pytest.raises(AttentionInputError, match="must share one dtype"):
            cache.decode(q, ["s0", "s1"], kn8.half(), vn8.half())
        with pytest.raises(AttentionInputError, match=r"caches take BFLOAT16 \(or FLOAT8"):
            cache.append("s0", kn8.half(), vn8.half())
        q8 = attention_kernels.fp8.quantize_queries(q.float(), 2)[0]
        with pytest.raises(AttentionInputError, match=r"attention\(\) and decode\(\) only"):
            cache.decode(q8, ["s0", "s1"], kn8, vn8)  # a cache's scales have no query's
        assert cache.lengths == {"s0": 13, "s1": 19}  # refused before anything was sent


def test_fp8_async_decode(server):
    q, k8, v8, ks, vs = _qkv(2, 17, seed=7, dtype=torch.float16)
    cu = [0, 5, 17]

    async def run():
        async with AsyncAttentionClient(server.target, timeout=60) as c:
            return await c.decode(q, k8, v8, cu, k_scale=ks, v_scale=vs)

    out = asyncio.run(run())
    ref = attention_kernels.decode_ref(q.double(), _deq(k8, ks), _deq(v8, vs),
                                       torch.tensor(cu, dtype=torch.int32))
    check_out(out, ref, "float16", q)
    assert f64(out).isfinite().all()


def test_fp8_tensors_in_a_region(server):
    """FP8 k/v that live in a registered shared-memory region travel by reference (their
    bytes counted at one byte per element), with the scales in the header."""
    with AttentionClient(server.target, timeout=60) as c:
        region = c.register_shm(1 << 20)
        q0, k80, v80, ks, vs = _qkv(30, 30, seed=8, dtype=torch.float16)
        q = region.empty(tuple(q0.shape), torch.float16)
        k8 = region.empty(tuple(k80.shape), FP8)
        v8 = region.empty(tuple(v80.shape), FP8)
        q.copy_(q0)
        k8.copy_(k80)
        v8.copy_(v80)
        out = c.attention(q, k8, v8, [0, 12, 30], causal=True, k_scale=ks, v_scale=vs)
        s = c.last_stats
        assert s["bytes_in"] == 0 and s["region_bytes_in"] == q.numel() * 2 + 2 * k8.numel()
        ref = attention_kernels.prefill_ref(q0.double(), _deq(k80, ks), _deq(v80, vs),
                                            torch.tensor([0, 12, 30], dtype=torch.int32),
                                            causal=True)
        check_out(out, ref, "float16", q0)


def test_fp8_torch_tensors_staged_into_a_region(server):
    """use_regions with torch FP8 k/v that live outside the region: the client copies their
    bits (not their values) into it."""
    q, k8, v8, ks, vs = _qkv(20, 20, seed=9, dtype=torch.float16)
    with AttentionClient(server.target, timeout=60, use_regions=True) as c:
        c.register_shm(1 << 20)
        out = c.attention(q, k8, v8, causal=True, k_scale=ks, v_scale=vs)
        assert c.last_stats["region_bytes_in"] > 0 and c.last_stats["bytes_in"] == 0
        out_d = c.decode(q[:2], k8, v8, [0, 7, 20], k_scale=ks, v_scale=vs)
    cu = torch.tensor([0, 20], dtype=torch.int32)
    ref = attention_kernels.prefill_ref(q.double(), _deq(k8, ks), _deq(v8, vs), cu, causal=True)
    check_out(out, ref, "float16", q)
    ref_d = attention_kernels.decode_ref(q[:2].double(), _deq(k8, ks), _deq(v8, vs),
                                         torch.tensor([0, 7, 20], dtype=torch.int32))
    check_out(out_d, ref_d, "float16", q)


def test_fp8_scales_are_what_float32_carries():
    with pytest.raises(AttentionInputError, match="as float32"):
        kv_scales_of([1e-50, 1.0], [1.0, 1.0])  # 0 once float32
    with pytest.raises(AttentionInputError, match="as float32"):
        kv_scales_of([1e39, 1.0], [1.0, 1.0])  # inf once float32
    ks = kv_scales_of([0.1, 0.3], [0.7, 1 / 3])
    assert ks == tuple(tuple(float(np.float32(x)) for x in part)
                       for part in ((0.1, 0.3), (0.7, 1 / 3)))


def test_fp8_step_without_tokens_on_listed_caches(client):
    """A step with no new tokens names caches the client learned from ListCaches and from its
    handle: one layout (scales compared as float32), the empty k/v sent in the stored dtype."""
    ks, vs = [0.1, 0.3], [0.7, 1 / 3]
    cache = client.kv_cache(2, 32, "bfloat16", kv_dtype="fp8", k_scale=ks, v_scale=vs)
    _, k8, v8, _, _ = _qkv(0, 10, seed=10)
    cache.append("L0", k8.bfloat16(), v8.bfloat16())
    client.list_caches(["L0"])  # the layout as the server reports it
    cache.append("L1", k8[:4].bfloat16(), v8[:4].bfloat16())
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(11)).bfloat16()
    out = client.decode_step(q, ["L0", "L1"])
    assert tuple(out.shape) == (2, 4, 32) and f64(out).isfinite().all()
    empty = cache.layout.empty_kv("k")
    assert empty.dtype == pb.FLOAT8_E4M3 and empty.nbytes == 0
    cache.release()


# ---- FP8 queries (FlashAttention-3's q_descale) ---------------------------------------------


def _qkv8(total: int, heads: int = 4, kv_heads: int = 2, dim: int = 32, seed: int = 11):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(total, heads, dim, generator=g)
    k = torch.randn(total, kv_heads, dim, generator=g) * 3
    v = torch.randn(total, kv_heads, dim, generator=g)
    q8, qs = attention_kernels.fp8.quantize_queries(q, kv_heads)
    (k8, ks), (v8, vs) = attention_kernels.quantize_kv(k), attention_kernels.quantize_kv(v)
    return q8, k8, v8, qs, ks, vs


def _deq_q(q8, s):
    return attention_kernels.fp8.dequantize_queries(q8, s, s.shape[0], torch.float64)


def test_fp8_query_header_carries_the_query_scales():
    q8, k8, v8, qs, ks, vs = _qkv8(7)
    prep = prepare_prefill(q8, k8, v8, kv_scales=kv_scales_of(ks, vs, qs))
    h = pb.PrefillHeader.FromString(prep.header)
    assert h.q.dtype == h.k.dtype == pb.FLOAT8_E4M3
    assert list(h.kv_scales.q) == pytest.approx(qs.tolist())
    assert prep.out_dtype == pb.BFLOAT16 and prep.tensors[0].nbytes == 7 * 4 * 32


@pytest.mark.parametrize(("change", "words"), [
    ({"q_scale": None}, "float8_e4m3fn q needs q_scale"),
    ({"q": "bf16"}, "q_scale given, but q is BFLOAT16"),
    ({"k": "bf16"}, "must share one dtype"),
    ({"q_scale": (0.5,)}, "q_scale has 1 entries for 2 kv heads"),
])
def test_fp8_query_client_refusals(change, words):
    q8, k8, v8, qs, ks, vs = _qkv8(4)
    with pytest.raises(AttentionInputError, match="q_scale is missing|v_scale is missing"):
        kv_scales_of(ks, None, qs)
    with pytest.raises(AttentionInputError, match="float8_e4m3fn q needs q_scale"):
        prepare_decode(q8[:2], k8, v8, [0, 2, 4], kv_scales=kv_scales_of(ks, vs))
    q_scale = change.get("q_scale", qs)
    if change.get("q") == "bf16":
        q8 = q8.to(torch.bfloat16)
    if change.get("k") == "bf16":
        k8, v8 = k8.to(torch.bfloat16), v8.to(torch.bfloat16)
    scales = (kv_scales_of(ks, vs, q_scale) if not isinstance(q_scale, tuple)
              else (tuple(ks.tolist()), tuple(vs.tolist()), q_scale))
    with pytest.raises(AttentionInputError, match=words):
        prepare_prefill(q8, k8, v8, kv_scales=scales)


def test_fp8_queries_end_to_end(client):
    """FP8 q, k, v through the server (cpu backend: queries widened exactly, the query scale
    folded into the key scale), in attention() and decode(): bf16 out and lse like float64 on
    the dequantized inputs, q at one byte per element."""
    q8, k8, v8, qs, ks, vs = _qkv8(45)
    cu = torch.tensor([0, 1, 20, 45], dtype=torch.int32)
    out, lse = client.attention(q8, k8, v8, cu, causal=True, q_scale=qs, k_scale=ks,
                                v_scale=vs, return_lse=True)
    assert out.dtype == torch.bfloat16
    ref, ref_lse = attention_kernels.prefill_ref(_deq_q(q8, qs), _deq(k8, ks), _deq(v8, vs),
                                                 cu, causal=True, return_lse=True)
    check_out(out, ref, "bfloat16", out)
    np.testing.assert_allclose(lse.double().numpy(), ref_lse.numpy(), rtol=1e-4, atol=2e-3)
    # decode: one query per sequence, the same scales.
    out, lse = client.decode(q8[:3], k8, v8, cu, q_scale=qs, k_scale=ks, v_scale=vs,
                             return_lse=True)
    assert out.dtype == torch.bfloat16 and client.last_stats["bytes_in"] == (3 * 4 + 90 * 2) * 32
    ref, ref_lse = attention_kernels.decode_ref(_deq_q(q8[:3], qs), _deq(k8, ks), _deq(v8, vs),
                                                cu, return_lse=True)
    check_out(out, ref, "bfloat16", out)
    np.testing.assert_allclose(lse.double().numpy(), ref_lse.numpy(), rtol=1e-4, atol=2e-3)


def test_fp8_queries_in_a_region(server):
    q80, k80, v80, qs, ks, vs = _qkv8(30, seed=12)
    with AttentionClient(server.target, timeout=60) as c:
        region = c.register_shm(1 << 20)
        q8, k8, v8 = (region.empty(tuple(t.shape), FP8) for t in (q80, k80, v80))
        for dst, src in ((q8, q80), (k8, k80), (v8, v80)):
            dst.copy_(src)
        out = region.empty(tuple(q80.shape), torch.bfloat16)
        got = c.attention(q8, k8, v8, [0, 12, 30], causal=True, q_scale=qs, k_scale=ks,
                          v_scale=vs, out=out)
        assert got.data_ptr() == out.data_ptr() and c.last_stats["bytes_in"] == 0
        ref = attention_kernels.prefill_ref(_deq_q(q80, qs), _deq(k80, ks), _deq(v80, vs),
                                            torch.tensor([0, 12, 30], dtype=torch.int32),
                                            causal=True)
        check_out(out, ref, "bfloat16", out)
        wrong = region.empty(tuple(q80.shape), FP8)
        with pytest.raises(AttentionInputError, match="bfloat16 for float8_e4m3fn q"):
            c.attention(q8, k8, v8, [0, 12, 30], q_scale=qs, k_scale=ks, v_scale=vs,
                        out=wrong)


def test_fp8_queries_numpy_ml_dtypes(client):
    """numpy callers: ml_dtypes float8_e4m3fn q, k, v give an ml_dtypes bfloat16 output."""
    q8, k8, v8, qs, ks, vs = _qkv8(20, seed=14)
    as_np = [t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn) for t in (q8, k8, v8)]
    out = client.attention(*as_np, [0, 7, 20], q_scale=qs.numpy(), k_scale=ks.tolist(),
                           v_scale=vs)
    assert isinstance(out, np.ndarray) and out.dtype == ml_dtypes.bfloat16
    ref = attention_kernels.prefill_ref(_deq_q(q8, qs), _deq(k8, ks), _deq(v8, vs),
                                        torch.tensor([0, 7, 20], dtype=torch.int32))
    got = torch.from_numpy(out.astype(np.float64))
    assert ((got - ref).norm() / ref.norm()).item() < 1.6e-2


def test_fp8_queries_async(server):
    """The async client's attention takes q_scale too (one core, two faces)."""
    q8, k8, v8, qs, ks, vs = _qkv8(17, seed=15)

    async def run():
        async with AsyncAttentionClient(server.target, timeout=60) as c:
            return await c.attention(q8, k8, v8, [0, 9, 17], causal=True, q_scale=qs,
                                     k_scale=ks, v_scale=vs)

    out = asyncio.run(run())
    assert out.dtype == torch.bfloat16
    ref = attention_kernels.prefill_ref(_deq_q(q8, qs), _deq(k8, ks), _deq(v8, vs),
                                        torch.tensor([0, 9, 17], dtype=torch.int32), causal=True)
    check_out(out, ref, "bfloat16", out)
