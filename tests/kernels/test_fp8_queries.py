"""FP8 (e4m3) queries beside FP8 keys and values (``q_scale=``, FlashAttention-3's
``q_descale``) in prefill, decode and the paged kernels, on any device: the widened path
(queries to bf16, the query scale folded into the key scale) against the float64 reference,
the scale layouts, bad input,
and the transposed values the Gluon kernel reads (``kv_copies.transpose_values``)
against their torch form. The FP8 tensor-core kernel itself: ``test_prefill_hopper.py``."""

from __future__ import annotations

import pytest
import torch

from attention_kernels import (
    decode,
    decode_ref,
    paged_decode,
    paged_prefill,
    paged_prefill_ref,
    prefill,
    prefill_kernel,
    prefill_ref,
    quantize_kv,
)
from attention_kernels.fp8 import (
    FP8_DTYPE,
    combined_scales,
    dequantize_queries,
    quantize_queries,
)
from attention_kernels.kv_copies import transpose_values
from attention_kernels.prefill_hopper import (
    _VT_ALIGN,
    _fp8_key_order,
    transposed_values_ref,
    values_first_column,
)
from tests.kernels.conftest import DEVICE, TOL, check_lse, cu_seqlens, poison_, rel_err
from tests.kernels.test_paged import Paged

# Against the reference on the unquantized inputs, per sequence: e4m3 rounding of Q, K and V
# (each value off by up to 1/16 of itself). The float64 reference on the FP8 inputs, 1500
# seeds of these shapes: prefill medians 0.03-0.06, max 0.081.
FP8_QKV_TOL = 0.1
# Decode's one query row per sequence has no rows to average the rounding over, and keys of
# std 2 make its softmax sharp: 3000 seeds, median 0.06, p99 0.105, max 0.136. (The kernel
# itself is held to bf16's tolerance against the reference on the FP8 inputs.)
FP8_QKV_DECODE_TOL = 0.2


