"""Variable-length flash-attention prefill (forward) in Triton.

Layout: ``q [total_q, H, D]``, ``k, v [total_k, H_kv, D]`` packed by ``cu_seqlens``. One program
computes one (sequence, query block, head) tile with an online softmax in fp32.

Scheduling: programs map to real tiles without reading ``cu_seqlens`` on the host. Sequence ``b``
owns the tile slots ``[cu_q[b] // BLOCK_M + b, cu_q[b+1] // BLOCK_M + b + 1)``: that range is
never shorter than ``cdiv(seqlen_b, BLOCK_M)`` and wastes at most two slots per sequence, so the
grid is ``total_q // BLOCK_M + batch + 1`` slots (known from shapes alone) instead of
``batch * cdiv(max_seqlen, BLOCK_M)``, which for lengths ``[78, 40, 8192]`` would be two-thirds
empty programs. Slots run in reverse so each sequence's last query blocks, which see the most keys
under a causal mask, are dispatched first. Masked launches (causal, window) make heads the
fastest-varying index, so all heads of a heavy tile start together; unmasked ones run every slot
of a head before the next head, so the resident programs share that head's K/V in L2
(``_prefill_slots.SLOT_RUN``: 1-7% more TFLOP/s without a mask, none with one).

Causal work skipping (bottom-right aligned, ``offset = seqlen_k - seqlen_q``): a query block
starting at row ``r0`` visits keys ``[0, n_full)`` without any mask, where every key is visible to
every row of the block, then ``[n_full, n_end)`` with the mask, where ``n_end`` is the last row's
bound. Key blocks above the diagonal are never loaded. This generalises the tutorial's
``range(start_m + 1)`` bound to ``BLOCK_M != BLOCK_N`` and to ``seqlen_q != seqlen_k``.

Sliding window (``window_size``, flash_attn's semantics) skips the same way, on both edges: a
query block visits only the key blocks between the first key its first row sees and the last
key its last row sees, in three stages: the left edge masked, then blocks every row sees in full
(unmasked, TMA where enabled), then the right edge or diagonal masked. Causal is the window's
right bound 0. Softcap and ALiBi only change the logits; all three are compile-time flags, so
a launch without them compiles to the code it compiled to before they existed.

Loads: on Hopper at D 128 the unmasked key loop reads K/V through tensor descriptors (the TMA
copy engine), worth 7-11% there (see ``_TMA_HEAD_DIMS``) for launches with enough work to hide
the descriptors' host cost (``_TMA_MIN_WORK``); masked blocks always use masked
pointer loads so a block that crosses into the next sequence never brings its values in.

On sm_90 such launches without window, softcap or ALiBi take the warp-specialized Gluon kernel
(``prefill_hopper``; ``_gluon_ok``) instead: at D 64 and 128 directly, at D 40-127 at the next
of them, on copies of k and v padded with zeros (q too unless its heads start on 16-byte
boundaries) with only ``out``'s columns stored (``_padded_gluon_dim``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from attention_kernels._checks import (
    check_features,
    check_kv_scales,
    check_outputs,
    check_paged_inputs,
    check_prefill_inputs,
    check_query_scale,
)
from attention_kernels._features import alibi_args, softcap_args, softcap_logits
from attention_kernels._fp8_dot import f16_queries
from attention_kernels._launch import (
    KernelLaunch,
    PlanCache,
    call_key,
    kv_room,
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
    unskew,
)
from attention_kernels._prefill_slots import causal_key_range, program_tile, slot_grid
from attention_kernels.configs import (
    PrefillConfig,
    _capability,
    dot_in_fp32,
    interpreting,
    many_programs,
    num_sms,
    padded_head_dim,
    prefill_config,
    short_rows_bucket,
)
from attention_kernels.fp8 import folded_scales, widened_queries
from attention_kernels.kv_copies import pad_rows, widen_kv
from attention_kernels.prefill_hopper import hopper_prefill_ws

LOG2E = 1.4426950408889634
# Sequences scanned per step when a program looks up its sequence. A constant, not a function of
# the batch size: with next_power_of_2(batch) each new batch size of the batching server compiled
# a new kernel variant (~1.8 s stall each on an H100).
_SEQ_SEARCH_BLOCK = 64
LN2 = 0.6931471805599453


@triton.jit
def _logits(qk, qk_scale, cap_scale, cap_log2, alibi2, pos_f, start_n, offs_n,
            HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Log2-unit logits of a raw ``q.k`` tile under softcap and/or ALiBi."""
    s = softcap_logits(qk, cap_scale, cap_log2) if HAS_SOFTCAP else qk * qk_scale
    if HAS_ALIBI:
        key_f = (start_n + offs_n).to(tl.float32)
        s = s - alibi2 * tl.abs(pos_f[:, None] - key_f[None, :])
    return s


