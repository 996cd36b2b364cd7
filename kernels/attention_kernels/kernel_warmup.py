"""Compile the Triton kernels ahead of traffic.

Triton compiles one binary per (dtype, head dim, causal, return_lse, config) on first use, which
takes about a second each; a server calls ``warmup`` before it reports SERVING so no request pays
that. Binaries also land in Triton's on-disk cache (``TRITON_CACHE_DIR``), so a restart with a
persistent cache only loads them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable

import torch

from attention_kernels.configs import DecodeConfig
from attention_kernels.decode_kernel import decode, for_cuda_graphs, paged_decode
from attention_kernels.prefill_kernel import paged_prefill, prefill


def warmup(
    head_dims: Iterable[int] = (64, 128),
    dtypes: Iterable[torch.dtype] = (torch.bfloat16, torch.float16),
    device: str | torch.device = "cuda",
    *,
    with_lse: bool = True,
    page_tokens: Iterable[int] = (),
) -> float:
    """Run every kernel variant once on tiny inputs; returns the seconds it took.

    ``page_tokens``: also the paged variants for these page sizes (one compile each, as the
    page size is a compile-time constant of the paged kernels)."""
    device = torch.device(device)
    t0 = time.perf_counter()
    lse_flags = (False, True) if with_lse else (False,)
    merges: list[Callable[[], object]] = []  # split decodes, again for CUDA graphs at the end
    for dtype in dtypes:
        for d in head_dims:
            # 2 query heads per kv head and two sequences: a realistic specialisation of strides.
            q = torch.randn(40, 4, d, dtype=dtype, device=device)
            kv = torch.randn(40, 2, d, dtype=dtype, device=device)
            cu = torch.tensor([0, 17, 40], dtype=torch.int32, device=device)
            for causal in (False, True):
                for lse in lse_flags:
                    prefill(q, kv, kv, cu, causal=causal, return_lse=lse)
            qd = torch.randn(2, 4, d, dtype=dtype, device=device)
            for lse in lse_flags:  # one split: the kernel writes the output directly
                decode(qd, kv, kv, cu, num_splits=1, return_lse=lse)
            # Splits merge (fused eagerly; a kernel of its own in a CUDA graph on Hopper) with
            # one tile row per query head of a group: the common GQA ratios get their variants.
            for group in (1, 2, 4, 8):
                qg = torch.randn(2, 2 * group, d, dtype=dtype, device=device)
                for lse in lse_flags:
                    merges.append(functools.partial(decode, qg, kv, kv, cu, num_splits=2,
                                                    return_lse=lse))
                    merges[-1]()
            if d == 128 and device.type == "cuda":  # decode_shape_config's other tiles
                for lse in lse_flags:  # one split writes directly: one variant for any group
                    decode(qd, kv, kv, cu, num_splits=1, return_lse=lse,
                           _config=DecodeConfig(32, 4, 2))
                for group in (1, 2, 4, 8):  # splits merge: a variant per group, as above
                    qg = torch.randn(2, 2 * group, d, dtype=dtype, device=device)
                    for lse in lse_flags:
                        merges.append(functools.partial(decode, qg, kv, kv, cu, num_splits=2,
                                                        return_lse=lse,
                                                        _config=DecodeConfig(128, 4, 3)))
                        merges[-1]()
            for p in page_tokens:
                pages = torch.randn(2 * -(-23 // p), p, 2, d, dtype=dtype, device=device)
                lens = torch.tensor([17, 23], dtype=torch.int32, device=device)
                table = torch.arange(pages.shape[0], dtype=torch.int32, device=device)
                table = table.view(2, -1)
                for causal in (False, True):
                    for lse in lse_flags:
                        paged_prefill(q, pages, pages, table, cu, lens, causal=causal,
                                      return_lse=lse)
                for splits in (1, 2):
                    for lse in lse_flags:
                        paged_decode(qd, pages, pages, table, lens, num_splits=splits,
                                     return_lse=lse)
                for group in (1, 2, 4, 8):
                    qg = torch.randn(2, 2 * group, d, dtype=dtype, device=device)
                    for lse in lse_flags:
                        merges.append(functools.partial(paged_decode, qg, pages, pages, table,
                                                        lens, num_splits=2, return_lse=lse))
                        merges[-1]()
    if device.type == "cuda":
        _graph_variants(merges)
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _graph_variants(calls: list[Callable[[], object]]) -> None:
    """The variants CUDA-graph callers take (``for_cuda_graphs``: on Hopper the split decode's
    PDL merge kernel), compiled now by eager calls."""
    with for_cuda_graphs():
        for call in calls:
            call()
