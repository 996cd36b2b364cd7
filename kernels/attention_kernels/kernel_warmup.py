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

from attention_kernels.configs import (
    LONG_SPLIT_TILE,
    MANY_PROGRAMS_TILE,
    ONE_SPLIT_TILE,
    interpreting,
    many_programs,
    paged_decode_config,
)
from attention_kernels.decode_kernel import (
    PAGE_SPAN,
    _merge_mode,
    decode,
    for_cuda_graphs,
    paged_decode,
)
from attention_kernels.prefill_kernel import _TMA_HEAD_DIMS, _tma_ok, paged_prefill, prefill


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
            _prefill_variants(q, kv, cu, lse_flags)
            qd = torch.randn(2, 4, d, dtype=dtype, device=device)
            for lse in lse_flags:  # one split: the kernel writes the output directly
                decode(qd, kv, kv, cu, num_splits=1, return_lse=lse)
            splits = functools.partial(_split_decodes, d, dtype, device, lse_flags, merges)
            splits(decode, kv, kv, cu)
            rule = d == 128 and device.type == "cuda"  # decode_shape_config's other tiles
            if rule:
                for lse in lse_flags:  # one split writes directly: one variant for any group
                    for tile in (ONE_SPLIT_TILE, MANY_PROGRAMS_TILE):
                        decode(qd, kv, kv, cu, num_splits=1, return_lse=lse, _config=tile)
                splits(decode, kv, kv, cu, _config=LONG_SPLIT_TILE)
            # Key blocks of the paged decode tiles (a page span needs pages smaller).
            blocks = [paged_decode_config(d, dtype, device).block_n]
            if rule:
                blocks.append(ONE_SPLIT_TILE.block_n)
            for p in page_tokens:
                pages = torch.randn(2 * -(-23 // p), p, 2, d, dtype=dtype, device=device)
                lens = torch.tensor([17, 23], dtype=torch.int32, device=device)
                table = torch.arange(pages.shape[0], dtype=torch.int32, device=device)
                table = table.view(2, -1)
                for causal in (False, True):
                    for lse in lse_flags:
                        paged_prefill(q, pages, pages, table, cu, lens, causal=causal,
                                      return_lse=lse)
                tables = [table]
                if p < max(blocks):
                    # Pages smaller than a key block: tables too wide for one page span per
                    # split take per-block lookups, a variant of their own
                    # (decode_kernel.PAGE_SPAN); page 0 stands in for every entry.
                    tables.append(torch.zeros(2, 2 * PAGE_SPAN + 2, dtype=torch.int32,
                                              device=device))
                for t in tables:
                    for lse in lse_flags:
                        paged_decode(qd, pages, pages, t, lens, num_splits=1, return_lse=lse)
                        if rule:  # pages take the one-split rule only
                            paged_decode(qd, pages, pages, t, lens, num_splits=1,
                                         return_lse=lse, _config=ONE_SPLIT_TILE)
                    splits(paged_decode, pages, pages, t, lens)
    if device.type == "cuda":
        _graph_variants(merges, device)
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _prefill_variants(q: torch.Tensor, kv: torch.Tensor, cu: torch.Tensor,
                      lse_flags: tuple[bool, ...]) -> None:
    """``prefill``'s variants for ``q``'s dtype and head dim: the tiles of launches of few and
    of many programs (``configs.many_programs``), each with and without a short
    ``max_seqlen_q`` hint, and on Hopper at the head dims that take them the descriptor (TMA)
    loads, which only launches with enough work take (``_TMA_MIN_WORK``). Without these the
    first long prompt or first big batch compiled them (~1-2 s each)."""
    d = q.shape[2]
    inputs = [(q, kv, cu)]
    if q.is_cuda and not interpreting():  # the interpreter has one tile, and no TMA
        # One query per sequence, many heads: the fewest bytes that make a many-program launch.
        one = torch.tensor([0, 1], dtype=torch.int32, device=q.device)
        inputs.append((torch.randn(1, _many_heads(1, q.device), d, dtype=q.dtype,
                                   device=q.device), kv[:1], one))
        if d in _TMA_HEAD_DIMS:
            n = 4096  # n * n * 16 heads = _TMA_MIN_WORK
            big_kv = torch.randn(n, 2, d, dtype=q.dtype, device=q.device)
            big_cu = torch.tensor([0, n], dtype=torch.int32, device=q.device)
            for heads in {16, _many_heads(n, q.device)}:
                big_q = torch.randn(n, heads, d, dtype=q.dtype, device=q.device)
                if _tma_ok(big_q, big_kv, big_kv):
                    inputs.append((big_q, big_kv, big_cu))
    for q_in, kv_in, cu_in in inputs:
        for causal in (False, True):
            for lse in lse_flags:
                for hint in (None, 23):
                    prefill(q_in, kv_in, kv_in, cu_in, causal=causal, return_lse=lse,
                            max_seqlen_q=hint)


def _many_heads(total_q: int, device: torch.device) -> int:
    """The least even head count, at least 16 (two kv heads divide it), that makes one
    sequence of ``total_q`` queries a launch of many programs on ``device``."""
    heads = 16
    while not many_programs(total_q, 1, heads, device):
        heads += 2
    return heads


def _split_decodes(d: int, dtype: torch.dtype, device: torch.device,
                   lse_flags: tuple[bool, ...], merges: list[Callable[[], object]],
                   fn: Callable[..., object], *args: object, **kwargs: object) -> None:
    """``fn(q, *args, num_splits=2, return_lse=..., **kwargs)`` (two sequences) for the common
    GQA ratios (the merge has one tile row per query head of a group: a variant per ratio) and
    lse flags: now, and into ``merges`` to run again for CUDA graphs."""
    for group in (1, 2, 4, 8):
        qg = torch.randn(2, 2 * group, d, dtype=dtype, device=device)
        for lse in lse_flags:
            call = functools.partial(fn, qg, *args, num_splits=2, return_lse=lse, **kwargs)
            call()
            merges.append(call)


def _graph_variants(calls: list[Callable[[], object]], device: torch.device) -> None:
    """The variants CUDA-graph callers take (``for_cuda_graphs``: on Hopper the split decode's
    PDL merge kernel), compiled now by eager calls; nothing where they are the eager ones."""
    with for_cuda_graphs():
        if _merge_mode(device) == "fused":
            return
        for call in calls:
            call()
