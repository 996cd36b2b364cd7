"""The cpu backend's attention: bounded memory and prompt cancellation for any request shape.

The kernels' reference (``attention_kernels.prefill_ref``) is an oracle: it expands K/V to
every query head and scores a whole row chunk against all keys, so a ~128 KiB request with a
huge heads ratio grew the server by ~600 MiB, and one long sequence ran as one uncancellable
unit (the next call waited 6.9 s after a cancel). Here each kv head's query group attends
to its own K/V (never expanded) in tiles of query rows x keys with an online softmax, so the
scratch memory is at most ``tile_elements`` scores (plus the tile's K/V and accumulators),
and the cancel flag is checked between tiles (each ~``tile_elements * head_dim`` multiply-adds,
milliseconds).

A batch whose sequences are all short (decode steps, small prefills) is one tile instead: every
sequence padded to the longest, masked, in a handful of tensor ops. The per-sequence loop costs
~20 small ops per sequence and kv head: a 64-sequence decode step took ~50 ms in it on the dev
box, ~1 ms as one tile.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from itertools import pairwise

import torch

from attention_kernels.reference import hidden_pairs
from attention_service.engine.jobs import Cancelled

TILE_ELEMENTS = 1 << 21  # scores per tile: 8 MiB of float32
# A padded batch may score this many times its real (row, key) pairs, plus PAD_SLACK, before
# the loop is cheaper: padding costs multiply-adds, the loop costs Python per sequence.
PAD_RATIO = 4
PAD_SLACK = 1 << 16


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], cu_k: list[int], *,
    causal: bool, scale: float | None, cancelled: Callable[[], bool],
    window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None, tile_elements: int = TILE_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed varlen attention (causal aligned bottom-right) in float32: ``out`` like ``q``
    (its dtype) and float32 ``lse [H, total_q]`` (-inf and zeros for rows without keys).
    ``window``, ``softcap`` and ``alibi_slopes`` ([batch, H]) as in attention_kernels'
    reference; a window's key range is skipped, not masked, outside each row tile's reach."""
    total_q, heads, dim = q.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(dim)
    n_q = [b - a for a, b in pairwise(cu_q)]
    n_k = [b - a for a, b in pairwise(cu_k)]
    padded = len(n_q) * max(n_q, default=0) * max(n_k, default=0) * heads
    if padded <= tile_elements and padded <= (
            PAD_RATIO * heads * sum(map(operator.mul, n_q, n_k)) + PAD_SLACK):
        if cancelled():
            raise Cancelled()
        return _attend_one_tile(q, k, v, cu_q, cu_k, n_q, n_k, causal=causal, scale=scale,
                                window=window, softcap=softcap, alibi_slopes=alibi_slopes)
    kv_heads = k.shape[1]
    group = heads // kv_heads
    out = torch.zeros((total_q, heads, dim), dtype=q.dtype)
    lse = torch.full((heads, total_q), float("-inf"), dtype=torch.float32)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        n_q, n_k = q1 - q0, k1 - k0
        if n_q == 0 or n_k == 0:
            continue
        # Tiles of rows x keys with group * rows * keys <= tile_elements.
        keys = max(1, min(n_k, tile_elements // group))
        rows = max(1, min(n_q, tile_elements // (group * keys)))
        offset = n_k - n_q  # query i sits at key position p = i + offset
        for g in range(kv_heads):
            hs = slice(g * group, (g + 1) * group)
            for r0 in range(0, n_q, rows):
                r1 = min(r0 + rows, n_q)
                qt = q[q0 + r0 : q0 + r1, hs].float().transpose(0, 1) * scale  # [G, R, D]
                m = torch.full((group, r1 - r0), float("-inf"))
                den = torch.zeros((group, r1 - r0))
                acc = torch.zeros((group, r1 - r0, dim))
                first, last = _key_range(r0 + offset, r1 - 1 + offset, n_k, causal, window)
                for c0 in range(first, last, keys):
                    if cancelled():
                        raise Cancelled()
                    c1 = min(c0 + keys, last)
                    kt = k[k0 + c0 : k0 + c1, g].float()  # [C, D]
                    s = torch.einsum("grd,cd->grc", qt, kt)
                    if softcap > 0:
                        s = softcap * torch.tanh(s / softcap)
                    # p - j for the tile: [R, C]
                    dist = (torch.arange(r0, r1).unsqueeze(1) + offset
                            - torch.arange(c0, c1).unsqueeze(0))
                    if alibi_slopes is not None:
                        s = s - alibi_slopes[b, hs].float()[:, None, None] * dist.abs()
                    hidden = hidden_pairs(dist, causal, window)
                    if hidden is not None:
                        s = s.masked_fill(hidden, float("-inf"))
                    m_new = torch.maximum(m, s.amax(dim=-1))
                    # Rows that have seen no key yet keep a finite shift (their p is 0).
                    shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                    p = torch.exp(s - shift.unsqueeze(-1))
                    alpha = torch.exp(m - shift)  # m = -inf (nothing seen yet): 0
                    den = den * alpha + p.sum(dim=-1)
                    acc = acc * alpha.unsqueeze(-1) + torch.einsum(
                        "grc,cd->grd", p, v[k0 + c0 : k0 + c1, g].float())
                    m = m_new
                seen = den > 0
                o = torch.where(seen.unsqueeze(-1), acc / den.clamp_min(1e-30).unsqueeze(-1),
                                torch.zeros_like(acc))
                out[q0 + r0 : q0 + r1, hs] = o.transpose(0, 1).to(q.dtype)
                lse[hs, q0 + r0 : q0 + r1] = torch.where(
                    seen, m + torch.log(den.clamp_min(1e-30)), torch.full_like(m, float("-inf")))
    return out, lse


def _attend_one_tile(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], cu_k: list[int],
    n_q: list[int], n_k: list[int], *, causal: bool, scale: float,
    window: tuple[int, int], softcap: float, alibi_slopes: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attend`` for a whole batch at once: each sequence's rows and keys padded to the
    longest, the padding masked like hidden keys (rows without a key: zeros, lse -inf)."""
    total_q, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    batch, rows, keys = len(n_q), max(n_q, default=0), max(n_k, default=0)
    out = torch.zeros((total_q, heads, dim), dtype=q.dtype)
    lse = torch.full((heads, total_q), float("-inf"), dtype=torch.float32)
    if rows == 0 or keys == 0:
        return out, lse
    lq, lk = torch.tensor(n_q).unsqueeze(1), torch.tensor(n_k).unsqueeze(1)
    r, c = torch.arange(rows).unsqueeze(0), torch.arange(keys).unsqueeze(0)
    row_ok, key_ok = r < lq, c < lk  # [B, rows], [B, keys]
    # Padding reads row / key 0 of the batch (any real one): masked or dropped below.
    q_at = torch.where(row_ok, torch.tensor(cu_q[:-1]).unsqueeze(1) + r, 0)
    k_at = torch.where(key_ok, torch.tensor(cu_k[:-1]).unsqueeze(1) + c, 0)
    qt = q[q_at].float().view(batch, rows, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
    kt = k[k_at].float().transpose(1, 2)  # [B, H_kv, keys, D]
    vt = v[k_at].float().transpose(1, 2)
    s = torch.einsum("bhgrd,bhcd->bhgrc", qt * scale, kt)  # [B, H_kv, G, rows, keys]
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    dist = (r + (lk - lq)).unsqueeze(2) - c.unsqueeze(1)  # p - j: [B, rows, keys]
    if alibi_slopes is not None:
        slopes = alibi_slopes.float().view(batch, kv_heads, group, 1, 1)
        s = s - slopes * dist.abs().unsqueeze(1).unsqueeze(1)
    hidden = ~key_ok.unsqueeze(1)
    pairs = hidden_pairs(dist, causal, window)
    if pairs is not None:
        hidden = hidden | pairs
    s = s.masked_fill(hidden.unsqueeze(1).unsqueeze(1), float("-inf"))
    m = s.amax(dim=-1)
    seen = torch.isfinite(m)
    p = torch.exp(s - torch.where(seen, m, 0).unsqueeze(-1))  # a row without keys: all 0
    den = p.sum(dim=-1)
    o = torch.einsum("bhgrc,bhcd->bhgrd", p, vt) / den.clamp_min(1e-30).unsqueeze(-1)
    # Back to packed rows: [B, rows, H, D] and [H, B, rows], real rows only.
    real = q_at[row_ok]
    out[real] = o.permute(0, 3, 1, 2, 4).reshape(batch, rows, heads, dim)[row_ok].to(q.dtype)
    l_all = torch.where(seen, m + torch.log(den.clamp_min(1e-30)), float("-inf"))
    lse[:, real] = l_all.reshape(batch, heads, rows).permute(1, 0, 2)[:, row_ok]
    return out, lse


def _key_range(p_first: int, p_last: int, n_k: int, causal: bool,
               window: tuple[int, int]) -> tuple[int, int]:
    """Keys [first, last) that rows at positions p_first..p_last can see at all."""
    left, right = window
    first = max(0, p_first - left) if left >= 0 else 0
    if not causal and right < 0:
        return first, max(first, n_k)  # no right bound (p may be negative: q longer than k)
    reach = min(right, 0) if causal and right >= 0 else (0 if causal else right)
    return first, max(first, min(n_k, p_last + reach + 1))

