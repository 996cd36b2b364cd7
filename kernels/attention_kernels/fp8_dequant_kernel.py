"""FP8 (e4m3) K/V widened to the queries' 16-bit dtype, scales applied, in one launch.

Why: the warp-specialized Hopper prefill (``prefill_hopper``) takes 16-bit K/V only, and the
portable kernel's FP8 path converts every tile inside its key loop, where it reached 364-382
TFLOP/s against the Gluon kernel's 585-625 on bf16 (H100, D 128 non-causal, 2026-11-24). A
dense prefill reads each K/V row once per query tile, so widening the whole K/V once first
(one pass: 1 byte read, 2 written per element) costs O(N) against the launch's O(N^2): the
FP8 prefill then runs at the bf16 kernel's speed, less that pass.

``k, v`` ``[total_k, H_kv, D]`` float8_e4m3fn (any token/head strides, unit stride along D);
scales float32 ``[H_kv]`` (stride_sb 0) or ``[batch, H_kv]`` per sequence of ``cu_seqlens_k``.
The result is ``round(x * scale)`` in ``dtype``: the one rounding the 16-bit K/V would have
had, next to the e4m3 rounding that made ``x``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention_kernels.configs import padded_head_dim

_BLOCK_ROWS = 32
_BLOCK_SEQS = 64  # cu_seqlens entries compared per step of the row -> sequence search


@triton.jit
def _dequant_kv_kernel(
    K, V, KScale, VScale, KOut, VOut, CuK,
    total, batch, stride_sb,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, PER_SEQ: tl.constexpr,
):
    head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < total
    if PER_SEQ:
        # A row's sequence is the count of sequence ends at or before it (empty ones too).
        seq = tl.zeros([BLOCK_R], dtype=tl.int32)
        for b0 in range(0, batch, BLOCK_B):
            ends_at = b0 + tl.arange(0, BLOCK_B)
            ends = tl.load(CuK + 1 + ends_at, mask=ends_at < batch, other=2147483647)
            seq += tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
        at = seq.to(tl.int64) * stride_sb + head
        k_scale = tl.load(KScale + at, mask=row_ok, other=1.0)[:, None]
        v_scale = tl.load(VScale + at, mask=row_ok, other=1.0)[:, None]
    else:
        k_scale = tl.load(KScale + head)
        v_scale = tl.load(VScale + head)
    d = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)
    r64 = rows.to(tl.int64)[:, None]
    out_at = (r64 * NUM_KV_HEADS + head) * HEAD_DIM + d[None, :]
    k = tl.load(K + r64 * stride_kt + head * stride_kh + d[None, :], mask=mask, other=0.0)
    tl.store(KOut + out_at, (k.to(tl.float32) * k_scale).to(KOut.dtype.element_ty), mask=mask)
    v = tl.load(V + r64 * stride_vt + head * stride_vh + d[None, :], mask=mask, other=0.0)
    tl.store(VOut + out_at, (v.to(tl.float32) * v_scale).to(VOut.dtype.element_ty), mask=mask)


def dequant_kv_packed(
    k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
    stride_sb: int, cu_seqlens_k: torch.Tensor, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh contiguous ``(k, v)`` in ``dtype`` (see the module doc); the caller checked the
    inputs (``k_scale``/``v_scale`` contiguous, ``stride_sb`` from ``kv_scale_args``)."""
    total, heads, dim = k.shape
    k_out = torch.empty((total, heads, dim), dtype=dtype, device=k.device)
    v_out = torch.empty_like(k_out)
    if total == 0:
        return k_out, v_out
    batch = cu_seqlens_k.shape[0] - 1
    _dequant_kv_kernel[(triton.cdiv(total, _BLOCK_ROWS), heads)](
        k, v, k_scale, v_scale, k_out, v_out, cu_seqlens_k,
        total, batch, stride_sb, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_KV_HEADS=heads, HEAD_DIM=dim, BLOCK_D=padded_head_dim(dim),
        BLOCK_R=_BLOCK_ROWS, BLOCK_B=_BLOCK_SEQS, PER_SEQ=stride_sb != 0,
        num_warps=4,
    )
    return k_out, v_out