def _inputs(lens: list[int], heads: int, kv_heads: int, dim: int,
            per_seq: bool) -> tuple[torch.Tensor, ...]:
    """Original q, k, v and their FP8 forms with scales per kv head, or per sequence and kv
    head (each sequence's queries 0.1**b times the first's, quantized with scales of its own:
    one shared set would leave the last sequence's in e4m3's subnormals)."""
    total = sum(lens)
    q = torch.randn(total, heads, dim, device=DEVICE)
    k = torch.randn(total, kv_heads, dim, device=DEVICE) * 2
    v = torch.randn(total, kv_heads, dim, device=DEVICE) / 2
    (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
    if not per_seq:
        q8, qs = quantize_queries(q, kv_heads)
        return q, k, v, q8, k8, v8, qs, ks, vs
    parts, at = [], 0
    for b, n in enumerate(lens):
        q[at : at + n] *= 0.1 ** b
        parts.append(quantize_queries(q[at : at + n], kv_heads))
        at += n
    q8 = torch.cat([p for p, _ in parts])
    qs = torch.stack([s for _, s in parts])
    return q, k, v, q8, k8, v8, qs, ks, vs


@pytest.mark.parametrize("per_seq", [False, True], ids=["per-head", "per-sequence"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_prefill_of_fp8_queries(causal: bool, per_seq: bool) -> None:
    """bf16 output, against the reference on the same FP8 inputs at bf16's tolerance (the
    widening is exact) and on the unquantized ones at ``FP8_QKV_TOL``; lse too; poisoned
    buffers; GQA; an empty sequence and lengths off every block size."""
    lens = [5, 0, 37, 70]
    q, k, v, q8, k8, v8, qs, ks, vs = _inputs(lens, 4, 2, 40, per_seq)
    cu = cu_seqlens(lens)
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=DEVICE)
    lse = torch.empty(4, q.shape[0], dtype=torch.float32, device=DEVICE)
    poison_(out)
    poison_(lse)
    got, got_lse = prefill(q8, k8, v8, cu, causal=causal, return_lse=True, out=out,
                           lse_out=lse, q_scale=qs, k_scale=ks, v_scale=vs)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    ref8, ref8_lse = prefill_ref(q8, k8, v8, cu, causal=causal, return_lse=True,
                                 compute_dtype=torch.float64, q_scale=qs, k_scale=ks,
                                 v_scale=vs)
    assert ref8.dtype == torch.bfloat16
    ref = prefill_ref(q.double(), k.double(), v.double(), cu, causal=causal)
    ends = cu.tolist()
    for b in range(len(lens)):  # each sequence against its own norm
        rows = slice(ends[b], ends[b + 1])
        if lens[b]:
            assert rel_err(got[rows], ref8[rows]) < TOL[torch.bfloat16]
            assert rel_err(got[rows], ref[rows]) < FP8_QKV_TOL
    check_lse(got_lse, ref8_lse, torch.bfloat16)


def _decode_inputs(lens: list[int], per_seq: bool) -> tuple[torch.Tensor, ...]:
    """One query per sequence (``_inputs`` over ``lens`` keys, a query row per sequence)."""
    q, k, v, _, k8, v8, _, ks, vs = _inputs(lens, 6, 2, 40, False)
    q = q[: len(lens)].clone()
    if not per_seq:
        q8, qs = quantize_queries(q, 2)
        return q, k, v, q8, k8, v8, qs, ks, vs
    q *= torch.tensor([0.1 ** b for b in range(len(lens))], device=DEVICE)[:, None, None]
    parts = [quantize_queries(q[b : b + 1], 2) for b in range(len(lens))]
    return (q, k, v, torch.cat([p for p, _ in parts]), k8, v8,
            torch.stack([s for _, s in parts]), ks.expand(len(lens), 2).contiguous(),
            vs.expand(len(lens), 2).contiguous())


@pytest.mark.parametrize("paged", [False, True], ids=["packed", "paged"])
@pytest.mark.parametrize("per_seq", [False, True], ids=["per-head", "per-sequence"])
def test_decode_of_fp8_queries(per_seq: bool, paged: bool) -> None:
    """``decode`` and ``paged_decode`` of FP8 queries: bf16 output against the reference on the
    same FP8 inputs at bf16's tolerance and on the unquantized ones at ``FP8_QKV_DECODE_TOL``; lse;
    poisoned buffers; GQA; an empty sequence, a sequence of one key, splits."""
    lens = [1, 0, 37, 70]
    q, k, v, q8, k8, v8, qs, ks, vs = _decode_inputs(lens, per_seq)
    cu = cu_seqlens(lens)
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=DEVICE)
    lse = torch.empty(len(lens), 6, dtype=torch.float32, device=DEVICE)
    poison_(out)
    poison_(lse)
    kw = dict(return_lse=True, out=out, lse_out=lse, num_splits=3, q_scale=qs, k_scale=ks,
              v_scale=vs)
    if paged:
        c = Paged(lens, 16, 2, 40, FP8_DTYPE, kv=(k8, v8))
        got, got_lse = paged_decode(q8, c.k_pages, c.v_pages, c.block_table, c.seqlens_k, **kw)
    else:
        got, got_lse = decode(q8, k8, v8, cu, **kw)
    assert got.dtype == torch.bfloat16 and got.data_ptr() == out.data_ptr()
    assert torch.isfinite(got).all()
    ref8, ref8_lse = decode_ref(q8, k8, v8, cu, return_lse=True, compute_dtype=torch.float64,
                                q_scale=qs, k_scale=ks, v_scale=vs)
    assert ref8.dtype == torch.bfloat16
    ref = decode_ref(q.double(), k.double(), v.double(), cu)
    for b, n in enumerate(lens):
        if n:
            assert rel_err(got[b], ref8[b]) < TOL[torch.bfloat16]
            assert rel_err(got[b], ref[b]) < FP8_QKV_DECODE_TOL
        else:
            assert (got[b] == 0).all()
    check_lse(got_lse, ref8_lse, torch.bfloat16)


def test_decode_of_fp8_queries_with_score_options() -> None:
    """Window, softcap and ALiBi pass through the widened path unchanged: FP8 queries give
    the reference's answer on the same FP8 inputs with the same options."""
    lens = [1, 30, 70]
    _, _, _, q8, k8, v8, qs, ks, vs = _decode_inputs(lens, False)
    cu = cu_seqlens(lens)
    opts = dict(window_size=(17, 0), softcap=5.0,
                alibi_slopes=torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], device=DEVICE))
    got = decode(q8, k8, v8, cu, q_scale=qs, k_scale=ks, v_scale=vs, **opts)
    ref = decode_ref(q8, k8, v8, cu, compute_dtype=torch.float64, q_scale=qs, k_scale=ks,
                     v_scale=vs, **opts)
    for b in range(len(lens)):
        assert rel_err(got[b], ref[b]) < TOL[torch.bfloat16]
    plain = decode_ref(q8, k8, v8, cu, compute_dtype=torch.float64, q_scale=qs, k_scale=ks,
                       v_scale=vs)
    assert rel_err(plain[2], ref[2]) > 0.05  # the options changed the answer


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_paged_prefill_of_fp8_queries(causal: bool) -> None:
    """``paged_prefill`` of FP8 queries (per-sequence scales): as the contiguous prefill."""
    lens_q, lens_k = [3, 0, 20], [3, 5, 50]
    q, _, _, q8, _, _, qs, _, _ = _inputs(lens_q, 4, 2, 40, True)
    _, k, v, _, k8, v8, _, ks, vs = _inputs(lens_k, 4, 2, 40, False)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    c = Paged(lens_k, 16, 2, 40, FP8_DTYPE, kv=(k8, v8))
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=DEVICE)
    poison_(out)
    got = paged_prefill(q8, c.k_pages, c.v_pages, c.block_table, cu_q, c.seqlens_k,
                        causal=causal, out=out, q_scale=qs, k_scale=ks, v_scale=vs)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    ref8 = paged_prefill_ref(q8, c.k_pages, c.v_pages, c.block_table, cu_q, c.seqlens_k,
                             causal=causal, compute_dtype=torch.float64, q_scale=qs,
                             k_scale=ks, v_scale=vs)
    ref = prefill_ref(q.double(), k.double(), v.double(), cu_q, cu_k, causal=causal)
    ends = cu_q.tolist()
    for b in range(len(lens_q)):
        rows = slice(ends[b], ends[b + 1])
        if lens_q[b]:
            assert rel_err(got[rows], ref8[rows]) < TOL[torch.bfloat16]
            assert rel_err(got[rows], ref[rows]) < FP8_QKV_TOL