@triton.jit
def _prefill_inner(
    Q, acc, l_i, m_i, q,
    k_base, v_base, stride_kt, stride_vt, kv_offs_k, kv_offs_v,
    desc_k, desc_v, k_row0, kv_col,
    lo, hi, seqlen_k, causal_offset, qk_scale,
    offs_m, offs_n, k_cols, v_cols, k_row, table_row, stride_kp, stride_vp,
    win_left, win_right, cap_scale, cap_log2, alibi2, pos_f,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, USE_TMA: tl.constexpr, PAGED: tl.constexpr, PAGE_TOKENS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    KV_FP8: tl.constexpr, WARP_SPEC: tl.constexpr, ROW_ALIGN: tl.constexpr,
    KV_SHIFT: tl.constexpr, ZERO_K: tl.constexpr,
):
    """Online-softmax update over key blocks ``[lo, hi)``; scores are in log2 units.
    Contiguous: ``kv_offs_*`` are the tile's offsets from its first key. Paged: ``kv_offs_*``
    are the head-dim offsets and each key's row comes from the block-table row ``table_row``.
    Window (masked blocks only; ``IS_CAUSAL`` is then folded into ``win_right = 0``): row ``r``
    at key position ``p = r + causal_offset`` keeps keys ``p - win_left <= j <= p + win_right``.
    Softcap / ALiBi: see ``_features``; ``alibi2`` is this head's slope times log2(e) and
    ``pos_f`` the rows' key positions as floats. ``KV_FP8``: K/V tiles are float8_e4m3fn,
    converted (exactly) to fp16, the dtype the caller brought ``q`` to (``_fp8_dot``); their
    scales are the caller's. ``k_cols`` / ``v_cols``: the columns loaded; ``KV_SHIFT``: the
    tiles are skewed (``kv_bases``); ``ZERO_K``: K's columns outside its row (``k_row``, a
    neighbour's) are zeroed, so an inf there cannot reach this head's scores (0 * inf)."""
    page = first_pages(table_row, lo, offs_n, seqlen_k, PAGE_TOKENS, BLOCK_N, PAGED)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        k_ptrs, v_ptrs, page = block_kv_ptrs(
            k_base, v_base, kv_offs_k, kv_offs_v, page, 0, table_row, start_n, offs_n,
            seqlen_k, stride_kp, stride_kt, stride_vp, stride_vt, PAGE_TOKENS, BLOCK_N, PAGED,
            0, ROW_ALIGN, KV_SHIFT)
        if MASKED:
            n_ok = (start_n + offs_n) < seqlen_k
            k = tl.load(k_ptrs, mask=n_ok[:, None] & k_cols[None, :], other=0.0)
        elif USE_TMA:
            # Whole blocks inside this sequence: the copy engine moves them (no address math).
            k = desc_k.load([k_row0 + start_n, kv_col])
        elif EVEN_D:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=k_cols[None, :], other=0.0)
        if ZERO_K:
            k = tl.where(k_row[None, :], k, 0.0)
        if KV_FP8:
            k = k.to(tl.float16)
        if DOT_F32:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            keep = n_ok[None, :]
            if HAS_WINDOW:
                # p - win_left <= j <= p + win_right as one unsigned compare of j - (p - win_left)
                # (negative: huge) with the span: two compares took ~20 more registers at D 128
                # and spilled (ptxas, sm_90a).
                rel = (start_n + offs_n)[None, :] - (offs_m + causal_offset - win_left)[:, None]
                span = (win_left + win_right).to(tl.uint32, bitcast=True)
                keep = keep & (rel.to(tl.uint32, bitcast=True) <= span)
            elif IS_CAUSAL:
                keep = keep & ((start_n + offs_n)[None, :] <= (offs_m + causal_offset)[:, None])
            if HAS_SOFTCAP or HAS_ALIBI:
                qk = _logits(qk, qk_scale, cap_scale, cap_log2, alibi2, pos_f, start_n, offs_n,
                             HAS_SOFTCAP, HAS_ALIBI)
                qk = tl.where(keep, qk, float("-inf"))
            else:
                qk = tl.where(keep, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # A row that has seen no key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            qk = qk - m_shift[:, None]
        elif HAS_SOFTCAP or HAS_ALIBI:
            qk = _logits(qk, qk_scale, cap_scale, cap_log2, alibi2, pos_f, start_n, offs_n,
                         HAS_SOFTCAP, HAS_ALIBI)
            m_new = tl.maximum(m_i, tl.max(qk, 1))  # every key visible: finite
            m_shift = m_new
            qk = qk - m_shift[:, None]
        else:
            # Every key here is visible to every row, so the new max is finite.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_shift = m_new
            qk = qk * qk_scale - m_shift[:, None]
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASKED:
            # Masked loads here, never TMA: a block that crosses into the next sequence must not
            # bring its values in (p = 0 times an inf there would still be NaN).
            v = tl.load(v_ptrs, mask=n_ok[:, None] & v_cols[None, :], other=0.0)
        elif USE_TMA:
            v = desc_v.load([k_row0 + start_n, kv_col])
        elif EVEN_D:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=v_cols[None, :], other=0.0)
        if KV_FP8:
            v = v.to(tl.float16)
        p = p.to(v.dtype)
        if DOT_F32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(p, v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_keys(
    Q, q, k_base, v_base, stride_kt, stride_vt, kv_offs_k, kv_offs_v, desc_k, desc_v,
    k_row0, kv_col, n_lo, n_a, n_b, n_hi, seqlen_k, causal_offset, qk_scale,
    offs_m, offs_n, k_cols, v_cols, k_row, table_row, stride_kp, stride_vp,
    win_left, win_right, cap_scale, cap_log2, alibi2, pos_f,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, USE_TMA: tl.constexpr, PAGED: tl.constexpr,
    PAGE_TOKENS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, KV_FP8: tl.constexpr, WARP_SPEC: tl.constexpr,
    ROW_ALIGN: tl.constexpr, KV_SHIFT: tl.constexpr, ZERO_K: tl.constexpr,
):
    """(acc, l, m) of a query block over its keys: ``[n_lo, n_a)`` masked (a window's left
    edge; empty without a window), ``[n_a, n_b)`` unmasked, ``[n_b, n_hi)`` masked."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if HAS_WINDOW:
        acc, l_i, m_i = _prefill_inner(
            Q, acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, kv_offs_k, kv_offs_v,
            desc_k, desc_v, k_row0, kv_col, n_lo, n_a, seqlen_k, causal_offset, qk_scale,
            offs_m, offs_n, k_cols, v_cols, k_row, table_row, stride_kp, stride_vp, win_left,
            win_right, cap_scale, cap_log2, alibi2, pos_f, True, IS_CAUSAL, EVEN_D, BLOCK_N,
            DOT_F32, USE_TMA, PAGED, PAGE_TOKENS, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, KV_FP8,
            False, ROW_ALIGN, KV_SHIFT, ZERO_K,
        )
    acc, l_i, m_i = _prefill_inner(
        Q, acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, kv_offs_k, kv_offs_v,
        desc_k, desc_v, k_row0, kv_col, n_a, n_b, seqlen_k, causal_offset, qk_scale,
        offs_m, offs_n, k_cols, v_cols, k_row, table_row, stride_kp, stride_vp, win_left,
        win_right, cap_scale, cap_log2, alibi2, pos_f, False, IS_CAUSAL, EVEN_D, BLOCK_N,
        DOT_F32, USE_TMA, PAGED, PAGE_TOKENS, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, KV_FP8,
        WARP_SPEC, ROW_ALIGN, KV_SHIFT, ZERO_K,
    )
    acc, l_i, m_i = _prefill_inner(
        Q, acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, kv_offs_k, kv_offs_v,
        desc_k, desc_v, k_row0, kv_col, n_b, n_hi, seqlen_k, causal_offset, qk_scale,
        offs_m, offs_n, k_cols, v_cols, k_row, table_row, stride_kp, stride_vp, win_left,
        win_right, cap_scale, cap_log2, alibi2, pos_f, True, IS_CAUSAL, EVEN_D, BLOCK_N,
        DOT_F32, USE_TMA, PAGED, PAGE_TOKENS, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, KV_FP8,
        False, ROW_ALIGN, KV_SHIFT, ZERO_K,
    )
    return acc, l_i, m_i


# Arguments that vary with the batch are not specialized (``do_not_specialize``): Triton
# compiles a variant per value 1 / multiple of 16 of the others. ``stride_lh`` is total_q
# (the lse rows): without it every lse launch compiled twice, by total_q % 16.
@triton.jit(do_not_specialize=["batch", "num_heads", "group", "num_slots", "slot_run", "stride_tb",
                               "stride_lh", "win_left", "win_right", "stride_ab", "stride_sb"])
def _prefill_kernel(
    Q, K, V, Out, Lse, cu_q, cu_k, desc_k, desc_v, Table,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lh, stride_tb, stride_kp, stride_vp,
    qk_scale, batch, num_heads, group, num_slots, slot_run,
    win_left, win_right, cap_scale, cap_log2, Alibi, stride_ab, KScale, VScale, stride_sb,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr, IS_CAUSAL: tl.constexpr, RETURN_LSE: tl.constexpr,
    DOT_F32: tl.constexpr, USE_TMA: tl.constexpr, PAGED: tl.constexpr, PAGE_TOKENS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    KV_FP8: tl.constexpr, KV_SCALED: tl.constexpr, WARP_SPEC: tl.constexpr,
    ROW_ALIGN: tl.constexpr, KV_SHIFT: tl.constexpr, KV_PADDED: tl.constexpr,
):
    """Contiguous: ``K, V [total_k, H_kv, D]`` packed by ``cu_k``. Paged (``PAGED``): ``K, V``
    are the pages, ``cu_k`` holds ``seqlens_k`` and ``Table`` the block table; the page stride
    is ``stride_kp`` / ``stride_vp``, the token stride inside a page ``stride_kt`` / ``stride_vt``.
    Window (``HAS_WINDOW``): ``win_left`` / ``win_right`` >= 0, causal already folded into
    ``win_right = 0``, unbounded sides already replaced by a bound no row reaches. ALiBi: the
    slope of (sequence b, head h) is ``Alibi[b * stride_ab + h]``. FP8 K/V (``KV_SCALED``):
    kv head ``g`` of sequence ``b`` stands for its values times ``KScale[b * stride_sb + g]`` /
    ``VScale[...]`` (``stride_sb`` 0: one scale per kv head for every sequence). With
    ``KV_FP8`` the tiles are still e4m3 and the dots run in fp16 (``_fp8_dot``); without it
    they were widened to ``q``'s dtype first (``kv_copies``), and the dots run in it.
    ``KV_SHIFT``: K/V tiles skewed to whole 16-byte loads (``kv_bases``); ``ROW_ALIGN`` then
    counts Q and Out only. ``KV_PADDED``: K/V rows hold ``BLOCK_D`` columns, zeros past the
    head dim (copies, ``pad_rows``), read whole.
    """
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D or KV_PADDED  # K/V tiles need no column mask
    head, slot = program_tile(tl.program_id(0), slot_run, num_heads, num_slots)
    if slot < 0:
        return

    # Find the sequence owning this slot: the number of b with slot_start(b) <= slot, minus one.
    count = 0
    for b0 in range(0, batch, BLOCK_B):
        bs = b0 + tl.arange(0, BLOCK_B)
        starts = tl.load(cu_q + bs, mask=bs < batch, other=0) // BLOCK_M + bs
        count += tl.sum(((starts <= slot) & (bs < batch)).to(tl.int32), 0)
    seq = count - 1
    q_start = tl.load(cu_q + seq)
    seqlen_q = tl.load(cu_q + seq + 1) - q_start
    block = slot - (q_start // BLOCK_M + seq)
    if block * BLOCK_M >= seqlen_q:
        return  # one of the <= 2 spare slots of this sequence
    k_start, seqlen_k = seq_keys(cu_k, seq, PAGED)
    kv_head = head // group
    if KV_SCALED:  # q.(s k) = s (q.k): K's scale goes into the logit scale, V's onto the output
        k_s = tl.load(KScale + seq * stride_sb + kv_head)
        qk_scale = qk_scale * k_s
        if HAS_SOFTCAP:
            cap_scale = cap_scale * k_s

    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < seqlen_q

    table_row = Table  # contiguous: None, never read
    if PAGED:
        table_row = Table + seq.to(tl.int64) * stride_tb
    k_base, v_base, kv_offs_k, kv_offs_v, k_skew, v_skew = kv_bases(
        K, V, k_start, kv_head, offs_n, offs_d, stride_kt, stride_kh, stride_vt, stride_vh, PAGED,
        PAGE_TOKENS, BLOCK_N, KV_SHIFT,
    )
    # int64 bases: total * heads * head_dim may exceed 2**31.
    q, k_cols, v_cols, k_row = q_and_kv_cols(
        Q + q_start.to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
        + offs_m[:, None].to(tl.int64) * stride_qt, m_ok, offs_d, k_skew, v_skew, HEAD_DIM,
        KV_SHIFT, ROW_ALIGN)
    if KV_PADDED:
        k_cols = offs_d < BLOCK_D
        v_cols = k_cols
    if DOT_F32:
        q = q.to(tl.float32)
    if KV_FP8:  # the dots run in fp16 (_fp8_dot)
        q, q_unit = f16_queries(q)
        qk_scale = qk_scale * q_unit
        if HAS_SOFTCAP:
            cap_scale = cap_scale * q_unit

    causal_offset = seqlen_k - seqlen_q
    alibi2 = Alibi  # None without ALiBi, never read
    pos_f = Alibi
    if HAS_ALIBI:
        alibi2 = tl.load(Alibi + seq * stride_ab + head) * 1.4426950408889634
        pos_f = (offs_m + causal_offset).to(tl.float32)
    if HAS_WINDOW:
        # Key blocks [n_lo, n_a) masked (the window's left edge), [n_a, n_b) unmasked (every
        # key visible to every row of the block), [n_b, n_hi) masked (right edge or diagonal).
        # Blocks wholly outside every row's window are never visited.
        p_first = block * BLOCK_M + causal_offset
        p_last = tl.minimum(block * BLOCK_M + BLOCK_M, seqlen_q) - 1 + causal_offset
        lo_key = tl.maximum(p_first - win_left, 0)  # the first key any row sees
        n_hi = tl.minimum(tl.maximum(p_last + win_right + 1, 0), seqlen_k)  # past the last
        n_lo = tl.minimum((lo_key // BLOCK_N) * BLOCK_N, n_hi)
        full_lo = tl.maximum(p_last - win_left, 0)  # keys every row sees: [full_lo, full_hi)
        full_hi = tl.minimum(tl.maximum(p_first + win_right + 1, 0), seqlen_k)
        n_a = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, n_lo), n_hi)
        n_b = tl.minimum(tl.maximum((full_hi // BLOCK_N) * BLOCK_N, n_a), n_hi)
    else:
        n_full, n_end = causal_key_range(block * BLOCK_M, seqlen_q, seqlen_k, BLOCK_M, IS_CAUSAL)
        n_lo = 0
        n_a = 0
        n_b = (n_full // BLOCK_N) * BLOCK_N
        n_hi = n_end

    acc, l_i, m_i = _prefill_keys(
        Q, q, k_base, v_base, stride_kt, stride_vt, kv_offs_k, kv_offs_v, desc_k, desc_v,
        k_start, kv_head * HEAD_DIM, n_lo, n_a, n_b, n_hi, seqlen_k, causal_offset, qk_scale,
        offs_m, offs_n, k_cols, v_cols, k_row, table_row, stride_kp, stride_vp, win_left,
        win_right, cap_scale, cap_log2, alibi2, pos_f, BLOCK_M, BLOCK_D, IS_CAUSAL, EVEN_D,
        BLOCK_N, DOT_F32, USE_TMA, PAGED, PAGE_TOKENS, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, KV_FP8,
        WARP_SPEC, ROW_ALIGN, KV_SHIFT, False,
    )
    # Skewed tiles hold a neighbouring head's K columns, against q's zeros there: only an inf
    # or NaN among them changes a score (to NaN). So the keys are read as they come, and only
    # a block whose sums end NaN reads them again with those columns zeroed (a NaN of this
    # head's own ends NaN either way). Zeroing every tile cost prefill 8-18% (K goes from
    # shared memory through registers and back before the MMA; H200, bf16, causal 4 x 4096,
    # D 100: 855 -> 783 us, D 111: 1036 -> 845, 2026-12-02).
    if KV_SHIFT > 0:  # noqa: SIM102 (a compile-time test, then a run-time one)
        if tl.max((l_i != l_i).to(tl.int32), 0) > 0:
            # Its own key blocks, half as long: on the first loop's offsets ptxas kept both
            # loops' tiles live (sm_90a, D 111: decode 149 -> 255 registers, prefill 132 B
            # spilled; 4-9% of GPU time).
            SLOW_N: tl.constexpr = BLOCK_N // 2 if BLOCK_N >= 32 else BLOCK_N
            offs_n2 = tl.arange(0, SLOW_N)
            k_base2, v_base2, kv_offs_k2, kv_offs_v2, _, _ = kv_bases(
                K, V, k_start, kv_head, offs_n2, offs_d, stride_kt, stride_kh, stride_vt,
                stride_vh, PAGED, PAGE_TOKENS, SLOW_N, KV_SHIFT)
            acc, l_i, m_i = _prefill_keys(
                Q, q, k_base2, v_base2, stride_kt, stride_vt, kv_offs_k2, kv_offs_v2, desc_k,
                desc_v, k_start, kv_head * HEAD_DIM, n_lo, n_a, n_b, n_hi, seqlen_k,
                causal_offset, qk_scale, offs_m, offs_n2, k_cols, v_cols, k_row, table_row,
                stride_kp, stride_vp, win_left, win_right, cap_scale, cap_log2, alibi2, pos_f,
                BLOCK_M, BLOCK_D, IS_CAUSAL, EVEN_D, SLOW_N, DOT_F32, USE_TMA, PAGED,
                PAGE_TOKENS, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, KV_FP8, False, ROW_ALIGN,
                KV_SHIFT, True,
            )

    if KV_SCALED:
        acc = acc * tl.load(VScale + seq * stride_sb + kv_head)
    # Normalise once. Rows that saw no key have l = 0 and acc = 0: output 0, lse -inf.
    if KV_SHIFT > 0:
        acc = unskew(acc, v_skew, offs_d, BLOCK_D, HEAD_DIM)
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_ptrs = row_ptrs(Out + q_start.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
                      + offs_m[:, None].to(tl.int64) * stride_ot, offs_d[None, :], ROW_ALIGN)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    if RETURN_LSE:
        lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453,
                       float("-inf"))
        l_ptrs = Lse + head.to(tl.int64) * stride_lh + q_start + offs_m
        tl.store(l_ptrs, lse, mask=m_ok)


# Head dims where descriptor (TMA) loads of K/V win. H100, bf16 dense B*N = 16K, 16 heads
# (.gpu A/B, 2026-11-22): D128 pointer -> TMA 427 -> 475 (N 4K), 439 -> 480 (8K), 459 -> 491
# (16K) TFLOP/s non-causal, 400 -> 431 .. 456 -> 490 causal; D64 got slower with the same
# tiles (370 -> 212 non-causal at 4K), so it keeps pointer loads. D256 is not measured yet.
_TMA_HEAD_DIMS = (128,)
# Descriptors cost host time: the launcher encodes both tensor maps on every call, +30 to
# +50 us per launch on the H100 VM, against a 3-10% GPU-time gain. So only launches whose
# work bound ``total_q * total_k * heads`` (exact for one sequence, an upper bound for many)
# reaches 2**28 take them; below that the kernel runs for well under 100 us and the host cost
# would show. H100, 2026-11-22 (small_shapes.py, bench_kernels.py): [64, 128, 256] 80 us/call
# with TMA vs 51 without for the same 10 us of GPU time; [1024]*3 causal 52 us of GPU time but
# 86 us per call with TMA.
_TMA_MIN_WORK = 1 << 28
# FP8 K/V tiles through descriptors: ``ATTENTION_KERNELS_TMA_FP8=1``. Off: they lost 2-11% at
# D 128 with every tile config tried (tools/tuning/tune_fp8.py, H200, 2026-11-23).
TMA_FP8 = os.environ.get("ATTENTION_KERNELS_TMA_FP8", "0") == "1"


def _tma_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: int | None = None,
            head_dims: tuple[int, ...] = _TMA_HEAD_DIMS, kv_copied: bool = False,
            dim: int = 0) -> bool:
    """Tensor-descriptor (TMA) loads of K/V in the unmasked key loop: Hopper or newer, 16-bit,
    a head dim in ``head_dims``, a work bound of at least ``_TMA_MIN_WORK``, and
    ``[total, H_kv * D]`` viewable with 16-byte aligned rows. ``span``: at most this many keys
    per query (a sliding window). ``kv_copied``: ``k, v`` reach the kernel as fresh
    contiguous copies in ``q``'s dtype (FP8 K/V widened for the Gluon kernel), so only their
    shapes count. ``dim``: the head dim the launch runs at, when not ``q``'s (padded copies).
    ``ATTENTION_KERNELS_TMA=0`` turns it off (A/B measurements)."""
    if interpreting() or not q.is_cuda:
        return False
    fp8 = k.dtype == torch.float8_e4m3fn
    if q.dtype not in (torch.float16, torch.bfloat16) or k.shape[0] == 0:
        return False
    if k.dtype != q.dtype and not (fp8 and TMA_FP8) and not kv_copied:
        return False
    keys = k.shape[0] if span is None else min(k.shape[0], span)
    if q.shape[0] * keys * q.shape[1] < _TMA_MIN_WORK:
        return False  # small launches (host-bound) return before the environment lookup
    if os.environ.get("ATTENTION_KERNELS_TMA", "1") == "0":
        return False
    if (dim or q.shape[2]) not in head_dims or _capability(q.device.index or 0)[0] < 9:
        return False
    return kv_copied or (_tma_rows(k) and _tma_rows(v))


def _tma_rows(t: torch.Tensor) -> bool:
    """``[total, H, D]`` viewable as ``[total, H * D]`` with 16-byte aligned rows (TMA)."""
    return (t.stride(2) == 1 and t.stride(1) == t.shape[2]
            and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0)


# The warp-specialized Gluon kernel (``prefill_hopper``) for launches big enough for descriptor
# loads (``_tma_ok``) on Hopper with no feature, persistent (one program per SM claiming tiles
# from a counter), with 64-row consumer warpgroups: 2 at D 128 (128 x 128 tiles), 3 at D 64
# (192 x 128, as FlashAttention-3 does: three warpgroups keep the tensor cores fed where the
# softmax weighs as much as the GEMMs). H100, 2026-11-24 (tune_hopper_prefill.py, dense
# B * N = 16K, N 4K / 8K / 16K, against SDPA cuDNN in the same run): bf16 D 128 0.97-0.99x
# non-causal, 0.97-1.00x causal; D 64 0.99-1.04x non-causal, 0.90-0.95x causal; fp16
# 0.97-1.05x except D 64 causal 0.93-0.96x; the portable kernel 0.80-0.91x. D 64 takes three
# stages (two calls, 2026-11-24g, call1_tune.log / call2_tune.log, medians of 3 rounds): causal
# 4K / 8K / 16K 388 / 421 / 447 against two stages' 379 / 398 / 408 TFLOP/s (cuDNN 418-441);
# non-causal even (452-488 against 450-473); four stages measured within 2% of three
# (2026-11-24h, call7). With the consumers' GEMMs in turns (``hopper_prefill_ws``'s
# ``pingpong``) and each tile's place handed to them by the producer, ``prefill()`` as served
# (bench_kernels.py --only dense --rounds 3: sides in turn, medians; the H100 sits at its 700 W
# cap and its clock moves 1545-1980 MHz), ours / cuDNN at N 4K / 8K / 16K, bf16 and fp16, with
# the consumers' one key loop (``prefill_hopper._attend``; 2026-11-24k, call 7): D 128
# non-causal 0.96-0.99 / 0.98-0.99 / 0.96-0.99, causal 1.01-1.04 / 1.01-1.02 / 1.00-1.02;
# D 64 non-causal 1.07-1.09 / 1.11 / 1.10-1.12, causal 1.01-1.02 / 1.06-1.07 / 1.07-1.08.
# ``ATTENTION_KERNELS_GLUON=0`` turns it off.
_GLUON_TILES = {128: {"consumers": 2, "block_n": 128, "stages": 2},
                64: {"consumers": 3, "block_n": 128, "stages": 3}}
_GLUON_HEAD_DIMS = tuple(_GLUON_TILES)
# D 64 causal: 192-row tiles waste much of the diagonal on short prompts. H100, bf16, 32 heads,
# B * N = 16K, medians of 3 rounds (tune_hopper_prefill.py, 2026-11-24k, call 8, with the
# consumers' one key loop): the Gluon kernel / the portable one / cuDNN at N 1K 248 / 263 /
# 341, 2K 359 / 332 / 388, 4K 412 / 363 / 413 TFLOP/s. Causal D 64 launches take it when their
# mean prompt (total queries / sequences: exact for a dense batch) is this long.
_GLUON_D64_CAUSAL_MIN_MEAN = 2048


def _gluon_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plain: bool, causal: bool,
              batch: int, dim: int = 0) -> bool:
    """The Gluon kernel: a launch that could take descriptor loads (``_tma_ok`` at the Gluon
    head dims: Hopper, 16-bit K/V like ``q``, enough work, aligned rows) with no window,
    softcap or ALiBi (``plain``), on sm_90 exactly (its wgmma/setmaxnreg code), with ``q``'s
    rows 16-byte aligned for its own descriptor. D 64 qualifies here though the portable
    kernel keeps pointer loads there; causal at D 64 only with long mean prompts. ``dim``:
    the launch runs at this head dim on zero-padded copies of k, v (``_padded_gluon_dim``),
    fresh and aligned, so only their shapes count; q is copied too unless TMA can read its
    heads as they are (``_PrefillPlan.pad_q``).

    FP8 K/V qualify too: ``_run`` widens them exactly to ``q``'s dtype first (every e4m3
    value is a bf16 and an fp16 value; ``kv_copies``) and the kernel applies the
    scales as the portable kernel does (key scale into the softmax scale, value scale into
    the output), so the arithmetic is the same. H100, bf16 queries, D 128, B * N = 16K, N 4K /
    8K / 16K (bench_kernels.py --only dense --rounds 3, 2026-11-24i call 8): FP8 K/V 584 /
    613 / 606 TFLOP/s non-causal and 488 / 558 / 579 causal, against 601 / 612 / 611 and 529
    / 566 / 580 for bf16 K/V; the portable kernel's FP8 path, which converts each tile inside
    its key loop, 366 / 364 / 363 and 331 / 347 / 365 (same call,
    ``ATTENTION_KERNELS_GLUON=0``). The copies cost one pass over K/V, O(N) against the
    launch's O(N^2), and 2 bytes per K/V element of memory while the launch runs."""
    widened = k.dtype == torch.float8_e4m3fn
    padded = dim not in (0, q.shape[2])
    dim = dim or q.shape[2]
    if not plain or dim not in _GLUON_HEAD_DIMS or (k.dtype != q.dtype and not widened):
        return False
    if causal and dim == 64 and q.shape[0] < _GLUON_D64_CAUSAL_MIN_MEAN * batch:
        return False
    if not _tma_ok(q, k, v, head_dims=_GLUON_HEAD_DIMS, kv_copied=widened or padded, dim=dim):
        return False
    if _capability(q.device.index or 0)[0] != 9:
        return False
    if os.environ.get("ATTENTION_KERNELS_GLUON", "1") == "0":
        return False
    return padded or _tma_rows(q)


