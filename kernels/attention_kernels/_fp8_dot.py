"""FP8 (e4m3) keys and values: the kernels' dots run in fp16, whatever the queries' 16-bit dtype.

Why: sm_90 has no e4m3 -> bf16 conversion. Triton 3.6 emits ``cvt.rn.f16x2.e4m3x2`` and then
a scalar ``cvt.bf16.f16`` per element (PTX for sm_90; ``tools/tuning/tune_fp8.py`` prints it),
so an FP8 tile cost more to convert than it saved in bytes: H200, 2026-11-23, bf16 queries,
decode 16 x 32K went 496 us (bf16 K/V) -> 735 us (FP8 K/V), dense prefill 8K 475 -> 304
TFLOP/s. To fp16 the conversion is the single paired ``cvt`` (e4m3 values are exact in fp16).

bf16 queries then go to fp16 too (fp16 ones are rescaled the same way, at the cost of one max
per program), and fp16 has the precision but not the range of bf16: each
program scales its query tile by one power of two, so the tile's largest magnitude lands in
``[2^13, 2^15)`` (fp16 tops out at 65504), and multiplies the logit scale back. Powers of two
are exact, fp16 keeps 3 more mantissa bits than bf16, and only entries below ``2^-28`` of the
tile's largest lose bits (their logits lie under the bf16 rounding of the largest ones). P goes
to fp16 for the P.V dot (it lies in [0, 1]): again more precise than bf16.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def f16_queries(q):
    """``(q16, unit)``: ``q`` as fp16 scaled by a power of two, and the factor
    (``q ~= q16 * unit``) to fold into the logit scale."""
    qf = q.to(tl.float32)
    amax = tl.max(tl.max(tl.abs(qf), 1), 0)
    # Floor 1e-30 (~2^-100): an all-zero tile scales by 2^113, still finite in fp32.
    e = tl.math.ceil(tl.math.log2(tl.maximum(amax, 1e-30)))
    q16 = (qf * tl.math.exp2(14.0 - e)).to(tl.float16)
    return q16, tl.math.exp2(e - 14.0)
