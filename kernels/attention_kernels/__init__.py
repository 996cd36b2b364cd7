"""Variable-length flash-attention kernels (Triton) and their torch reference.

``prefill`` and ``decode`` are the Triton kernels (CUDA tensors, or any tensor under
``TRITON_INTERPRET=1``); ``prefill_ref`` and ``decode_ref`` are plain torch with the same
signatures. ``paged_prefill`` / ``paged_decode`` read K/V from a paged cache through a block
table (``paged_*_ref`` and ``gather_pages`` are their torch side). Every one of them takes
flash_attn's ``window_size=(left, right)``, ``softcap`` and ``alibi_slopes`` (see
``reference.py`` for the semantics), and FP8 (e4m3) K/V with per-kv-head scales
(``k_scale=, v_scale=``; ``quantize_kv`` makes them, see ``fp8.py``), and FP8 queries too
(``q_scale=``; ``quantize_queries``). A repeated kernel call
with the same shapes, strides, dtypes and arguments reuses its checked set-up and launches the
compiled kernel directly (``_launch.py``): a batch-1 decode step costs ~30 us of host time. The
Triton modules are imported lazily so the reference works without Triton.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attention_kernels._checks import SUPPORTED_DTYPES, supported_head_dim
from attention_kernels.fp8 import (
    FP8_DTYPE,
    dequantize_kv,
    dequantize_queries,
    quantize_kv,
    quantize_queries,
)
from attention_kernels.paged_reference import gather_pages, paged_decode_ref, paged_prefill_ref
from attention_kernels.reference import decode_ref, prefill_ref

if TYPE_CHECKING:
    from attention_kernels.decode_kernel import decode, for_cuda_graphs, paged_decode
    from attention_kernels.kernel_warmup import warmup
    from attention_kernels.prefill_kernel import paged_prefill, prefill

__all__ = [
    "FP8_DTYPE",
    "SUPPORTED_DTYPES",
    "decode",
    "decode_ref",
    "dequantize_kv",
    "dequantize_queries",
    "for_cuda_graphs",
    "gather_pages",
    "paged_decode",
    "paged_decode_ref",
    "paged_prefill",
    "paged_prefill_ref",
    "prefill",
    "prefill_ref",
    "quantize_kv",
    "quantize_queries",
    "supported_head_dim",
    "warmup",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("prefill", "paged_prefill"):
        from attention_kernels import prefill_kernel

        return getattr(prefill_kernel, name)
    if name in ("decode", "paged_decode", "for_cuda_graphs"):
        from attention_kernels import decode_kernel

        return getattr(decode_kernel, name)
    if name == "warmup":
        from attention_kernels.kernel_warmup import warmup

        return warmup
    raise AttributeError(f"module 'attention_kernels' has no attribute {name!r}")
