"""Copies of K/V that a prefill kernel reads instead of the caller's, each in one launch:

* FP8 (e4m3) K/V widened to bf16 or fp16 for 16-bit queries (``widen_kv``), or V transposed
  for FP8 queries (``transpose_values``), for the Gluon prefill;
* rows padded with zeros to a wider head dim (``pad_rows``): K/V to the portable prefill's
  tile, for head dims whose rows it could otherwise only read element by element (D 59), and
  k, v (q where TMA cannot read its heads in place) to the Gluon prefill's head dim, for head
  dims it does not take (``prefill_kernel._padded_gluon_dim``; the kernel stores the output's
  own columns).

Widening is exact: every e4m3 value is a bf16 and an fp16 value (3 mantissa bits, exponents
within both ranges), so the kernel that reads the copies with the scales applied in float32 does
the FP8 arithmetic of the portable kernel. One launch for both tensors, 16-byte stores: two torch
``.to`` copies instead took the FP8 prefill from 561 to 508 TFLOP/s at N 4K and 468 to 385
causal (H100, D 128, B * N = 16K; calls 6 and 7 of 2026-11-24i, different hosts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention_kernels.configs import padded_head_dim

_BLOCK_ROWS = 64
_BLOCK_COLS = 64  # transposed columns per program (``transpose_values``)


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
    elements (default D: contiguous): a caller whose kernel was planned on padded rows (the
    caller's own view of wider rows) gets its copies in that layout, strides and all."""
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


@triton.jit(do_not_specialize=["batch", "search_steps", "cols"])
def _transpose_values_kernel(
    V, Cu, VT, batch, search_steps, stride_vt, stride_vh, cols,
    HEAD_DIM: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, ALIGN: tl.constexpr,
):
    """One program per ``BLOCK_C`` columns of one kv head's ``D`` rows of the transposed values:
    each column's token gathered (``D`` contiguous bytes), the tile stored along the columns
    (contiguous: vector stores), gaps and tails written as zeros."""
    head = tl.program_id(1)
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    gap: tl.constexpr = BLOCK_N + ALIGN
    # Each column's sequence: the last b in [0, batch) whose first column is <= c.
    lo = tl.zeros([BLOCK_C], tl.int32)
    hi = tl.zeros([BLOCK_C], tl.int32) + (batch - 1)
    for _ in range(search_steps):
        active = lo < hi
        mid = (lo + hi + 1) // 2
        first = (tl.load(Cu + mid, mask=active, other=0) + ALIGN - 1) // ALIGN * ALIGN + mid * gap
        ok = first <= c
        hi = tl.where(active & ~ok, mid - 1, hi)
        lo = tl.where(active & ok, mid, lo)
    start = tl.load(Cu + lo)
    length = tl.load(Cu + lo + 1) - start
    p = c - ((start + ALIGN - 1) // ALIGN * ALIGN + lo * gap)
    o = p % 16  # position 4t + 2g + e holds key 8g + 2t + e (``_fp8_key_order``)
    key = p - o + (o % 4) // 2 * 8 + o // 4 * 2 + o % 2
    live = (key < length) & (c < cols)
    d = tl.arange(0, HEAD_DIM)
    vals = tl.load(V + (start + key).to(tl.int64)[:, None] * stride_vt + head * stride_vh
                   + d[None, :], mask=live[:, None], other=0.0)
    rows = (head * HEAD_DIM + d).to(tl.int64)
    tl.store(VT + rows[:, None] * cols + c[None, :], tl.trans(vals), mask=(c < cols)[None, :])


def transpose_values(v: torch.Tensor, cu_k: torch.Tensor, block_n: int,
                     align: int) -> torch.Tensor:
    """``prefill_hopper.transposed_values_ref`` in one launch: V's tokens as columns, sequence
    ``b``'s from column ``ceil(cu_k[b] / align) * align + b * (block_n + align)`` in the FP8 key
    order, zeros between. H200, 16K tokens x 16 kv heads x D 128: a torch scatter of the same
    took 620 us (2026-11-30, call B), a third of a prefill at N 4K; a launch over tokens
    storing each one's scattered column, 500 us (call D)."""
    total, heads, dim = v.shape
    batch = cu_k.shape[0] - 1
    cols = -(-total // align) * align + batch * (block_n + align)
    vt = torch.empty((heads * dim, cols), dtype=v.dtype, device=v.device)
    if batch:
        _transpose_values_kernel[(triton.cdiv(cols, _BLOCK_COLS), heads)](
            v, cu_k, vt, batch, max(batch - 1, 1).bit_length() + 1, v.stride(0), v.stride(1),
            cols, HEAD_DIM=dim, BLOCK_C=_BLOCK_COLS, BLOCK_N=block_n, ALIGN=align,
            num_warps=4,
        )
    return vt


# Elements of its padded rows per program of ``_pad_rows_kernel``.
_COPY_ELEMENTS = 4096


@triton.jit(do_not_specialize=["rows", "heads"])
def _pad_rows_kernel(
    Src, Dst, rows, heads, src_t, src_h,
    COLS: tl.constexpr, ROW: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """``BLOCK_R`` consecutive (token, head) rows of the packed ``Dst [T, H, ROW]`` per
    program (16-byte stores), each read from its row of ``Src`` (zeros past ``COLS``): a
    packed source is read in one stretch a program. H200, 16K x 16 x 59 bf16 into 64 columns:
    19 us, 3.3 TB/s (torch's pad 52 us; 2026-12-02, call 2)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    t = r // heads  # once per row, not per element
    h = r - t * heads
    c = tl.arange(0, BLOCK_C)
    live = (r < rows)[:, None]
    x = tl.load(Src + (t * src_t + h * src_h)[:, None] + c[None, :],
                mask=live & (c[None, :] < COLS), other=0.0)
    tl.store(Dst + r[:, None] * ROW + c[None, :], x, mask=live & (c[None, :] < ROW))


def pad_rows(x: torch.Tensor, row: int) -> torch.Tensor:
    """``x [T, H, D]`` (unit stride along D, any token/head strides) copied into a fresh
    contiguous ``[T, H, row]`` with zeros past D, in one launch."""
    total, heads, dim = x.shape
    if x.stride(2) != 1 or row < dim:
        raise ValueError(f"pad_rows needs unit stride along D and row >= D, got "
                         f"{tuple(x.stride())} and {row} for D {dim}")
    out = torch.empty((total, heads, row), dtype=x.dtype, device=x.device)
    wide = padded_head_dim(row)
    block_r = max(_COPY_ELEMENTS // wide, 1)
    if total * heads:
        _pad_rows_kernel[(triton.cdiv(total * heads, block_r),)](
            x, out, total * heads, heads, x.stride(0), x.stride(1), COLS=dim, ROW=row,
            BLOCK_C=wide, BLOCK_R=block_r, num_warps=4,
        )
    return out
