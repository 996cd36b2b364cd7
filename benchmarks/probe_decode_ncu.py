"""One decode launch for Nsight Compute: our split kernel on contiguous keys (``contiguous``) or
on a shuffled page pool as the server lays it out (``paged``, bench_paged.py's pool), or SDPA
cuDNN, 32 q / 8 kv heads, bf16, ``--batch`` sequences of ``--ctx`` keys.

Compiles and warms up first; only the launch between ``cudaProfilerStart/Stop`` is profiled:

    ncu --profile-from-start off --set full -o paged \
        python benchmarks/probe_decode_ncu.py --which paged --page-tokens 64
    ncu --import paged.ncu-rep --page raw --csv > paged.csv
    python benchmarks/ncu_summary.py contiguous.csv paged.csv
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_paged import cu, paged_copy
from probe_prefill_ncu import profile_once

from attention_kernels import decode, paged_decode

HEADS, KV_HEADS = 32, 8


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--which", choices=["contiguous", "paged", "cudnn"], required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-tokens", type=int, default=64)
    a = p.parse_args()
    b, n, d = a.batch, a.ctx, a.head_dim
    q = torch.randn(b, HEADS, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(b * n, KV_HEADS, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    if a.which == "contiguous":
        cus = cu([n] * b, q.device)

        def run() -> None:
            decode(q, k, v, cus, max_seqlen_k=n)
    elif a.which == "paged":
        k_pages, v_pages, table, lens = paged_copy(k, v, [n] * b, a.page_tokens,
                                                   torch.Generator().manual_seed(0))

        def run() -> None:
            paged_decode(q, k_pages, v_pages, table, lens, max_seqlen_k=n)
    else:
        qd = q[:, :, None, :]
        kd, vd = (t.view(b, n, KV_HEADS, d).transpose(1, 2).contiguous() for t in (k, v))

        def run() -> None:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)

    profile_once(run)


if __name__ == "__main__":
    main()
