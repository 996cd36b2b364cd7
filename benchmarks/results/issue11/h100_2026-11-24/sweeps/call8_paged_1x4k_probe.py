"""The probe behind call8_paged_1x4k_probe.log (run once from the repository root on the GPU host;
kept here as the record of what ran): paged decode at 1 x 4K and 1 x 32K over pages of 4096 / 256
/ 64 / 16 tokens, pages in order or shuffled, with a page span of 1024 or per-block lookups,
against contiguous decode. GPU time from CUDA-graph replays of calls under for_cuda_graphs()."""
import sys

import torch
import triton

sys.path.insert(0, "benchmarks")
from bench_kernels import for_graphs  # noqa: E402

from attention_kernels import decode, paged_decode  # noqa: E402
from attention_kernels import decode_kernel as dk  # noqa: E402

H, HK, D = 32, 8, 128


def us(fn):
    fn()
    torch.cuda.synchronize()
    g = for_graphs(fn)
    g()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(g, rep=100, return_mode="median") * 1e3


for ctx in (4096, 32768):
    q = torch.randn(1, H, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(ctx, HK, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    cu = torch.tensor([0, ctx], dtype=torch.int32, device="cuda")
    lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    print(f"ctx {ctx} contig {us(lambda: decode(q, k, v, cu)):.2f}")
    for page in (4096, 256, 64, 16):
        kp, vp = k.view(-1, page, HK, D), v.view(-1, page, HK, D)
        for order in ("seq", "shuffled"):
            n = ctx // page
            perm = torch.arange(n) if order == "seq" else torch.randperm(n)
            if order == "shuffled":
                kp2, vp2 = torch.empty_like(kp), torch.empty_like(vp)
                kp2[perm], vp2[perm] = kp, vp
            else:
                kp2, vp2 = kp, vp
            table = perm.int().view(1, -1).cuda()
            row = []
            for span in (1024, 0):
                dk.PAGE_SPAN = span
                dk._PLANS.clear()
                out = paged_decode(q, kp2, vp2, table, lens)
                err = (out.float() - decode(q, k, v, cu).float()).abs().max().item()
                t = us(lambda: paged_decode(q, kp2, vp2, table, lens))
                row.append(f"span {span}: {t:.2f} (err {err:.1e})")
            print(f"  page {page:5d} {order:8s} " + " | ".join(row))
    dk.PAGE_SPAN = 1024
    dk._PLANS.clear()
