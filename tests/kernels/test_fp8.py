"""FP8 (e4m3) K/V with per-kv-head scales in every kernel, vs the float64 reference.

Two checks per case: against the reference on the *dequantized* K/V (the kernel's arithmetic,
so the queries' dtype tolerance applies), and against the reference on the original K/V
before quantization (what a user gives up by storing FP8: ``FP8_TOL``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from attention_kernels import (
    configs,
    decode,
    decode_ref,
    paged_decode,
    paged_decode_ref,
    paged_prefill,
    paged_prefill_ref,
    prefill,
    prefill_kernel,
    prefill_ref,
)
from attention_kernels.fp8 import FP8_DTYPE, FP8_MAX, dequantize_kv, quantize_kv
from tests.kernels.conftest import (
    DEVICE,
    TOL,
    check_lse,
    cu_seqlens,
    poison_,
    randn,
    rel_err,
)
from tests.kernels.test_paged import Paged

# Relative-norm error of the output against the float64 reference on the unquantized K/V,
# random normal inputs with per-head amax scales: e4m3 keeps 3 mantissa bits (a value's
# rounding error up to 1/16); the output averages many values, and measured 0.03-0.04.
FP8_TOL = 0.06
Q_DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture(params=["tiles", "widened"])
def fp8_prefill_path(request: pytest.FixtureRequest,
                     monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Contiguous FP8 prefills both ways: each e4m3 tile converted in the key loop, or K/V
    widened to the queries' dtype first (``prefill_kernel._widen_fp8``, which picks by size
    and would leave these small cases on tiles)."""
    keys = 0 if request.param == "widened" else 1 << 62
    monkeypatch.setattr(prefill_kernel, "FP8_WIDEN_MIN_KEYS_SEEN", keys)
    prefill_kernel._PLANS.clear()  # plans are keyed by the call, not by the threshold
    yield request.param
    prefill_kernel._PLANS.clear()


