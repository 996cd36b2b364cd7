"""Softcap, ALiBi and sliding-window helpers shared by the prefill and decode kernels.

The kernels keep scores in log2 units (``log2(e)`` folded into the scale, so the softmax uses
``exp2``). The features follow flash_attn, in natural units: the logit is
``softcap * tanh(scale * q.k / softcap)`` (or ``scale * q.k``), then ALiBi adds
``-slope * |p - j|``. In log2 units that is ``softcap * log2(e) * tanh(q.k * (scale / softcap))``
(tanh of the natural-unit logit, the factor after it) and ``-slope * log2(e) * |p - j|``.

Each feature is a ``tl.constexpr`` flag of the kernels: without it the kernel is compiled exactly
as before the feature existed, and its launch arguments are ``None`` (compile-time constants).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def tanh(x):
    """fp32 tanh from one exp2: ``sign(x) (1 - e^(-2|x|)) / (1 + e^(-2|x|))`` (no overflow at
    any ``x``; error ~1e-7 absolute)."""
    t = tl.math.exp2(-2.8853900817779268 * tl.abs(x))  # e^(-2|x|)
    r = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0.0, -r, r)


@triton.jit
def softcap_logits(qk, cap_scale, cap_log2):
    """Log2-unit logits of raw ``q.k`` under a softcap (``cap_scale = scale / softcap``,
    ``cap_log2 = softcap * log2(e)``)."""
    return cap_log2 * tanh(qk * cap_scale)


def softcap_args(softcap: float, scale: float) -> tuple[float | None, float | None]:
    """The kernels' ``(cap_scale, cap_log2)`` for a softcap, ``(None, None)`` when it is off."""
    if softcap > 0:
        return scale / softcap, softcap * LOG2E
    return None, None


def alibi_args(alibi_slopes, num_heads: int):
    """``(slopes, batch stride)`` for the kernels: the slopes of sequence ``b``, head ``h`` are
    at ``slopes + b * stride + h``; ``(None, None)`` without ALiBi."""
    if alibi_slopes is None:
        return None, None
    slopes = alibi_slopes.contiguous()
    return slopes, (num_heads if slopes.dim() == 2 else 0)