# Head dims the Gluon kernel does not take run on it all the same, at the next one it does: k and
# v copied into rows of 64 or 128 columns padded with zeros (``kv_copies.pad_rows``, one launch
# each); q read as it is where each head starts on a 16-byte boundary (D a multiple of 8 at 16
# bits), each head's Q tile zeroed past its columns in shared memory, else copied too (``pad_q``:
# a TMA copy must start on one); the caller's ``out`` columns stored directly.
# Zero columns add nothing to a score and zero values only fill output columns that are not
# stored, so the result is the unpadded one's (the scale stays 1 / sqrt(D)). The portable kernel
# is the slower of the two at every such dim: H200, bf16, 4 x 4096, 16q / 8kv heads, GPU time,
# the portable kernel against the Gluon kernel on copies made beforehand (2026-12-02, stop 100),
# causal D 40 402 / 312, 59 426 / 328, 72 720 / 474, 96 713 / 506, 100 806 / 508, 111 901 /
# 515, 112 730 / 512 us; non-causal D 59 779 / 575, 100 1513 / 928, 111 1618 / 948. The whole
# call at causal D 59 (D 64: 325 us): q, k, v padded and the output copied back 394 us; the
# output stored directly 380 (its element stores cost the kernel 340 against 325 us with whole
# rows; 8 elements a lane 365, 2 349, 4 342). q read as it is (``bench_kernels.py --only
# headdim``, same day): D 40 369 -> 352 us, 72 515 -> 493, 80 519 -> 496, 112 556 -> 530. The
# copies hold k, v (and q) again while the launch runs. Under 40 columns padding to 64 was not
# measured; FP8 K/V (widened for the Gluon kernel) keep their own path.
_GLUON_PAD_MIN_DIM = 40


