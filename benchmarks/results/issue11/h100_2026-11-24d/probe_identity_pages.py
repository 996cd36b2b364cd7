"""Diagnostic (kept as the record of what ran; run from the repository root on the GPU host):
is paged decode's fixed ~1.6 us over contiguous at 1 x 4K the block-table reads, or the rest
of the paged program? ``python probe_identity_pages.py [identity]``: with ``identity``, the
per-block page lookup is replaced by ``start_n // PAGE_TOKENS`` (no table read; right only for
the identity table used here). GPU time of CUDA-graph replays under for_cuda_graphs()
(``bench_kernels.graph_us``; the recorded runs used a copy of it at ``rep=200``)."""
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks")
from attention_kernels import _paging  # noqa: E402

if "identity" in sys.argv[1:]:
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

from attention_kernels import decode, paged_decode  # noqa: E402

H, HK, D = 32, 8, 128


tag = "identity" if "identity" in sys.argv[1:] else "table"
for ctx in (4096, 32768):
    q = torch.randn(1, H, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(ctx, HK, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    cu = torch.tensor([0, ctx], dtype=torch.int32, device="cuda")
    lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    ref = decode(q, k, v, cu)
    row = [f"ctx {ctx} contig {graph_us(lambda: decode(q, k, v, cu)):.2f}"]
    for page in (4096, 64):
        kp, vp = k.view(-1, page, HK, D), v.view(-1, page, HK, D)
        table = torch.arange(ctx // page, dtype=torch.int32, device="cuda").view(1, -1)
        err = (paged_decode(q, kp, vp, table, lens).float() - ref.float()).abs().max().item()
        t = graph_us(lambda: paged_decode(q, kp, vp, table, lens))
        row.append(f"page {page} {tag} {t:.2f} (err {err:.1e})")
    print(" | ".join(row), flush=True)
