"""Plain-torch attention with the exact semantics of the Triton kernels.

It is the oracle in the tests and the ``cpu`` backend of the service, so it is written for
clarity and bounded memory, not speed: one sequence at a time, query rows in chunks so a long
sequence never materialises a full ``[heads, seqlen_q, seqlen_k]`` score matrix.

Conventions (shared with the Triton kernels in ``prefill_kernel`` and ``decode_kernel``):

* Packed varlen layout: ``q [total_q, H, D]``, ``k, v [total_k, H_kv, D]``; sequence ``b`` owns
  rows ``cu_seqlens[b]:cu_seqlens[b + 1]``.
* GQA: query head ``h`` reads kv head ``h // (H // H_kv)``.
* Causal masking is aligned bottom-right: query ``i`` of a sequence sits at key position
  ``p = i + seqlen_k - seqlen_q`` and sees key ``j`` iff ``j <= p``.
* Sliding window ``window_size = (left, right)`` (flash_attn's): query ``i`` sees key ``j`` iff
  ``p - left <= j <= p + right``, a bound dropped where it is -1; ``causal`` adds ``j <= p``.
  A decode query is the last position, ``p = seqlen_k - 1``.
* ``softcap > 0``: the logit is ``softcap * tanh(softmax_scale * q.k / softcap)``, else
  ``softmax_scale * q.k``. ALiBi then adds ``-slope * |p - j|`` (``alibi_slopes`` float32
  ``[H]`` or ``[batch, H]``, per query head).
* A query row that sees no key outputs zeros and has ``lse = -inf`` (never NaN).
* ``lse`` is the natural-log log-sum-exp of the logits (after softcap and ALiBi), float32.
"""

from __future__ import annotations

import math

import torch

from attention_kernels._checks import (
    check_alibi_values,
    check_cu_seqlens_values,
    check_decode_inputs,
    check_features,
    check_kv_scales,
    check_prefill_inputs,
    check_query_scale,
)
from attention_kernels.fp8 import dequantize_kv, dequantize_queries

# Query rows per chunk: bounds the score matrix at H * 1024 * seqlen_k elements.
_ROW_CHUNK = 1024


def _default_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def hidden_pairs(dist: torch.Tensor, causal: bool,
                 window: tuple[int, int]) -> torch.Tensor | None:
    """The (row, key) pairs the causal mask and the window hide, from ``dist = p - j`` (a
    query's key position minus the key's); None when nothing is hidden."""
    left, right = window
    if not causal and left < 0 and right < 0:
        return None
    hidden = torch.zeros(dist.shape, dtype=torch.bool, device=dist.device)
    if causal:
        hidden |= dist < 0
    if left >= 0:
        hidden |= dist > left
    if right >= 0:
        hidden |= dist < -right
    return hidden


def _attend_rows(
    q: torch.Tensor,  # [rows, H, D] compute dtype
    k: torch.Tensor,  # [seqlen_k, H, D] compute dtype (already expanded for GQA)
    v: torch.Tensor,
    scale: float,
    first_pos: int,
    causal: bool,
    window: tuple[int, int],
    softcap: float,
    slopes: torch.Tensor | None,  # [H] compute dtype, or None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``rows`` query rows; row ``r`` sits at key position ``first_pos + r``."""
    rows, seqlen_k = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    left, right = window
    if causal or left >= 0 or right >= 0 or slopes is not None:
        pos = torch.arange(first_pos, first_pos + rows, device=q.device).unsqueeze(1)
        dist = pos - torch.arange(seqlen_k, device=q.device).unsqueeze(0)  # p - j [rows, keys]
        if slopes is not None:
            scores = scores - slopes[:, None, None] * dist.abs().to(scores.dtype)
        hidden = hidden_pairs(dist, causal, window)
        if hidden is not None:
            scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, rows]; -inf where a row sees no key
    # exp(-inf - -inf) would be NaN: give fully masked rows a finite shift, their p is 0 anyway.
    shift = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(scores - shift.unsqueeze(-1))
    out = torch.einsum("hqk,khd->qhd", p, v)
    return out, lse


