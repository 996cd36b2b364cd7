"""Diagnostic: how should a paged decode split look its key blocks' pages up?

Paged decode trails contiguous keys by 3-7% at some shapes (H200, 2026-11-27), and replacing
the block-table read with ``start_n // PAGE_TOKENS`` (``identity``: right only for an identity
table) closes the gap: the cost is the look-up chain (table load -> page offset -> the block's
async copies), which Triton's pipeliner places right before the copies it feeds. This probe
swaps ``decode_kernel.block_kv_ptrs`` for other look-ups, one mode per process:

  table     what the kernel does (a scalar load one block ahead, or the split's page span)
  vector    each block's pages as a ``[BLOCK_N]`` load (one entry per key) in the block's own
            iteration, nothing carried: the pipeliner may treat it as an indirect load and
            issue it a stage before the copies that use it
  identity  no table read (pages = key // PAGE_TOKENS); ``views`` only, batch 1 only

Per shape ``B:ctx:D:page`` (32 query heads, 8 kv heads, bf16), GPU time of CUDA-graph replays
(median of 3 interleaved rounds) of: ``contig`` decode() on packed K/V, ``views`` paged_decode()
over page views of the same packed K/V with an identity table, ``pool`` paged_decode() on
bench_paged's shuffled pool (the server's layout). Every output is checked against contig.

    python benchmarks/probe_paged_lookup.py table|vector|identity [--shapes B:ctx:D:page ...]
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks")
import attention_kernels.decode_kernel as decode_kernel  # noqa: E402
from attention_kernels import _paging  # noqa: E402


@triton.jit
def _vector_kv_ptrs(k_base, v_base, kv_offs_k, kv_offs_v, page, first, table_row, start_n,
                    offs_n, end, stride_kp, stride_kt, stride_vp, stride_vt,
                    PAGE_TOKENS: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
                    SPAN: tl.constexpr = 0):
    if PAGED:
        pos = start_n + offs_n
        pages = tl.load(table_row + pos // PAGE_TOKENS, mask=pos < end, other=0).to(tl.int64)
        if PAGE_TOKENS % BLOCK_N == 0:  # kv_offs_* hold the block's rows within the page
            slot = tl.cast(start_n % PAGE_TOKENS, tl.int64)
            k_rows = (pages * stride_kp)[:, None] + slot * stride_kt
            v_rows = (pages * stride_vp)[:, None] + slot * stride_vt
        elif BLOCK_N % PAGE_TOKENS == 0:  # kv_offs_* hold the slots
            k_rows = (pages * stride_kp)[:, None]
            v_rows = (pages * stride_vp)[:, None]
        else:
            slot = (pos % PAGE_TOKENS).to(tl.int64)
            k_rows = (pages * stride_kp + slot * stride_kt)[:, None]
            v_rows = (pages * stride_vp + slot * stride_vt)[:, None]
        k_ptrs = k_base + k_rows + kv_offs_k
        v_ptrs = v_base + v_rows + kv_offs_v
    else:
        k_ptrs = k_base + tl.cast(start_n, tl.int64) * stride_kt + kv_offs_k
        v_ptrs = v_base + tl.cast(start_n, tl.int64) * stride_vt + kv_offs_v
    return k_ptrs, v_ptrs, page


@triton.jit
def _identity_pages(table_row, start_n, offs_n, end, PAGE_TOKENS: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    if PAGE_TOKENS % BLOCK_N == 0:
        page = start_n // PAGE_TOKENS + 0 * end
    else:
        page = (start_n + offs_n) // PAGE_TOKENS + 0 * end
    return page.to(tl.int64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("table", "vector", "identity"))
    parser.add_argument("--shapes", nargs="+", default=[
        "1:4096:128:64", "1:32768:128:64", "8:8192:128:64", "64:8192:128:64",
        "128:2048:128:64", "8:8192:64:64", "1:32768:128:16", "8:8192:128:16"])
    args = parser.parse_args()
    if args.mode == "vector":
        decode_kernel.block_kv_ptrs = _vector_kv_ptrs
        # With the span off every page size looks up per block (the vector above).
        decode_kernel.PAGE_SPAN = 0
    elif args.mode == "identity":
        _paging.block_pages = _identity_pages
        decode_kernel.PAGE_SPAN = 0  # the span path reads the table without block_pages

    from bench_kernels import graph_us
    from bench_paged import cu, paged_copy

    from attention_kernels import decode, paged_decode

    heads, kv_heads = 32, 8
    for spec in args.shapes:
        b, n, d, page = (int(x) for x in spec.split(":"))
        if args.mode == "identity" and b > 1:  # key // PAGE_TOKENS is sequence 0's page only
            print(f"identity {spec}: skipped (batch 1 only)", flush=True)
            continue
        q = torch.randn(b, heads, d, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(b * n, kv_heads, d, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        cus = cu([n] * b, q.device)
        lens = torch.tensor([n] * b, dtype=torch.int32, device="cuda")
        views = k.view(-1, page, kv_heads, d), v.view(-1, page, kv_heads, d)
        ident = torch.arange(b * n // page, dtype=torch.int32, device="cuda").view(b, -1)
        sides = {"contig": lambda: decode(q, k, v, cus, max_seqlen_k=n),
                 "views": lambda: paged_decode(q, *views, ident, lens, max_seqlen_k=n)}
        if args.mode != "identity":
            kp, vp, table, plens = paged_copy(k, v, [n] * b, page,
                                              torch.Generator().manual_seed(0))
            sides["pool"] = lambda: paged_decode(q, kp, vp, table, plens, max_seqlen_k=n)
        ref = sides["contig"]().float()
        times: dict[str, list[float]] = {s: [] for s in sides}
        for _ in range(3):
            for s, fn in sides.items():
                err = (fn().float() - ref).abs().max().item()
                assert err < 0.05, (spec, s, err)
                times[s].append(graph_us(fn))
        med = {s: sorted(t)[1] for s, t in times.items()}
        ratios = " ".join(f"{s}/contig {med['contig'] / med[s]:.3f}" for s in med if s != "contig")
        print(f"{args.mode} {spec}: " + " | ".join(f"{s} {t:.2f}" for s, t in med.items())
              + f" | {ratios}", flush=True)


if __name__ == "__main__":
    main()
