"""Softcap, ALiBi and sliding-window helpers shared by the prefill and decode kernels, and the
decode kernels' online-softmax step (``online_softmax_block``).

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

from attention_kernels.configs import interpreting

LOG2E = 1.4426950408889634
# On the GPU, the hardware tanh (PTX tanh.approx.f32, one MUFU op, max relative error ~2^-11,
# what flash_attn's softcap uses): the exp2 form below cost +41% over plain causal prefill at
# 8K on an H100 (a divide and an exp2 per score). The interpreter has no inline asm.
FAST_TANH = tl.constexpr(not interpreting())


@triton.jit
def tanh(x):
    """fp32 tanh. GPU: ``tanh.approx.f32``. Interpreter: from one exp2,
    ``sign(x) (1 - e^(-2|x|)) / (1 + e^(-2|x|))`` (no overflow at any ``x``)."""
    if FAST_TANH:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        t = tl.math.exp2(-2.8853900817779268 * tl.abs(x))  # e^(-2|x|)
        r = (1.0 - t) / (1.0 + t)
        return tl.where(x < 0.0, -r, r)


@triton.jit
def softcap_logits(qk, cap_scale, cap_log2):
    """Log2-unit logits of raw ``q.k`` under a softcap (``cap_scale = scale / softcap``,
    ``cap_log2 = softcap * log2(e)``)."""
    return cap_log2 * tanh(qk * cap_scale)


@triton.jit
def online_softmax_block(s, v, m_i, l_i, acc, P_DTYPE: tl.constexpr, DOT_F32: tl.constexpr):
    """One key block of the online softmax, in log2 units: ``s`` the block's scores (-inf
    where masked), ``v`` its values; returns the new (acc, l, m), acc un-normalised. P is
    rounded to ``P_DTYPE`` (the dot's, as the prefill kernel rounds it), then widened for the
    interpreter's dots (``DOT_F32``)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(P_DTYPE)
    if DOT_F32:
        p = p.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v)
    return acc, l_i, m_new


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
