"""Hopper (sm_90) prefill in Gluon: warp specialization and the wgmma order written out.

The portable kernel (``prefill_kernel.py``) leaves the order of the two GEMMs and the softmax to
Triton's pipeliner, which waits for every QK^T wgmma before the softmax reads it and for every
PV wgmma before the next block (``warp_group_dot_wait pendings=0`` after each dot in its TTGIR),
so the tensor cores idle while the warps do exponentials: 0.81-0.88x SDPA cuDNN at D 128 on an
H100. This kernel is laid out as FlashAttention-3 is (and as cuDNN's sm90 kernel is: ncu shows
384 threads, 168 registers at launch):

* a producer warp issues every TMA copy of Q, K and V into rings of ``STAGES`` shared-memory
  slots, each with a "ready" mbarrier (TMA bytes) and an "empty" one (one arrival per consumer);
* two or three consumer warpgroups take 64 query rows each of a 128- or 192-row tile (192 at
  D 64, as FlashAttention-3 does: there the softmax weighs as much as the GEMMs, and a third
  warpgroup keeps the tensor cores fed), at 224 / 160 registers (``setmaxnreg``), and per key
  block j run

      issue S_j = Q K_j^T          (async)
      issue O += P_{j-1} V_{j-1}   (async, P from registers)
      wait until S_j is done       (the PV keeps running); K_j's slot is empty
      softmax of S_j -> P_j        (exp2 on the SFUs while the tensor cores do the PV)
      wait for the PV; V_{j-1}'s slot is empty; O *= alpha_j

  ptxas hoists that last wait above the softmax (the PTX wait names no registers), so in the
  SASS a warpgroup's softmax overlaps only the other warpgroup's GEMMs. The FP8 build (Q, K,
  V and P in e4m3, where the GEMMs take half as long and the softmax is the bound) writes the
  order so that ptxas cannot: P_j goes to shared memory, and the PV is waited for at the top
  of the next block (``_ws_step_fp8``), which also frees the registers for a third consumer.
  Under a causal mask each warpgroup computes only the key blocks its own rows see and passes
  the tile's other blocks through;
* persistent launches (``prefill`` uses them): one program per SM walks tiles, claiming the
  next from a counter (causal tiles differ in length: every SM-count-th tile left programs
  6-25% apart), with two Q buffers so the next tile's Q and first keys load while the
  consumers finish this one. H100: 0.95-0.97x -> 0.98-1.01x cuDNN at D 128 non-causal.
  The producer finds each tile's place (global loads of ``cu_seqlens``) and hands it to the
  consumers through shared memory, off their path between tiles: D 64 causal N 4K 378 -> 400
  TFLOP/s (H100, 2026-11-24h, call 8, same call);
* the consumers issue their GEMMs in turns (FlashAttention-3's ping-pong: named barriers, as
  inline PTX), so one warpgroup's softmax runs under the next one's GEMMs by construction rather
  than by drift (``_ws_consumer``).

No CTA-wide barrier sits in the loop, so without turns the consumers drift apart and one's
softmax runs under the other's GEMMs some of the time. The same order without warp
specialization (all 8 warps issuing, each refill behind a CTA barrier that keeps both
warpgroups in lockstep) measured no better than the portable kernel (H100, 2026-11-24: 482-537
TFLOP/s at D 128 non-causal; ncu at 2 x 8K x 16 heads: 2.40 ms against cuDNN's 1.92); this one
593-615 against cuDNN's 611-629.

Scope: contiguous packed varlen inputs (``[total, H, D]``), fp16/bf16, D 64 or 128, causal or
not, GQA, LSE, FP8 K/V handed in widened to 16 bits with their scales (``kv_scales``: applied
per tile), or FP8 Q, K and V at D 64 or 128 (both dots in e4m3, bf16 output); no window, softcap,
ALiBi or pages (those keep the portable kernel). The program-to-tile mapping is the portable
kernel's (``prefill_kernel`` module docstring): reverse slots, heads fastest under a causal
mask. Varlen edges: TMA reads whole tiles, so a tile can hold rows of the next sequence. Queries
there only produce rows that are never stored; keys there are masked to -inf before the softmax
(a ``where``, so NaN or inf in them cannot leak); values there would meet ``p = 0`` but ``0 *
inf`` is NaN, so the producer brings the last key block's values through masked pointer loads
(zeros past the sequence) instead of TMA.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from attention_kernels._launch import KernelLaunch
from attention_kernels._prefill_slots import causal_key_range, program_tile, slot_grid
from attention_kernels.kv_copies import transpose_values


@gluon.jit
def _find_sequence(cu_q, slot, batch, BLOCK_M: gl.constexpr, BLOCK_B: gl.constexpr,
                   NUM_WARPS: gl.constexpr):
    """The sequence owning tile slot ``slot`` (``_prefill_slots``; the portable kernel's search
    with a Gluon layout on its index block)."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    count = 0
    for b0 in range(0, batch, BLOCK_B):
        bs = b0 + gl.arange(0, BLOCK_B, layout=lay)
        starts = gl.load(cu_q + bs, mask=bs < batch, other=0) // BLOCK_M + bs
        count += gl.sum(((starts <= slot) & (bs < batch)).to(gl.int32), 0)
    return count - 1


# FP8 P (e4m3: normal from 2^-6, subnormal to 2^-9, largest 448) is taken as 2^8 times the
# probabilities, in (0, 256] (430 with the lazy max, ``_softmax_block``): probabilities down to
# 2^-14 keep all 3 mantissa bits instead of 2^-6, for no instruction (the shift joins the
# exp2's subtraction).
_P_SHIFT_FP8 = gl.constexpr(8)


@gluon.jit
def _row_max(x):
    """Row max of a wgmma accumulator tile as a tree: Triton reduces a thread's values in one
    dependent chain (31 ``FMNMX`` back to back per row at 128 columns, sm_90a SASS), which the
    softmax waits on. Halving first (column ``c`` against ``c + cols // 2``: a thread holds
    both while ``cols // 2`` is a multiple of 8, so no data moves) leaves a chain of 4 plus
    the last 8 columns' reduction."""
    rows: gl.constexpr = gl.SliceLayout(1, x.type.layout)
    for _ in gl.static_range(4):
        if x.shape[1] > 8:
            x = gl.permute(gl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), (0, 2, 1))
            a, b = gl.split(x)
            x = gl.maximum(a, b)
    return gl.convert_layout(gl.max(x, 1), rows)  # the same registers: no data moves


@gluon.jit
def _softmax_block(s, m_i, l_i, block, seqlen_k, rows_pos, qk_scale, masked,
                   IS_CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, FP8: gl.constexpr):
    """Online-softmax update for one block of raw scores ``s`` (``qk_scale`` takes them to log2
    units). Returns ``p`` (fp32), the new max, alpha (the old rows' rescale) and the new sum.
    ``masked``: a compile-time or run-time flag; only the mask sits under it, so a run-time
    flag costs no second copy of the rest (``_attend``). ``FP8``: ``p`` is ``2**_P_SHIFT_FP8``
    times the probabilities (up to 2^0.75 more under the lazy max below; the output's
    normalisation cancels it and the lse takes it off), the row max a tree (``_row_max``; the
    16-bit builds ran 1-5% slower with it, H200, 2026-12-01), and no row sum (``l_i``
    returned as given: ``_pv_issue`` sums P)."""
    P_SHIFT: gl.constexpr = _P_SHIFT_FP8 if FP8 else 0
    scale = qk_scale
    if masked:
        offs_n = block * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        keep = gl.expand_dims(offs_n < seqlen_k, 0)
        if IS_CAUSAL:
            keep = keep & (gl.expand_dims(offs_n, 0) <= gl.expand_dims(rows_pos, 1))
        # Scaled before the mask: -inf times a zero or negative scale would be NaN or +inf.
        s = gl.where(keep, s * qk_scale, float("-inf"))
        scale = gl.to_tensor(1.0)
    # Unmasked, every key of the block is visible to every row, and max(s) * scale, the max of
    # the scaled scores for a positive scale (as the portable kernel assumes there too), lets
    # one FMA per score scale and shift it.
    row_max = _row_max(s) if FP8 else gl.max(s, 1)
    if FP8:
        # A lazy max: a row's moves only past 0.75 (log2 units) above the one P is taken
        # against, so P stays <= 2^(8 + 0.75) = 430 < 448 (e4m3's largest) and most blocks keep
        # alpha exactly 1, which lets ``_rescale_skip`` leave the output alone: +2-9% TFLOP/s
        # at D 128 (H200, 2026-12-01, same call); the 16-bit build lost 2-5% with both.
        cand = row_max * scale
        m_new = gl.where(cand > m_i + 0.75, cand, m_i)
    else:
        m_new = gl.maximum(m_i, row_max * scale)
    # A row that has seen no key keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * scale - gl.expand_dims(m_shift - P_SHIFT, 1))
    alpha = gl.exp2(m_i - m_shift)
    if not FP8:
        l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, alpha, l_i


