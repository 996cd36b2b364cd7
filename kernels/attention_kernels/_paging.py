"""Block-table addressing shared by the paged paths of the prefill and decode kernels.

Paged layout (FlashAttention's ``flash_attn_with_kvcache`` / vLLM): ``k_pages, v_pages
[num_pages, PAGE_TOKENS, H_kv, D]`` with any page/token/head strides, and an int32 block table
whose row ``b`` lists sequence ``b``'s pages in order, so key ``j`` lives at slot
``j % PAGE_TOKENS`` of page ``table[b, j // PAGE_TOKENS]``. Entries past a sequence's length
are not part of the contract (often -1 or stale), so they must never be read.

``PAGE_TOKENS`` is a compile-time constant: a server has one page size per layout, and a
constant divisor turns ``//`` and ``%`` into a multiply and shift (a shift and mask for powers
of two) instead of a runtime integer division per key.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_pages(table_row, start_n, offs_n, end, PAGE_TOKENS: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Pages (int64) of keys ``start_n + offs_n`` (``start_n`` a multiple of ``BLOCK_N``): a
    scalar when the block sits inside one page, else one per key. Only entries of keys below
    ``end`` (the sequence length) are read; the others give page 0, a valid address that is
    never loaded (those keys' K/V loads are masked)."""
    if PAGE_TOKENS % BLOCK_N == 0:
        page = tl.load(table_row + start_n // PAGE_TOKENS, mask=start_n < end, other=0)
    else:
        pos = start_n + offs_n
        page = tl.load(table_row + pos // PAGE_TOKENS, mask=pos < end, other=0)
    return page.to(tl.int64)


@triton.jit
def block_rows(page, start_n, offs_n, stride_p, stride_t, PAGE_TOKENS: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """What the key block at ``start_n`` adds (int64) to ``kv_bases``' tile offsets: a scalar
    when the block sits in one page (``page`` a scalar), else ``[BLOCK_N, 1]`` row offsets.
    The tile offsets hold every part that is the same for all blocks, so a block costs about
    as many instructions as a contiguous one: per-row slot arithmetic in every block made the
    paged split kernel execute 1.52x the contiguous one's instructions (ncu, H100, 1 x 4K,
    64-token pages, 2026-11-24), in a launch bound by issue latency."""
    if PAGE_TOKENS % BLOCK_N == 0:
        return page * stride_p + tl.cast(start_n % PAGE_TOKENS, tl.int64) * stride_t
    elif BLOCK_N % PAGE_TOKENS == 0:  # blocks start on a page: slot offsets are in the tile
        return (page * stride_p)[:, None]
    else:
        slot = ((start_n + offs_n) % PAGE_TOKENS).to(tl.int64)
        return (page * stride_p + slot * stride_t)[:, None]


@triton.jit
def span_pages(table_row, lo, end, PAGE_TOKENS: tl.constexpr, PAGED: tl.constexpr,
               SPAN: tl.constexpr):
    """(pages, first) for ``block_kv_ptrs``'s ``SPAN`` > 0 path: the table entries of the
    ``SPAN`` pages from key ``lo``'s on, and the index of the first; placeholders (0, 0)
    otherwise. Only the entries of keys below ``end`` (the split's end) are read: the others
    are 0 (and may lie past the table row)."""
    if PAGED and SPAN > 0:
        first = lo // PAGE_TOKENS
        idx = first + tl.arange(0, SPAN)
        # int32 as stored: the gather per block moves half the bytes of int64 entries.
        pages = tl.load(table_row + idx, mask=idx * PAGE_TOKENS < end, other=0)
        return pages, first
    else:
        return 0, 0


@triton.jit
def first_pages(table_row, lo, offs_n, end, PAGE_TOKENS: tl.constexpr, BLOCK_N: tl.constexpr,
                PAGED: tl.constexpr, span=0, SPAN: tl.constexpr = 0):
    """What ``block_kv_ptrs`` carries into a key loop that starts at ``lo``: ``span`` (what
    ``span_pages`` gave) when ``SPAN`` > 0, else the first block's pages (paged) or a
    placeholder (contiguous)."""
    if PAGED and SPAN > 0:
        return span
    elif PAGED:
        return block_pages(table_row, lo, offs_n, end, PAGE_TOKENS, BLOCK_N)
    else:
        return 0


@triton.jit
def block_kv_ptrs(k_base, v_base, kv_offs_k, kv_offs_v, page, first, table_row, start_n,
                  offs_n, end, stride_kp, stride_kt, stride_vp, stride_vt,
                  PAGE_TOKENS: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
                  SPAN: tl.constexpr = 0, ROW_ALIGN: tl.constexpr = 0,
                  KV_SHIFT: tl.constexpr = 0):
    """(K pointers, V pointers, pages carried to the next block) of the key block at
    ``start_n``, for the bases and offsets ``kv_bases`` gave and what ``first_pages`` gave.
    Paged, ``SPAN`` > 0: the block's pages come out of the loop's page span in registers, so
    every block's addresses are known from the start and the loop's pipeliner can issue loads
    blocks ahead, as on contiguous keys. ``SPAN`` 0: ``page`` holds this block's pages and the
    next block's are looked up now, off this block's critical path (but the loads of a block
    cannot be issued before the previous iteration has looked its pages up).
    ``ROW_ALIGN``: the pointers marked with their rows' alignment (``row_ptrs``); rows read
    skewed (``KV_SHIFT``, ``kv_bases``) start on a piece (``KV_SHIFT`` elements) whatever it
    says."""
    if KV_SHIFT > 0:  # a piece's bytes
        KV_ALIGN: tl.constexpr = KV_SHIFT * k_base.dtype.element_ty.primitive_bitwidth // 8
    else:
        KV_ALIGN: tl.constexpr = ROW_ALIGN
    if PAGED:
        if SPAN > 0:
            # Spans are for pages smaller than a block (decode_kernel._page_span): one page per
            # block is a scalar lookup, which block_rows takes as a scalar.
            tl.static_assert(PAGE_TOKENS % BLOCK_N != 0)
            # Clamped: the software pipeliner computes the addresses of blocks past the loop's
            # end too (their loads are predicated off, the gather is not), and where a split
            # fills the span those blocks' indices run past it. Unclamped, that gather read
            # past its shared-memory scratch: an illegal address on an H100 at 1 x 16K keys in
            # 16-token pages, one split (1024 pages), and at 8 x 32K (2026-11-24).
            idx = tl.minimum((start_n + offs_n) // PAGE_TOKENS - first, SPAN - 1)
            here = tl.gather(page, idx, 0).to(tl.int64)
        else:
            here = page
            page = block_pages(table_row, start_n + BLOCK_N, offs_n, end, PAGE_TOKENS, BLOCK_N)
        k_rows = k_base + block_rows(here, start_n, offs_n, stride_kp, stride_kt,
                                     PAGE_TOKENS, BLOCK_N)
        v_rows = v_base + block_rows(here, start_n, offs_n, stride_vp, stride_vt,
                                     PAGE_TOKENS, BLOCK_N)
    else:
        k_rows = k_base + tl.cast(start_n, tl.int64) * stride_kt
        v_rows = v_base + tl.cast(start_n, tl.int64) * stride_vt
    return row_ptrs(k_rows, kv_offs_k, KV_ALIGN), row_ptrs(v_rows, kv_offs_v, KV_ALIGN), page


@triton.jit
def row_ptrs(rows, offs, ROW_ALIGN: tl.constexpr):
    """``rows + offs``: a ``[rows, D]`` tile of pointers (``offs`` unit stride along D) marked
    as rows that start at a multiple of ``ROW_ALIGN`` bytes (``_launch.row_align``; 0: no
    mark). Triton sees a row stride's alignment only when it is a multiple of 16 elements:
    rows of 72 bf16 (144 bytes) were read 2 bytes at a time, without async copies (sm_90a
    decode: 144 ld.global.b16 a key block, 255 registers, 280 bytes spilled; a 64 x 4K decode
    took 64x D 80's GPU time). Dim 1 is the row; dim 0 (across rows) claims nothing. The sum
    is made here: a mark on a function's argument is dropped (it needs the op that made it)."""
    ptrs = rows + offs
    if ROW_ALIGN > 0:
        ptrs = tl.multiple_of(ptrs, [1, ROW_ALIGN])
    return ptrs


@triton.jit
def seq_keys(lens, seq, PAGED: tl.constexpr):
    """(first packed key row, key count) of sequence ``seq``: ``lens`` is cu_seqlens_k, or
    seqlens_k when paged (the first row is then unused: keys come through the table)."""
    if PAGED:
        k_start = 0
        seqlen = tl.load(lens + seq)
    else:
        k_start = tl.load(lens + seq)
        seqlen = tl.load(lens + seq + 1) - k_start
    return k_start, seqlen


@triton.jit
def kv_bases(K, V, k_start, kv_head, offs_n, offs_d, stride_kt, stride_kh, stride_vt,
             stride_vh, PAGED: tl.constexpr, PAGE_TOKENS: tl.constexpr = 1,
             BLOCK_N: tl.constexpr = 1, KV_SHIFT: tl.constexpr = 0):
    """Where a program's keys and values start: (K base, V base, K tile offsets, V tile
    offsets, K skew, V skew). Contiguous: the bases point at the sequence's first key and the
    offsets span a tile of keys. Paged: the bases point at the kv head only; the offsets hold
    what every key block shares (the rows within a page where a block sits in one, the slots
    of each page where blocks start on page boundaries, else the head dim only), and each key
    block adds its pages from the block table (``block_rows``). (The table row stays with the
    caller: returning the contiguous path's None table would not compile.)
    ``KV_SHIFT`` (``_launch.kv_shift``: the elements in a 16- or 8-byte piece, 0: off): every
    row of this kv head starts the same number of elements past a piece boundary, its skew;
    the bases move back by it, so column ``c`` of a tile is the row's element ``c - skew``
    and each row is read in whole pieces (``skewed_cols``)."""
    k_skew = 0
    v_skew = 0
    if KV_SHIFT > 0:
        k_skew = ((kv_head.to(tl.int64) * stride_kh) % KV_SHIFT).to(tl.int32)
        v_skew = ((kv_head.to(tl.int64) * stride_vh) % KV_SHIFT).to(tl.int32)
    if PAGED:
        k_base = K + (kv_head.to(tl.int64) * stride_kh - k_skew)
        v_base = V + (kv_head.to(tl.int64) * stride_vh - v_skew)
        if PAGE_TOKENS % BLOCK_N == 0:
            rows = offs_n
        elif BLOCK_N % PAGE_TOKENS == 0:
            rows = offs_n % PAGE_TOKENS
        else:
            rows = offs_n * 0
        kv_offs_k = rows[:, None] * stride_kt + offs_d[None, :]
        kv_offs_v = rows[:, None] * stride_vt + offs_d[None, :]
    else:
        k_base = K + (k_start.to(tl.int64) * stride_kt + kv_head.to(tl.int64) * stride_kh
                      - k_skew)
        v_base = V + (k_start.to(tl.int64) * stride_vt + kv_head.to(tl.int64) * stride_vh
                      - v_skew)
        kv_offs_k = offs_n[:, None] * stride_kt + offs_d[None, :]
        kv_offs_v = offs_n[:, None] * stride_vt + offs_d[None, :]
    return k_base, v_base, kv_offs_k, kv_offs_v, k_skew, v_skew


@triton.jit
def skewed_cols(offs_d, skew, HEAD_DIM: tl.constexpr, KV_SHIFT: tl.constexpr):
    """(columns to load, columns of the row) of a tile whose rows start ``skew`` elements
    into it (``kv_bases``): the loads take every piece (16 or 8 bytes) that holds part of the
    row, so they stay whole (a mask that changed inside a piece would split it into element
    loads); the pieces' other elements belong to the neighbouring heads."""
    end = tl.multiple_of((skew + HEAD_DIM + KV_SHIFT - 1) // KV_SHIFT * KV_SHIFT, KV_SHIFT)
    return offs_d < end, (offs_d >= skew) & (offs_d < skew + HEAD_DIM)


@triton.jit
def q_and_kv_cols(q_rows, rows_ok, offs_d, k_skew, v_skew, HEAD_DIM: tl.constexpr,
                  KV_SHIFT: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """(the query tile, K's columns to load, V's, K's columns of the row) for ``q_rows`` (a
    ``[rows, 1]`` tile of row pointers) against K/V tiles from ``kv_bases``. Skewed
    (``KV_SHIFT``): q is read into K's columns (once a program: element loads are fine);
    else every mask is the head dim's, and q's rows carry their ``ROW_ALIGN`` mark."""
    d_ok = offs_d < HEAD_DIM
    if KV_SHIFT > 0:
        k_cols, k_row = skewed_cols(offs_d, k_skew, HEAD_DIM, KV_SHIFT)
        v_cols, _ = skewed_cols(offs_d, v_skew, HEAD_DIM, KV_SHIFT)
        q = tl.load(q_rows + (offs_d - k_skew)[None, :], mask=rows_ok[:, None] & k_row[None, :],
                    other=0.0)
    else:
        k_cols, v_cols, k_row = d_ok, d_ok, d_ok
        q = tl.load(row_ptrs(q_rows, offs_d[None, :], ROW_ALIGN),
                    mask=rows_ok[:, None] & d_ok[None, :], other=0.0)
    return q, k_cols, v_cols, k_row


@triton.jit
def unskew(acc, skew, offs_d, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """``acc`` (rows x ``BLOCK_D``) computed on V tiles whose rows started ``skew`` columns in
    (``kv_bases``), moved back: column ``c`` of the result is the head dim's ``c``; columns
    past the head dim are 0."""
    cols = tl.minimum(offs_d + skew, BLOCK_D - 1)
    acc = tl.gather(acc, tl.broadcast_to(cols[None, :], acc.shape), 1)
    return tl.where((offs_d < HEAD_DIM)[None, :], acc, 0.0)