def _gluon_padding(dim: int) -> int:
    """The Gluon head dim a head dim ``dim`` it does not take pads to, or 0 (outside
    ``_GLUON_PAD_MIN_DIM`` up to its largest)."""
    if dim in _GLUON_HEAD_DIMS or not _GLUON_PAD_MIN_DIM <= dim < max(_GLUON_HEAD_DIMS):
        return 0
    return min(d for d in _GLUON_HEAD_DIMS if d > dim)


def _padded_gluon_dim(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plain: bool,
                      causal: bool, batch: int) -> int:
    """The Gluon head dim a contiguous prefill at another head dim runs at once padded, or 0:
    ``_gluon_padding`` where ``_gluon_ok`` takes the padded launch, for K/V in ``q``'s dtype
    (FP8 K/V are widened, not padded)."""
    padded = _gluon_padding(q.shape[2])
    if not padded or k.dtype != q.dtype:
        return 0
    return padded if _gluon_ok(q, k, v, plain, causal, batch, padded) else 0


# Contiguous FP8 K/V prefills the Gluon kernel does not take (which always widens) are widened
# to the queries' dtype first (one launch, ``kv_copies``) when a query sees at least
# this many keys on average (half at head dim 64 and below), then run as 16-bit prefills with
# the scales applied in the kernel; others convert each tile in the key loop. Widening moves
# 6 bytes per K/V element once; the per-tile conversion costs on every tile a query block
# reads. H100, bf16 queries, 16/8 heads, GPU time per-tile -> widened (bf16 K/V)
# (tune_fp8_widen.py, medians of 3 rounds, 2026-11-24): D 64 causal 16 x 1K 208 -> 150 us
# (133), 8 x 2K 336 -> 222 (217); D 128 causal 4 x 4K softcap 842 -> 720 (704); but a
# 512-key window over 4 x 4K 312 -> 323 (287), [512] * 32 192 -> 192 (161), and
# [64, 128, 256] per call 20.7 -> 20.9 us.
FP8_WIDEN_MIN_KEYS_SEEN = 1024