# Named barriers 8.. order the consumers' GEMM issues (Triton 3.6 numbers its own from 0: with
# three consumers 0-3 appear in this kernel's PTX).
_TURN_BARRIER = gl.constexpr(8)


@gluon.jit
def _turn(bar_id, ARRIVE: gl.constexpr):
    """``bar.sync`` (wait for this warpgroup's turn) or ``bar.arrive`` (hand the turn on) on
    named barrier ``bar_id``, 256 threads: the warpgroup whose turn it is and the one before it
    in the order. Inline PTX: Gluon has no named barriers."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    ids = gl.full([128], bar_id, gl.int32, layout=lay)
    if ARRIVE:
        gl.inline_asm_elementwise("bar.arrive $1, 256;\n\tmov.b32 $0, $1;", "=r,r", [ids],
                                  dtype=gl.int32, is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("bar.sync $1, 256;\n\tmov.b32 $0, $1;", "=r,r", [ids],
                                  dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _zero_columns(q_part, first: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Zero columns ``first ..`` of a consumer's landed 64-row Q part: q rows narrower than
    the tile arrive with the next head's first columns (zeros past the last head), which
    must score nothing against K's zero-padded columns, infinities included. Once per tile;
    every thread's stores fenced and done before the first QK wgmma reads the part."""
    TPW_D: gl.constexpr = HEAD_DIM // 8
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_D, TPW_D], [4, 1], [1, 0])
    vals = q_part.load(layout)
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    q_part.store(gl.where(gl.expand_dims(cols < first, 0), vals, gl.zeros_like(vals)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _store_tile(acc, m_i, l_i, Out, Lse, q_start, seqlen_q, row0, head, stride_ot, stride_oh,
                stride_lh, out_scale, HEAD_DIM: gl.constexpr, OUT_D: gl.constexpr,
                BLOCK_M: gl.constexpr, RETURN_LSE: gl.constexpr, NUM_WARPS: gl.constexpr,
                P_SHIFT: gl.constexpr):
    """Normalise (times ``out_scale``: FP8 values' scale, else 1) and store rows ``row0 ..
    row0 + BLOCK_M`` of the sequence (those that exist), columns ``0 .. OUT_D``. Rows that
    saw no key: output 0, lse -inf."""
    # 16-byte stores along D (the wgmma layout holds 2 columns per thread per row). Rows
    # narrower than the tile (a zero-padded launch's, ``OUT_D`` < ``HEAD_DIM``) start off
    # 16-byte boundaries (D 59: 118-byte rows), so their stores go one element at a time,
    # a warp's lanes on 32 adjacent columns of one row: 64 contiguous bytes per store.
    VEC: gl.constexpr = 8 if OUT_D == HEAD_DIM else 1
    TPW_D: gl.constexpr = HEAD_DIM // 8 if OUT_D == HEAD_DIM else 32
    out_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // TPW_D, TPW_D],
                                                [NUM_WARPS, 1], [1, 0])
    seen = l_i > 0.0
    inv = gl.where(seen, out_scale / gl.where(seen, l_i, 1.0), 0.0)
    o_rows: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    out = acc * gl.expand_dims(gl.convert_layout(inv, o_rows), 1)
    out = gl.convert_layout(out.to(Out.dtype.element_ty), out_layout)
    offs_m = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out_layout))
    # Rows below 0 belong to an end-aligned first tile (``_tile``): they do not exist.
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, out_layout))
    o_ptrs = (Out + q_start.to(gl.int64) * stride_ot + head.to(gl.int64) * stride_oh
              + gl.expand_dims(offs_m.to(gl.int64) * stride_ot, 1) + gl.expand_dims(offs_d, 0))
    row_ok = gl.expand_dims((offs_m >= 0) & (offs_m < seqlen_q), 1)
    if OUT_D == HEAD_DIM:
        gl.store(o_ptrs, out, mask=row_ok)
    else:
        gl.store(o_ptrs, out, mask=row_ok & gl.expand_dims(offs_d < OUT_D, 0))
    if RETURN_LSE:
        lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0)) - P_SHIFT)
                       * 0.6931471805599453,
                       float("-inf"))
        rows = row0 + gl.arange(0, BLOCK_M, layout=m_i.type.layout)
        gl.store(Lse + head.to(gl.int64) * stride_lh + q_start + rows, lse,
                 mask=(rows >= 0) & (rows < seqlen_q))


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16,
              torch.float8_e4m3fn: gl.float8e4nv}


