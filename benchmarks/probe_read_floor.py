"""How fast can one launch read N bytes from HBM? The floor under a small decode's GPU time.

A batch-1 decode reads its whole cache once (1 x 4K keys, 8 kv heads x 128 bf16: 16 MiB) in
one short wave of programs, so its time is start-up latency plus bytes over bandwidth plus the
merge. This times a plain read (each program sums a contiguous chunk with 16-byte loads and
writes one float) of the same byte counts, over rotating copies (a cold L2, as in
``bench_kernels.graph_cold_us``), at several program counts, and an empty kernel (the launch
alone, in a graph). Decode at the same bytes (ours and SDPA cuDNN, cold) sits beside it.

    python benchmarks/probe_read_floor.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import graph_cold_us, graph_us, sdpa
from torch.nn.attention import SDPBackend

from attention_kernels import decode


@triton.jit
def _read_kernel(X, Out, n, per_program, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    first = pid.to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, per_program, BLOCK):
        idx = first + start + offs
        acc += tl.load(X + idx, mask=idx < n, other=0.0).to(tl.float32)
    tl.store(Out + pid, tl.sum(acc, 0))


@triton.jit
def _empty_kernel(Out):
    pass


def read_call(nbytes: int, programs: int):
    x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(programs, dtype=torch.float32, device="cuda")
    block = 2048
    per = -(-x.numel() // (programs * block)) * block  # every element read once
    return lambda: _read_kernel[(programs,)](x, out, x.numel(), per, BLOCK=block, num_warps=4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    out = torch.empty(1, device="cuda")
    empty = graph_us(lambda: _empty_kernel[(1,)](out))
    print(f"empty kernel (graph): {empty:.2f} us", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for ctx in (4096, 8192, 32768):
        nbytes = 2 * ctx * 8 * 128 * 2  # K and V of 1 x ctx keys, 8 kv heads x 128 bf16
        row = {"ctx": ctx, "bytes": nbytes}
        for programs in (sms, 2 * sms, 4 * sms, 8 * sms):
            us = graph_cold_us(lambda p=programs: read_call(nbytes, p), nbytes)
            row[f"read_{programs}_us"] = us
        q = torch.randn(1, 32, 128, dtype=torch.bfloat16, device="cuda")
        cu = torch.tensor([0, ctx], dtype=torch.int32, device="cuda")

        def ours():
            k = torch.randn(ctx, 8, 128, dtype=torch.bfloat16, device="cuda")
            v = torch.randn_like(k)
            return lambda: decode(q, k, v, cu, max_seqlen_k=ctx)

        def cudnn():
            k = torch.randn(1, 8, ctx, 128, dtype=torch.bfloat16, device="cuda")
            return sdpa(SDPBackend.CUDNN_ATTENTION, q[:, :, None], k, torch.randn_like(k),
                        False, gqa=True)

        row["ours_decode_us"] = graph_cold_us(ours, nbytes)
        row["cudnn_decode_us"] = graph_cold_us(cudnn, nbytes)
        reads = {k: v for k, v in row.items() if k.startswith("read_")}
        best = min(reads.values())
        print(f"1 x {ctx} ({nbytes / 2**20:.0f} MiB), cold: read "
              + " | ".join(f"{k[5:-3]} programs {v:.1f} us" for k, v in reads.items())
              + f" (best {nbytes / best / 1e3:.0f} GB/s) | decode ours {row['ours_decode_us']:.1f}"
              f" cuDNN {row['cudnn_decode_us']:.1f} us", flush=True)
        rows.append(row)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "read_floor.json").write_text(json.dumps(
            {"gpu": torch.cuda.get_device_name(), "empty_kernel_us": empty, "rows": rows},
            indent=1))


if __name__ == "__main__":
    main()