def _widen_fp8(q: torch.Tensor, k: torch.Tensor, batch: int, causal: bool,
               span: int | None) -> bool:
    """Whether a contiguous FP8 K/V prefill widens K/V first: 16-bit queries, and a query
    sees about ``FP8_WIDEN_MIN_KEYS_SEEN`` keys (half at head dim <= 64), estimated from
    shapes: the mean sequence length, halved if causal, at most the window's ``span``."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return False
    seen = k.shape[0] / max(batch, 1) / (2 if causal else 1)
    if span is not None:
        seen = min(seen, span)
    need = FP8_WIDEN_MIN_KEYS_SEEN // (2 if q.shape[2] <= 64 else 1)
    return seen >= need


def _kv_descriptor(t: torch.Tensor, block_n: int) -> TensorDescriptor:
    rows, heads, dim = t.shape
    return TensorDescriptor(t, [rows, heads * dim], [t.stride(0), 1], [block_n, dim])


def _head_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    # The kernel takes any token/head strides but needs unit stride along the head dim for
    # vectorised loads; anything else is copied once (correct, just slower).
    return t if t.stride(-1) == 1 else t.contiguous()


def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None = None,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    _config: PrefillConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Variable-length flash attention forward.

    Args:
        q: ``[total_q, H, D]`` fp16/bf16/fp32; ``k, v``: ``[total_k, H_kv, D]``, ``H % H_kv == 0``.
        cu_seqlens_q / cu_seqlens_k: int32 ``[batch + 1]`` prefix sums (k defaults to q). Their
            values are trusted (validated by the caller); nothing here reads them on the host.
        max_seqlen_q / max_seqlen_k: host-side hints, never read on the device. A
            ``max_seqlen_q`` no sequence exceeds picks smaller tiles for short sequences where
            they were measured faster (``configs.prefill_config``); a wrong one costs only
            speed. ``max_seqlen_k`` is accepted for API parity.
        causal: bottom-right aligned mask; rows that see no key output zeros (lse -inf).
        softmax_scale: defaults to ``1 / sqrt(D)``.
        return_lse: also return float32 natural-log ``lse [H, total_q]``.
        out / lse_out: optional preallocated outputs (contiguous, right shape and dtype); the
            service passes pinned or pooled buffers, the tests pass poisoned ones.
        window_size: ``(left, right)`` sliding window, flash_attn's semantics: query ``i`` at key
            position ``p = i + seqlen_k - seqlen_q`` sees keys ``p - left <= j <= p + right``
            (-1: that side unbounded); ``causal`` adds ``j <= p``. Key blocks outside every
            row's window are skipped, not masked.
        softcap: when > 0, logits are ``softcap * tanh(softmax_scale * q.k / softcap)``.
        alibi_slopes: float32 ``[H]`` or ``[batch, H]`` (trusted values): adds
            ``-slope * |p - j|`` to the logit (after the softcap).
        k_scale, v_scale: with float8_e4m3fn ``k, v`` (fp16/bf16 ``q``), float32 ``[H_kv]``:
            kv head ``g`` stands for ``k[:, g] * k_scale[g]`` (``attention_kernels.fp8``); or
            ``[batch, H_kv]``: each sequence's keys and values with scales of their own.
        q_scale: with float8_e4m3fn ``q`` (and FP8 ``k, v``), float32 ``[H_kv]`` or
            ``[batch, H_kv]``: query head ``h`` stands for ``q[:, h] * q_scale[h // group]``
            (FlashAttention-3's ``q_descale``). The output is bf16 (``_fp8_prefill``).

    fp32 inputs use TF32 tensor-core dots (relative error ~1e-3, see tests).
    """
    del max_seqlen_k
    if cu_seqlens_k is None:
        cu_seqlens_k = cu_seqlens_q
    if q.dtype == torch.float8_e4m3fn:
        return _fp8_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal,
                            softmax_scale, return_lse, out, lse_out, window_size, softcap,
                            alibi_slopes, q_scale, k_scale, v_scale, _config)
    check_query_scale(q, k, q_scale, 0)  # 16-bit q: refuses a q_scale
    rows = short_rows_bucket(max_seqlen_q)
    key = _plan_key(False, q, k, v, cu_seqlens_q, cu_seqlens_k, None, causal, softmax_scale,
                    return_lse, out, lse_out, window_size, softcap, alibi_slopes, k_scale,
                    v_scale, _config, rows)
    plan = _PLANS.get(key)
    if plan is None:
        check_prefill_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
        plan = _plan(q, k, v, cu_seqlens_q, None, causal, softmax_scale, return_lse, _config,
                     window_size, softcap, alibi_slopes, k.shape[0], k_scale, v_scale, out,
                     lse_out, rows)
        _PLANS.put(key, plan)
    return _run(plan, q, k, v, cu_seqlens_q, cu_seqlens_k, None, out, lse_out, alibi_slopes,
                k_scale, v_scale)


