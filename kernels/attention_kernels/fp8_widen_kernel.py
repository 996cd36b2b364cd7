"""FP8 (e4m3) K/V widened to bf16 or fp16 in one launch, for the Gluon prefill.

Exact: every e4m3 value is a bf16 and an fp16 value (3 mantissa bits, exponents within both
ranges), so the kernel that reads the copies with the scales applied in float32 does the FP8
arithmetic of the portable kernel. One launch for both tensors, 16-byte stores: two torch
``.to`` copies instead took the FP8 prefill from 561 to 508 TFLOP/s at N 4K and 468 to 385
causal (H100, D 128, B * N = 16K; calls 6 and 7 of 2026-11-24i, different hosts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention_kernels.configs import padded_head_dim

_BLOCK_ROWS = 64


# One variant per dtype and head dim: the row count and the kv head count are run-time values
# (the strides keep their divisibility hints, which the 16-byte loads need).
@triton.jit(do_not_specialize=["total", "num_kv_heads"])
def _widen_kv_kernel(
    K, V, KOut, VOut, total, num_kv_heads, stride_kt, stride_kh, stride_vt, stride_vh, out_row,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    mask = (rows < total)[:, None] & (d[None, :] < HEAD_DIM)
    r64 = rows.to(tl.int64)[:, None]
    out_at = (r64 * num_kv_heads + head) * out_row + d[None, :]
    k = tl.load(K + r64 * stride_kt + head * stride_kh + d[None, :], mask=mask)
    tl.store(KOut + out_at, k.to(KOut.dtype.element_ty), mask=mask)
    v = tl.load(V + r64 * stride_vt + head * stride_vh + d[None, :], mask=mask)
    tl.store(VOut + out_at, v.to(VOut.dtype.element_ty), mask=mask)


def widen_kv(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype,
             row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` in ``dtype`` from float8_e4m3fn ``k, v [total, H_kv, D]`` (any token/head
    strides, unit stride along D); bitwise what ``k.to(dtype)`` gives. Rows of ``row``
    elements (default D: contiguous): a caller whose kernel was planned on padded rows
    (``_launch.aligned_rows``) gets its copies in that layout, strides and all."""
    total, heads, dim = k.shape
    row = row or dim
    k_out = torch.empty((total, heads, row), dtype=dtype, device=k.device)[..., :dim]
    v_out = torch.empty((total, heads, row), dtype=dtype, device=k.device)[..., :dim]
    if total:
        _widen_kv_kernel[(triton.cdiv(total, _BLOCK_ROWS), heads)](
            k, v, k_out, v_out, total, heads, k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), row, HEAD_DIM=dim, BLOCK_D=padded_head_dim(dim),
            BLOCK_R=_BLOCK_ROWS, num_warps=4,
        )
    return k_out, v_out
