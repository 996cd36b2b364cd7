"""Where the time of a small launch goes: GPU time vs host overhead (GPU only).

For the smallest shapes of bench_kernels.py (decode at batch 1 x 4K keys, varlen prefill of a
few hundred tokens) the kernel runs for tens of microseconds, so the host's launch cost can
decide the timing. For each case this prints:

- ``do_bench``: the median of triton.testing.do_bench (L2 cleared before each run), as in
  bench_kernels.py, repeated to show its spread;
- ``graph``: the median of do_bench_cudagraph (the same launches replayed from a CUDA graph,
  so no host time at all): the GPU's own time;
- ``host``: microseconds of Python + launch per call (a loop of calls without waiting);

and the same for torch SDPA (cuDNN) / varlen_attn as the peer, plus A/B variants (decode split
counts, prefill with and without TMA descriptor loads).

    python benchmarks/small_shapes.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend

from attention_kernels import decode, prefill

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import bench, cu, graph_us, sdpa


def host_us(fn: Callable[[], object], n: int = 300) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def measure(name: str, fn: Callable[[], object]) -> dict:
    fn()
    runs = [bench(fn) * 1e3 for _ in range(3)]
    graph = graph_us(fn)
    row = {"case": name, "do_bench_us": runs, "graph_us": graph, "host_us": host_us(fn)}
    print(f"{name:44s} do_bench {' '.join(f'{r:6.1f}' for r in runs)} us | graph {graph:6.1f}"
          f" us | host {row['host_us']:6.1f} us/call")
    return row


def decode_cases() -> list[dict]:
    rows = []
    batch, ctx, heads, kv_heads, d = 1, 4096, 32, 8, 128
    dt = torch.bfloat16
    q4 = torch.randn(batch, heads, 1, d, dtype=dt, device="cuda")
    k4 = torch.randn(batch, kv_heads, ctx, d, dtype=dt, device="cuda")
    v4 = torch.randn_like(k4)
    q = q4[:, :, 0].contiguous()
    k = k4.transpose(1, 2).reshape(batch * ctx, kv_heads, d).contiguous()
    v = v4.transpose(1, 2).reshape(batch * ctx, kv_heads, d).contiguous()
    cus = cu([ctx])
    cudnn = sdpa(SDPBackend.CUDNN_ATTENTION, q4, k4, v4, causal=False, gqa=True)
    rows.append(measure("decode 1x4K cudnn", cudnn))
    for splits in (0, 1, 4, 8, 16, 32):
        rows.append(measure(f"decode 1x4K ours splits={splits}",
                            lambda s=splits: decode(q, k, v, cus, max_seqlen_k=ctx, num_splits=s)))
    return rows


def varlen_cases() -> list[dict]:
    from torch.nn.attention.varlen import varlen_attn

    rows = []
    heads, kv_heads, d = 16, 8, 128
    for lens in ([64, 128, 256], [128, 256, 512], [1024] * 3, [512] * 32):
        total, mx = sum(lens), max(lens)
        q = torch.randn(total, heads, d, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(total, kv_heads, d, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        # torch 2.11's varlen_attn has no enable_gqa: give it expanded kv heads.
        kx, vx = (t.repeat_interleave(heads // kv_heads, 1) for t in (k, v))
        cus = cu(lens)
        for causal in (True, False):
            tag = f"{lens[:3]}{'...' if len(lens) > 3 else ''} {'causal' if causal else 'full'}"
            ws = (-1, 0) if causal else (-1, -1)
            rows.append(measure(f"varlen {tag} varlen_attn", lambda w=ws: varlen_attn(
                q, kx, vx, cus, cus, mx, mx, window_size=w)))
            for tma in ("1", "0"):
                os.environ["ATTENTION_KERNELS_TMA"] = tma
                rows.append(measure(f"varlen {tag} ours tma={tma}", lambda c=causal: prefill(
                    q, k, v, cus, max_seqlen_q=mx, max_seqlen_k=mx, causal=c)))
            os.environ.pop("ATTENTION_KERNELS_TMA")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--only", choices=["decode", "varlen"], action="append")
    args = p.parse_args()
    only = set(args.only or ["decode", "varlen"])
    gpu = torch.cuda.get_device_name()
    print(gpu, "torch", torch.__version__, "triton", triton.__version__)
    rows = (decode_cases() if "decode" in only else []) + (
        varlen_cases() if "varlen" in only else [])
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"small_shapes_{gpu.replace(' ', '_')}.json"
    path.write_text(json.dumps({"gpu": gpu, "rows": rows,
                                "median_do_bench_us": {r["case"]: statistics.median(
                                    r["do_bench_us"]) for r in rows}}, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