def _on_sm90(t: torch.Tensor) -> bool:
    """A compiled (not interpreted) launch on an sm_90 GPU."""
    return not interpreting() and t.is_cuda and _capability(t.device.index or 0)[0] == 9


def _fp8_gluon_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int,
                  plain: bool) -> bool:
    """FP8 queries, keys and values the Gluon kernel takes with both dots in FP8: sm_90, a
    head dim in ``_FP8_HEAD_DIMS``, no window, softcap or ALiBi (``plain``), ``[total, H, D]``
    rows contiguous and 16-byte aligned (TMA), and sequences of at least a key block on
    average (the zeros between sequences of ``prefill_hopper.transposed_values_ref`` then
    about double V at most). ``ATTENTION_KERNELS_GLUON=0`` turns it off."""
    if not plain or batch == 0 or q.shape[0] == 0:
        return False
    if q.shape[2] not in _FP8_HEAD_DIMS or k.shape[0] < batch * _FP8_TILE["block_n"]:
        return False
    if not _on_sm90(q) or os.environ.get("ATTENTION_KERNELS_GLUON", "1") == "0":
        return False
    return all(t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.stride(0) % 16 == 0
               and t.data_ptr() % 16 == 0 for t in (q, k, v))


# The FP8 Gluon kernel's head dims and its tile (one for both), and its launches by the 16-byte
# alignment of the pointers Triton specializes on (``_fp8_prefill``), then by their compile-time
# arguments (``hopper_prefill_ws``). P goes through shared memory, each PV is waited for a key block
# late (``prefill_hopper._ws_step_fp8``) and the row sums are a wgmma (``_pv_issue``), which leaves
# room for a third consumer. H200, dense B * N = 16K, 16 heads, D 128, TFLOP/s at N 4K / 8K / 16K,
# interleaved rounds (2026-12-01): non-causal three consumers, three stages 719-737 / 768-777 /
# 823-826 against two consumers' 723-727 / 748-753 / 758-759 (before the row-sum wgmma); causal,
# with it, three consumers 608 / 764 / 848 against two consumers' 603 / 733 / 789. 256-key blocks do
# not fit in shared memory with P there (246 KB). D 64, three consumers (``bench_kernels.py --only
# fp8``, 2026-12-01): 531 / 568 / 585 non-causal, 424 / 485 / 525 causal, against the widened path's
# 449 / 495 / 523 and 353 / 433 / 483 (bf16 speed or below).
_FP8_HEAD_DIMS = (64, 128)
_FP8_TILE = {"consumers": 3, "block_n": 128, "stages": 3}
_FP8_LAUNCHES: dict[tuple[bool, ...], dict[tuple[object, ...], KernelLaunch]] = {}


def _fp8_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
    max_seqlen_q: int | None, causal: bool, softmax_scale: float | None, return_lse: bool,
    out: torch.Tensor | None, lse_out: torch.Tensor | None, window_size: tuple[int, int],
    softcap: float, alibi_slopes: torch.Tensor | None, q_scale: torch.Tensor | None,
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
    config: PrefillConfig | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``prefill`` of FP8 queries: on Hopper both dots on FP8 tensor cores (``_fp8_gluon_ok``:
    the Gluon kernel, ``prefill_hopper``); otherwise the queries widened exactly to bf16 (every
    e4m3 value is one) with ``q_scale`` folded into the key scale, through the FP8 K/V path.
    The output is bf16 both ways."""
    check_prefill_inputs(q, k, v, cu_q, cu_k)
    batch = cu_q.shape[0] - 1
    ks, vs = folded_scales(q, k, q_scale, k_scale, v_scale, batch)
    plain = window_size == (-1, -1) and not softcap and alibi_slopes is None and config is None
    if not _fp8_gluon_ok(q, k, v, batch, plain):
        return prefill(q.to(torch.bfloat16), k, v, cu_q, cu_k, max_seqlen_q=max_seqlen_q,
                       causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                       out=out, lse_out=lse_out, window_size=window_size, softcap=softcap,
                       alibi_slopes=alibi_slopes, k_scale=ks, v_scale=vs, _config=config)
    total_q, num_heads, head_dim = q.shape
    check_outputs(out, lse_out, return_lse, (total_q, num_heads, head_dim),
                  (num_heads, total_q), torch.bfloat16, q.device)
    out, lse = outputs(out, lse_out, return_lse, (total_q, num_heads, head_dim),
                       (num_heads, total_q), torch.bfloat16, q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()
    # Triton compiles a launch for its first call's pointers, 16-byte aligned or not (vector
    # stores of ``out``, vector loads of ``cu_seqlens``): a caller's ``out=`` view at another
    # alignment gets a launch of its own rather than a misaligned store.
    aligned = tuple(t.data_ptr() % 16 == 0 for t in (out, lse, cu_q, cu_k, ks, vs))
    hopper_prefill_ws(q, k, v, cu_q, cu_k, out, lse if return_lse else None, causal,
                      scale * LOG2E, programs=num_sms(q.device.index or 0), dynamic=True,
                      kv_scales=(ks, vs, ks.shape[1] if ks.dim() == 2 else 0),
                      launches=_FP8_LAUNCHES.setdefault(aligned, {}), **_FP8_TILE)
    return (out, lse) if return_lse else out


def paged_prefill(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    _config: PrefillConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``prefill`` against a paged KV cache (``flash_attn_with_kvcache``'s layout).

    Args:
        q: ``[total_q, H, D]`` packed by ``cu_seqlens_q`` (int32 ``[batch + 1]``).
        k_pages, v_pages: ``[num_pages, page_tokens, H_kv, D]``, unit stride along ``D``, any
            other strides.
        block_table: int32 ``[batch, max_pages_per_seq]``: key ``j`` of sequence ``b`` is
            ``k_pages[block_table[b, j // page_tokens], j % page_tokens]``; entries past a
            sequence's length are never read.
        seqlens_k: int32 ``[batch]`` keys per sequence (trusted values, 0 allowed). The queries
            of sequence ``b`` are its last ``seqlen_q`` positions for the causal mask (bottom-right
            aligned), e.g. new tokens already appended to the cache.
        max_seqlen_q / max_seqlen_k: accepted for API parity (pages take the default tiles:
            the short-sequence ones were measured on contiguous keys of the same length only).
        Other arguments (``window_size``, ``softcap``, ``alibi_slopes`` included) and the
        outputs (``lse [H, total_q]``) as in ``prefill``. One compiled variant per page size.
        FP8 queries (``q_scale``) are widened to bf16, their scale folded into the key scale
        (``fp8.widened_queries``; the Gluon FP8 kernel reads contiguous keys only).
    """
    del max_seqlen_q, max_seqlen_k
    q, k_scale, v_scale = widened_queries(q, k_pages, q_scale, k_scale, v_scale,
                                          cu_seqlens_q.shape[0] - 1)
    key = _plan_key(True, q, k_pages, v_pages, cu_seqlens_q, seqlens_k, block_table, causal,
                    softmax_scale, return_lse, out, lse_out, window_size, softcap,
                    alibi_slopes, k_scale, v_scale, _config, None)
    plan = _PLANS.get(key)
    if plan is None:
        check_paged_inputs(q, k_pages, v_pages, block_table, seqlens_k, cu_seqlens_q)
        plan = _plan(q, k_pages, v_pages, cu_seqlens_q, block_table, causal, softmax_scale,
                     return_lse, _config, window_size, softcap, alibi_slopes,
                     block_table.shape[1] * k_pages.shape[1], k_scale, v_scale, out, lse_out)
        _PLANS.put(key, plan)  # paged launches never take descriptor loads
    return _run(plan, q, k_pages, v_pages, cu_seqlens_q, seqlens_k, block_table, out, lse_out,
                alibi_slopes, k_scale, v_scale)


