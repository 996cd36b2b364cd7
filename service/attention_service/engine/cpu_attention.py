"""The cpu backend's attention: bounded memory and prompt cancellation for any request shape.

The kernels' reference (``attention_kernels.prefill_ref``) is an oracle: it expands K/V to
every query head and scores a whole row chunk against all keys, so a ~128 KiB request with a
huge heads ratio grew the server by ~600 MiB, and one long sequence ran as one uncancellable
unit (the next call waited 6.9 s after a cancel). Here each kv head's query group attends
to its own K/V (never expanded) in tiles of query rows x keys with an online softmax, so the
scratch memory is at most ``tile_elements`` scores (plus the tile's K/V and accumulators),
and the cancel flag is checked between tiles (each ~``tile_elements * head_dim`` multiply-adds,
milliseconds).

Sequences that fit in a tile (decode steps, short prompts) go in batches instead: padded to
the next power of two of their rows and keys, those of one padded shape together, masked, in a
handful of tensor ops. The per-sequence loop costs ~20 small ops per sequence and kv head: a
64-sequence decode step took ~50 ms in it on the dev box, ~1 ms batched.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from attention_kernels.reference import hidden_pairs
from attention_service.engine.jobs import Cancelled

TILE_ELEMENTS = 1 << 21  # scores per tile: 8 MiB of float32
# A sequence with at most this many scores per kv head (its query group x rows x keys) once
# padded goes in a batch; a larger one in the loop, whose ~20 ops per kv head then cost less
# than the padding. Per kv head, not per call: a call split by kv heads (striped) takes the
# same path. Dev box, 64 decode rows (H 32 / 8, D 128) at 600-1000 keys (4K scores each):
# loop 285 ms, batched 330; at 100-300 keys (H 8 / 2, D 64, 2K): 55 against 11; 16 causal
# prompts of 40 (16K): 17 against 5; of 70 (64K): 20 against 20; 4 of 130 (256K): 7 against 17.
PADDED_SCORES = 1 << 14


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
    out = torch.zeros((total_q, heads, dim), dtype=q.dtype)
    lse = torch.full((heads, total_q), float("-inf"), dtype=torch.float32)
    opts = {"causal": causal, "scale": scale, "window": window, "softcap": softcap,
            "alibi_slopes": alibi_slopes}
    # Sequences by their padded (rows, keys): what a sequence's bits depend on is its own
    # lengths, never the batch it came in (a merged call equals a solo one bitwise).
    group = heads // k.shape[1]
    padded: dict[tuple[int, int], list[int]] = {}
    long: list[int] = []
    for b in range(len(cu_q) - 1):
        n_q, n_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if n_q == 0 or n_k == 0:
            continue
        shape = (_round_up(n_q), _round_up(n_k))
        scores = shape[0] * shape[1]
        if group * scores <= PADDED_SCORES and heads * scores <= tile_elements:
            padded.setdefault(shape, []).append(b)
        else:
            long.append(b)
    cu = (torch.tensor(cu_q), torch.tensor(cu_k)) if padded else None
    for (rows, keys), seqs in padded.items():
        per_tile = tile_elements // (heads * rows * keys)
        for i in range(0, len(seqs), per_tile):
            if cancelled():
                raise Cancelled()
            _attend_padded(q, k, v, cu, seqs[i : i + per_tile], rows, keys, out, lse,
                           **opts)  # type: ignore[arg-type]
    for b in long:
        _attend_tiled(q, k, v, cu_q, cu_k, b, out, lse, cancelled=cancelled,
                      tile_elements=tile_elements, **opts)  # type: ignore[arg-type]
    return out, lse


def _round_up(n: int) -> int:
    """A length's padded size: the next power of two (at most 2x the work, and few shapes)."""
    return 1 << (n - 1).bit_length()


