"""``fp8_dequant_kernel``: FP8 K/V widened to bf16/fp16 with per-head or per-sequence scales
(what the Gluon prefill reads for FP8 K/V), against ``dequantize_kv`` in float64."""

from __future__ import annotations

import pytest
import torch

from attention_kernels.fp8 import dequantize_kv, quantize_kv
from attention_kernels.fp8_dequant_kernel import dequant_kv_packed
from tests.kernels.conftest import DEVICE, cu_seqlens, randn


def _expected(x8: torch.Tensor, scale: torch.Tensor, cu: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor:
    """float64 product, then the one rounding to ``dtype``."""
    return dequantize_kv(x8, scale.double(), torch.float64, cu).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("per_seq", [False, True], ids=["per-head", "per-sequence"])
@pytest.mark.parametrize("lens, kv_heads, dim", [
    ([0], 2, 64), ([1], 1, 128), ([33, 0, 70], 3, 40), ([5, 0, 0, 31, 64], 2, 72),
    ([100] * 70, 2, 64),  # more sequences than one step of the row -> sequence search
], ids=lambda x: "-".join(map(str, x))[:20] if isinstance(x, list) else str(x))
def test_matches_dequantize_kv(lens: list[int], kv_heads: int, dim: int, per_seq: bool,
                               dtype: torch.dtype) -> None:
    cu = cu_seqlens(lens)
    total = sum(lens)
    # Every head of K a view with a gap after it (a strided head axis), V packed.
    k = randn(total, kv_heads + 1, dim, dtype=torch.float32)[:, 1:] * 4
    v = randn(total, kv_heads, dim, dtype=torch.float32)
    if per_seq:
        ends = cu.tolist()
        ks = torch.rand(len(lens), kv_heads, device=DEVICE) + 0.01
        vs = torch.rand(len(lens), kv_heads, device=DEVICE) * 100 + 0.01
        rows = torch.repeat_interleave(torch.arange(len(lens), device=DEVICE),
                                       torch.tensor(lens, device=DEVICE))
        k8 = quantize_kv(k, ks[rows])[0] if total else k.to(torch.float8_e4m3fn)
        v8 = quantize_kv(v, vs[rows])[0] if total else v.to(torch.float8_e4m3fn)
        stride_sb = kv_heads
        assert ends[-1] == total
    else:
        (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
        stride_sb = 0
    k_out, v_out = dequant_kv_packed(k8, v8, ks.contiguous(), vs.contiguous(), stride_sb, cu,
                                     dtype)
    assert k_out.dtype == v_out.dtype == dtype and k_out.is_contiguous()
    assert k_out.shape == v_out.shape == (total, kv_heads, dim)
    # One unit in the last place: the kernel rounds the float32 product (and Triton's
    # interpreter casts float32 to bf16 by truncation); a wrong scale is off by far more
    # (the scales are random per head and sequence).
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(k_out, _expected(k8, ks, cu, dtype), rtol=eps, atol=0)
    torch.testing.assert_close(v_out, _expected(v8, vs, cu, dtype), rtol=eps, atol=0)