def _window_args(window: tuple[int, int], causal: bool, max_keys: int,
                 total_q: int) -> tuple[bool, int | None, int | None]:
    """``(causal, win_left, win_right)`` for the kernel from a checked ``window_size``.

    ``win_left`` is None when the window hides nothing that ``causal`` does not (the kernel is
    then compiled without it). Otherwise both are >= 0: causal folded into ``win_right = 0``,
    and an unbounded side (-1, or wider than any sequence) replaced by ``max_keys + total_q``,
    a bound no row reaches (key positions lie in ``[-total_q, max_keys)``), small enough that
    ``p +- bound`` stays in int32. ``(-1, 0)`` without causal is causal, and runs as such."""
    left, right = window
    limit = max_keys + total_q
    left = -1 if left >= limit else left
    right = -1 if right >= limit else right
    if causal:
        right = 0
    elif left == -1 and right == 0:
        return True, None, None
    if left == -1 and (right == -1 or causal):
        return causal, None, None
    return causal, (limit if left == -1 else left), (limit if right == -1 else right)


def _check_not_float64(q: torch.Tensor) -> None:
    if q.dtype == torch.float64:
        raise ValueError("float64 is supported by the references only; kernels take "
                         "fp16/bf16/fp32")


# Checked launch set-ups by call signature (``_plan_key``); see ``_launch``.
_PLANS = PlanCache()


def _plan_key(paged: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              cu_q: torch.Tensor, lens_k: torch.Tensor, table: torch.Tensor | None,
              causal: object, softmax_scale: object, return_lse: object,
              out: torch.Tensor | None, lse_out: torch.Tensor | None, window_size: object,
              softcap: object, alibi_slopes: object, k_scale: object, v_scale: object,
              config: PrefillConfig | None, rows: int | None) -> tuple | None:
    """Everything a prefill call's checks and set-up read (``_launch.call_key``), the A/B
    switches ``ATTENTION_KERNELS_TMA`` / ``ATTENTION_KERNELS_GLUON`` included. Descriptor and
    Gluon plans were once made afresh per call: at N = 1K causal D 128 (a 0.2 ms launch)
    that host work starved the GPU, 212 against 335 TFLOP/s for the same launch made
    directly (H100, 2026-11-24g, probe_causal_1k.py)."""
    return call_key((q, k, v, cu_q, lens_k, table, out, lse_out if return_lse else None,
                     alibi_slopes, k_scale, v_scale),
                    (paged, causal, softmax_scale, return_lse, softcap, config, rows,
                     os.environ.get("ATTENTION_KERNELS_TMA"),
                     os.environ.get("ATTENTION_KERNELS_GLUON"), kv_room(k, v)),
                    window_size)


@dataclass(frozen=True, slots=True)
class _PrefillPlan:
    """A checked prefill call's derived set-up; ``_run`` launches it on the call's tensors."""

    out_shape: tuple[int, int, int]
    dtype: torch.dtype
    return_lse: bool
    empty: bool  # no launch: no queries (nothing to write) or no pages
    zero_fill: bool  # empty with queries but no pages: zeros, lse -inf
    copy_q: bool  # inputs without unit stride along D go through a contiguous copy
    copy_kv: bool
    use_tma: bool  # K/V through tensor descriptors (made per call: they hold the pointers)
    block_n: int
    scalars: tuple[object, ...]  # the launch arguments between the tensors and the features
    stride_ab: int | None
    launch: KernelLaunch | None  # None when empty
    gluon: bool = False  # the warp-specialized Gluon kernel instead (``_gluon_ok``)
    causal: bool = False  # for the Gluon launch
    scale_log2: float = 0.0
    widen_kv: bool = False  # FP8 K/V widened to q's dtype first (``_widen_fp8``)
    widen_row: int = 0  # the widened copies' row (elements): the strides the launch holds
    pad_kv: bool = False  # K/V copied into rows of ``widen_row`` padded with zeros
    # The Gluon kernel at this head dim on zero-padded copies of k, v (``_padded_gluon_dim``),
    # and of q where TMA cannot read its heads as they are (``pad_q``: rows or heads not on
    # 16-byte boundaries, as D 59's, where a TMA copy at the head's column faults; or fewer
    # columns in all than the tile)
    gluon_dim: int = 0
    pad_q: bool = False
    # The Gluon kernel's launches (``hopper_prefill_ws``): the plan's key is everything
    # Triton specializes them on, so each is bound once.
    gluon_launches: dict[tuple[object, ...], KernelLaunch] = field(default_factory=dict)


