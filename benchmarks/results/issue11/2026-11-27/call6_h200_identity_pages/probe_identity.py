"""Diagnostic (record of what ran; from the repository root on the GPU host): at 8 x 8K,
1 x 64K (the same 128 programs of 4096 keys), 1 x 32K and 1 x 4K keys (32q/8kv x 128 bf16,
64-token pages), is paged decode's gap to contiguous keys the block-table reads?
GPU time of CUDA-graph replays (medians of 3):
  contig  decode() on packed K/V
  views   paged_decode() over 64-token views of the same packed K/V, identity table
  pool    paged_decode() on bench_paged's shuffled pool (K then V in each page)
``python benchmarks/_probe_identity.py identity``: the table read replaced by
``start_n // PAGE_TOKENS`` (no table load; right only for the identity table of ``views``)."""
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks")
from attention_kernels import _paging

IDENTITY = "identity" in sys.argv[1:]
if IDENTITY:
    @triton.jit
    def identity_pages(table_row, start_n, offs_n, end, PAGE_TOKENS: tl.constexpr,
                       BLOCK_N: tl.constexpr):
        if PAGE_TOKENS % BLOCK_N == 0:
            page = start_n // PAGE_TOKENS + 0 * end
        else:
            page = (start_n + offs_n) // PAGE_TOKENS + 0 * end
        return page.to(tl.int64)
    _paging.block_pages = identity_pages

from bench_kernels import graph_us  # noqa: E402
from bench_paged import cu, paged_copy  # noqa: E402

from attention_kernels import decode, paged_decode  # noqa: E402

H, HK, D, PAGE = 32, 8, 128, 64
for b, n in ((1, 65536), (1, 32768), (1, 4096)) if IDENTITY else (
        (8, 8192), (1, 65536), (1, 32768), (1, 4096)):
    q = torch.randn(b, H, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(b * n, HK, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    cus = cu([n] * b, q.device)
    lens = torch.tensor([n] * b, dtype=torch.int32, device="cuda")
    kv_views = k.view(-1, PAGE, HK, D), v.view(-1, PAGE, HK, D)
    ident = torch.arange(b * n // PAGE, dtype=torch.int32, device="cuda").view(b, -1)
    sides = {"contig": lambda: decode(q, k, v, cus, max_seqlen_k=n),
             "views": lambda: paged_decode(q, *kv_views, ident, lens, max_seqlen_k=n)}
    if not IDENTITY:
        kp, vp, table, plens = paged_copy(k, v, [n] * b, PAGE, torch.Generator().manual_seed(0))
        sides["pool"] = lambda: paged_decode(q, kp, vp, table, plens, max_seqlen_k=n)
    ref = sides["contig"]().float()
    times: dict[str, list[float]] = {s: [] for s in sides}
    for _ in range(3):
        for s, fn in sides.items():
            assert (fn().float() - ref).abs().max().item() < 0.05, s
            times[s].append(graph_us(fn))
    tag = "identity" if IDENTITY else "table"
    print(f"{tag} {b} x {n}: " + " | ".join(f"{s} {sorted(t)[1]:.2f}" for s, t in times.items()),
          flush=True)