def test_quantized_queries_take_their_kv_heads_scale() -> None:
    """Query head ``h`` takes kv head ``h // group``'s scale (FlashAttention-3's
    ``q_descale`` layout): the group's largest magnitude maps to 448, the round trip is
    within e4m3's rounding."""
    q = torch.randn(9, 6, 8, device=DEVICE)
    q[:, 4] *= 100  # kv head 2 of 3 (heads 4 and 5)
    q8, scale = quantize_queries(q, 3)
    assert q8.dtype == FP8_DTYPE and scale.shape == (3,)
    amax = q.reshape(9, 3, 16).abs().amax(dim=(0, 2))
    torch.testing.assert_close(scale, amax / 448)
    back = dequantize_queries(q8, scale, 3, torch.float32)
    assert ((back - q).abs() <= q.abs() / 16 + scale.repeat_interleave(2)[None, :, None]
            * 2 ** -9).all()
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        quantize_queries(q, 4)


def test_combined_scales_broadcast_to_per_sequence() -> None:
    qs, ks, vs = torch.rand(3, 2), torch.rand(2), torch.rand(2)
    k_eff, v_eff = combined_scales(qs, ks, vs)
    torch.testing.assert_close(k_eff, qs * ks)
    assert v_eff.shape == (3, 2) and (v_eff == vs).all()
    k_eff, v_eff = combined_scales(ks, ks, vs)
    assert k_eff.shape == (2,) and torch.equal(v_eff, vs)
    # Views (FlashAttention-3's descales expanded per sequence) come back contiguous: the
    # kernels index the scales as [batch, H_kv] rows.
    k_eff, v_eff = combined_scales(ks.expand(3, 2), ks, vs.expand(3, 2))
    assert k_eff.is_contiguous() and v_eff.is_contiguous() and torch.equal(v_eff[2], vs)


def test_fp8_queries_bad_input_names_the_argument() -> None:
    lens = [3, 4]
    _, _, _, q8, k8, v8, qs, ks, vs = _inputs(lens, 4, 2, 16, False)
    cu = cu_seqlens(lens)
    with pytest.raises(ValueError, match="q_scale is required"):
        prefill(q8, k8, v8, cu, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match=r"q_scale must be float32 \[num_kv_heads=2\]"):
        prefill(q8, k8, v8, cu, q_scale=torch.ones(4, device=DEVICE), k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="q_scale must be float32"):
        prefill(q8, k8, v8, cu, q_scale=qs.double(), k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="k_scale is required"):
        prefill(q8, k8, v8, cu, q_scale=qs)
    bf = k8.to(torch.bfloat16)
    with pytest.raises(ValueError, match="float8_e4m3fn queries need float8_e4m3fn k and v"):
        prefill(q8, bf, bf, cu, q_scale=qs)
    with pytest.raises(ValueError, match="q_scale is for float8_e4m3fn q"):
        prefill(q8.to(torch.bfloat16), k8, v8, cu, q_scale=qs, k_scale=ks, v_scale=vs)
    # Decode and the paged kernels check the same way.
    cu_k = cu_seqlens([3, 4])
    with pytest.raises(ValueError, match="q_scale is required"):
        decode(q8[:2], k8, v8, cu_k, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="float8_e4m3fn queries need float8_e4m3fn k and v"):
        decode(q8[:2], bf, bf, cu_k, q_scale=qs)
    with pytest.raises(ValueError, match="q_scale is for float8_e4m3fn q"):
        decode(q8[:2].to(torch.bfloat16), k8, v8, cu_k, q_scale=qs, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match=r"q_scale must be float32 \[num_kv_heads=2\] or "
                       r"\[batch=2"):
        decode(q8[:2], k8, v8, cu_k, q_scale=torch.ones(3, 2, device=DEVICE), k_scale=ks,
               v_scale=vs)
    c = Paged(lens, 16, 2, 16, FP8_DTYPE, kv=(k8, v8))
    with pytest.raises(ValueError, match="q_scale is required"):
        paged_decode(q8[:2], c.k_pages, c.v_pages, c.block_table, c.seqlens_k, k_scale=ks,
                     v_scale=vs)
    with pytest.raises(ValueError, match="k_scale is required"):
        paged_prefill(q8, c.k_pages, c.v_pages, c.block_table, cu, c.seqlens_k, q_scale=qs)


