"""Sweep decode launch configs on GPU time (CUDA-graph replays), for the small-batch shapes
where the split count and tile decide the time; SDPA cuDNN in the same run as the yardstick.

    python benchmarks/tune_decode_gpu.py [--out DIR]

32 q / 8 kv heads, D 128, bf16. Each config is checked against the default first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_kernels import decode  # noqa: E402
from attention_kernels.configs import DecodeConfig  # noqa: E402

SHAPES = [(1, 4096), (1, 8192), (2, 4096), (4, 4096), (1, 32768)]


def gpu_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    heads, kv_heads, d = 32, 8, 128
    rows = []
    for batch, ctx in SHAPES:
        q = torch.randn(batch, heads, d, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(batch * ctx, kv_heads, d, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        cu = torch.arange(0, (batch + 1) * ctx, ctx, dtype=torch.int32, device="cuda")
        qd = q[:, :, None, :]
        kd = k.view(batch, ctx, kv_heads, d).transpose(1, 2)
        vd = v.view(batch, ctx, kv_heads, d).transpose(1, 2)

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)

        ref = decode(q, k, v, cu)
        peer = gpu_us(cudnn)
        default = gpu_us(lambda: decode(q, k, v, cu))
        best = (default, "default")
        for bn, warps, stages, splits in itertools.product(
                (32, 64, 128), (4, 8), (2, 3), (4, 8, 12, 16, 24, 32, 48, 64)):
            if splits * bn > ctx:
                continue
            cfg = DecodeConfig(bn, warps, stages)
            fn = lambda cfg=cfg, s=splits: decode(q, k, v, cu, num_splits=s, _config=cfg)  # noqa: E731
            try:
                err = ((fn().float() - ref.float()).norm() / ref.float().norm()).item()
                if not err < 1e-2:
                    print(f"  {cfg} splits {splits}: wrong (rel err {err:.3g})")
                    continue
                us = gpu_us(fn)
            except Exception as e:  # noqa: BLE001 (out of resources and the like: skip)
                print(f"  {cfg} splits {splits}: {type(e).__name__}")
                continue
            rows.append({"B": batch, "ctx": ctx, "block_n": bn, "warps": warps,
                         "stages": stages, "splits": splits, "gpu_us": us})
            if us < best[0]:
                best = (us, f"block_n {bn} warps {warps} stages {stages} splits {splits}")
        print(f"B={batch} ctx={ctx}: cuDNN {peer:.1f} us | ours default {default:.1f} us "
              f"({peer / default:.2f}x) | best {best[0]:.1f} us ({peer / best[0]:.2f}x): "
              f"{best[1]}", flush=True)
        rows.append({"B": batch, "ctx": ctx, "cudnn_us": peer, "default_us": default,
                     "best_us": best[0], "best": best[1]})
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tune_decode_gpu.json").write_text(json.dumps(
            {"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