def _attend_padded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: tuple[torch.Tensor, torch.Tensor],
    seqs: list[int], rows: int, keys: int, out: torch.Tensor, lse: torch.Tensor, *,
    causal: bool, scale: float, window: tuple[int, int], softcap: float,
    alibi_slopes: torch.Tensor | None,
) -> None:
    """Sequences ``seqs`` at once, each padded to ``rows`` x ``keys``: the padding masked
    like hidden keys (or dropped: rows), every kv head in one product. ``cu``: cu_seqlens
    of q and k as tensors. Writes ``out``, ``lse``."""
    heads, dim = q.shape[1:]
    kv_heads = k.shape[1]
    group = heads // kv_heads
    batch = len(seqs)
    at = torch.tensor(seqs)
    cq, ck = cu
    q_from, k_from = cq[at].unsqueeze(1), ck[at].unsqueeze(1)
    lq, lk = cq[at + 1].unsqueeze(1) - q_from, ck[at + 1].unsqueeze(1) - k_from
    r, c = torch.arange(rows).unsqueeze(0), torch.arange(keys).unsqueeze(0)
    row_ok, key_ok = r < lq, c < lk  # [B, rows], [B, keys]
    # Padding reads the sequence's first row / key (a real one): masked or dropped below.
    q_at = q_from + torch.where(row_ok, r, 0)
    k_at = k_from + torch.where(key_ok, c, 0)
    # Batched products of contiguous [B * H_kv] matrices: their bits then depend on a
    # sequence's own shape only (einsum folded a batch of one into another product).
    mats = batch * kv_heads
    qt = q[q_at].float().view(batch, rows, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
    qt = (qt * scale).reshape(mats, group * rows, dim)
    kt = k[k_at].float().transpose(1, 2).reshape(mats, keys, dim)
    s = torch.bmm(qt, kt.transpose(1, 2)).view(batch, kv_heads, group, rows, keys)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    dist = (r + (lk - lq)).unsqueeze(2) - c.unsqueeze(1)  # p - j: [B, rows, keys]
    if alibi_slopes is not None:
        slopes = alibi_slopes[at].float().view(batch, kv_heads, group, 1, 1)
        s = s - slopes * dist.abs()[:, None, None]
    hidden = ~key_ok.unsqueeze(1)
    pairs = hidden_pairs(dist, causal, window)
    if pairs is not None:
        hidden = hidden | pairs
    s = s.masked_fill(hidden[:, None, None], float("-inf"))
    m = s.amax(dim=-1)
    seen = torch.isfinite(m)
    p = torch.exp(s - torch.where(seen, m, 0).unsqueeze(-1))  # a row without keys: all 0
    den = p.sum(dim=-1)
    vt = v[k_at].float().transpose(1, 2).reshape(mats, keys, dim)
    o = torch.bmm(p.view(mats, group * rows, keys), vt).view(batch, kv_heads, group, rows, dim)
    o = o / den.clamp_min(1e-30).unsqueeze(-1)
    # Back to packed rows ([B, rows, H, D] and [H, B, rows]), real rows only.
    real = q_at[row_ok]
    out[real] = o.permute(0, 3, 1, 2, 4).reshape(batch, rows, heads, dim)[row_ok].to(q.dtype)
    row_lse = torch.where(seen, m + torch.log(den.clamp_min(1e-30)), float("-inf"))
    lse[:, real] = row_lse.reshape(batch, heads, rows).permute(1, 0, 2)[:, row_ok]


def _attend_tiled(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], cu_k: list[int],
    b: int, out: torch.Tensor, lse: torch.Tensor, *, causal: bool, scale: float,
    cancelled: Callable[[], bool], window: tuple[int, int], softcap: float,
    alibi_slopes: torch.Tensor | None, tile_elements: int,
) -> None:
    """Sequence ``b``, larger than a tile: each kv head's query group in tiles of rows x
    keys with an online softmax, the cancel flag checked between tiles. Writes ``out``,
    ``lse``."""
    heads, dim = q.shape[1:]
    kv_heads = k.shape[1]
    group = heads // kv_heads
    q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
    n_q, n_k = q1 - q0, k1 - k0
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


def _key_range(p_first: int, p_last: int, n_k: int, causal: bool,
               window: tuple[int, int]) -> tuple[int, int]:
    """Keys [first, last) that rows at positions p_first..p_last can see at all."""
    left, right = window
    first = max(0, p_first - left) if left >= 0 else 0
    if not causal and right < 0:
        return first, max(first, n_k)  # no right bound (p may be negative: q longer than k)
    reach = min(right, 0) if causal and right >= 0 else (0 if causal else right)
    return first, max(first, min(n_k, p_last + reach + 1))