def test_fp8_gluon_path_is_taken_only_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_fp8_gluon_ok``: sm_90, D 64 or 128, no window/softcap/ALiBi, a mean sequence of a
    key block at least, contiguous rows."""
    sm90 = [True]
    monkeypatch.setattr(prefill_kernel, "_on_sm90", lambda t: sm90[0])
    q = torch.empty(512, 4, 128, dtype=FP8_DTYPE)
    kv = torch.empty(512, 2, 128, dtype=FP8_DTYPE)
    ok = prefill_kernel._fp8_gluon_ok
    assert ok(q, kv, kv, 4, True)
    assert not ok(q, kv, kv, 4, False)  # a feature
    assert not ok(q, kv, kv, 5, True)  # a mean sequence under 128 keys
    q64, kv64 = (t[..., :64].contiguous() for t in (q, kv))
    assert ok(q64, kv64, kv64, 4, True)  # D 64
    assert not ok(q[..., :96].contiguous(), kv[..., :96].contiguous(),
                  kv[..., :96].contiguous(), 4, True)  # D 96: no FP8 tile, widened
    assert not ok(q, kv[:, :1].expand(512, 2, 128), kv, 4, True)  # rows not contiguous
    monkeypatch.setenv("ATTENTION_KERNELS_GLUON", "0")
    assert not ok(q, kv, kv, 4, True)
    monkeypatch.delenv("ATTENTION_KERNELS_GLUON")
    sm90[0] = False
    assert not ok(q, kv, kv, 4, True)


@pytest.mark.parametrize("lens", [[1, 0, 37, 70, 0], [300], [0, 5], [16] * 9, [200, 900]],
                         ids=str)
def test_transposed_values(lens: list[int]) -> None:
    """The launch's transposed values equal the torch form byte for byte; each sequence's
    columns start 16-byte aligned (TMA), hold its keys in ``_fp8_key_order`` and zeros
    everywhere else a block of 64 keys reads."""
    cu = cu_seqlens(lens)
    v = torch.randn(sum(lens), 3, 32, device=DEVICE).to(FP8_DTYPE)
    ref = transposed_values_ref(v, cu, 64)
    got = transpose_values(v, cu, 64, _VT_ALIGN)
    assert got.shape == ref.shape and torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    first = values_first_column(cu, 64).tolist()
    assert all(f % 16 == 0 for f in first)
    cols = ref.view(torch.uint8).view(3, 32, -1).cpu()
    src = v.view(torch.uint8).cpu()
    ends = cu.tolist()
    for b, n in enumerate(lens):
        where = (first[b] + _fp8_key_order(torch.arange(n))).tolist()
        assert torch.equal(cols[:, :, where].permute(2, 0, 1), src[ends[b] : ends[b + 1]])
        read = set(range(first[b], first[b] + -(-n // 64) * 64)) - set(where)
        assert (cols[:, :, sorted(read)] == 0).all()


def test_key_order_puts_each_threads_keys_in_its_operand() -> None:
    """Accumulator thread ``t`` holds keys ``2t, 2t+1, 2t+8, 2t+9`` of each 16; the FP8 operand
    gives it positions ``4t .. 4t+3``: the order maps the one set onto the other."""
    pos = _fp8_key_order(torch.arange(32))
    assert sorted(pos.tolist()) == list(range(32))
    for t in range(4):
        keys = [2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9]
        assert sorted(pos[keys].tolist()) == list(range(4 * t, 4 * t + 4))
