"""One dense prefill launch for Nsight Compute: ours (the Gluon Hopper kernel with a given
tile, ``prefill()`` as served (``served``: the Gluon kernel with its tuned tile, persistent),
or the portable Triton kernel: ``prefill`` with ``ATTENTION_KERNELS_GLUON=0``) or SDPA cuDNN,
bf16, ``B x N`` = 16K tokens (``--n``, default 8K) x ``2048 / D`` heads (``--head-dim``,
default 128), non-causal unless ``--causal``.

Compiles and warms up first; only the launch between ``cudaProfilerStart/Stop`` is profiled:

    ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        python benchmarks/probe_prefill_ncu.py --which gluon
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import dense_inputs

from attention_kernels import prefill
from attention_kernels.prefill_hopper import hopper_prefill_ws


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--which", choices=["gluon", "served", "portable", "cudnn"], required=True)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--tile", default="128,2", help="gluon: block_n,stages")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--n", type=int, default=8192, help="tokens per sequence (16K / n of them)")
    a = p.parse_args()
    d, n, b = a.head_dim, a.n, 16384 // a.n
    h = 2048 // d
    (q, k, v), (qp, kp, vp), cus = dense_inputs(b, h, n, d, torch.bfloat16)
    out = torch.empty_like(qp)
    bn, st = (int(x) for x in a.tile.split(","))
    if a.which == "portable":
        os.environ["ATTENTION_KERNELS_GLUON"] = "0"

    def run() -> None:
        if a.which == "gluon":
            hopper_prefill_ws(qp, kp, vp, cus, cus, out, None, a.causal,
                              1.4426950408889634 / math.sqrt(d), block_n=bn, stages=st)
        elif a.which in ("served", "portable"):
            prefill(qp, kp, vp, cus, causal=a.causal, out=out)
        else:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(q, k, v, is_causal=a.causal)

    profile_once(run)


def profile_once(run: Callable[[], object]) -> None:
    """``run`` three times (compiles, warms up), then once between ``cudaProfilerStart/Stop``:
    the launch an ``ncu --profile-from-start off`` run profiles."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
