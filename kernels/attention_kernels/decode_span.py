"""Decode with one program over a span of adjacent kv heads: ``decode``'s route for packed K/V
rows that are not whole 32-byte DRAM sectors (D 100: 200 bytes, D 200: 400).

``decode``'s programs each read one kv head's rows. Rows of 200 or 400 bytes start off sector
boundaries (D 100's off 16-byte ones too, read skewed: ``_launch.kv_shift``), and they cost
1.2-1.8x the GPU time of the next multiple of 16 (H200, bf16, 32q/8kv: D 100 / D 112 at 16 x
8192 163 / 126 us, D 200 / D 208 374 / 320 us). Here a program reads ``HG`` adjacent kv heads'
rows of a token at once: one contiguous span of ``HG * D`` elements that starts and ends on
32-byte boundaries (800 bytes at both dims), and computes all their query heads as the rows of
one block-diagonal ``[rows, SPAN] x [SPAN, BLOCK_N]`` dot: row ``r`` (query head ``r`` of the
span) holds q in its own kv head's columns and zeros elsewhere, so the other heads' keys add
exact zeros. P.V yields every head's columns for every row; each row keeps its own (a gather).
The wasted dot work (HG-fold) is free in a bandwidth-bound kernel: the same shapes take 110 /
209 us this way (2026-12-02, CUDA-graph GPU time), 0.87 / 0.65 of D 112's and D 208's decode.

An inf or NaN among another head's keys would turn a row's scores to NaN (0 x inf): as for
``decode``'s skewed tiles, a split whose sums end NaN reads its keys again, one head at a time
with the other heads' columns masked, so a head's output never depends on its neighbours'.

Split partials merge in ``decode_kernel``'s merge kernel (launched by ``decode_kernel._plan``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from attention_kernels._features import online_softmax_block
from attention_kernels._launch import KernelLaunch

# "auto": the measured rule (``span_heads``) on Hopper; "always": wherever the layout allows it
# (the CPU tests' way to run this kernel); "never": ``decode``'s per-head programs only.
SPAN_MODE = "auto"
SPAN_COLUMNS = 512  # the most columns a span takes: 4 heads of D 100, 2 of D 200
# (block_n, warps, stages), best of 8 tiles at D 100 / 200 x 7 shapes (H200, 2026-12-02):
# 16-key blocks lost 5-40%, 64-key ones 0-5%, 8 warps 10-25%, 3 stages +-2%.
SPAN_TILE = (32, 4, 2)
# The rule's smallest call, in keys over all sequences (batch x max_seqlen_k): at 1 x 4096 the
# span lost to decode (D 100 10.3 / 9.7 us, D 200 15.4 / 14.8); at 1 x 16384 it won at D 100
# (23.7 / 26.4) but not at D 200 (46.8 / 44.5), which wins from 1 x 32768 (72.4 / 82.1).
SPAN_MIN_KEYS = {2: 32768, 4: 16384}


def span_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, est_keys: int,
               hopper: bool) -> int:
    """Kv heads per span program for a contiguous decode call (``decode_kernel._plan`` asks it
    only for 16-bit K/V without window, softcap, ALiBi or a caller's config or split count), or
    0 for ``decode``'s own programs. ``est_keys``: the call's keys over all sequences."""
    head_dim, num_kv = q.shape[-1], k.shape[1]
    if SPAN_MODE == "never" or (SPAN_MODE == "auto" and not hopper):
        return 0
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype:
        return 0
    packed = k.stride(1) == head_dim and k.stride(2) == 1 and v.stride() == k.stride()
    if not packed or num_kv < 2:
        return 0
    hg = 1
    while num_kv % (2 * hg) == 0 and 2 * hg * head_dim <= SPAN_COLUMNS:
        hg *= 2
    if SPAN_MODE == "always":
        return hg
    # Spans of whole sectors over rows that are not, at D > 64 (2 or 4 heads a span). Odd
    # dims have none (D 111's 4-head span is 888 bytes; it lost 7-26% there); D 40 in spans of
    # 8 heads measured 0.9-1.0x. The base needs 16 bytes (the plan key's alignment,
    # ``_launch.call_key``; allocations are sector aligned).
    sector, elem = 32, k.element_size()
    rows_whole = head_dim * elem % sector == 0
    span_whole = (k.stride(0) * elem % sector == 0 and hg * head_dim * elem % sector == 0
                  and k.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0)
    # At most 16 query heads a span (ROWS): 32 (group 8 at 4 heads) took 255 registers and
    # spilled 92-132 bytes (sm_90a, D 100), 64 spilled 3-4 KB.
    too_many_rows = hg * (q.shape[1] // num_kv) > 16
    if rows_whole or not span_whole or head_dim <= 64 or too_many_rows:
        return 0
    if est_keys < SPAN_MIN_KEYS.get(hg, 1 << 62):
        return 0
    return hg


def span_split_count(units: int, est_seqlen: int, sms: int) -> int:
    """About two programs per SM (``units``: sequences x spans), splits of >= 4 key blocks.
    Half or twice that count measured 1-10% slower at D 100 / 200 (H200)."""
    block_n = SPAN_TILE[0]
    if sms == 0:  # off Hopper / the interpreter: a few splits, so the merge is exercised
        return max(1, min(4, est_seqlen // (2 * block_n)))
    return max(1, min(2 * sms // units, est_seqlen // (4 * block_n), 128))


def span_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hg: int, num_splits: int,
                block_d: int, return_lse: bool, pdl: bool, dot_f32: bool) -> KernelLaunch:
    """The span kernel's launch; its run-time arguments are ``decode_kernel._run``'s, with the
    scalars ``span_scalars`` made."""
    batch, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    block_n, warps, stages = SPAN_TILE
    elem = k.element_size()
    align = math.gcd(k.stride(0) * elem, hg * head_dim * elem, 16)
    row_align = math.gcd(align, head_dim * elem)
    if k.data_ptr() % 16 or v.data_ptr() % 16:  # the plan key holds no finer alignment
        align = row_align = 0
    return KernelLaunch(_decode_span_kernel, (num_splits, batch * (k.shape[1] // hg)), dict(
        HEAD_DIM=head_dim, BLOCK_D=block_d, HG=hg, GQ=group,
        ROWS=max(16, triton.next_power_of_2(hg * group)),
        SPAN=triton.next_power_of_2(hg * head_dim), BLOCK_N=block_n, DIRECT=num_splits == 1,
        PDL=pdl, RETURN_LSE=return_lse, ALIGN=align if align >= 4 else 0,
        ROW_ALIGN=row_align if row_align >= 4 else 0, DOT_F32=dot_f32,
        num_warps=warps, num_stages=stages))


def span_scalars(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hg: int, scale: float,
                 num_splits: int) -> tuple[object, ...]:
    num_heads, head_dim = q.shape[1:]
    return (q.stride(0), q.stride(1), k.stride(0), v.stride(0), num_heads * head_dim, head_dim,
            scale * 1.4426950408889634, k.shape[1] // hg, num_splits)


@triton.jit
def _blocks(q, k_base, v_base, stride_kt, stride_vt, lo, hi, qk_scale, offs, cols,
            BLOCK_N: tl.constexpr, ALIGN: tl.constexpr, DOT_F32: tl.constexpr):
    """Online softmax of ``q``'s rows over keys ``[lo, hi)``, K/V columns ``offs`` (``cols``
    of them read, the rest zeros) of rows marked ``ALIGN`` bytes aligned: un-normalised."""
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([q.shape[0]], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([q.shape[0]], dtype=tl.float32)
    acc = tl.zeros([q.shape[0], offs.shape[0]], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        rows = start_n + offs_n
        n_ok = rows < hi
        k_ptrs = k_base + rows[:, None].to(tl.int64) * stride_kt + offs[None, :]
        v_ptrs = v_base + rows[:, None].to(tl.int64) * stride_vt + offs[None, :]
        if ALIGN > 0:
            k_ptrs = tl.multiple_of(k_ptrs, [1, ALIGN])
            v_ptrs = tl.multiple_of(v_ptrs, [1, ALIGN])
        k = tl.load(k_ptrs, mask=n_ok[:, None] & cols[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=n_ok[:, None] & cols[None, :], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.where(n_ok[None, :], tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
        acc, l_i, m_i = online_softmax_block(s, v, m_i, l_i, acc, v_base.dtype.element_ty,
                                             DOT_F32)
    return acc, l_i, m_i


@triton.jit
def _normalised(acc, l_i, m_i):
    """``acc / l`` and the log2-domain lse (-inf, and zeros, where no key was seen)."""
    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    return o, tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))


@triton.jit(do_not_specialize=["num_groups", "num_splits"])
def _decode_span_kernel(
    Q, K, V, Out, Lse, OutPart, LsePart, Counter, cu_k, Table,
    stride_qb, stride_qh, stride_kt, stride_vt, stride_ob, stride_oh,
    qk_scale, num_groups, num_splits, Alibi, stride_ab, KScale, VScale, stride_sb,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HG: tl.constexpr, GQ: tl.constexpr,
    ROWS: tl.constexpr, SPAN: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
    PDL: tl.constexpr, RETURN_LSE: tl.constexpr, ALIGN: tl.constexpr, ROW_ALIGN: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """``K, V [total_k, H_kv, D]`` packed per token, ``cu_k`` their cu_seqlens. A program is a
    (split, sequence x span of ``HG`` kv heads). ``ALIGN``: the bytes a span starts at a multiple
    of; ``ROW_ALIGN``: a row (0: no mark). ``Counter``, ``Table``, ``Alibi`` and the
    scales are ``decode``'s launch arguments, unused here."""
    if PDL:  # the merge kernel may be scheduled now; it waits for this grid's end
        gdc_launch_dependents()
    split = tl.program_id(0)
    pid = tl.program_id(1)
    seq = pid // num_groups
    grp = pid % num_groups
    num_heads = num_groups * HG * GQ
    k_start = tl.load(cu_k + seq)
    seqlen = tl.load(cu_k + seq + 1) - k_start
    split_len = tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
    lo = tl.minimum(split * split_len, seqlen)
    hi = tl.minimum(lo + split_len, seqlen)

    offs_r = tl.arange(0, ROWS)
    offs_c = tl.arange(0, SPAN)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = offs_r < HG * GQ
    own = offs_r // GQ  # the row's kv head within the span
    heads = grp * (HG * GQ) + offs_r
    qcol = offs_c[None, :] - own[:, None] * HEAD_DIM
    q = tl.load(Q + seq.to(tl.int64) * stride_qb + heads[:, None].to(tl.int64) * stride_qh
                + qcol, mask=r_ok[:, None] & (qcol >= 0) & (qcol < HEAD_DIM), other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    first = grp.to(tl.int64) * (HG * HEAD_DIM)
    k_base = K + (k_start.to(tl.int64) * stride_kt + first)
    v_base = V + (k_start.to(tl.int64) * stride_vt + first)

    acc, l_i, m_i = _blocks(q, k_base, v_base, stride_kt, stride_vt, lo, hi, qk_scale, offs_c,
                            offs_c < HG * HEAD_DIM, BLOCK_N, ALIGN, DOT_F32)
    # Each row's own head's columns.
    idx = tl.minimum(own[:, None] * HEAD_DIM + offs_d[None, :], SPAN - 1)
    o, lse2 = _normalised(tl.gather(acc, tl.broadcast_to(idx, [ROWS, BLOCK_D]), 1), l_i, m_i)
    d_ok = offs_d < HEAD_DIM
    if tl.max((l_i != l_i).to(tl.int32), 0) > 0:
        # A NaN score: read the keys again one head at a time, that head's columns only, and
        # keep its rows. In the span's own loop this re-read took 255 registers and spilled
        # (sm_90a, D 100: 210 without it); one head's [rows, BLOCK_D] tiles fit beside it.
        q_rows = Q + seq.to(tl.int64) * stride_qb + heads[:, None].to(tl.int64) * stride_qh
        for h in range(HG):
            mine = own == h
            q_h = tl.load(q_rows + offs_d[None, :], mask=(r_ok & mine)[:, None] & d_ok[None, :],
                          other=0.0)
            if DOT_F32:
                q_h = q_h.to(tl.float32)
            acc_h, l_h, m_h = _blocks(q_h, k_base + h * HEAD_DIM, v_base + h * HEAD_DIM,
                                      stride_kt, stride_vt, lo, hi, qk_scale, offs_d, d_ok,
                                      BLOCK_N // 2, ROW_ALIGN, DOT_F32)
            o_h, lse_h = _normalised(acc_h, l_h, m_h)
            o = tl.where(mine[:, None], o_h, o)
            lse2 = tl.where(mine, lse_h, lse2)
    o = tl.where(d_ok[None, :], o, 0.0)
    if DIRECT:
        o_ptrs = (Out + seq.to(tl.int64) * stride_ob + heads[:, None].to(tl.int64) * stride_oh
                  + offs_d[None, :])
        tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
        if RETURN_LSE:
            tl.store(Lse + seq * num_heads + heads, lse2 * 0.6931471805599453, mask=r_ok)
    else:
        row = (seq * num_heads + heads).to(tl.int64) * num_splits + split  # [B*H, S] rows
        tl.store(OutPart + row[:, None] * BLOCK_D + offs_d[None, :], o, mask=r_ok[:, None],
                 cache_modifier=".wt")
        tl.store(LsePart + row, lse2, mask=r_ok, cache_modifier=".wt")
