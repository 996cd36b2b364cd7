"""FP8 (e4m3) keys and values: per-kv-head scales, quantize and dequantize.

A K/V tensor stored as ``float8_e4m3fn`` with a float32 scale per kv head stands for
``x_fp8.float() * scale[head]``. Half the bytes of bf16 for the same tokens: decode, which is
bound by K/V reads, moves half as much, and so does a client that sends its cache. The kernels
take such K/V beside fp16/bf16 queries (``k_scale=, v_scale=``), convert each loaded tile to the
queries' dtype and fold the scales into the softmax scale (K) and the output (V), so the
arithmetic is that of the unquantized kernel on the dequantized values.

Queries may be e4m3 too (``q_scale=`` in every kernel, FlashAttention-3's ``q_descale``): a
scale per kv head (or per sequence and kv head) for the query heads that read it. On Hopper
the Gluon prefill then runs both dots on FP8 tensor cores (``prefill_hopper``); elsewhere, and
in decode and the paged kernels, the queries are widened exactly to bf16 with their scale
folded into the keys' (``widened_queries``): a decode step reads a query tile per head against
thousands of keys, so its dots were never the bound. The output is bf16 either way.
"""

from __future__ import annotations

import torch

from attention_kernels._checks import check_kv_scales, check_query_scale

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., H_kv, D]`` as (float8_e4m3fn values, float32 scales ``[H_kv]``). Without
    ``scale``, each head's is its absolute maximum over 448 (every value representable, none
    saturated); with one, values beyond ``448 * scale`` saturate to +-448. A given ``scale``
    may also be ``[rows, H_kv]`` for ``x [rows, H_kv, D]``: one per row and kv head (rows of
    packed sequences with scales of their own)."""
    if x.dim() < 2:
        raise ValueError(f"x must be [..., num_kv_heads, head_dim], got shape {tuple(x.shape)}")
    heads = x.shape[-2]
    xf = x.float()
    if scale is None:
        per_head = xf.abs().movedim(-2, 0).reshape(heads, -1)
        amax = per_head.amax(dim=1) if per_head.shape[1] else per_head.new_zeros(heads)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    per_row = x.dim() == 3 and tuple(scale.shape) == (x.shape[0], heads)
    if tuple(scale.shape) != (heads,) and not per_row:
        raise ValueError(f"scale must be [num_kv_heads={heads}] (or [rows, num_kv_heads] for "
                         f"3-D x), got shape {tuple(scale.shape)}")
    scale = scale.to(device=x.device, dtype=torch.float32)
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                  cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (float8_e4m3fn ``[..., H_kv, D]``) times its per-head ``scale``, in ``dtype``.
    With per-sequence scales (``[batch, H_kv]``), ``x`` is packed ``[total, H_kv, D]`` and
    ``cu_seqlens`` (``[batch + 1]``) says which rows take which sequence's scales."""
    if scale.dim() == 2:
        if cu_seqlens is None:
            raise ValueError("per-sequence scales [batch, num_kv_heads] need cu_seqlens")
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=scale.device, dtype=torch.int64)
        scale = scale.repeat_interleave(lens, dim=0)  # [total, H_kv]: each row's scales
    return x.to(dtype) * scale.to(dtype)[..., None]


def quantize_queries(q: torch.Tensor, num_kv_heads: int, scale: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [rows, H, D]`` as (float8_e4m3fn values, float32 scales ``[num_kv_heads]``): query
    head ``h`` takes the scale of kv head ``h // (H // num_kv_heads)``, FlashAttention-3's
    ``q_descale`` layout (``quantize_kv`` of the heads grouped per kv head)."""
    rows, heads, dim = q.shape
    if num_kv_heads <= 0 or heads % num_kv_heads:
        raise ValueError(f"num_heads {heads} must be a multiple of num_kv_heads {num_kv_heads}")
    grouped = q.reshape(rows, num_kv_heads, heads // num_kv_heads * dim)
    q8, scale = quantize_kv(grouped, scale)
    return q8.view(rows, heads, dim), scale


def dequantize_queries(q: torch.Tensor, scale: torch.Tensor, num_kv_heads: int,
                       dtype: torch.dtype, cu_seqlens: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """FP8 ``q [rows, H, D]`` times its per-kv-head ``scale`` (``[num_kv_heads]``, or
    ``[batch, num_kv_heads]`` with ``cu_seqlens``), in ``dtype``."""
    rows, heads, dim = q.shape
    grouped = q.reshape(rows, num_kv_heads, heads // num_kv_heads * dim)
    return dequantize_kv(grouped, scale, dtype, cu_seqlens).view(rows, heads, dim)


def combined_scales(q_scale: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' key and value scales for FP8 queries: ``q_scale * k_scale`` (the query
    scale joins the logits' scale) and ``v_scale``, both ``[H_kv]`` or both ``[batch, H_kv]``
    when either input is per sequence."""
    ks = q_scale * k_scale
    return ks.contiguous(), v_scale.expand(ks.shape).contiguous()  # the kernels index them


def folded_scales(q: torch.Tensor, k: torch.Tensor, q_scale: torch.Tensor | None,
                  k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, batch: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value scales of float8_e4m3fn ``q`` beside FP8 ``k, v``, ``q_scale`` folded
    into the key scale (``combined_scales``), after checking all three (ValueError naming the
    argument; ``batch``: the sequences, for per-sequence rows)."""
    if k.dtype != FP8_DTYPE:
        raise ValueError(f"float8_e4m3fn queries need float8_e4m3fn k and v, got {k.dtype}")
    if q.device != k.device:
        raise ValueError(f"q and k devices differ: {q.device}, {k.device}")
    check_query_scale(q, k, q_scale, batch)
    check_kv_scales(k, k_scale, v_scale, batch)
    assert q_scale is not None and k_scale is not None and v_scale is not None
    return combined_scales(q_scale, k_scale, v_scale)


def widened_queries(q: torch.Tensor, k: torch.Tensor, q_scale: torch.Tensor | None,
                    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, batch: int
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(q, key scale, value scale)`` as the 16-bit and FP8 K/V paths take them: float8_e4m3fn
    ``q`` widened exactly to bf16 (every e4m3 value is a bf16 one) with the scales
    ``folded_scales``'; any other ``q`` as it is, its scales too (a ``q_scale`` refused)."""
    if q.dtype != FP8_DTYPE:
        check_query_scale(q, k, q_scale, 0)  # raises for a q_scale
        return q, k_scale, v_scale
    ks, vs = folded_scales(q, k, q_scale, k_scale, v_scale, batch)
    return q.to(torch.bfloat16), ks, vs