def _plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    table: torch.Tensor | None,
    causal: bool,
    softmax_scale: float | None,
    return_lse: bool,
    config: PrefillConfig | None,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    max_keys: int,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    out: torch.Tensor | None,
    lse_out: torch.Tensor | None,
    rows: int | None = None,
) -> _PrefillPlan:
    """The checks prefill and paged prefill share, then the call's set-up; the caller checked
    the inputs. Contiguous (``table`` None): ``k, v [total_k, H_kv, D]``. Paged: ``k, v`` are
    the pages. ``max_keys``: a bound on any sequence's key count known from shapes (total_k,
    or the block table's capacity). ``rows``: ``short_rows_bucket`` of the caller's
    ``max_seqlen_q`` hint (the tile choice only)."""
    batch = cu_seqlens_q.shape[0] - 1
    fp8 = check_kv_scales(k, k_scale, v_scale, batch)
    window = check_features(window_size, softcap, alibi_slopes, q.shape[1], batch, q.device)
    _check_not_float64(q)
    check_outputs(out, lse_out, return_lse, tuple(q.shape), (q.shape[1], q.shape[0]),
                  q.dtype, q.device)
    copy_q = q.stride(-1) != 1
    copy_kv = table is None and (k.stride(-1) != 1 or v.stride(-1) != 1)
    q = _head_dim_contiguous(q)
    if copy_kv:  # both, as ``launch_inputs`` copies them: the plan takes the copies' strides
        k, v = k.contiguous(), v.contiguous()
    total_q, num_heads, head_dim = q.shape
    out_shape = (total_q, num_heads, head_dim)
    if total_q == 0 or batch == 0 or (table is not None and (k.shape[0] == 0
                                                              or table.shape[1] == 0)):
        # With pages but no keys at all: zeros, and no pointer into an empty pool.
        return _PrefillPlan(out_shape, q.dtype, return_lse, True,
                            table is not None and total_q > 0 and batch > 0, False, False,
                            False, 0, (), None, None)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    causal, win_left, win_right = _window_args(window, causal, max_keys, total_q)
    has_window = win_left is not None
    cap_scale, cap_log2 = softcap_args(softcap, scale)
    stride_ab = alibi_args(alibi_slopes, num_heads)[1]
    # A window's blocks are split into masked and unmasked stages like causal ones: causal's
    # tiles.
    # Paged launches keep the table's tiles: the others were measured on contiguous keys.
    many = table is None and many_programs(total_q, batch, num_heads, q.device)
    scored = has_window or cap_scale is not None or alibi_slopes is not None
    gluon = table is None and _gluon_ok(q, k, v, not scored, causal, batch)
    gluon_dim = 0 if gluon or table is not None else _padded_gluon_dim(
        q, k, v, not scored, causal, batch)
    if gluon_dim:
        return _PrefillPlan(out_shape, q.dtype, return_lse, False, False, copy_q, copy_kv,
                            False, 0, (), None, None, gluon=True, causal=causal,
                            scale_log2=scale * LOG2E, gluon_dim=gluon_dim,
                            pad_q=not _tma_rows(q) or (q.shape[2] * q.element_size()) % 16 != 0
                            or q.shape[1] * q.shape[2] < gluon_dim)
    # The window's unmasked stage reads whole blocks inside the sequence, as the plain loop
    # does, so it takes the descriptor loads too; only the work bound shrinks.
    span = (win_left + win_right + 1) if has_window else None
    widen = fp8 and table is None and (gluon or _widen_fp8(q, k, batch, causal, span))
    fp8_tiles = fp8 and not widen  # the kernel converts each e4m3 tile itself
    cfg = config or prefill_config(head_dim, q.dtype, causal or has_window, q.device,
                                   fp8_tiles, rows, many)
    num_slots, slot_run, programs = slot_grid(total_q, batch, num_heads, cfg.block_m,
                                              causal or has_window)
    use_tma = table is None and _tma_ok(q, k, v, span, kv_copied=widen)
    widen_row = 0
    if table is None:
        # None for the paged-only arguments: Triton makes them compile-time constants, so the
        # contiguous launch passes (and costs) no more than it did before paging existed.
        page_tokens = 1
        strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1), None, None, None)
        if widen:
            # ``_run`` launches on the widened copies, not on ``k, v``: their strides, rows
            # padded as ``k``'s were (a D 40 plan on padded strides read unpadded copies as
            # garbage on an H200). The Gluon kernel reads heads packed (``[rows, H * D]``
            # descriptors): its copies are packed whatever ``k``'s rows were.
            padded = (k.stride(0) == k.shape[1] * k.stride(1) and k.stride(1) > head_dim
                      and not gluon)
            widen_row = k.stride(1) if padded else head_dim
            token = k.shape[1] * widen_row
            strides = (token, widen_row, token, widen_row, None, None, None)
    else:
        page_tokens = k.shape[1]
        strides = (k.stride(1), k.stride(2), v.stride(1), v.stride(2), table_row_stride(table),
                   k.stride(0), v.stride(0))
    # Skewed K/V rows: not through descriptors, nor the widened copies' own strides.
    block_d = padded_head_dim(head_dim)
    tile_d, shift = (block_d, 0) if use_tma or widen else kv_tile(k, v, strides, head_dim)
    # Rows whose largest skew does not fit the tile (D 59 bf16: 7 past 64 columns; decode reads
    # them in tiles twice as wide) are copied into rows padded with zeros to it and read
    # whole. H200, bf16, causal 4 x 4096, 16q/8kv, GPU time, D 59: 905 us element by element,
    # 422 on the copies (the copy included; D 64: 328), 2026-12-02; a launch that large now
    # takes the Gluon kernel on padded copies (``_padded_gluon_dim``): this is for the rest.
    if tile_d > block_d:
        shift = 0
    pad_kv = tile_d > block_d and table is None and not gluon
    if pad_kv:
        widen_row = block_d
        token = k.shape[1] * block_d
        strides = (token, block_d, token, block_d, None, None, None)
    # Outputs are contiguous: out [total_q, H, D], lse [H, total_q] (fresh, or checked so).
    scalars = (q.stride(0), q.stride(1), *strides[:4], num_heads * head_dim, head_dim,
               total_q if return_lse else 0, *strides[4:],
               scale * LOG2E, batch, num_heads, num_heads // k.shape[-2], num_slots, slot_run,
               win_left, win_right, cap_scale, cap_log2)
    launch = KernelLaunch(_prefill_kernel, (programs,), dict(
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_B=_SEQ_SEARCH_BLOCK,
        IS_CAUSAL=causal, RETURN_LSE=return_lse, DOT_F32=dot_in_fp32(q.dtype) and not fp8_tiles,
        USE_TMA=use_tma, PAGED=table is not None, PAGE_TOKENS=page_tokens,
        HAS_WINDOW=has_window, HAS_SOFTCAP=cap_scale is not None,
        HAS_ALIBI=alibi_slopes is not None, KV_FP8=fp8_tiles, KV_SCALED=fp8,
        WARP_SPEC=cfg.warp_specialize and not interpreting(),
        ROW_ALIGN=row_align(q, k, v, out, strides, shift > 0), KV_SHIFT=shift,
        KV_PADDED=pad_kv, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    ))
    return _PrefillPlan(out_shape, q.dtype, return_lse, False, False, copy_q, copy_kv, use_tma,
                        cfg.block_n, scalars, stride_ab, launch, gluon, causal, scale * LOG2E,
                        widen, widen_row, pad_kv)


def _run(
    plan: _PrefillPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    lens_k: torch.Tensor,
    table: torch.Tensor | None,
    out: torch.Tensor | None,
    lse_out: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Launch ``plan`` on a call's tensors (which passed the checks its key stands for).
    Contiguous: ``lens_k`` = cu_seqlens_k. Paged: ``k, v`` are the pages, ``lens_k`` =
    seqlens_k."""
    total_q, num_heads, _ = plan.out_shape
    out, lse = outputs(out, lse_out, plan.return_lse, plan.out_shape, (num_heads, total_q),
                       plan.dtype, q.device)
    if plan.empty:
        if plan.zero_fill:
            no_keys(out, lse, plan.return_lse)
        return (out, lse) if plan.return_lse else out
    q, k, v, table, slopes, ks, vs, stride_sb = launch_inputs(
        plan, q, k, v, table, alibi_slopes, k_scale, v_scale)
    if cu_seqlens_q.stride(0) != 1:
        cu_seqlens_q = cu_seqlens_q.contiguous()
    if lens_k.stride(0) != 1:
        lens_k = lens_k.contiguous()
    if plan.widen_kv:
        k, v = widen_kv(k, v, q.dtype, plan.widen_row)
    elif plan.pad_kv:
        k, v = pad_rows(k, plan.widen_row), pad_rows(v, plan.widen_row)
    if plan.gluon:
        scales = (ks, vs, stride_sb) if plan.widen_kv else None
        if plan.gluon_dim:  # zero-padded copies in; the kernel stores ``out``'s D columns
            k, v = pad_rows(k, plan.gluon_dim), pad_rows(v, plan.gluon_dim)
            if plan.pad_q:
                q = pad_rows(q, plan.gluon_dim)
        hopper_prefill_ws(q, k, v, cu_seqlens_q, lens_k, out, lse if plan.return_lse else None,
                          plan.causal, plan.scale_log2, programs=num_sms(q.device.index or 0),
                          dynamic=True, kv_scales=scales, launches=plan.gluon_launches,
                          **_GLUON_TILES[k.shape[2]])
        return (out, lse) if plan.return_lse else out
    if plan.use_tma:
        desc_k, desc_v = _kv_descriptor(k, plan.block_n), _kv_descriptor(v, plan.block_n)
    else:
        desc_k, desc_v = k, v  # unused placeholders
    assert plan.launch is not None
    plan.launch(q, k, v, out, lse, cu_seqlens_q, lens_k, desc_k, desc_v, table, *plan.scalars,
                slopes, plan.stride_ab, ks, vs, stride_sb)
    return (out, lse) if plan.return_lse else out