def prefill_ref(
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
    compute_dtype: torch.dtype | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Variable-length attention prefill; same signature and semantics as ``prefill``.
    FP8 ``k, v`` (float8_e4m3fn with float32 ``k_scale, v_scale``, ``[H_kv]`` or per sequence
    ``[batch, H_kv]``) are dequantized (``fp8.dequantize_kv``) in the compute dtype first; so
    are FP8 queries (``q_scale``), whose output is bf16.

    ``compute_dtype`` (default float32, float64 for float64 inputs) is the precision of the
    arithmetic; pass ``torch.float64`` for an oracle. The output has the input dtype; ``lse`` is
    float32 ``[H, total_q]``. ``max_seqlen_*`` are accepted for signature parity and ignored.
    """
    del max_seqlen_q, max_seqlen_k
    if cu_seqlens_k is None:
        cu_seqlens_k = cu_seqlens_q
    check_prefill_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    window = check_features(window_size, softcap, alibi_slopes, q.shape[1],
                            cu_seqlens_q.shape[0] - 1, q.device)
    check_alibi_values(alibi_slopes)
    total_q, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    out_dtype = q.dtype
    if check_query_scale(q, k, q_scale, cu_seqlens_q.shape[0] - 1):
        out_dtype = torch.bfloat16
        assert q_scale is not None
        q = dequantize_queries(q, q_scale, k.shape[1], compute_dtype or torch.float32,
                               cu_seqlens_q)
    cdt = compute_dtype or _default_compute_dtype(q.dtype)
    if check_kv_scales(k, k_scale, v_scale, cu_seqlens_q.shape[0] - 1):
        k = dequantize_kv(k, k_scale, cdt, cu_seqlens_k)  # type: ignore[arg-type]
        v = dequantize_kv(v, v_scale, cdt, cu_seqlens_k)  # type: ignore[arg-type]

    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    check_cu_seqlens_values(cq, total_q, "cu_seqlens_q")
    check_cu_seqlens_values(ck, k.shape[0], "cu_seqlens_k")
    out = torch.zeros((total_q, num_heads, head_dim), dtype=cdt, device=q.device)
    lse = torch.full((num_heads, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0:
            continue
        kb = k[k0:k1].to(cdt).repeat_interleave(group, dim=1)
        vb = v[k0:k1].to(cdt).repeat_interleave(group, dim=1)
        offset = (k1 - k0) - (q1 - q0)  # query row i sits at key position i + offset
        slopes = None
        if alibi_slopes is not None:
            slopes = (alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]).to(cdt)
        for r0 in range(0, q1 - q0, _ROW_CHUNK):
            r1 = min(r0 + _ROW_CHUNK, q1 - q0)
            o, l = _attend_rows(q[q0 + r0 : q0 + r1].to(cdt), kb, vb, scale, r0 + offset,
                                causal, window, float(softcap), slopes)
            out[q0 + r0 : q0 + r1] = o
            lse[:, q0 + r0 : q0 + r1] = l.float()
    out = out.to(out_dtype)
    return (out, lse) if return_lse else out


def decode_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    max_seqlen_k: int | None = None,
    softmax_scale: float | None = None,
    num_splits: int = 0,
    return_lse: bool = False,
    compute_dtype: torch.dtype | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One query token per sequence against its packed keys; same semantics as ``decode``
    (FP8 ``k, v`` and queries with their scales as in ``prefill_ref``).

    ``q [B, H, D]``; ``lse`` is float32 ``[B, H]``. ``num_splits`` and ``max_seqlen_k`` only
    steer the kernel's schedule and are ignored here. The query sits at position
    ``seqlen_k - 1``, so only the window's left bound can hide keys.
    """
    del max_seqlen_k, num_splits
    check_decode_inputs(q, k, v, cu_seqlens_k)
    batch = q.shape[0]
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    # A decode step is a prefill with one query per sequence and no causal mask (the new token
    # sees its whole context, or its window).
    out, lse = prefill_ref(
        q, k, v, cu_q, cu_seqlens_k, softmax_scale=softmax_scale, return_lse=True,
        compute_dtype=compute_dtype, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, k_scale=k_scale, v_scale=v_scale, q_scale=q_scale,
    )
    lse = lse.t().contiguous()
    return (out, lse) if return_lse else out