def _kv(total: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    """Original K/V (heads of very different magnitudes: each needs its own scale) and their
    FP8 forms."""
    spread = torch.logspace(-1, 1, kv_heads, device=DEVICE)[None, :, None]
    k = torch.randn(total, kv_heads, dim, device=DEVICE) * spread
    v = torch.randn(total, kv_heads, dim, device=DEVICE) * spread.flip(1)
    (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
    return k, v, k8, v8, ks, vs


def _kv_per_sequence(lens: list[int], kv_heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    """Like ``_kv``, but sequence ``b``'s values are 30**b and its keys 0.1**b times the
    first's (keys shrink so the logits stay tame), each sequence quantized with scales of its
    own: ``ks, vs [batch, H_kv]``. One shared set would flush the small ones to zero."""
    k, v, *_ = _kv(sum(lens), kv_heads, dim)
    parts, at = [], 0
    for b, n in enumerate(lens):
        kb, vb = k[at : at + n] * 0.1 ** b, v[at : at + n] * 30.0 ** b
        k[at : at + n], v[at : at + n] = kb, vb
        parts.append((quantize_kv(kb), quantize_kv(vb)))
        at += n
    k8 = torch.cat([kq for (kq, _), _ in parts])
    v8 = torch.cat([vq for _, (vq, _) in parts])
    ks = torch.stack([s for (_, s), _ in parts])
    vs = torch.stack([s for _, (_, s) in parts])
    return k, v, k8, v8, ks, vs


def _check_each(got: torch.Tensor, ref8: torch.Tensor, cu: list[int], dtype: torch.dtype) -> None:
    """Sequence by sequence against the dequantized reference, each relative to its own norm:
    with magnitudes 30x apart per sequence one norm over all would hide a small sequence read
    with another's scales."""
    for b in range(len(cu) - 1):
        rows = slice(cu[b], cu[b + 1])
        if ref8[rows].abs().sum() == 0:
            assert (got[rows].cpu() == 0).all(), f"sequence {b}: no keys, must be zeros"
            continue
        err = rel_err(got[rows], ref8[rows])
        assert err < TOL[dtype], f"sequence {b}: {err:.3g} >= {TOL[dtype]:.3g}"


def _check(got: torch.Tensor, ref8: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    err = rel_err(got, ref8)
    assert err < TOL[dtype], f"vs the dequantized reference: {err:.3g} >= {TOL[dtype]:.3g}"
    err = rel_err(got, ref)
    assert err < FP8_TOL, f"vs the unquantized reference: {err:.3g} >= {FP8_TOL}"


def _decode_case(lens: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
                 splits: int, paged_tokens: int = 0, per_seq: bool = False,
                 **features: object) -> None:
    batch, total = len(lens), sum(lens)
    cu = cu_seqlens(lens)
    q = randn(batch, heads, dim, dtype=dtype)
    k, v, k8, v8, ks, vs = (_kv_per_sequence(lens, kv_heads, dim) if per_seq
                            else _kv(total, kv_heads, dim))
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=DEVICE)
    poison_(out)
    poison_(lse)
    if paged_tokens:
        c = Paged(lens, paged_tokens, kv_heads, dim, FP8_DTYPE, kv=(k8, v8))
        kp, vp, table, seqlens = *c.cache, c.seqlens_k
        got, got_lse = paged_decode(q, kp, vp, table, seqlens, num_splits=splits,
                                    return_lse=True, out=out, lse_out=lse, k_scale=ks,
                                    v_scale=vs, **features)
    else:
        got, got_lse = decode(q, k8, v8, cu, num_splits=splits, return_lse=True, out=out,
                              lse_out=lse, k_scale=ks, v_scale=vs, **features)
    ref8, ref8_lse = decode_ref(q.double(), k8, v8, cu, return_lse=True, k_scale=ks,
                                v_scale=vs, **features)
    if paged_tokens:  # the paged reference gathers the same FP8 keys
        torch.testing.assert_close(paged_decode_ref(q.double(), kp, vp, table, seqlens,
                                                    k_scale=ks, v_scale=vs, **features), ref8)
    ref = decode_ref(q.double(), k.double(), v.double(), cu, **features)
    _check(got, ref8, ref, dtype)
    if per_seq:
        _check_each(got, ref8, list(range(batch + 1)), dtype)
    check_lse(got_lse, ref8_lse, dtype)
    empty = torch.tensor(lens) == 0
    assert (got.cpu()[empty] == 0).all(), "empty sequences give zeros"


@pytest.mark.parametrize("lens", [[1], [0, 5, 0], [127, 1], [300, 31]],
                         ids=lambda x: "-".join(map(str, x)))
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_lengths_and_splits(lens: list[int], splits: int) -> None:
    _decode_case(lens, 8, 2, 64, torch.float16, splits)


@pytest.mark.parametrize("dim", [40, 128])
@pytest.mark.parametrize("dtype", Q_DTYPES, ids=str)
def test_decode_dtypes_and_head_dims(dim: int, dtype: torch.dtype) -> None:
    _decode_case([33, 70], 8, 4, dim, dtype, 2)


@pytest.mark.parametrize("page_tokens", [7, 16])
def test_paged_decode(page_tokens: int) -> None:
    _decode_case([40, 0, 17], 8, 2, 64, torch.bfloat16, 3, paged_tokens=page_tokens)


@pytest.mark.parametrize("features", [
    {"window_size": (20, -1)}, {"softcap": 5.0}, {"alibi_slopes": "per-head"},
], ids=["window", "softcap", "alibi"])
def test_decode_with_score_features(features: dict) -> None:
    if features.get("alibi_slopes") == "per-head":
        features = {"alibi_slopes": torch.rand(8, device=DEVICE) * 0.2}
    _decode_case([90, 13], 8, 2, 64, torch.float16, 2, **features)


def _prefill_case(len_q: list[int], len_k: list[int], heads: int, kv_heads: int, dim: int,
                  dtype: torch.dtype, causal: bool, paged_tokens: int = 0, per_seq: bool = False,
                  **features: object) -> None:
    cu_q, cu_k = cu_seqlens(len_q), cu_seqlens(len_k)
    q = randn(sum(len_q), heads, dim, dtype=dtype)
    k, v, k8, v8, ks, vs = (_kv_per_sequence(len_k, kv_heads, dim) if per_seq
                            else _kv(sum(len_k), kv_heads, dim))
    out = torch.empty_like(q)
    lse = torch.empty(heads, q.shape[0], dtype=torch.float32, device=DEVICE)
    poison_(out)
    poison_(lse)
    if paged_tokens:
        c = Paged(len_k, paged_tokens, kv_heads, dim, FP8_DTYPE, kv=(k8, v8))
        kp, vp, table, seqlens = *c.cache, c.seqlens_k
        got, got_lse = paged_prefill(q, kp, vp, table, cu_q, seqlens, causal=causal,
                                     return_lse=True, out=out, lse_out=lse, k_scale=ks,
                                     v_scale=vs, **features)
    else:
        got, got_lse = prefill(q, k8, v8, cu_q, cu_k, causal=causal, return_lse=True, out=out,
                               lse_out=lse, k_scale=ks, v_scale=vs, **features)
    ref8, ref8_lse = prefill_ref(q.double(), k8, v8, cu_q, cu_k, causal=causal,
                                 return_lse=True, k_scale=ks, v_scale=vs, **features)
    if paged_tokens:
        torch.testing.assert_close(paged_prefill_ref(q.double(), kp, vp, table, cu_q, seqlens,
                                                     causal=causal, k_scale=ks, v_scale=vs,
                                                     **features), ref8)
    ref = prefill_ref(q.double(), k.double(), v.double(), cu_q, cu_k, causal=causal,
                      **features)
    _check(got, ref8, ref, dtype)
    if per_seq:
        _check_each(got, ref8, cu_q.tolist(), dtype)
    check_lse(got_lse, ref8_lse, dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", Q_DTYPES, ids=str)
def test_prefill(causal: bool, dtype: torch.dtype, fp8_prefill_path: str) -> None:
    # q shorter than k (a continuation), one empty sequence, lengths off the block sizes.
    _prefill_case([5, 0, 37, 1], [9, 4, 37, 70], 4, 2, 40, dtype, causal)


@pytest.mark.parametrize("page_tokens", [7, 16])
def test_paged_prefill(page_tokens: int) -> None:
    _prefill_case([3, 20], [50, 20], 8, 2, 64, torch.bfloat16, True, paged_tokens=page_tokens)


# Paged prefills never widen (``prefill_kernel._plan``: only contiguous K/V are the call's to
# copy) and no decode reads the widening threshold: the paged case is one run, whichever
# prefill path the fixture sets (a "widened-paged" run repeated "tiles-paged" launch for launch).
@pytest.mark.parametrize(("fp8_prefill_path", "paged_tokens"),
                         [("tiles", 0), ("widened", 0), ("tiles", 16)],
                         ids=["tiles-contiguous", "widened-contiguous", "tiles-paged"],
                         indirect=["fp8_prefill_path"])
def test_per_sequence_scales(paged_tokens: int, fp8_prefill_path: str) -> None:
    """``k_scale, v_scale [batch, H_kv]``: sequences whose magnitudes differ 10-30x per step,
    each quantized with its own scales (one shared set would lose the small ones), in decode
    (split and not) and prefill, contiguous and paged; with a softcap, whose scale K's folds
    into. The decodes once per layout (the prefill path is not theirs: "tiles" runs them)."""
    if fp8_prefill_path == "tiles":
        _decode_case([40, 0, 17, 3], 8, 2, 64, torch.bfloat16, 3, paged_tokens=paged_tokens,
                     per_seq=True)
        _decode_case([9, 70], 8, 4, 64, torch.float16, 1, paged_tokens=paged_tokens,
                     per_seq=True, softcap=20.0)
    _prefill_case([3, 20, 0], [50, 20, 6], 8, 2, 64, torch.bfloat16, True,
                  paged_tokens=paged_tokens, per_seq=True)


@pytest.mark.parametrize("magnitude", [1e5, 1e-7, "mixed"], ids=str)
def test_bf16_queries_of_any_magnitude(magnitude: float | str, fp8_prefill_path: str) -> None:
    """bf16 queries with FP8 K/V run their dots in fp16 (``_fp8_dot``), whose range is far
    narrower than bf16's: queries past fp16's largest (1e5) or below its smallest subnormal
    (1e-7), and heads 1e6 apart in one tile, must still give bf16 accuracy. The softmax scale
    undoes the magnitude so the logits stay ordinary. The decode once per magnitude (it does
    not read the fixture's prefill path: the "tiles" run checks it)."""
    dim, heads, kv_heads = 64, 8, 2
    if magnitude == "mixed":
        factor = torch.logspace(-3, 3, heads, device=DEVICE)[None, :, None]
        scale = dim**-0.5
    else:
        factor, scale = magnitude, dim**-0.5 / magnitude
    lens = [37, 70]
    cu = cu_seqlens(lens)
    k, v, k8, v8, ks, vs = _kv(sum(lens), kv_heads, dim)
    if fp8_prefill_path == "tiles":
        q = (randn(len(lens), heads, dim, dtype=torch.float32) * factor).bfloat16()
        got = decode(q, k8, v8, cu, num_splits=2, softmax_scale=scale, k_scale=ks, v_scale=vs)
        ref8 = decode_ref(q.double(), k8, v8, cu, softmax_scale=scale, k_scale=ks, v_scale=vs)
        assert rel_err(got, ref8) < TOL[torch.bfloat16]
    qp = (randn(sum(lens), heads, dim, dtype=torch.float32) * factor).bfloat16()
    got = prefill(qp, k8, v8, cu, cu, causal=True, softmax_scale=scale, k_scale=ks,
                  v_scale=vs)
    ref8 = prefill_ref(qp.double(), k8, v8, cu, cu, causal=True, softmax_scale=scale,
                       k_scale=ks, v_scale=vs)
    assert rel_err(got, ref8) < TOL[torch.bfloat16]


def test_prefill_with_window_and_softcap(fp8_prefill_path: str) -> None:
    _prefill_case([40, 17], [40, 30], 4, 4, 64, torch.float16, True, window_size=(11, 0),
                  softcap=8.0)


def test_widening_rule() -> None:
    """Contiguous FP8 prefills widen K/V first where a query sees enough keys for the per-tile
    conversion to cost more than one pass over K/V (``_widen_fp8``, the measured cases in its
    comment), and paged ones never widen (the pool is not the call's to copy)."""
    def widen(lens: int, batch: int, d: int, causal: bool, span: int | None = None,
              dtype: torch.dtype = torch.bfloat16) -> bool:
        q = torch.empty(0, 4, d, dtype=dtype)
        k = torch.empty(lens * batch, 2, d, dtype=FP8_DTYPE)
        return prefill_kernel._widen_fp8(q, k, batch, causal, span)

    assert widen(1024, 16, 64, True)  # D 64 causal 16 x 1K: 208 -> 150 us
    assert widen(4096, 4, 128, True)  # a softcap over 4 x 4K: 842 -> 720 us
    assert not widen(4096, 4, 128, True, span=513)  # a 512-key window: 312 -> 323 us
    assert not widen(512, 32, 128, False)  # even
    assert not widen(150, 3, 128, True)  # small: host-bound either way
    assert not widen(4096, 4, 128, True, dtype=torch.float32)  # fp32 queries: tiles
    # The launches: 600 keys non-causal at D 64 are past the widening threshold (half of
    # FP8_WIDEN_MIN_KEYS_SEEN at D <= 64), at a seventh of 4K keys' interpreter time.
    assert prefill_kernel.FP8_WIDEN_MIN_KEYS_SEEN // 2 <= 600
    q = randn(40, 4, 64, dtype=torch.bfloat16)
    _, _, k8, v8, ks, vs = _kv(600, 2, 64)
    prefill_kernel._PLANS.clear()
    prefill(q, k8, v8, cu_seqlens([40]), cu_seqlens([600]), k_scale=ks, v_scale=vs)
    assert [p.widen_kv for p in prefill_kernel._PLANS._plans.values()] == [True]
    c = Paged([600], 64, 2, 64, FP8_DTYPE, kv=(k8, v8))
    kp, vp, table, seqlens = *c.cache, c.seqlens_k
    prefill_kernel._PLANS.clear()
    paged_prefill(q, kp, vp, table, cu_seqlens([40]), seqlens, k_scale=ks, v_scale=vs)
    assert [p.widen_kv for p in prefill_kernel._PLANS._plans.values()] == [False]
    prefill_kernel._PLANS.clear()


def test_widened_kv_from_padded_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 K/V in rows padded past the head dim (a caller's view of wider rows), padding NaN:
    the widened copies keep the layout the launch was planned on. (Planned on padded strides,
    the kernel once read unpadded copies: garbage at D 40 on an H200.)"""
    monkeypatch.setattr(prefill_kernel, "FP8_WIDEN_MIN_KEYS_SEEN", 0)  # always widen
    dim, row = 40, 48

    def padded(t: torch.Tensor) -> torch.Tensor:
        buf = torch.full((*t.shape[:-1], row), float("nan"), device=t.device).to(t.dtype)
        view = buf[..., :dim]
        view.copy_(t)
        return view

    q = randn(37, 4, dim, dtype=torch.bfloat16)
    _, _, k8, v8, ks, vs = _kv(70, 2, dim)
    cu_q, cu_k = cu_seqlens([37]), cu_seqlens([70])
    try:
        prefill_kernel._PLANS.clear()
        want = prefill(q, k8, v8, cu_q, cu_k, k_scale=ks, v_scale=vs)
        prefill_kernel._PLANS.clear()
        got = prefill(q, padded(k8), padded(v8), cu_q, cu_k, k_scale=ks, v_scale=vs)
        assert [p.widen_kv for p in prefill_kernel._PLANS._plans.values()] == [True]
    finally:
        prefill_kernel._PLANS.clear()
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bad_scales_and_dtypes_raise() -> None:
    q = randn(2, 4, 64, dtype=torch.float16)
    k, v, k8, v8, ks, vs = _kv(10, 2, 64)
    cu = cu_seqlens([4, 6])
    cases = [
        ({"k": k8, "v": v8}, "k_scale is required"),
        ({"k": k8, "v": v8, "k_scale": ks}, "v_scale is required"),
        ({"k": k8, "v": v8, "k_scale": ks.double(), "v_scale": vs}, "k_scale must be float32"),
        ({"k": k8, "v": v8, "k_scale": ks[:1], "v_scale": vs}, "num_kv_heads=2"),
        ({"k": k8, "v": v8, "k_scale": ks.expand(3, 2), "v_scale": vs.expand(3, 2)},
         r"\[batch=2, num_kv_heads=2\]"),
        ({"k": k8, "v": v8, "k_scale": ks.expand(2, 2), "v_scale": vs}, "the same shape"),
        ({"k": k.half(), "v": v.half(), "k_scale": ks, "v_scale": vs}, "float8_e4m3fn"),
        ({"k": k8, "v": v.half(), "k_scale": ks, "v_scale": vs}, "dtypes differ"),
    ]
    for kwargs, words in cases:
        for fn in (decode, decode_ref):
            with pytest.raises(ValueError, match=words):
                fn(q, kwargs["k"], kwargs["v"], cu,
                   **{n: t for n, t in kwargs.items() if n in ("k_scale", "v_scale")})
    with pytest.raises(ValueError, match="dtypes differ"):  # fp32 queries: not with FP8 K/V
        decode(q.float(), k8, v8, cu, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="k_scale is required"):
        prefill(randn(10, 4, 64, dtype=torch.float16), k8, v8, cu)


def test_quantize_kv_scales_per_head() -> None:
    k = torch.randn(33, 3, 16, device=DEVICE) * torch.tensor([0.01, 1.0, 300.0],
                                                             device=DEVICE)[None, :, None]
    k[:, 1] = 0.0  # an all-zero head: scale 1, zeros back
    k8, scale = quantize_kv(k)
    assert k8.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (3,)
    amax = k.abs().amax(dim=(0, 2))
    torch.testing.assert_close(scale[[0, 2]], amax[[0, 2]] / FP8_MAX)
    assert scale[1] == 1.0 and (k8[:, 1].float() == 0).all()
    back = dequantize_kv(k8, scale, torch.float64)
    # e4m3: 3 mantissa bits, so |error| <= 2^-4 |x| for normal values; a subnormal step of
    # 2^-9 * scale below 2^-6 * scale.
    bound = (k.double().abs() / 16).clamp_min(2.0**-9 * scale.double()[None, :, None])
    assert ((back - k.double()).abs() <= bound + 1e-12).all()
    # A given scale saturates what it cannot reach.
    sat, _ = quantize_kv(k, scale=torch.full((3,), 1e-3, device=DEVICE))
    assert sat[:, 2].float().abs().max() == FP8_MAX


def test_fp8_launch_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 K/V pick their own measured tiles on Hopper (``configs``), 16-bit K/V keep theirs;
    the cached functions are called unwrapped, as for an H100 (no GPU needed)."""
    monkeypatch.setattr(configs, "_INTERPRETING", False)
    monkeypatch.setattr(configs, "_capability", lambda index: (9, 0))
    gpu = torch.device("cuda", 0)
    decode_cfg = configs.decode_config.__wrapped__
    assert decode_cfg(128, torch.bfloat16, gpu, True) == configs.DecodeConfig(128, 4, 3)
    assert decode_cfg(128, torch.bfloat16, gpu) == configs.DecodeConfig(64, 4, 3)
    assert decode_cfg(64, torch.bfloat16, gpu, True) == configs.DecodeConfig(64, 4, 3)
    # 16-bit K/V at head dim 64 and below: 128-key blocks, contiguous and paged alike.
    for d in (64, 40, 32):
        assert decode_cfg(d, torch.bfloat16, gpu) == configs.SMALL_HEAD_TILE
        assert configs.paged_decode_config.__wrapped__(d, torch.float16, gpu) == (
            configs.SMALL_HEAD_TILE)
    assert decode_cfg(96, torch.bfloat16, gpu) == configs.DECODE_TILE
    paged_cfg = configs.paged_decode_config.__wrapped__
    assert paged_cfg(128, torch.bfloat16, gpu, True) == configs.DecodeConfig(128, 4, 3)
    assert paged_cfg(128, torch.bfloat16, gpu) == configs.DecodeConfig(64, 4, 3)
    prefill_cfg = configs.prefill_config.__wrapped__
    for causal in (False, True):
        assert prefill_cfg(128, torch.bfloat16, causal, gpu, True) == configs.PrefillConfig(
            128, 64, 4, 3)
        assert prefill_cfg(128, torch.bfloat16, causal, gpu) == configs.PrefillConfig(
            128, 128, 8, 3)
        # FP8 K/V keep their tiles for short sequences too.
        assert prefill_cfg(128, torch.bfloat16, causal, gpu, True, 512, True) == (
            configs.PrefillConfig(128, 64, 4, 3))
