"""Split-K flash-decoding in Triton: one new query token per sequence.

Decode reads every K/V byte once and does little arithmetic per byte, so it is bound by memory
bandwidth. Two choices follow:

* GQA head packing: one program owns a (sequence, kv head, split) and computes *all* query heads
  of that kv group as the rows of one ``[BLOCK_G, D] x [D, BLOCK_N]`` dot, so each K/V byte is
  loaded once per group rather than once per query head (4x less traffic at 32q/8kv heads).
* Split-K: at batch 1 there are only ``H_kv`` (sequence, kv head) pairs, far fewer than SMs, so
  the key range is split over ``num_splits`` programs. Each writes a normalised partial output and
  its log-sum-exp, then counts itself done on an atomic counter of its (sequence, kv head); the
  program that finishes last merges the group's partials in fp32. One launch, not a split kernel
  plus a merge kernel: at batch 1 the call is host-bound (the GPU work is ~9 us at 1 x 4K keys),
  and a second launch costs host time too. With one split the kernel writes the final output
  directly and nothing is counted.
* The merge loads ``[heads, splits, D]`` tiles (``MERGE_TILE_ELEMS``), all 16 splits of a 1 x
  4K call in one step. Merging one split per step made the fused tail a chain of dependent L2
  round trips: GPU time (CUDA graph, H100, 32q/8kv x 128 bf16) at 1 x 4K 10.3 -> 9.0 us, against
  cuDNN's 9.5; a merge kernel of its own measured 9.1 us and one launched as a programmatic
  dependent (PDL, ``MERGE_MODE = "pdl"``) 8.8 (``tune_decode_gpu.py --sweep merge``).
* Calls to be captured in a CUDA graph (``for_cuda_graphs()``) merge in that PDL kernel on
  Hopper: a replay costs no launch host time, so the second launch is free there and its GPU
  time the lowest: 1 x 4K 7.6 us against cuDNN's 9.6 (``MERGE_MODE`` "auto"); 7.1 us since
  a split runs one loop of masked loads instead of an unmasked loop and a masked tail.

The split length is chosen per sequence in the kernel (``cdiv(seqlen, num_splits)`` rounded up to
``BLOCK_N``), so ``cu_seqlens_k`` is never read on the host. With a sliding window the splits
share only the window's keys ``[seqlen - 1 - left, seqlen)`` (from its first key block): keys
before it are never read, and the automatic split count is sized on the window, not the cache.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from attention_kernels import decode_span
from attention_kernels._checks import (
    check_decode_inputs,
    check_features,
    check_kv_scales,
    check_outputs,
    check_paged_inputs,
)
from attention_kernels._features import (
    alibi_args,
    online_softmax_block,
    softcap_args,
    softcap_logits,
)
from attention_kernels._fp8_dot import f16_queries
from attention_kernels._launch import (
    KernelLaunch,
    PlanCache,
    call_key,
    kv_room,
    kv_shift,
    kv_tile,
    launch_inputs,
    no_keys,
    outputs,
    row_align,
    table_row_stride,
)
from attention_kernels._paging import (
    block_kv_ptrs,
    first_pages,
    kv_bases,
    q_and_kv_cols,
    row_ptrs,
    seq_keys,
    span_pages,
    unskew,
)
from attention_kernels.configs import (
    FAST_DRAM_SM_GBPS,
    TWO_WARP_TILE,
    WIDE_SKEW_TILE,
    DecodeConfig,
    _capability,
    decode_config,
    decode_shape_config,
    dot_in_fp32,
    dram_gbps,
    fast_dram_decode,
    interpreting,
    num_sms,
    padded_head_dim,
    paged_decode_config,
    paged_split_count,
    wide_skew_split_count,
)
from attention_kernels.fp8 import widened_queries

LOG2E = 1.4426950408889634
MAX_SPLITS = 128
# How the split partials are merged (tools/tuning/tune_decode_gpu.py compares them): "fused" (the
# group's last split program merges, after an atomic count), "separate" (a merge kernel), "pdl"
# (that kernel launched as a programmatic dependent, Hopper and later), or "auto": "pdl" for
# calls inside ``for_cuda_graphs()`` on Hopper, else "fused". A second launch costs host time
# on every eager call, but a graph replays both launches for nothing, and there the PDL merge
# is the fastest: GPU time at 1 x 4K (H100, CUDA graph) fused 8.9-9.1 us, PDL 7.5-7.7 against
# cuDNN's 9.5-9.6 (``tune_decode_gpu.py --sweep merge``, three runs).
MERGE_MODE = "auto"
_FOR_GRAPHS: contextvars.ContextVar[bool] = contextvars.ContextVar("for_graphs", default=False)
# Elements of one merge step's [group heads, splits, D] fp32 tile: 8192 at 4 heads x D 128 is
# 16 splits per step, 64 registers per thread at 4 warps. The splits per step depend on the
# group and head dim only, not the split count, so a group's variant serves every length (the
# warm-up compiles groups 1-8). Padding the heads to the dot's 16 rows instead (one variant
# for every group) cost 9.0 -> 9.8 us at 1 x 4K (tile 16384, 8 splits per step, H200).
MERGE_TILE_ELEMS = 8192
# The same for the merge kernel of its own ("separate"/"pdl"): 16384 (32 splits per step at 4
# heads x D 128) measured 8.3 / 7.6-7.7 us at 1 x 4K against 9.2 / 8.7-8.8 with 8192, in two
# runs on one H100 (tune_decode_gpu.py --sweep merge); the fused merge gained nothing from it.
MERGE_KERNEL_TILE_ELEMS = 16384
MERGE_KERNEL_WARPS = 4  # the merge kernel's warps (tune_decode_gpu.py --sweep merge)
# Paged decode: a split program holds the block-table entries of its whole key range in
# registers (``_paging.span_pages``), this many, where its range can span no more pages; else
# it looks each block's pages up one block ahead, and a block's loads wait for the previous
# iteration's lookup. One size, so a page size and tile make two variants (span or not), not
# one per table width and split count: on an H100, 16-token pages, GPU time (graph) of
# per-block lookups -> a span of 1024 (int32 entries) -> the smallest power-of-two span:
# 1 x 4K 10.1 -> 9.8 -> 9.8 us, 1 x 32K 52.3 -> 50.2 -> 50.0, 8 x 8K 95.2 -> 91.8 -> 91.8,
# 64 x 8K 704.9 -> 693.3 -> 691.4, 128 x 2K 363.2 -> 362.2 -> 361.5 (cuDNN 9.5, 50.3, 93.5,
# 692.8, 353.8). With int64 entries a span of 1024 lost at 8 x 8K (97.5 us).
PAGE_SPAN = 1024


@triton.jit
def _decode_inner(
    Q, acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, kv_offs_k, kv_offs_v,
    lo, hi, qk_scale, offs_n, k_cols, v_cols, k_row, table_row, seqlen, stride_kp, stride_vp,
    span, first, key_lo, cap_scale, cap_log2, slopes2,
    BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
    PAGED: tl.constexpr, PAGE_TOKENS: tl.constexpr, LOW_MASK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, KV_FP8: tl.constexpr,
    PAGE_SPAN: tl.constexpr, ROW_ALIGN: tl.constexpr, KV_SHIFT: tl.constexpr,
    ZERO_K: tl.constexpr,
):
    """Online-softmax update over keys ``[lo, hi)`` (log2 units). Contiguous: ``kv_offs_*`` are
    the tile's offsets from its first key. Paged: ``kv_offs_*`` are the head-dim offsets and
    each key's row comes from the sequence's block-table row ``table_row`` (``seqlen`` keys),
    through ``span, first`` (``span_pages``) when ``PAGE_SPAN`` > 0.
    Every block's loads are masked (keys at or past ``hi``, columns past the head dim): a split
    is a few blocks, and an unmasked loop plus a masked tail, two pipelined loops, cost more
    code than the masks. H100, GPU time of CUDA-graph replays, 32q/8kv x 128 bf16, two loops ->
    one, two rounds each (2026-11-24k, call 13, bench_paged.py --only decode): contiguous 1 x
    4K 7.5 / 7.4 -> 7.1 / 7.1 us (cuDNN 9.5-9.6), 1 x 32K 47.9 / 47.8 -> 47.4 / 47.6, 128 x
    2K 355.2 / 351.7 -> 351.4 / 351.4; paged (64-token pages) 1 x 4K 8.2 / 8.1 -> 8.1 / 8.1,
    1 x 32K 50.2 / 50.0 -> 49.6 / 49.7; no shape slower.
    ``LOW_MASK``: keys below ``key_lo`` (the window's left edge) are hidden too.
    Softcap / ALiBi: see ``_features``; ``slopes2`` are the rows' slopes times log2(e).
    ``KV_FP8``: K/V tiles are float8_e4m3fn, converted (exactly) to fp16 here, the dtype the
    caller brought ``q`` to (``_fp8_dot``); the caller folded K's scale into ``qk_scale`` /
    ``cap_scale`` and applies V's to the output.
    ``k_cols`` / ``v_cols``: the columns loaded; ``KV_SHIFT``: the tiles are skewed
    (``kv_bases``); ``ZERO_K``: K's columns outside its row (``k_row``, a neighbour's) are
    zeroed, so an inf there cannot reach this head's scores (0 * inf)."""
    page = first_pages(table_row, lo, offs_n, seqlen, PAGE_TOKENS, BLOCK_N, PAGED, span,
                       PAGE_SPAN)
    for start_n in range(lo, hi, BLOCK_N):
        k_ptrs, v_ptrs, page = block_kv_ptrs(
            k_base, v_base, kv_offs_k, kv_offs_v, page, first, table_row, start_n, offs_n,
            seqlen, stride_kp, stride_kt, stride_vp, stride_vt, PAGE_TOKENS, BLOCK_N, PAGED,
            PAGE_SPAN, ROW_ALIGN, KV_SHIFT)
        n_ok = (start_n + offs_n) < hi
        if LOW_MASK:
            n_ok = n_ok & ((start_n + offs_n) >= key_lo)
        k = tl.load(k_ptrs, mask=n_ok[:, None] & k_cols[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=n_ok[:, None] & v_cols[None, :], other=0.0)
        if ZERO_K:
            k = tl.where(k_row[None, :], k, 0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif KV_FP8:
            k = k.to(tl.float16)
            v = v.to(tl.float16)
        if HAS_SOFTCAP:
            qk = softcap_logits(tl.dot(q, tl.trans(k)), cap_scale, cap_log2)
        else:
            qk = tl.dot(q, tl.trans(k)) * qk_scale
        if HAS_ALIBI:
            # The query is the last key: its distance to key j is seqlen - 1 - j >= 0.
            dist = (seqlen - 1 - (start_n + offs_n)).to(tl.float32)
            qk = qk - slopes2[:, None] * dist[None, :]
        qk = tl.where(n_ok[None, :], qk, float("-inf"))
        # At least one key per block is valid, so the running max is finite after this block.
        acc, l_i, m_i = online_softmax_block(
            qk, v, m_i, l_i, acc, tl.float16 if KV_FP8 else Q.dtype.element_ty, DOT_F32)
    return acc, l_i, m_i


@triton.jit
def _merge_group(
    Out, Lse, OutPart, LsePart, seq, kv_head, group, offs_d, d_ok, stride_ob, stride_oh,
    num_heads, num_splits, BLOCK_D: tl.constexpr, MERGE_G: tl.constexpr, MERGE_S: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    """Merge the ``num_splits`` partials of the ``group`` query heads of (``seq``,
    ``kv_head``), ``MERGE_S`` splits of all heads per step: one ``[MERGE_G, MERGE_S, D]`` load
    rather than a chain of dependent per-split loads, so the merge costs about one L2 round trip
    when ``num_splits <= MERGE_S``.

    Other programs wrote the partials (in L2, write-through): loads use ``.cg`` (L2 only), so no
    stale L1 line can answer.
    """
    offs_g = tl.arange(0, MERGE_G)
    g_ok = offs_g < group
    heads = kv_head * group + offs_g
    rows = (seq * num_heads + heads).to(tl.int64) * num_splits  # first partial of each head
    offs_s = tl.arange(0, MERGE_S)
    m = tl.full([MERGE_G], float("-inf"), dtype=tl.float32)
    total = tl.zeros([MERGE_G], dtype=tl.float32)
    acc = tl.zeros([MERGE_G, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, MERGE_S):
        ok = g_ok[:, None] & ((s0 + offs_s) < num_splits)[None, :]
        idx = rows[:, None] + (s0 + offs_s)[None, :]
        lse_s = tl.load(LsePart + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(OutPart + idx[:, :, None] * BLOCK_D + offs_d[None, None, :],
                       mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse_s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: weights 0
        alpha = tl.math.exp2(m - shift)
        w = tl.math.exp2(lse_s - shift[:, None])
        total = total * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * part, 1)
        m = m_new
    seen = total > 0.0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    o_ptrs = (Out + seq.to(tl.int64) * stride_ob + heads[:, None].to(tl.int64) * stride_oh
              + offs_d[None, :])
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    if RETURN_LSE:
        lse2 = tl.where(m == float("-inf"), 0.0, m) + tl.math.log2(tl.where(seen, total, 1.0))
        lse = tl.where(seen, lse2 * 0.6931471805599453, float("-inf"))
        tl.store(Lse + seq * num_heads + heads, lse, mask=g_ok)


@triton.jit(do_not_specialize=["num_kv_heads", "group", "num_splits"])
def _decode_merge_kernel(
    Out, Lse, OutPart, LsePart, stride_ob, stride_oh, num_kv_heads, group, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MERGE_G: tl.constexpr,
    MERGE_S: tl.constexpr, RETURN_LSE: tl.constexpr, PDL: tl.constexpr,
):
    """The merge as a kernel of its own (``MERGE_MODE`` "separate"/"pdl"): one program per
    (sequence, kv head). With ``PDL`` it is launched while the split kernel still runs and
    waits here for its partials."""
    if PDL:
        gdc_wait()
    pid = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    _merge_group(Out, Lse, OutPart, LsePart, pid // num_kv_heads, pid % num_kv_heads, group,
                 offs_d, offs_d < HEAD_DIM, stride_ob, stride_oh, num_kv_heads * group,
                 num_splits, BLOCK_D, MERGE_G, MERGE_S, RETURN_LSE)


@triton.jit(do_not_specialize=["num_kv_heads", "group", "num_splits", "stride_tb", "win_left",
                               "stride_ab", "stride_sb"])
def _decode_split_kernel(
    Q, K, V, Out, Lse, OutPart, LsePart, Counter, cu_k, Table,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ob, stride_oh,
    stride_tb, stride_kp, stride_vp,
    qk_scale, num_kv_heads, group, num_splits,
    win_left, cap_scale, cap_log2, Alibi, stride_ab, KScale, VScale, stride_sb,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, FUSED_MERGE: tl.constexpr, MERGE_G: tl.constexpr,
    MERGE_S: tl.constexpr, PDL: tl.constexpr, RETURN_LSE: tl.constexpr, DOT_F32: tl.constexpr,
    PAGED: tl.constexpr, PAGE_TOKENS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    KV_FP8: tl.constexpr, PAGE_SPAN: tl.constexpr, ROW_ALIGN: tl.constexpr,
    KV_SHIFT: tl.constexpr,
):
    """Contiguous: ``K, V [total_k, H_kv, D]`` packed by ``cu_k``. Paged (``PAGED``): ``K, V``
    are the pages, ``cu_k`` holds ``seqlens_k`` and ``Table`` the block table; the page stride
    is ``stride_kp`` / ``stride_vp``, the token stride inside a page ``stride_kt`` / ``stride_vt``.
    Window (``HAS_WINDOW``): the query sees keys ``[seqlen - 1 - win_left, seqlen)``; that range,
    not the whole sequence, is split. ALiBi: the slope of (sequence b, head h) is
    ``Alibi[b * stride_ab + h]``. FP8 K/V (``KV_FP8``): kv head ``g`` of sequence ``b`` stands
    for its values times ``KScale[b * stride_sb + g]`` / ``VScale[...]`` (``stride_sb`` 0: one
    scale per kv head); the dots then run in fp16 (``_fp8_dot``). ``KV_SHIFT``: K/V tiles
    skewed to whole 16- or 8-byte loads (``kv_bases``); ``ROW_ALIGN`` then counts Q and Out
    only.
    """
    if PDL:  # the merge kernel may be scheduled now; it waits for this grid's end
        gdc_launch_dependents()
    split = tl.program_id(0)
    pid = tl.program_id(1)
    seq = pid // num_kv_heads
    kv_head = pid % num_kv_heads
    num_heads = num_kv_heads * group

    k_start, seqlen = seq_keys(cu_k, seq, PAGED)
    if HAS_WINDOW:
        # Keys before the window are never visited: the splits share [base, seqlen), base the
        # window's first key rounded down to a block; keys [base, key_lo) of that first block
        # are masked (``_decode_inner``'s ``LOW_MASK``).
        key_lo = tl.maximum(seqlen - 1 - win_left, 0)
        base = (key_lo // BLOCK_N) * BLOCK_N
        split_len = tl.cdiv(tl.cdiv(seqlen - base, num_splits), BLOCK_N) * BLOCK_N
        lo = tl.minimum(base + split * split_len, seqlen)
        hi = tl.minimum(lo + split_len, seqlen)
    else:
        key_lo = 0
        split_len = tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
        lo = tl.minimum(split * split_len, seqlen)
        hi = tl.minimum(lo + split_len, seqlen)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < group
    d_ok = offs_d < HEAD_DIM
    heads = kv_head * group + offs_g
    k_base, v_base, kv_offs_k, kv_offs_v, k_skew, v_skew = kv_bases(
        K, V, k_start, kv_head, offs_n, offs_d, stride_kt, stride_kh, stride_vt, stride_vh, PAGED,
        PAGE_TOKENS, BLOCK_N, KV_SHIFT,
    )
    q, k_cols, v_cols, k_row = q_and_kv_cols(
        Q + seq.to(tl.int64) * stride_qb + heads[:, None].to(tl.int64) * stride_qh, g_ok, offs_d,
        k_skew, v_skew, HEAD_DIM, KV_SHIFT, ROW_ALIGN)
    if DOT_F32:
        q = q.to(tl.float32)

    table_row = Table  # contiguous: None, never read
    if PAGED:
        table_row = Table + seq.to(tl.int64) * stride_tb

    if KV_FP8:  # q.(s k) = s (q.k): K's scale goes into the logit scale, V's onto the output
        k_s = tl.load(KScale + seq * stride_sb + kv_head)
        qk_scale = qk_scale * k_s
        if HAS_SOFTCAP:
            cap_scale = cap_scale * k_s
    if KV_FP8:  # the dots run in fp16 (_fp8_dot)
        q, q_unit = f16_queries(q)
        qk_scale = qk_scale * q_unit
        if HAS_SOFTCAP:
            cap_scale = cap_scale * q_unit

    slopes2 = Alibi  # None without ALiBi, never read
    if HAS_ALIBI:
        slopes2 = tl.load(Alibi + seq * stride_ab + heads, mask=g_ok, other=0.0)
        slopes2 = slopes2 * 1.4426950408889634

    # PAGE_SPAN: the table entries of this split's keys, looked up once for all its blocks.
    span, first = span_pages(table_row, lo, hi, PAGE_TOKENS, PAGED, PAGE_SPAN)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    acc, l_i, m_i = _decode_inner(
        Q, acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, kv_offs_k, kv_offs_v,
        lo, hi, qk_scale, offs_n, k_cols, v_cols, k_row, table_row, seqlen, stride_kp,
        stride_vp, span, first, key_lo, cap_scale, cap_log2, slopes2,
        BLOCK_N, DOT_F32, PAGED, PAGE_TOKENS, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, KV_FP8,
        PAGE_SPAN, ROW_ALIGN, KV_SHIFT, False,
    )
    # Skewed tiles hold a neighbouring head's K columns, against q's zeros there: only an inf
    # or NaN among them changes a score (to NaN), so only a split whose sums end NaN reads its
    # keys again with those columns zeroed. Zeroing every tile cost 9% at D 111 (H200, bf16,
    # 64 x 4096, 270 -> 247 us, 2026-12-02).
    if KV_SHIFT > 0:  # noqa: SIM102 (a compile-time test, then a run-time one)
        if tl.max((l_i != l_i).to(tl.int32), 0) > 0:
            m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
            acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
            # Its own key blocks, half as long: on the first loop's offsets ptxas kept both
            # loops' tiles live (sm_90a, D 111: decode 149 -> 255 registers, prefill 132 B
            # spilled; 4-9% of GPU time).
            SLOW_N: tl.constexpr = BLOCK_N // 2 if BLOCK_N >= 32 else BLOCK_N
            offs_n2 = tl.arange(0, SLOW_N)
            k_base2, v_base2, kv_offs_k2, kv_offs_v2, _, _ = kv_bases(
                K, V, k_start, kv_head, offs_n2, offs_d, stride_kt, stride_kh, stride_vt,
                stride_vh, PAGED, PAGE_TOKENS, SLOW_N, KV_SHIFT)
            lo2 = lo
            if HAS_WINDOW:
                # Every block must hold a key the window shows (``_decode_inner``): a half
                # block wholly below ``key_lo`` would give exp2(-inf - -inf), NaN.
                lo2 = tl.maximum(lo, (key_lo // SLOW_N) * SLOW_N)
            acc, l_i, m_i = _decode_inner(
                Q, acc, l_i, m_i, q, k_base2, v_base2, stride_kt, stride_vt, kv_offs_k2,
                kv_offs_v2, lo2, hi, qk_scale, offs_n2, k_cols, v_cols, k_row, table_row, seqlen,
                stride_kp, stride_vp, span, first, key_lo, cap_scale, cap_log2, slopes2,
                SLOW_N, DOT_F32, PAGED, PAGE_TOKENS, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI,
                KV_FP8, 0, ROW_ALIGN, KV_SHIFT, True,  # pages looked up per block: any size
            )

    if KV_FP8:
        acc = acc * tl.load(VScale + seq * stride_sb + kv_head)
    if KV_SHIFT > 0:
        acc = unskew(acc, v_skew, offs_d, BLOCK_D, HEAD_DIM)
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    # log2-domain lse of this split; -inf for an empty split (weight 0 in the merge).
    lse2 = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    if DIRECT:
        o_ptrs = row_ptrs(
            Out + seq.to(tl.int64) * stride_ob + heads[:, None].to(tl.int64) * stride_oh,
            offs_d[None, :], ROW_ALIGN)
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        if RETURN_LSE:
            tl.store(Lse + seq * num_heads + heads, lse2 * 0.6931471805599453, mask=g_ok)
    else:
        row = (seq * num_heads + heads).to(tl.int64) * num_splits + split  # [B*H, S] rows
        # All BLOCK_D columns (the padded ones are exact zeros) so the merge reads no garbage.
        # Write-through, so the partials are in L2 for whichever SM merges them.
        tl.store(OutPart + row[:, None] * BLOCK_D + offs_d[None, :], out, mask=g_ok[:, None],
                 cache_modifier=".wt")
        tl.store(LsePart + row, lse2, mask=g_ok, cache_modifier=".wt")
        if FUSED_MERGE:
            # Every thread's stores are issued before the count; acq_rel orders them (release)
            # before the last program's reads (acquire). The last of the group's programs
            # merges.
            tl.debug_barrier()
            done = tl.atomic_add(Counter + pid, 1, sem="acq_rel", scope="gpu")
            if done == num_splits - 1:
                _merge_group(Out, Lse, OutPart, LsePart, seq, kv_head, group, offs_d, d_ok,
                             stride_ob, stride_oh, num_heads, num_splits, BLOCK_D, MERGE_G,
                             MERGE_S, RETURN_LSE)
                # Every program of the group has counted: back to zero for the next call.
                tl.store(Counter + pid, 0)


# (device, stream) -> int32 counters, all zero between calls (each launch's last programs reset
# theirs). One buffer per stream: calls on a stream run in order, calls on different streams
# may overlap and must not share. A zeroed buffer per call would cost a memset kernel (~2 us of
# GPU time at batch 1, where the whole decode is ~10 us) and its host time.
_COUNTERS: dict[tuple[str, int], torch.Tensor] = {}


def _stream_key(device: torch.device) -> tuple[str, int] | None:
    """(device, current raw stream), or None while a CUDA graph is being captured (a graph
    owns its buffers: replays of graphs captured on one stream may run on several streams at
    once, and must never share a buffer that eager calls also use). The raw torch._C calls
    cost ~1 us where torch.cuda.current_stream(...) and is_current_stream_capturing() took
    ~12 us of a decode call's ~95 us host path (H100, cProfile)."""
    if device.type != "cuda":
        return (str(device), 0)
    if torch._C._cuda_isCurrentStreamCapturing():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (str(device), torch._C._cuda_getCurrentRawStream(index))


# (device, stream) -> the split partials' buffers of the last shape launched there. Calls on
# one stream run in order, so the next launch may reuse them: no allocation per call when
# the shape repeats (decode steps), and a new pair when it changes.
_WORKSPACE: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(rows: int, block_d: int, device: torch.device,
               key: tuple[str, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    ws = _WORKSPACE.get(key) if key is not None else None
    if ws is None or ws[0].shape != (rows, block_d):
        ws = (torch.empty((rows, block_d), dtype=torch.float32, device=device),
              torch.empty((rows,), dtype=torch.float32, device=device))
        if key is not None:
            _WORKSPACE[key] = ws
    return ws


def _counters(n: int, device: torch.device, key: tuple[str, int] | None = None) -> torch.Tensor:
    key = _stream_key(device) if key is None else key
    if key is None:  # capturing: the graph's own, zeroed by a memset inside the graph
        return torch.zeros(n, dtype=torch.int32, device=device)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        # Allocated on this stream, so a replaced buffer's memory is reused only after the
        # launches already queued here; only eager calls ever hold these buffers.
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def choose_num_splits(batch: int, num_kv_heads: int, est_seqlen: int, device: torch.device,
                      block_n: int) -> int:
    """Enough programs to keep every SM streaming, but splits of at least a few key blocks."""
    if device.type != "cuda":
        return max(1, min(4, triton.cdiv(est_seqlen, 4 * block_n)))
    units = batch * num_kv_heads
    # About one program per SM. Measured on an H100 (32q/8kv, D128, bf16): at batch 1 x 32K keys
    # 16 splits (128 programs) gave 2073 GB/s against 1948 for 48 and 1406 for 33 splits of
    # 128-key minimum; at 16 x 32K (128 programs) one split beat 3 and 4 (3123 vs ~3000 GB/s).
    # Rounded down: one program more than the SMs is a second wave. At batch 1 x 4K keys
    # (8 kv heads) 17 splits (136 programs) took 11.3 us of GPU time, 16 splits 9.0 us.
    target = num_sms(device.index or 0)
    if 2 * units >= target:
        return 1
    by_occupancy = target // units  # >= 2 here
    by_length = max(1, est_seqlen // (2 * block_n))  # splits of >= 2 key blocks
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    max_seqlen_k: int | None = None,
    softmax_scale: float | None = None,
    num_splits: int = 0,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    _config: DecodeConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query token per sequence against its packed keys/values.

    Args:
        q: ``[batch, H, D]``; ``k, v``: ``[total_k, H_kv, D]`` packed by ``cu_seqlens_k`` (int32
            ``[batch + 1]``, trusted values).
        max_seqlen_k: only a hint for the automatic split count (``total_k / batch`` otherwise);
            never read from the device.
        num_splits: 0 chooses from the SM count and lengths; any positive value is honoured
            (clamped to 128) and gives the same answer up to rounding.
        return_lse: also return float32 natural-log ``lse [batch, H]``.
        out / lse_out: optional preallocated contiguous outputs.
        window_size: ``(left, right)``, flash_attn's semantics with the query at position
            ``seqlen_k - 1``: it sees keys ``j >= seqlen_k - 1 - left`` (-1: all); ``right``
            hides nothing. Only the window's keys are read, and they are what the splits share.
        softcap: when > 0, logits are ``softcap * tanh(softmax_scale * q.k / softcap)``.
        alibi_slopes: float32 ``[H]`` or ``[batch, H]`` (trusted values): adds
            ``-slope * (seqlen_k - 1 - j)`` to the logit of key ``j`` (after the softcap).
        k_scale, v_scale: with float8_e4m3fn ``k, v`` (fp16/bf16 ``q``), float32 ``[H_kv]``:
            kv head ``g`` stands for ``k[:, g] * k_scale[g]`` (``attention_kernels.fp8``); or
            ``[batch, H_kv]``: each sequence's keys and values with scales of their own.
        q_scale: with float8_e4m3fn ``q`` (and FP8 ``k, v``), float32 ``[H_kv]`` or
            ``[batch, H_kv]`` (FlashAttention-3's ``q_descale``): the queries are widened to
            bf16 and their scale folded into the key scale (``fp8.widened_queries``, on every
            call: three small device ops before the reused set-up); the output is bf16.
    Empty sequences give zeros (lse -inf). A call whose inputs have the shapes, strides, dtypes,
    devices and alignment of an earlier call with the same other arguments reuses that call's
    checked set-up (``_launch``): a batch-1 decode loop pays ~1/3 of the host time.
    """
    q, k_scale, v_scale = widened_queries(q, k, q_scale, k_scale, v_scale, q.shape[0])
    mode = _merge_mode(q.device)
    key = _plan_key(False, q, k, v, cu_seqlens_k, None, max_seqlen_k, softmax_scale, num_splits,
                    return_lse, out, lse_out, window_size, softcap, alibi_slopes, k_scale,
                    v_scale, _config, mode)
    plan = _PLANS.get(key)
    if plan is None:
        check_decode_inputs(q, k, v, cu_seqlens_k)
        # Plain ints: triton.cdiv costs microseconds of host time per call at batch 1.
        est = max_seqlen_k if max_seqlen_k is not None else -(-k.shape[0] // max(1, q.shape[0]))
        plan = _plan(q, k, v, None, est, softmax_scale, num_splits, return_lse, _config, mode,
                     window_size, softcap, alibi_slopes, k_scale, v_scale, out, lse_out)
        _PLANS.put(key, plan)
    return _run(plan, q, k, v, cu_seqlens_k, None, out, lse_out, alibi_slopes, k_scale,
                v_scale)


def paged_decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seqlens_k: torch.Tensor,
    *,
    max_seqlen_k: int | None = None,
    softmax_scale: float | None = None,
    num_splits: int = 0,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    _config: DecodeConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``decode`` over a paged KV cache (``flash_attn_with_kvcache``'s layout).

    Args:
        q: ``[batch, H, D]``.
        k_pages, v_pages: ``[num_pages, page_tokens, H_kv, D]``, unit stride along ``D``, any
            other strides (e.g. K and V of a page interleaved in one pool).
        block_table: int32 ``[batch, max_pages_per_seq]``: key ``j`` of sequence ``b`` is
            ``k_pages[block_table[b, j // page_tokens], j % page_tokens]``. Entries past a
            sequence's length are never read.
        seqlens_k: int32 ``[batch]`` keys per sequence (trusted values, 0 allowed).
        max_seqlen_k: a host-side hint for the split count (``max_pages_per_seq * page_tokens``
            otherwise, an upper bound); never read from the device.
        Other arguments (``window_size``, ``softcap``, ``alibi_slopes``, the FP8 scales
        included) and the outputs as in ``decode``. One compiled variant per page size.
    """
    q, k_scale, v_scale = widened_queries(q, k_pages, q_scale, k_scale, v_scale, q.shape[0])
    mode = _merge_mode(q.device)
    key = _plan_key(True, q, k_pages, v_pages, seqlens_k, block_table, max_seqlen_k,
                    softmax_scale, num_splits, return_lse, out, lse_out, window_size, softcap,
                    alibi_slopes, k_scale, v_scale, _config, mode)
    plan = _PLANS.get(key)
    if plan is None:
        check_paged_inputs(q, k_pages, v_pages, block_table, seqlens_k)
        est = (max_seqlen_k if max_seqlen_k is not None
               else block_table.shape[1] * k_pages.shape[1])
        plan = _plan(q, k_pages, v_pages, block_table, est, softmax_scale, num_splits,
                     return_lse, _config, mode, window_size, softcap, alibi_slopes, k_scale,
                     v_scale, out, lse_out)
        _PLANS.put(key, plan)
    return _run(plan, q, k_pages, v_pages, seqlens_k, block_table, out, lse_out, alibi_slopes,
                k_scale, v_scale)


def _check_kernel_args(q: torch.Tensor, num_splits: int) -> None:
    if q.dtype == torch.float64:
        raise ValueError("float64 is supported by the references only; kernels take "
                         "fp16/bf16/fp32")
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0, got {num_splits}")


# Checked launch set-ups by call signature (``_plan_key``); see ``_launch``.
_PLANS = PlanCache()


def _plan_key(paged: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              lens: torch.Tensor, table: torch.Tensor | None, max_seqlen_k: object,
              softmax_scale: object, num_splits: object, return_lse: object,
              out: torch.Tensor | None, lse_out: torch.Tensor | None, window_size: object,
              softcap: object, alibi_slopes: object, k_scale: object, v_scale: object,
              config: DecodeConfig | None, merge_mode: str) -> tuple | None:
    """Everything a decode call's checks and set-up read (``_launch.call_key``)."""
    return call_key((q, k, v, lens, table, out, lse_out if return_lse else None, alibi_slopes,
                     k_scale, v_scale),
                    (paged, max_seqlen_k, softmax_scale, num_splits, return_lse, softcap,
                     config, merge_mode, MERGE_TILE_ELEMS, MERGE_KERNEL_TILE_ELEMS,
                     MERGE_KERNEL_WARPS, kv_room(k, v), decode_span.SPAN_MODE),
                    window_size)


@dataclass(frozen=True, slots=True)
class _DecodePlan:
    """A checked decode call's derived set-up; ``_run`` launches it on the call's tensors."""

    out_shape: tuple[int, int, int]
    dtype: torch.dtype
    return_lse: bool
    empty: bool  # no launch: batch 0 (nothing to write) or no pages
    zero_fill: bool  # empty with sequences but no pages: zeros, lse -inf
    copy_q: bool  # inputs without unit stride along D go through a contiguous copy
    copy_kv: bool
    direct: bool  # one split: the kernel writes the output, no partials and no counters
    workspace_rows: int
    block_d: int
    counters: int
    scalars: tuple[object, ...]  # the launch arguments between the tensors and the features
    stride_ab: int | None
    launch: KernelLaunch | None  # None when empty
    merge: KernelLaunch | None  # the merge kernel (merge mode "separate"/"pdl"), else None
    merge_scalars: tuple[int, ...]


def _plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor | None,
    est_seqlen: int,
    softmax_scale: float | None,
    num_splits: int,
    return_lse: bool,
    config: DecodeConfig | None,
    merge_mode: str,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    out: torch.Tensor | None,
    lse_out: torch.Tensor | None,
) -> _DecodePlan:
    """The checks decode and paged decode share, then the call's set-up; the caller checked
    the inputs. Contiguous (``table`` None): ``k, v [total_k, H_kv, D]``. Paged: ``k, v`` are
    the pages."""
    fp8 = check_kv_scales(k, k_scale, v_scale, q.shape[0])
    win_left = check_features(window_size, softcap, alibi_slopes, q.shape[1], q.shape[0],
                              q.device)[0]  # the window's left bound (-1: none)
    _check_kernel_args(q, num_splits)
    check_outputs(out, lse_out, return_lse, tuple(q.shape), tuple(q.shape[:2]), q.dtype,
                  q.device)
    copy_q = q.stride(-1) != 1
    copy_kv = table is None and (k.stride(-1) != 1 or v.stride(-1) != 1)
    if copy_q:
        q = q.contiguous()
    if copy_kv:
        k, v = k.contiguous(), v.contiguous()
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[-2]
    group = num_heads // num_kv_heads
    if batch == 0 or (table is not None and (k.shape[0] == 0 or table.shape[1] == 0)):
        return _DecodePlan(
            out_shape=(batch, num_heads, head_dim), dtype=q.dtype, return_lse=return_lse,
            empty=True, zero_fill=batch > 0, copy_q=False, copy_kv=False, direct=True,
            workspace_rows=0, block_d=0,
            counters=0, scalars=(), stride_ab=None, launch=None, merge=None,
            merge_scalars=())
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    # Contiguous 16-bit rows that are not whole sectors: a program over a span of kv heads
    # (``decode_span``), where nothing asks for decode's own tiles, splits or options.
    if (table is None and config is None and num_splits == 0 and not fp8 and softcap <= 0
            and alibi_slopes is None and not 0 <= win_left < k.shape[0]):
        hg = decode_span.span_heads(q, k, v, batch * est_seqlen, _hopper(q.device))
        if hg:
            return _span_plan(q, k, v, hg, est_seqlen, scale, return_lse, merge_mode, copy_q,
                              copy_kv)
    if table is None:
        # None for the paged-only arguments: Triton makes them compile-time constants, so the
        # contiguous launch passes (and costs) no more than it did before paging existed.
        page_tokens = 1
        strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1), None, None, None)
    else:
        page_tokens = k.shape[1]
        strides = (k.stride(1), k.stride(2), v.stride(1), v.stride(2), table_row_stride(table),
                   k.stride(0), v.stride(0))
    block_d, shift = kv_tile(k, v, strides, head_dim)
    # Skewed tiles are chosen by their width (which may be twice the padded head dim).
    tile_dim = block_d if shift else head_dim
    if config is not None:
        cfg = config
    elif table is None:
        cfg = decode_config(tile_dim, q.dtype, q.device, fp8, shift > 0)
    else:
        cfg = paged_decode_config(tile_dim, q.dtype, q.device, fp8, shift > 0)
    # A left bound past any sequence's length hides nothing: no window variant for it.
    max_keys = k.shape[0] if table is None else table.shape[1] * k.shape[1]
    has_window = 0 <= win_left < max_keys
    if has_window:
        # At most left + 1 keys are read per sequence (+ one block of alignment): split those.
        est_seqlen = min(est_seqlen, win_left + 1 + cfg.block_n)
    cap_scale, cap_log2 = softcap_args(softcap, scale)
    stride_ab = alibi_args(alibi_slopes, num_heads)[1]
    sms = _shape_rule_sms(q.device) if config is None and not fp8 else 0
    units = batch * num_kv_heads
    # 16-bit skewed rows that do not fit the padded 64 (D 59) read in 128-wide tiles: their own
    # rules (``configs.wide_skew_split_count``), measured there on contiguous keys only.
    wide = (bool(sms) and table is None and block_d == 128 and padded_head_dim(head_dim) == 64
            and k.element_size() == 2)
    # On GPUs whose DRAM feeds each SM faster (an H200), narrow 16-byte rows and odd dims'
    # skewed rows take tiles and split counts of their own (``configs.fast_dram_decode``).
    rule = None
    if table is None and k.element_size() == 2 and sms and fast_dram(q.device):
        rule = fast_dram_rule(k, v, strides, head_dim, block_d, shift, units, est_seqlen, sms)
    if rule is not None:
        cfg = rule[0]
        num_splits = num_splits or rule[1]
    if num_splits == 0:
        if wide:
            num_splits = wide_skew_split_count(units, est_seqlen, sms)
        else:
            num_splits = choose_num_splits(batch, num_kv_heads, est_seqlen, q.device,
                                           cfg.block_n)
        if sms and table is not None:
            num_splits = paged_split_count(num_splits, est_seqlen, cfg.block_n, units, sms,
                                           _dram_gbps(q.device))
    num_splits = min(num_splits, MAX_SPLITS)
    if wide and units <= 3 * sms:
        cfg = WIDE_SKEW_TILE
    elif wide and num_splits == 1:
        # See ``wide_skew_split_count``: the padded width in 8-byte pieces where the skews fit
        # it (D 59: up to 3; not D 63, which keeps the 128-wide tile and the rules below).
        narrow = kv_shift(k, v, strides, head_dim, 64, piece=8)
        if narrow:
            block_d, shift, cfg = 64, narrow, TWO_WARP_TILE
    if sms:
        cfg = decode_shape_config(cfg, batch * num_kv_heads, num_splits,
                                  -(-est_seqlen // num_splits), sms, block_d,
                                  paged=table is not None,
                                  page_tokens=0 if table is None else k.shape[1],
                                  gbps=_dram_gbps(q.device))
    page_span = 0 if table is None else _page_span(table.shape[1] * page_tokens, num_splits,
                                                   cfg.block_n, page_tokens)
    # Outputs are contiguous [batch, H, D] (fresh, or checked so).
    scalars = (q.stride(0), q.stride(1), *strides[:4], num_heads * head_dim, head_dim,
               *strides[4:], scale * LOG2E, num_kv_heads, group, num_splits,
               win_left if has_window else None, cap_scale, cap_log2)
    direct = num_splits == 1
    mode = "fused" if direct else merge_mode
    merge_g = triton.next_power_of_2(group)
    merge_s = _merge_splits(merge_g, block_d, MERGE_TILE_ELEMS if mode == "fused"
                            else MERGE_KERNEL_TILE_ELEMS)
    merge = None if direct or mode == "fused" else _merge_launch(q, num_kv_heads, block_d, mode,
                                                                  return_lse)
    fused = not direct and mode == "fused"
    launch = KernelLaunch(
        _decode_split_kernel, (num_splits, batch * num_kv_heads), dict(
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_G=max(16, merge_g),
            BLOCK_N=cfg.block_n, DIRECT=direct, FUSED_MERGE=fused,
            # Unused without the fused merge: fixed, so they make no variant of their own.
            MERGE_G=merge_g if fused else 1, MERGE_S=merge_s if fused else 1,
            PDL=mode == "pdl", RETURN_LSE=return_lse,
            DOT_F32=dot_in_fp32(q.dtype) and not fp8, PAGED=table is not None,
            PAGE_TOKENS=page_tokens, HAS_WINDOW=has_window, HAS_SOFTCAP=cap_scale is not None,
            HAS_ALIBI=alibi_slopes is not None, KV_FP8=fp8,
            PAGE_SPAN=page_span, ROW_ALIGN=row_align(q, k, v, out, strides, shift > 0),
            KV_SHIFT=shift,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        ))
    return _DecodePlan(
        out_shape=(batch, num_heads, head_dim), dtype=q.dtype, return_lse=return_lse,
        empty=False, zero_fill=False, copy_q=copy_q, copy_kv=copy_kv, direct=direct,
        workspace_rows=batch * num_heads * num_splits, block_d=block_d,
        counters=batch * num_kv_heads if merge is None else 0, scalars=scalars,
        stride_ab=stride_ab, launch=launch, merge=merge,
        merge_scalars=(num_heads * head_dim, head_dim, num_kv_heads, group, num_splits),
    )


def _merge_launch(q: torch.Tensor, num_kv_heads: int, block_d: int, mode: str,
                  return_lse: bool) -> KernelLaunch:
    """The merge kernel of its own (merge mode "separate" or "pdl")."""
    batch, num_heads, head_dim = q.shape
    merge_g = triton.next_power_of_2(num_heads // num_kv_heads)
    return KernelLaunch(
        _decode_merge_kernel, (batch * num_kv_heads,), dict(
            HEAD_DIM=head_dim, BLOCK_D=block_d, MERGE_G=merge_g,
            MERGE_S=_merge_splits(merge_g, block_d, MERGE_KERNEL_TILE_ELEMS),
            RETURN_LSE=return_lse, PDL=mode == "pdl", launch_pdl=mode == "pdl",
            num_warps=MERGE_KERNEL_WARPS, num_stages=1))


def _span_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hg: int, est_seqlen: int,
               scale: float, return_lse: bool, merge_mode: str, copy_q: bool,
               copy_kv: bool) -> _DecodePlan:
    """A contiguous call on ``decode_span``'s programs over ``hg`` kv heads each; its splits
    merge in the merge kernel ("fused" counts on a (sequence, kv head) the span does not
    own). ``q``, ``k``, ``v`` as launched: the copies ``copy_q`` / ``copy_kv`` say ``_run``
    makes."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_splits = decode_span.span_split_count(batch * (num_kv_heads // hg), est_seqlen,
                                              _shape_rule_sms(q.device))
    block_d = padded_head_dim(head_dim)
    direct = num_splits == 1
    mode = "pdl" if merge_mode == "pdl" else "separate"
    pdl = mode == "pdl" and not direct
    return _DecodePlan(
        out_shape=(batch, num_heads, head_dim), dtype=q.dtype, return_lse=return_lse,
        empty=False, zero_fill=False, copy_q=copy_q, copy_kv=copy_kv, direct=direct,
        workspace_rows=batch * num_heads * num_splits, block_d=block_d, counters=0,
        scalars=decode_span.span_scalars(q, k, v, hg, scale, num_splits), stride_ab=None,
        launch=decode_span.span_launch(q, k, v, hg, num_splits, block_d, return_lse, pdl,
                                       dot_in_fp32(q.dtype)),
        merge=None if direct else _merge_launch(q, num_kv_heads, block_d, mode, return_lse),
        merge_scalars=(num_heads * head_dim, head_dim, num_kv_heads,
                       num_heads // num_kv_heads, num_splits),
    )


@contextlib.contextmanager
def for_cuda_graphs() -> Iterator[None]:
    """Decode calls inside are, or will be, captured in CUDA graphs, where a launch costs no
    host time: on Hopper their split partials merge in a kernel of its own, launched as a
    programmatic dependent (``MERGE_MODE`` "auto"), the lowest GPU time. Make the same calls
    once eagerly inside it before capturing them, so their kernels compile outside the capture
    (a Triton compile inside one failed for an fp32 variant on an H100)."""
    token = _FOR_GRAPHS.set(True)
    try:
        yield
    finally:
        _FOR_GRAPHS.reset(token)


def _hopper_index(device: torch.device) -> int | None:
    """The index of ``device`` when it is a Hopper GPU (compute capability 9.x: where PDL, the
    merge modes and the shape rule were measured), else None; never under the interpreter."""
    if device.type != "cuda" or interpreting():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return index if _capability(index)[0] == 9 else None


def _hopper(device: torch.device) -> bool:
    return _hopper_index(device) is not None


def _merge_mode(device: torch.device) -> str:
    """The merge a split call on ``device`` takes now (a plan key part): ``MERGE_MODE`` with
    "auto" resolved, and "pdl" run as "separate" where PDL was not measured (off Hopper) or
    does not exist (the interpreter)."""
    mode = MERGE_MODE
    if mode == "auto":
        return "pdl" if _FOR_GRAPHS.get() and _hopper(device) else "fused"
    if mode == "pdl" and not _hopper(device):
        return "separate"
    return mode


def _page_span(max_keys: int, num_splits: int, block_n: int, page_tokens: int) -> int:
    """The kernel's ``PAGE_SPAN`` for splits of sequences of at most ``max_keys`` keys:
    ``PAGE_SPAN`` where a key block spans several pages and a split can touch no more than
    ``PAGE_SPAN`` pages, else 0 (per-block lookups). A split starts at a multiple of
    ``block_n`` and spans a multiple of it (the kernel's ``split_len``)."""
    if page_tokens >= block_n:
        # A block within one page looks it up in one scalar load: a span saved nothing there
        # and its gather cost (1 x 4K, 64-token pages: 9.3 -> 9.7 us; H100).
        return 0
    per_split = -(-max_keys // num_splits)
    split_len = -(-per_split // block_n) * block_n
    if block_n % page_tokens == 0:  # starts on a page
        pages = split_len // page_tokens
    else:
        pages = (split_len + page_tokens - 2) // page_tokens + 1
    return PAGE_SPAN if pages <= PAGE_SPAN else 0


def _merge_splits(merge_g: int, block_d: int, tile_elems: int) -> int:
    """Splits per merge step: the largest power of two whose tile fits ``tile_elems``."""
    per_split = merge_g * block_d
    return max(1, 1 << max(0, (tile_elems // per_split).bit_length() - 1))


def _dram_gbps(device: torch.device) -> float:
    """``device``'s DRAM GB/s where the shape rules were measured (Hopper GPUs), else 0."""
    index = _hopper_index(device)
    return 0.0 if index is None else dram_gbps(index)


def fast_dram(device: torch.device) -> bool:
    """A Hopper GPU whose DRAM feeds each SM at least ``FAST_DRAM_SM_GBPS`` (an H200), where
    ``configs.fast_dram_decode``'s tiles were measured."""
    sms = _shape_rule_sms(device)
    return bool(sms) and _dram_gbps(device) >= FAST_DRAM_SM_GBPS * sms


def fast_dram_rule(k: torch.Tensor, v: torch.Tensor, strides: tuple[int | None, ...],
                   head_dim: int, block_d: int, shift: int, units: int, est_seqlen: int,
                   sms: int) -> tuple[DecodeConfig, int] | None:
    """``configs.fast_dram_decode`` for contiguous 16-bit K/V of these ``strides`` read in
    (``block_d``, ``shift``) tiles (``kv_tile``); the plan's and the warm-up's."""
    rows16 = (k.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0
              and all(s * k.element_size() % 16 == 0 for s in (*strides[:4], head_dim)))
    return fast_dram_decode(units, est_seqlen, sms, head_dim, block_d, shift > 0, rows16)


def _shape_rule_sms(device: torch.device) -> int:
    """The SM count where ``decode_shape_config`` was measured (Hopper GPUs), else 0."""
    index = _hopper_index(device)
    return 0 if index is None else num_sms(index)


def _run(
    plan: _DecodePlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: torch.Tensor,
    table: torch.Tensor | None,
    out: torch.Tensor | None,
    lse_out: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Launch ``plan`` on a call's tensors (which passed the checks its key stands for)."""
    device = q.device
    out, lse = outputs(out, lse_out, plan.return_lse, plan.out_shape, plan.out_shape[:2],
                       plan.dtype, device)
    if plan.empty:
        if plan.zero_fill:
            no_keys(out, lse, plan.return_lse)
        return (out, lse) if plan.return_lse else out
    q, k, v, table, slopes, ks, vs, stride_sb = launch_inputs(
        plan, q, k, v, table, alibi_slopes, k_scale, v_scale)
    if lens.stride(0) != 1:
        lens = lens.contiguous()
    if plan.direct:
        out_part = lse_part = counter = out  # unused dummies
    else:
        key = _stream_key(device)
        out_part, lse_part = _workspace(plan.workspace_rows, plan.block_d, device, key)
        counter = _counters(plan.counters, device, key) if plan.counters else out
    assert plan.launch is not None
    with _on_device(device):  # Triton launches on the current device's current stream
        plan.launch(q, k, v, out, lse, out_part, lse_part, counter, lens, table, *plan.scalars,
                    slopes, plan.stride_ab, ks, vs, stride_sb)
        if plan.merge is not None:
            plan.merge(out, lse, out_part, lse_part, *plan.merge_scalars)
    return (out, lse) if plan.return_lse else out


def _on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    # The common case (already current) skips the device switch and its host time.
    if device.type == "cuda" and device.index != torch._C._cuda_getDevice():
        return torch.cuda.device(device)
    return contextlib.nullcontext()