@functools.cache
def _tile_layout(block_rows: int, cols: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared layout of one ``[block_rows, cols]`` tile, made once: a descriptor took
    8.8 us with it made per call, 2.5 us without (dev box), and a launch makes three."""
    return gl.NVMMASharedLayout.get_default_for([block_rows, cols], _GL_DTYPES[dtype])


def descriptor(t: torch.Tensor, block_rows: int, cols: int = 0) -> TensorDescriptor:
    """A TMA descriptor over packed ``[total, heads, D]`` as ``[total, heads * D]``, one
    ``[block_rows, cols]`` tile per copy (``cols``: D, or more: a copy at head ``h``'s column
    ``h * D`` then holds the next head's first columns, zeros past the last head)."""
    rows, heads, dim = t.shape
    cols = cols or dim
    layout = _tile_layout(block_rows, cols, t.dtype)
    return TensorDescriptor(t, [rows, heads * dim], [t.stride(0), 1], [block_rows, cols], layout)


# Columns of ``transposed_values_ref``' rows are a multiple of this: TMA needs 16-byte strides.
_VT_ALIGN_GL = gl.constexpr(16)  # the kernel's copy (``_ws_producer``)
_VT_ALIGN = _VT_ALIGN_GL.value


def _fp8_key_order(r: torch.Tensor) -> torch.Tensor:
    """Where key ``r`` of a sequence sits among its block's columns (``_p_store``): within
    each 16, key ``8g + 2t + e`` (``g, e`` in 0..1, ``t`` in 0..3: the QK^T accumulator gives
    thread ``t`` of a quad keys ``2t, 2t + 1, 2t + 8, 2t + 9``) at ``4t + 2g + e`` (the FP8
    operand gives thread ``t`` four consecutive keys, ``4t .. 4t + 3``)."""
    o = r % 16
    return r - o + (o % 8) // 2 * 4 + o // 8 * 2 + o % 2


def values_first_column(cu_k: torch.Tensor, block_n: int) -> torch.Tensor:
    """Each sequence's first column in ``transposed_values_ref``: ``cu_k[b]`` rounded up to
    ``_VT_ALIGN`` (TMA copies start on 16-byte boundaries: an unaligned start took the
    kernel down with "illegal instruction" on an H200) plus ``b * (block_n + _VT_ALIGN)``."""
    b = torch.arange(cu_k.shape[0] - 1, device=cu_k.device)
    start = cu_k[:-1].to(torch.int64)
    return (start + _VT_ALIGN - 1) // _VT_ALIGN * _VT_ALIGN + b * (block_n + _VT_ALIGN)


def transposed_values_ref(v: torch.Tensor, cu_k: torch.Tensor, block_n: int) -> torch.Tensor:
    """FP8 ``v [total, H_kv, D]`` as ``[H_kv * D, columns]``: tokens along rows, sequence
    ``b``'s from ``values_first_column`` in ``_fp8_key_order``, zeros between sequences.

    Why transposed: FP8 wgmma takes its B operand K-major only, and the P.V dot reduces over
    tokens (Triton's fused-attention tutorial transposes V on the host too; FlashAttention-3
    does it in shared memory). Why the zeros: a sequence's last key block runs past its end,
    where ``p = 0`` but the next sequence's values could hold NaN (``0 * NaN`` is NaN); the
    16-bit kernel loads that block through masked pointer loads, which at 8 bits along the
    tokens cannot be vectorised and spilled the 32-register producer (8 KB of stack, ptxas,
    sm_90a). They cost ``batch * (block_n + 16)`` columns (``_fp8_gluon_ok`` asks for a mean
    sequence of at least ``block_n``: about V's size again at most) and one pass over V, O(N)
    against the launch's O(N^2). Torch, for tests: the launch uses ``transpose_values``
    (``kv_copies``)."""
    total, heads, dim = v.shape
    batch = cu_k.shape[0] - 1
    cols = -(-total // _VT_ALIGN) * _VT_ALIGN + batch * (block_n + _VT_ALIGN)
    vt = torch.zeros((heads * dim, cols), dtype=torch.uint8, device=v.device)
    tokens = torch.arange(total, device=v.device)
    seq = torch.searchsorted(cu_k[1:], tokens.to(cu_k.dtype), right=True)
    start = cu_k.to(torch.int64)[seq]
    where = values_first_column(cu_k, block_n)[seq] + _fp8_key_order(tokens - start)
    vt[:, where] = v.reshape(total, heads * dim).view(torch.uint8).t()
    return vt.view(v.dtype)


def values_descriptor(vt: torch.Tensor, dim: int, block_n: int) -> TensorDescriptor:
    """TMA over ``transposed_values_ref``, one ``[D, block_n]`` tile (one kv head's D rows,
    ``block_n`` tokens) per copy."""
    layout = _tile_layout(dim, block_n, vt.dtype)
    return TensorDescriptor(vt, list(vt.shape), [vt.stride(0), 1], [dim, block_n], layout)


@gluon.jit
def _tile(t, walk, BLOCK_M: gl.constexpr, BLOCK_B: gl.constexpr, IS_CAUSAL: gl.constexpr,
          END_TILES: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Where tile ``t`` of the launch (``walk``, as the kernel packs it) is
    (``_prefill_slots``): ``(live, head, q_start, seqlen_q, row0, k_start, seqlen_k, n_full,
    n_end, seq)``; ``live`` is false for spare slots.

    ``END_TILES``: a sequence's tiles end at its last row, so a partial tile (rows from
    ``row0 < 0``) is its first. Under a causal mask that tile sees the fewest keys; aligned at
    the start instead, the partial tile is the last and heaviest: at N = 4096 with 192-row
    tiles, 64 live rows of 192 in the tile that sees all 4096 keys."""
    cu_q, cu_k, batch, num_heads, num_slots, slot_run, _ = walk
    head, slot_or_spare = program_tile(t, slot_run, num_heads, num_slots)
    slot = gl.maximum(slot_or_spare, 0)
    seq = _find_sequence(cu_q, slot, batch, BLOCK_M, BLOCK_B, NUM_WARPS)
    q_start = gl.load(cu_q + seq)
    seqlen_q = gl.load(cu_q + seq + 1) - q_start
    block = slot - (q_start // BLOCK_M + seq)
    n_tiles = gl.cdiv(seqlen_q, BLOCK_M)
    live = (block < n_tiles) & (slot_or_spare >= 0)
    row0 = block * BLOCK_M - (n_tiles * BLOCK_M - seqlen_q) if END_TILES else block * BLOCK_M
    k_start = gl.load(cu_k + seq)
    seqlen_k = gl.load(cu_k + seq + 1) - k_start
    n_full, n_end = causal_key_range(row0, seqlen_q, seqlen_k, BLOCK_M, IS_CAUSAL)
    return live, head, q_start, seqlen_q, row0, k_start, seqlen_k, n_full, n_end, seq


# What the producer hands the consumers per tile (``_publish_tile``): the tile id, then
# ``_tile``'s live, head, q_start, seqlen_q, row0, seqlen_k, n_end, then the bits of the
# tile's FP8 key and value scales (float32; 1.0 without FP8).
_TILE_FIELDS = gl.constexpr(10)
_ONE_BITS = gl.constexpr(0x3F800000)  # 1.0f


@gluon.jit
def _publish_tile(n, fields, tile_info, tile_ready, tile_empty):
    """Hand the consumers the ``n``-th tile (``fields``, as ``_TILE_FIELDS`` lists them)
    through a two-slot ring. The consumers used to find their tile themselves, a chain of
    dependent global loads (``_tile``) on their critical path at every tile boundary."""
    slot = n % 2
    mbarrier.wait(tile_empty.index(slot), ((n // 2) & 1) ^ 1, pred=n >= 2)
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    for i in gl.static_range(_TILE_FIELDS):
        tile_info.index(slot * _TILE_FIELDS + i).store(
            gl.full([1], fields[i], gl.int32, layout=lay))
    mbarrier.arrive(tile_ready.index(slot))  # release: the stores are seen after the wait
    return n + 1


@gluon.jit
def _take_field(tile_info, index):
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    return gl.max(tile_info.index(index).load(lay), 0)


@gluon.jit
def _take_tile(n, tile_info, tile_ready, tile_empty):
    """The ``n``-th tile the producer handed out: ``(t, live, head, q_start, seqlen_q, row0,
    seqlen_k, n_end, k_scale, v_scale, n + 1)``."""
    slot = n % 2
    mbarrier.wait(tile_ready.index(slot), (n // 2) & 1)
    base = slot * _TILE_FIELDS
    t = _take_field(tile_info, base)
    live = _take_field(tile_info, base + 1) != 0
    head = _take_field(tile_info, base + 2)
    q_start = _take_field(tile_info, base + 3)
    seqlen_q = _take_field(tile_info, base + 4)
    row0 = _take_field(tile_info, base + 5)
    seqlen_k = _take_field(tile_info, base + 6)
    n_end = _take_field(tile_info, base + 7)
    k_scale = _take_field(tile_info, base + 8).to(gl.float32, bitcast=True)
    v_scale = _take_field(tile_info, base + 9).to(gl.float32, bitcast=True)
    mbarrier.arrive(tile_empty.index(slot))
    return t, live, head, q_start, seqlen_q, row0, seqlen_k, n_end, k_scale, v_scale, n + 1


@gluon.jit
def _ws_producer(loads, bufs, bars, walk, HEAD_DIM: gl.constexpr, Q_D: gl.constexpr,
                 BLOCK_N: gl.constexpr,
                 BLOCK_B: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                 Q_BUFS: gl.constexpr, DYNAMIC: gl.constexpr, IS_CAUSAL: gl.constexpr,
                 END_TILES: gl.constexpr, KV_SCALES: gl.constexpr, FP8: gl.constexpr):
    """Every TMA copy: per tile its Q (with two buffers the next tile's Q lands while the
    consumers finish this one), then its K and V blocks through the rings. ``it`` counts key
    blocks over all tiles of this program (ring slot and phase), ``tc`` tiles with keys.
    Each tile's place is handed to the consumers before its copies (``_publish_tile``), and
    after the last tile one past the end, which stops them. ``DYNAMIC``: the next tile is
    claimed from ``Counter`` once this one's copies are issued (causal tiles differ in length;
    a fixed stride left programs 6-25% apart). ``FP8``: V comes transposed
    (``transposed_values_ref``), a ``[D, BLOCK_N]`` tile per block, all through TMA.
    ``Q_D``: the head dim of q's rows (``HEAD_DIM`` or fewer: a head's Q tile starts at
    column ``head * Q_D`` and runs on into the next head's, ``_zero_columns``)."""
    desc_q, desc_k, desc_v, V, stride_vt, group, Counter, KScale, VScale, stride_sb = loads
    q_smem, k_smem, v_smem, _, _, tile_info = bufs
    q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, tile_ready, tile_empty = bars
    num_tiles = walk[6]
    BLOCK_M: gl.constexpr = 64 * CONSUMERS
    it = 0
    tc = 0
    n = 0
    t = gl.program_id(0)
    while t < num_tiles:
        live, head, q_start, seqlen_q, row0, k_start, seqlen_k, n_full, n_end, seq = _tile(
            t, walk, BLOCK_M, BLOCK_B, IS_CAUSAL, END_TILES, 1)
        if KV_SCALES:  # (sequence, kv head)'s: stride_sb 0 for one scale per kv head
            at = seq.to(gl.int64) * stride_sb + head // group
            k_bits = gl.load(KScale + at).to(gl.int32, bitcast=True)
            v_bits = gl.load(VScale + at).to(gl.int32, bitcast=True)
        else:
            k_bits = _ONE_BITS
            v_bits = _ONE_BITS
        n = _publish_tile(n, (t, live.to(gl.int32), head, q_start, seqlen_q, row0, seqlen_k,
                              n_end, k_bits, v_bits), tile_info, tile_ready, tile_empty)
        n_blocks = gl.cdiv(n_end, BLOCK_N)
        if live & (n_blocks > 0):
            qb = tc % Q_BUFS
            mbarrier.wait(q_empty.index(qb), ((tc // Q_BUFS) & 1) ^ 1, pred=tc >= Q_BUFS)
            # Q as 64-row parts, one per consumer (TMA boxes and shared tiles are powers of 2).
            # An end-aligned first tile's rows below the sequence's start come from the previous
            # sequence (below row 0 of the tensor TMA fills zeros): computed, never stored.
            mbarrier.expect(q_ready.index(qb), CONSUMERS * desc_q.block_type.nbytes)
            for part in gl.static_range(CONSUMERS):
                tma.async_copy_global_to_shared(
                    desc_q, [q_start + row0 + part * 64, head * Q_D], q_ready.index(qb),
                    q_smem.index(qb * CONSUMERS + part))
            kv_col = (head // group) * HEAD_DIM
            ragged = n_blocks * BLOCK_N > seqlen_k  # the last block runs past the sequence
            for j in range(n_blocks):
                r = it + j
                slot = r % STAGES
                phase = ((r // STAGES) & 1) ^ 1  # the phase the consumers completed on it
                mbarrier.wait(k_empty.index(slot), phase, pred=r >= STAGES)
                mbarrier.expect(k_ready.index(slot), desc_k.block_type.nbytes)
                tma.async_copy_global_to_shared(desc_k, [k_start + j * BLOCK_N, kv_col],
                                                k_ready.index(slot), k_smem.index(slot))
                mbarrier.wait(v_empty.index(slot), phase, pred=r >= STAGES)
                if FP8:  # sequences end in zero columns (``transposed_values_ref``)
                    mbarrier.expect(v_ready.index(slot), desc_v.block_type.nbytes)
                    first = ((k_start + _VT_ALIGN_GL - 1) // _VT_ALIGN_GL * _VT_ALIGN_GL
                             + seq * (BLOCK_N + _VT_ALIGN_GL))  # ``values_first_column``
                    tma.async_copy_global_to_shared(desc_v, [kv_col, first + j * BLOCK_N],
                                                    v_ready.index(slot), v_smem.index(slot))
                elif ragged and j == n_blocks - 1:
                    # Values past the sequence's end would meet p = 0, and 0 * inf is NaN:
                    # this block comes through masked loads (zeros past the end), 8 rows at a
                    # time (the swizzle unit of the shared tile; the producer has few registers).
                    TPW_D: gl.constexpr = HEAD_DIM // 8
                    CH: gl.constexpr = 8
                    v_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_D, TPW_D],
                                                              [1, 1], [1, 0])
                    # One offset tile for every chunk, and a scalar row base per chunk: tensors
                    # per chunk would be hoisted out of the tile loop (16 of them) and spill.
                    chunk_rows = gl.arange(0, CH, layout=gl.SliceLayout(1, v_layout))
                    offs = (gl.expand_dims(chunk_rows * stride_vt, 1)
                            + gl.expand_dims(gl.arange(0, HEAD_DIM,
                                                       layout=gl.SliceLayout(0, v_layout)), 0))
                    for c in gl.static_range(BLOCK_N // CH):
                        first = j * BLOCK_N + c * CH
                        base = V + (k_start + first).to(gl.int64) * stride_vt + kv_col
                        keep = gl.expand_dims(chunk_rows < seqlen_k - first, 1)
                        vals = gl.load(base + offs, mask=keep, other=0.0)
                        v_smem.index(slot).slice(c * CH, CH).store(vals)
                    fence_async_shared()
                    gl.thread_barrier()
                    mbarrier.arrive(v_ready.index(slot))
                else:
                    mbarrier.expect(v_ready.index(slot), desc_v.block_type.nbytes)
                    tma.async_copy_global_to_shared(desc_v, [k_start + j * BLOCK_N, kv_col],
                                                    v_ready.index(slot), v_smem.index(slot))
            it += n_blocks
            tc += 1
        if DYNAMIC:
            t = gl.num_programs(0) + gl.atomic_add(Counter, 1)
        else:
            t += gl.num_programs(0)
    _publish_tile(n, (t, 0, 0, 0, 0, 0, 0, 0, 0, 0), tile_info, tile_ready, tile_empty)


@gluon.jit
def _pv_wait(acc_tok, p_prev):
    """Wait for the 16-bit P.V wgmma; its register operand ``p_prev`` stays live until then."""
    acc, p_prev = warpgroup_mma_wait(0, deps=(acc_tok, p_prev))
    return acc


@gluon.jit
def _rescale(acc, alpha):
    """The output rows times their softmax rescale ``alpha`` (a row vector of S's layout)."""
    return acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)


@gluon.constexpr_function
def _rescale_skip_asm(n: int) -> str:
    """PTX for ``_rescale_skip`` over a thread's ``n`` output values (``$n..``; ``$2n..``
    their rows' alpha; ``$0..`` the results). A thread holds two rows of a wgmma accumulator,
    at its values 0 and 2 (columns ``c``, ``c + 1`` of row ``r``, then of row ``r + 8``)."""
    a = 2 * n
    lines = ["{", ".reg .pred %p<2>;",
             f"setp.neu.f32 %p0, ${a}, 0f3F800000;",
             f"setp.neu.or.f32 %p0, ${a + 2}, 0f3F800000, %p0;",
             "vote.sync.any.pred %p1, %p0, 0xffffffff;"]
    lines += [f"mov.b32 ${i}, ${n + i};" for i in range(n)]
    lines.append("@!%p1 bra.uni SKIP${:uid};")
    lines += [f"mul.f32 ${i}, ${n + i}, ${a + i};" for i in range(n)]
    lines += ["SKIP${:uid}:", "}"]
    return "\n".join(lines)


@gluon.constexpr_function
def _rescale_skip_constraints(n: int) -> str:
    return ",".join(["=r"] * n + ["r"] * (2 * n))


@gluon.jit
def _rescale_skip(acc, alpha):
    """``_rescale`` of one warpgroup's [64, D] fp32 output, skipped by a warp-uniform branch
    where every row of the warp kept alpha 1 (its max did not move: FP8's lazy max,
    ``_softmax_block``): D / 2 FMUL a thread saved in most blocks. Triton has no such branch
    on a value (it would predicate each multiply), hence the PTX."""
    N: gl.constexpr = acc.shape[1] // 2  # a thread's values: 64 rows x D over 128 threads
    gl.static_assert(acc.shape[0] == 64, "one warpgroup's 64 rows (two a thread)")
    gl.static_assert(acc.shape[1] <= 128, "measured and compiled at D 64 and 128 only")
    a = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
    a = gl.broadcast(a, acc)[0]
    return gl.inline_asm_elementwise(_rescale_skip_asm(N), _rescale_skip_constraints(N),
                                     [acc, a], dtype=gl.float32, is_pure=True, pack=N)


@gluon.jit
def _pv_issue(p, v, acc, ones, ROW_SUM: gl.constexpr):
    """O += P V issued. ``ROW_SUM`` (FP8; ``acc`` = (O, the running row sums, the last block's
    sums, whose registers the next take)): also P ones from zero, each of its 8 columns P's row
    sums, which ``_settle_pv`` adds to the running sums in fp32: the softmax's sum moved off
    the FP32 units onto the tensor cores. Why: issue slots, not the MUFU or the tensor cores,
    bound the FP8 build's block (ncu, H200, D 128, N 8K: issue 47% busy, MUFU 49%; a build
    without the row sum ran 17-20% faster); its 64 FADD a thread go, for a wgmma 1/16 of the
    PV: +10-19% non-causal in one call's interleaved A/B, causal +1-2% with two consumers and
    +6-9% with three (H200, D 128, N 4K-16K, 2026-12-01). Sums kept in the wgmma's accumulator
    across blocks lost bits (FP8 wgmma adds with ~14: the output's relative error against
    cuDNN's bf16 at N 4K 0.080, not 0.053), so each block's start from zero. Returns the
    token, or both and the running sums."""
    if ROW_SUM:
        return (warpgroup_mma(p, v, acc[0], is_async=True),
                warpgroup_mma(p, ones, acc[2], use_acc=False, is_async=True), acc[1])
    else:
        return warpgroup_mma(p, v, acc, is_async=True)


@gluon.jit
def _block_gemms(r, q_part, k_smem, k_ready, k_empty, p_prev, v_prev, v_ready, acc, s_zero, turns,
                 STAGES: gl.constexpr, PINGPONG: gl.constexpr, ones=None,
                 ROW_SUM: gl.constexpr = False):
    """Key block at ring position ``r``: S = Q K^T and O += P_prev V_prev issued (in this
    warpgroup's turn with ``PINGPONG``; V_prev from position ``r - 1``; ``ROW_SUM``: the row
    sums' wgmma too, ``_pv_issue``), then S waited for and its K slot released. Returns S and
    the token(s) of what is still in flight."""
    kslot = r % STAGES
    mbarrier.wait(k_ready.index(kslot), (r // STAGES) & 1)
    if PINGPONG:
        mbarrier.wait(v_ready.index((r - 1) % STAGES), ((r - 1) // STAGES) & 1)
        _turn(turns[0], False)
    s_tok = warpgroup_mma(q_part, k_smem.index(kslot).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
    if not PINGPONG:
        mbarrier.wait(v_ready.index((r - 1) % STAGES), ((r - 1) // STAGES) & 1)
    acc_tok = _pv_issue(p_prev, v_prev, acc, ones, ROW_SUM)
    if PINGPONG:
        _turn(turns[1], True)
    if ROW_SUM:  # noqa: SIM108 (compile-time). S, PV, P ones: S done at 2 groups pending
        s = warpgroup_mma_wait(2, deps=(s_tok, ))
    else:
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(kslot))
    return s, acc_tok


@gluon.jit
def _ws_step(r, j, acc, p_prev, m_i, l_i, q_part, k_smem, v_smem, k_ready, v_ready, k_empty,
             v_empty, seqlen_k, rows_pos, qk_scale, s_zero, turns, masked,
             IS_CAUSAL: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
             p_layout: gl.constexpr, PINGPONG: gl.constexpr):
    """Key block ``j`` of the tile (16-bit), ring position ``r``: S_j issued, P_{j-1} V_{j-1}
    issued, the softmax of S_j, then the PV waited for. ``PINGPONG``: both issues in this
    warpgroup's turn (``turns``: its barrier and the next one's).

    The softmax is written under the PV (FlashAttention-3's order), but ptxas hoists the
    PV's wait above it (sm_90a SASS: ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` before the first row
    max; the PTX wait has no register operands to hold it), so it overlaps only the other
    warpgroup's GEMMs. FP8 avoids that (``_ws_step_fp8``); here the moved wait would keep two
    P operands in registers, past the consumers' 224 (ptxas then serialized the wgmma)."""
    vslot = (r - 1) % STAGES
    s, acc_tok = _block_gemms(r, q_part, k_smem, k_ready, k_empty, p_prev, v_smem.index(vslot),
                              v_ready, acc, s_zero, turns, STAGES, PINGPONG)
    p, m_i, alpha, l_i = _softmax_block(s, m_i, l_i, j, seqlen_k, rows_pos, qk_scale, masked,
                                        IS_CAUSAL, BLOCK_N, False)
    acc = _pv_wait(acc_tok, p_prev)
    mbarrier.arrive(v_empty.index(vslot))
    acc = _rescale(acc, alpha)
    p_next = gl.convert_layout(p.to(p_prev.dtype), p_layout)
    return acc, p_next, m_i, l_i


@gluon.jit
def _first_block(q_part, k_smem, k_ready, k_empty, it, seqlen_k, rows_pos, qk_scale, turns,
                 IS_CAUSAL: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                 s_layout: gl.constexpr, PINGPONG: gl.constexpr, FP8: gl.constexpr):
    """A warpgroup's first key block (ring position ``it``): S_0 in its turn, waited for, and
    its softmax (masked). Returns P_0, the max, alpha, the sum, and the zero S operand the
    next blocks reuse."""
    rows_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    m_i = gl.full([64], float("-inf"), gl.float32, layout=rows_layout)
    l_i = gl.zeros([64], gl.float32, layout=rows_layout)
    s_zero = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
    kslot = it % STAGES
    mbarrier.wait(k_ready.index(kslot), (it // STAGES) & 1)
    if PINGPONG:
        _turn(turns[0], False)
    s_tok = warpgroup_mma(q_part, k_smem.index(kslot).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
    if PINGPONG:
        _turn(turns[1], True)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(kslot))
    p, m_i, alpha, l_i = _softmax_block(s, m_i, l_i, 0, seqlen_k, rows_pos, qk_scale, True,
                                        IS_CAUSAL, BLOCK_N, FP8)
    return p, m_i, alpha, l_i, s_zero


@gluon.jit
def _attend(q_part, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, it, n_blocks, nb_full,
            seqlen_k, rows_pos, qk_scale, turns, IS_CAUSAL: gl.constexpr, STAGES: gl.constexpr,
            BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, s_layout: gl.constexpr,
            o_layout: gl.constexpr, p_layout: gl.constexpr, PINGPONG: gl.constexpr):
    """One warpgroup's 64 rows (16-bit Q, K, V) against ``n_blocks`` key blocks (ring positions
    from ``it``); blocks below ``nb_full`` need no mask. Returns the unnormalised output, max
    and sum. ``PINGPONG``: ``n_blocks + 1`` turns (each block's issues, then the last PV's)."""
    acc = gl.zeros([64, HEAD_DIM], gl.float32, layout=o_layout)
    p, m_i, alpha, l_i, s_zero = _first_block(
        q_part, k_smem, k_ready, k_empty, it, seqlen_k, rows_pos, qk_scale, turns, IS_CAUSAL,
        STAGES, BLOCK_N, s_layout, PINGPONG, False)
    p_prev = gl.convert_layout(p.to(q_part.dtype), p_layout)
    # One loop, the mask under a run-time branch, rather than an unmasked loop and a masked
    # one: the consumers' code is a fifth smaller (sm_90a SASS, D 64 causal: 8.6K -> 6.9K
    # instructions over three consumer copies; spills 64 -> 52 bytes). H100, dense bf16
    # B * N = 16K, N 4K / 8K / 16K, medians of 3 rounds, TFLOP/s two loops -> one
    # (2026-11-24k, call 5): D 64 causal 400 / 427 / 429 -> 419 / 442 / 470 (cuDNN 421 / 436 /
    # 464), non-causal 477 / 476 / 474 -> 489 / 507 / 524; D 128 causal 528 / 553 / 557 ->
    # 534 / 551 / 582, non-causal 609 / 607 / 587 -> 600 / 610 / 624. Under ncu (D 64 causal
    # N 4K, calls 3 and 6) 5% fewer instructions ran (280M -> 266M) and the launch took
    # 821 -> 775 us against cuDNN's 788-793; warps stalled on "no instruction" stayed at 1.0
    # per issue (cuDNN 0.07), so the gain is not fewer instruction-cache misses.
    for j in range(1, n_blocks):
        acc, p_prev, m_i, l_i = _ws_step(
            it + j, j, acc, p_prev, m_i, l_i, q_part, k_smem, v_smem, k_ready, v_ready,
            k_empty, v_empty, seqlen_k, rows_pos, qk_scale, s_zero, turns, j >= nb_full,
            IS_CAUSAL, STAGES, BLOCK_N, p_layout, PINGPONG)
    last = it + n_blocks - 1
    vslot = last % STAGES
    mbarrier.wait(v_ready.index(vslot), (last // STAGES) & 1)
    if PINGPONG:
        _turn(turns[0], False)
    acc_tok = warpgroup_mma(p_prev, v_smem.index(vslot), acc, is_async=True)
    if PINGPONG:
        _turn(turns[1], True)
    acc = _pv_wait(acc_tok, p_prev)
    mbarrier.arrive(v_empty.index(vslot))
    return acc, m_i, l_i


@gluon.jit
def _p_store(p, p_buf):
    """FP8 P (fp32, the QK^T accumulator's layout) into its shared-memory buffer as e4m3, each
    16 keys in V's token order (``_fp8_key_order``: four consecutive bytes per thread, one
    32-bit store), for the P.V wgmma to read; fenced for the async proxy (the issue waits for
    every thread's stores behind a barrier, ``_ws_step_fp8``)."""
    rows: gl.constexpr = p.shape[0]
    cols: gl.constexpr = p.shape[1]
    p = gl.reshape(p, [rows, cols // 16, 2, 4, 2])
    p = gl.permute(p, (0, 1, 3, 2, 4))
    p = gl.reshape(p, [rows, cols])
    p_buf.store(p.to(gl.float8e4nv))
    fence_async_shared()


@gluon.jit
def _row_sums(sums, like):
    """The row sums of a P ones wgmma (``_pv_issue``: its 8 columns agree), a row vector in the
    layout of ``like``."""
    return gl.convert_layout(gl.max(sums, 1), like.type.layout)


@gluon.jit
def _settle_pv(acc_tok, alpha, v_slot_empty, release):
    """FP8: the PV and row sums issued a block ago (``_pv_issue``) waited for; the V slot
    released (``release``: there was one); the output rescaled, the sums added to the running
    ones and those rescaled; and every thread's P store (fenced) done before the next issue
    reads it. Returns (O, the running sums, the sums' registers) for the next issue."""
    o, sums = warpgroup_mma_wait(0, deps=(acc_tok[0], acc_tok[1]))
    mbarrier.arrive(v_slot_empty, pred=release)
    acc = (_rescale_skip(o, alpha), (acc_tok[2] + _row_sums(sums, alpha)) * alpha, sums)
    gl.thread_barrier()
    return acc


@gluon.jit
def _ws_step_fp8(r, j, acc_tok, alpha, m_i, l_i, q_part, k_smem, v_smem, p_smem, p_base, ones,
                 k_ready, v_ready, k_empty, v_empty, seqlen_k, rows_pos, qk_scale, s_zero,
                 turns, masked, IS_CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                 BLOCK_N: gl.constexpr, PINGPONG: gl.constexpr):
    """``_ws_step`` for FP8, with P through shared memory and the PV waited for one block
    late: P_{j-2} V_{j-2} waited for and the output rescaled, then S_j and P_{j-1} V_{j-1}
    issued (P_{j-1} from buffer ``p_base + (j - 1) % 2``), and the softmax of S_j under that
    PV, its P stored to the other buffer.

    Why: with the wait after the softmax (``_ws_step``'s order) ptxas hoisted it above the
    softmax (sm_90a SASS: ``WARPGROUP.DEPBAR`` right after the block's first row max), so a
    warpgroup's softmax never ran under its own PV, and P's registers, read by the PV in
    flight, could not be rewritten before it ended. At the top of the next block the PV has
    long finished, and with P in shared memory no register is shared with a wgmma in flight."""
    acc = _settle_pv(acc_tok, alpha, v_empty.index((r + STAGES - 2) % STAGES), j >= 2)
    s, acc_tok = _block_gemms(r, q_part, k_smem, k_ready, k_empty,
                              p_smem.index(p_base + (j - 1) % 2),
                              v_smem.index((r - 1) % STAGES).permute((1, 0)), v_ready, acc,
                              s_zero, turns, STAGES, PINGPONG, ones, True)
    p, m_i, alpha, l_i = _softmax_block(s, m_i, l_i, j, seqlen_k, rows_pos, qk_scale, masked,
                                        IS_CAUSAL, BLOCK_N, True)
    _p_store(p, p_smem.index(p_base + j % 2))
    return acc_tok, alpha, m_i, l_i


@gluon.jit
def _attend_fp8(q_part, k_smem, v_smem, p_smem, p_base, ones, k_ready, v_ready, k_empty,
                v_empty, it, n_blocks, nb_full, seqlen_k, rows_pos, qk_scale, turns,
                IS_CAUSAL: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                HEAD_DIM: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                PINGPONG: gl.constexpr):
    """``_attend`` for FP8 Q, K, V (``_ws_step_fp8``): P in this warpgroup's two shared-memory
    buffers from ``p_base``, its row sums by wgmma against ``ones`` (``_pv_issue``)."""
    p, m_i, alpha, l_i, s_zero = _first_block(
        q_part, k_smem, k_ready, k_empty, it, seqlen_k, rows_pos, qk_scale, turns, IS_CAUSAL,
        STAGES, BLOCK_N, s_layout, PINGPONG, True)
    _p_store(p, p_smem.index(p_base))
    # No PV is in flight before block 1: its wait passes at once, and block 0's alpha
    # (exp2(-inf) = 0) scales the zero output (and sums).
    sum_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 32])
    acc_tok = (warpgroup_mma_init(gl.zeros([64, HEAD_DIM], gl.float32, layout=o_layout)),
               warpgroup_mma_init(gl.zeros([64, 8], gl.float32, layout=sum_layout)),
               gl.zeros_like(l_i))
    for j in range(1, n_blocks):
        acc_tok, alpha, m_i, l_i = _ws_step_fp8(
            it + j, j, acc_tok, alpha, m_i, l_i, q_part, k_smem, v_smem, p_smem, p_base, ones,
            k_ready, v_ready, k_empty, v_empty, seqlen_k, rows_pos, qk_scale, s_zero, turns,
            j >= nb_full, IS_CAUSAL, STAGES, BLOCK_N, PINGPONG)
    last = it + n_blocks - 1
    acc = _settle_pv(acc_tok, alpha, v_empty.index((last + STAGES - 1) % STAGES), n_blocks >= 2)
    vslot = last % STAGES
    mbarrier.wait(v_ready.index(vslot), (last // STAGES) & 1)
    if PINGPONG:
        _turn(turns[0], False)
    acc_tok = _pv_issue(p_smem.index(p_base + (n_blocks - 1) % 2),
                        v_smem.index(vslot).permute((1, 0)), acc, ones, True)
    if PINGPONG:
        _turn(turns[1], True)
    acc, sums = warpgroup_mma_wait(0, deps=(acc_tok[0], acc_tok[1]))
    l_i = acc_tok[2] + _row_sums(sums, m_i)
    mbarrier.arrive(v_empty.index(vslot))
    return acc, m_i, l_i


@gluon.jit
def _pass_blocks(r0, r1, k_ready, v_ready, k_empty, v_empty, turns, extra_turn,
                 STAGES: gl.constexpr, PINGPONG: gl.constexpr):
    """Release ring positions ``r0 .. r1`` unused: each is waited for first, so the arrival
    counts toward that fill of the slot and not an earlier one. ``PINGPONG``: one empty turn
    per position, and ``extra_turn`` more, so every warpgroup takes as many turns per tile as
    the others (``n_blocks + 1``) whatever its share of the keys."""
    for r in range(r0, r1):
        slot = r % STAGES
        mbarrier.wait(k_ready.index(slot), (r // STAGES) & 1)
        mbarrier.arrive(k_empty.index(slot))
        mbarrier.wait(v_ready.index(slot), (r // STAGES) & 1)
        if PINGPONG:
            _turn(turns[0], False)
            _turn(turns[1], True)
        mbarrier.arrive(v_empty.index(slot))
    if PINGPONG:  # noqa: SIM102 (a compile-time test, then a run-time one)
        if extra_turn:
            _turn(turns[0], False)
            _turn(turns[1], True)


@gluon.jit
def _ws_consumer(PART: gl.constexpr, stores, bufs, bars, num_tiles, HEAD_DIM: gl.constexpr,
                 Q_D: gl.constexpr, OUT_D: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, CONSUMERS: gl.constexpr, Q_BUFS: gl.constexpr,
                 IS_CAUSAL: gl.constexpr, RETURN_LSE: gl.constexpr, PINGPONG: gl.constexpr,
                 KV_SCALES: gl.constexpr, FP8: gl.constexpr):
    """Rows ``PART * 64 .. PART * 64 + 64`` of each tile the producer hands out.
    ``KV_SCALES``: K/V are FP8 values widened exactly; the tile's key scale joins the softmax
    scale and its value scale the output's normalisation.

    ``PINGPONG`` (FlashAttention-3's warpgroup scheduling): the consumers issue their GEMMs
    in turns, 0, 1, (2,) 0, ..., each handing the turn on once its wgmma are issued, so one
    warpgroup's softmax runs while the next one's GEMMs hold the tensor cores. Consumer
    ``PART`` waits on named barrier ``_TURN_BARRIER + PART`` and arrives on the next one's;
    the last consumer hands consumer 0 its first turn.

    ``FP8``: Q, K, V and P in e4m3 (the dots on FP8 tensor cores: wgmma K 32), V tiles
    transposed, P through shared memory (``_attend_fp8``) as ``2**_P_SHIFT_FP8`` times the
    probabilities."""
    Out, Lse, qk_scale, stride_ot, stride_oh, stride_lh = stores
    q_smem, k_smem, v_smem, p_smem, ones_smem, tile_info = bufs
    q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, tile_ready, tile_empty = bars
    ROWS: gl.constexpr = 64
    MMA_K: gl.constexpr = 32 if FP8 else 16  # one wgmma's reduction: 32 bytes
    P_SHIFT: gl.constexpr = _P_SHIFT_FP8 if FP8 else 0
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, MMA_K])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, MMA_K])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    turns = (_TURN_BARRIER + PART, _TURN_BARRIER + (PART + 1) % CONSUMERS)
    if PINGPONG and PART == CONSUMERS - 1:
        _turn(_TURN_BARRIER, True)
    it = 0
    tc = 0
    t, live, head, q_start, seqlen_q, row0, seqlen_k, n_end, k_scale, v_scale, n = _take_tile(
        0, tile_info, tile_ready, tile_empty)
    while t < num_tiles:
        n_blocks = gl.cdiv(n_end, BLOCK_N)
        my_row0 = row0 + PART * ROWS
        tile_scale = qk_scale
        out_scale = 1.0
        if KV_SCALES:
            tile_scale = qk_scale * k_scale
            out_scale = v_scale
        if live:
            # Rows that see no key (a tile without keys, rows past the sequence): output 0,
            # lse -inf.
            acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
            m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=rows_layout)
            l_i = gl.zeros([ROWS], gl.float32, layout=rows_layout)
            if n_blocks > 0:
                qb = tc % Q_BUFS
                mbarrier.wait(q_ready.index(qb), (tc // Q_BUFS) & 1)
                if Q_D < HEAD_DIM:
                    _zero_columns(q_smem.index(qb * CONSUMERS + PART), Q_D, HEAD_DIM)
                # This warpgroup's own key range: under a causal mask its 64 rows see fewer
                # keys than the tile's last rows (and rows past the sequence's end need none);
                # it passes the tile's other blocks through so the rings stay in step.
                my_full, my_end = causal_key_range(my_row0, seqlen_q, seqlen_k, ROWS, IS_CAUSAL)
                n_mine = gl.cdiv(my_end, BLOCK_N)
                if (my_row0 >= seqlen_q) | (my_row0 + ROWS <= 0):
                    n_mine = 0
                if n_mine > 0:
                    rows_pos = (my_row0 + gl.arange(0, ROWS, layout=rows_layout)
                                + (seqlen_k - seqlen_q))
                    if FP8:
                        acc, m_i, l_i = _attend_fp8(
                            q_smem.index(qb * CONSUMERS + PART), k_smem, v_smem, p_smem,
                            2 * PART, ones_smem.permute((1, 0)), k_ready, v_ready, k_empty,
                            v_empty, it, n_mine, my_full // BLOCK_N, seqlen_k, rows_pos,
                            tile_scale, turns, IS_CAUSAL, STAGES, BLOCK_N, HEAD_DIM, s_layout,
                            o_layout, PINGPONG)
                    else:
                        acc, m_i, l_i = _attend(
                            q_smem.index(qb * CONSUMERS + PART), k_smem, v_smem, k_ready,
                            v_ready, k_empty, v_empty, it, n_mine, my_full // BLOCK_N,
                            seqlen_k, rows_pos, tile_scale, turns, IS_CAUSAL, STAGES, BLOCK_N,
                            HEAD_DIM, s_layout, o_layout, p_layout, PINGPONG)
                _pass_blocks(it + n_mine, it + n_blocks, k_ready, v_ready, k_empty, v_empty,
                             turns, n_mine == 0, STAGES, PINGPONG)
                mbarrier.arrive(q_empty.index(qb))
                it += n_blocks
                tc += 1
            _store_tile(acc, m_i, l_i, Out, Lse, q_start, seqlen_q, my_row0, head, stride_ot,
                        stride_oh, stride_lh, out_scale, HEAD_DIM, OUT_D, ROWS, RETURN_LSE, 4,
                        P_SHIFT)
        t, live, head, q_start, seqlen_q, row0, seqlen_k, n_end, k_scale, v_scale, n = (
            _take_tile(n, tile_info, tile_ready, tile_empty))


@gluon.jit(do_not_specialize=["batch", "num_heads", "group", "num_slots", "slot_run",
                              "num_tiles", "stride_lh", "stride_sb"])
def _hopper_prefill_ws_kernel(
    desc_q, desc_k, desc_v, V, Out, Lse, cu_q, cu_k, Counter, KScale, VScale,
    stride_vt, stride_ot, stride_oh, stride_lh, stride_sb,
    qk_scale, batch, num_heads, group, num_slots, slot_run, num_tiles,
    HEAD_DIM: gl.constexpr, Q_D: gl.constexpr, OUT_D: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_B: gl.constexpr,
    STAGES: gl.constexpr, CONSUMERS: gl.constexpr, Q_BUFS: gl.constexpr, DYNAMIC: gl.constexpr,
    IS_CAUSAL: gl.constexpr, END_TILES: gl.constexpr, RETURN_LSE: gl.constexpr,
    PINGPONG: gl.constexpr, KV_SCALES: gl.constexpr, FP8: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    gl.static_assert((CONSUMERS == 2) or (CONSUMERS == 3), "two or three consumer warpgroups")
    gl.static_assert(gl.num_warps() == 4, "the default partition is one consumer warpgroup")
    dtype: gl.constexpr = desc_q.dtype
    q_smem = gl.allocate_shared_memory(dtype, [Q_BUFS * CONSUMERS, 64, HEAD_DIM], desc_q.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], desc_k.layout)
    if FP8:  # transposed tiles (``transposed_values_ref``)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, HEAD_DIM, BLOCK_N], desc_v.layout)
    else:
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], desc_v.layout)
    if FP8:  # two P buffers per consumer (``_ws_step_fp8``); the row sums' ones (``_pv_issue``)
        p_smem = gl.allocate_shared_memory(
            dtype, [2 * CONSUMERS, 64, BLOCK_N],
            gl.NVMMASharedLayout.get_default_for([64, BLOCK_N], dtype))
        ones_smem = gl.allocate_shared_memory(
            dtype, [8, BLOCK_N], gl.NVMMASharedLayout.get_default_for([8, BLOCK_N], dtype))
        # e4m3 1.0 is the byte 0x38, stored as bytes: the constant 1.0 converted to e4m3 came
        # out as 0x00003838 words, half the keys' ones lost (ptxas filled each pair's other
        # half from an unrelated register: F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C, sm_90a,
        # Triton 3.6).
        ones_smem._reinterpret(gl.uint8, [8, BLOCK_N], ones_smem.layout).store(
            gl.full([8, BLOCK_N], 0x38, gl.uint8,
                    layout=gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])))
    else:  # unused: 16-bit P stays in registers (``bufs`` has one form for both builds)
        p_smem = q_smem
        ones_smem = q_smem
    tile_info = gl.allocate_shared_memory(gl.int32, [2 * _TILE_FIELDS, 1],
                                          gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
    tile_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    tile_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_BUFS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=CONSUMERS)  # one arrival per consumer
    for i in gl.static_range(2):
        mbarrier.init(tile_ready.index(i), count=1)
        mbarrier.init(tile_empty.index(i), count=CONSUMERS)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    fence_async_shared()

    # Runtime values travel in tuples, compile-time ones flat: a tuple loses the constexpr-ness
    # of its members in Triton 3.6's warp_specialize.
    bufs = (q_smem, k_smem, v_smem, p_smem, ones_smem, tile_info)
    bars = (q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, tile_ready, tile_empty)
    walk = (cu_q, cu_k, batch, num_heads, num_slots, slot_run, num_tiles)
    stores = (Out, Lse, qk_scale, stride_ot, stride_oh, stride_lh)
    loads = (desc_q, desc_k, desc_v, V, stride_vt, group, Counter, KScale, VScale, stride_sb)
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_ws_consumer, (0, stores, bufs, bars, num_tiles, HEAD_DIM, Q_D, OUT_D, BLOCK_N,
                            STAGES, CONSUMERS, Q_BUFS, IS_CAUSAL, RETURN_LSE, PINGPONG,
                            KV_SCALES, FP8)),
            (_ws_consumer, (1, stores, bufs, bars, num_tiles, HEAD_DIM, Q_D, OUT_D, BLOCK_N,
                            STAGES, CONSUMERS, Q_BUFS, IS_CAUSAL, RETURN_LSE, PINGPONG,
                            KV_SCALES, FP8)),
            (_ws_consumer, (2, stores, bufs, bars, num_tiles, HEAD_DIM, Q_D, OUT_D, BLOCK_N,
                            STAGES, CONSUMERS, Q_BUFS, IS_CAUSAL, RETURN_LSE, PINGPONG,
                            KV_SCALES, FP8)),
            (_ws_producer, (loads, bufs, bars, walk, HEAD_DIM, Q_D, BLOCK_N, BLOCK_B,
                            STAGES, CONSUMERS, Q_BUFS, DYNAMIC, IS_CAUSAL, END_TILES, KV_SCALES,
                            FP8)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_ws_consumer, (0, stores, bufs, bars, num_tiles, HEAD_DIM, Q_D, OUT_D, BLOCK_N,
                            STAGES, CONSUMERS, Q_BUFS, IS_CAUSAL, RETURN_LSE, PINGPONG,
                            KV_SCALES, FP8)),
            (_ws_consumer, (1, stores, bufs, bars, num_tiles, HEAD_DIM, Q_D, OUT_D, BLOCK_N,
                            STAGES, CONSUMERS, Q_BUFS, IS_CAUSAL, RETURN_LSE, PINGPONG,
                            KV_SCALES, FP8)),
            (_ws_producer, (loads, bufs, bars, walk, HEAD_DIM, Q_D, BLOCK_N, BLOCK_B,
                            STAGES, CONSUMERS, Q_BUFS, DYNAMIC, IS_CAUSAL, END_TILES, KV_SCALES,
                            FP8)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# Registers per thread of (consumer warpgroups, producer warp) by consumer count. Two consumers:
# Triton 3.6 runs the default partition (consumer 0) at 256 outside the specialized region
# while idle workers sit at 120, and inside at 504 - consumer - producer (a 168-register launch
# of 12 warps); three: a 128-register launch of 16 warps (see ``register_split``).
_REGS = {2: (224, 32), 3: (160, 24)}


@functools.cache
def register_split(consumers: int, consumer_regs: int, producer_regs: int) -> int:
    """The default partition's registers inside the specialized region (Triton 3.6's
    AllocateWarpGroups: the launch's 64K registers less the workers' requests, over the
    default warpgroup), or ValueError where a split cannot be granted: ``setmaxnreg.inc``
    would then wait forever for registers no warp gives back."""
    warps = 4 * consumers + 4  # the producer warp's warpgroup is padded to four warps
    launch = 65536 // (warps * 32) // 8 * 8
    default = (launch * (consumers + 1) - (consumers - 1) * consumer_regs
               - producer_regs) // 8 * 8
    if consumers == 2 and consumer_regs + producer_regs > 256:
        # Measured (H100, 2026-11-24): 240 + 32 hung; the default partition's 256 outside
        # the region plus the idle workers' 120 leave no room for more.
        raise ValueError("consumer_regs + producer_regs must be <= 256 with two consumers")
    if default < consumer_regs:
        raise ValueError(f"consumer_regs {consumer_regs} x {consumers} with producer_regs "
                         f"{producer_regs} leaves the default consumer {default} registers")
    return default


def tile_options(causal: bool, consumers: int, end_tiles: bool | None = None,
                 pingpong: bool | None = None) -> tuple[bool, bool]:
    """``(end_tiles, pingpong)`` with the defaults of ``hopper_prefill_ws`` for those left
    None: causal 192-row tiles end at each sequence's last row, other tiles start at its
    first; every launch takes turns."""
    causal_192 = causal and consumers == 3
    return (causal_192 if end_tiles is None else end_tiles,
            True if pingpong is None else pingpong)


def hopper_prefill_ws(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                      cu_k: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                      causal: bool, scale_log2: float, *, block_n: int = 128, stages: int = 2,
                      consumers: int = 2, programs: int | None = None, dynamic: bool = False,
                      end_tiles: bool | None = None, pingpong: bool | None = None,
                      consumer_regs: int | None = None, producer_regs: int | None = None,
                      kv_scales: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                      launches: dict[tuple[object, ...], KernelLaunch] | None = None) -> None:
    """The Gluon kernel over checked inputs: ``q [total_q, H, D]``, ``k, v [total_k, H_kv, D]``
    with unit stride along D, heads packed and 16-byte aligned rows, ``out`` like ``q`` with
    unit stride along D, ``lse`` float32 ``[H, total_q]`` or None; ``scale_log2`` is the
    softmax scale times log2(e).

    16-bit ``q`` and ``out`` may hold fewer columns per head than ``k`` and ``v`` (a launch
    at a padded head dim, ``prefill_kernel._padded_gluon_dim``: K and V zero-padded to it).
    Each head's Q tile then starts at its own column and runs on into the next head's, and
    those columns are zeroed in shared memory (``_zero_columns``); only ``out``'s columns
    are stored (``_store_tile``). (V read the same way would need a column mask on its
    masked last block, which spilled the producer's registers: 1.9 KB, sm_90a.)
    ``kv_scales``: ``(k_scale, v_scale, stride_sb)`` (``_checks.kv_scale_args``) of FP8 K/V
    that ``k, v`` hold widened (exactly) to ``q``'s dtype: the kernel applies them per
    (sequence, kv head), as the portable kernel does. FP8 ``q, k, v`` (float8_e4m3fn, ``out``
    bf16) run both dots on FP8 tensor cores (``_ws_consumer``); their ``kv_scales`` then hold
    the query scale times the key scale, and the value scale.

    ``consumers`` warpgroups of 64 query rows each make the tile (2: 128 rows, 3: 192).
    ``programs``: None launches one program per tile; a number launches at most that many,
    each walking the tiles ``t = pid, pid + programs, ...`` (persistent: ``configs.num_sms``; the
    next tile's Q and first keys then load while a program finishes its current tile).
    ``dynamic`` (with ``programs``): programs claim their next tile from a counter instead of
    taking every ``programs``-th, which keeps causal launches balanced. ``end_tiles`` ends each
    sequence's tiles at its last row, so the partial tile is the one that sees the fewest keys
    (``_tile``). Default: for causal 192-row tiles. H100, bf16, dense causal D 64, three
    stages, N 4K / 8K / 16K (2026-11-24g, medians of 3 rounds): 386 / 418 / 442 against 379 /
    416 / 431 TFLOP/s. At D 128 (128-row tiles, no partial tile at those N) the two builds
    measured within noise causal (-1% to +4%), but non-causal the end-aligned build ran 4-8%
    slower with the same row arithmetic (ptxas allocates it differently): so only causal.

    ``pingpong``: the consumers issue their GEMMs in turns (``_ws_consumer``). Default: on.
    With one key loop (``_attend``) D 64 causal gained from it too (2026-11-24k, calls 10-11,
    medians of 3 rounds, N 4K / 8K / 16K, without -> with): bf16 409 / 445 / 470 -> 413 / 452
    / 477 and 415 / 449 / 478 -> 424 / 452 / 482, fp16 405 / 436 / 437 -> 413 / 436 / 464
    TFLOP/s. Before that (two key loops), H100, dense, B * N = 16K, medians of 5 rounds
    (2026-11-24h, ``tune_hopper_prefill.py --rounds 5``), TFLOP/s without -> with, bf16, N 4K /
    8K / 16K: D 128 non-causal 598 / 609 / 587 -> 605 / 607 / 624 (the rounds without ran
    bimodal, 562-635 at 16K; with, 617-636), causal 510 / 551 / 575 -> 522 / 548 / 573; D 64
    non-causal 455 / 455 / 463 -> 472 / 491 / 497, causal 388 / 415 / 419 -> 387 / 416 / 438.
    fp16 alike, except D 64 causal at 4K: 379 -> 369.

    ``launches``: a caller's cache of this kernel's launches (``_launch.KernelLaunch``), for
    calls whose arguments Triton specializes alike (``prefill``'s plans are keyed on exactly
    that): repeated calls then skip Triton's argument binding. Host time of one launch inside
    the service's prefill of 8192 x 16 x 128 (H100, ``trace_call.py``, 2026-11-24): 280-340 us
    through ``kernel[grid]`` on an idle engine."""
    if consumers not in _REGS:
        raise ValueError(f"consumers must be one of {sorted(_REGS)}, got {consumers}")
    c_regs = consumer_regs if consumer_regs is not None else _REGS[consumers][0]
    p_regs = producer_regs if producer_regs is not None else _REGS[consumers][1]
    register_split(consumers, c_regs, p_regs)
    total_q, num_heads, q_dim = q.shape
    head_dim = k.shape[2]  # the tile's; q's rows may be narrower (docstring)
    batch = cu_q.shape[0] - 1
    block_m = 64 * consumers
    num_slots, slot_run, tiles = slot_grid(total_q, batch, num_heads, block_m, causal)
    grid = tiles if programs is None else max(1, min(tiles, programs))
    dynamic = dynamic and programs is not None  # (variants by launch kind, not by size)
    end_tiles, pingpong = tile_options(causal, consumers, end_tiles, pingpong)
    # A fresh zeroed counter per launch (one small fill, against launches of 2**28+ work): a
    # shared one would need resetting, and launches on two streams would race on it.
    counter = torch.zeros(1, dtype=torch.int32, device=q.device) if dynamic else cu_q
    k_scale, v_scale, stride_sb = kv_scales if kv_scales is not None else (cu_q, cu_q, 0)
    fp8 = q.dtype == torch.float8_e4m3fn
    if q_dim != head_dim and (fp8 or v.shape[2] != head_dim):
        raise ValueError("only 16-bit q may be narrower than k and v")
    if any(t.stride(1) != t.shape[2] or t.stride(2) != 1 for t in (q, k, v)):
        raise ValueError("q, k, v must hold their heads packed: [total, H, D] rows read as "
                         "[total, H * D]")
    if fp8:
        v_ptr = transpose_values(v, cu_k, block_n, _VT_ALIGN)
        desc_v = values_descriptor(v_ptr, head_dim, block_n)
    else:
        v_ptr, desc_v = v, descriptor(v, block_n)
    constexprs = dict(
        HEAD_DIM=head_dim, Q_D=q_dim, OUT_D=out.shape[2], BLOCK_N=block_n, BLOCK_B=64,
        STAGES=stages, CONSUMERS=consumers, Q_BUFS=1 if programs is None else 2,
        DYNAMIC=dynamic, IS_CAUSAL=causal, END_TILES=end_tiles, RETURN_LSE=lse is not None,
        PINGPONG=pingpong, KV_SCALES=kv_scales is not None, FP8=fp8, CONSUMER_REGS=c_regs,
        PRODUCER_REGS=p_regs, num_warps=4,
    )
    key = (grid, *constexprs.values())
    launch = launches.get(key) if launches is not None else None
    if launch is None:
        launch = KernelLaunch(_hopper_prefill_ws_kernel, (grid,), constexprs)
        if launches is not None:
            launches[key] = launch
    launch(
        descriptor(q, 64, head_dim), descriptor(k, block_n), desc_v, v_ptr, out,
        lse if lse is not None else out, cu_q, cu_k, counter, k_scale, v_scale,
        v_ptr.stride(0), out.stride(0), out.stride(1), total_q if lse is not None else 0, stride_sb,
        scale_log2, batch, num_heads, num_heads // k.shape[1], num_slots, slot_run, tiles,
    )
