"""FP8 (e4m3) K/V prefill on the portable kernel: convert each tile in the key loop, or widen K/V
to the queries' dtype first (one launch, ``kv_copies``) and run the 16-bit kernel with
the scales applied. Picks ``prefill_kernel.FP8_WIDEN_MIN_KEYS_SEEN``.

    python tools/tuning/tune_fp8_widen.py [--rounds 3] [--out DIR]

Per case, in interleaved rounds: per-call time (``bench``: do_bench, L2 flushed, host included)
and GPU time (``graph_us``: CUDA-graph replays) of the per-tile path, the widened path, and the
same prefill with bf16 K/V (the ceiling). The Gluon kernel, which always widens, is turned off
(``ATTENTION_KERNELS_GLUON=0``), so every case runs the portable kernel: small varlen batches,
short D 64 causal prompts, a sliding window, softcap.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_kernels import bench, cu, flops, graph_us

from attention_kernels import prefill, prefill_kernel
from attention_kernels.fp8 import quantize_kv

HEADS, KV_HEADS = 16, 8
CASES = [  # name, lengths, head dim, causal, features
    ("varlen [64,128,256]", [64, 128, 256], 128, True, {}),
    ("varlen [512]*32", [512] * 32, 128, False, {}),
    ("varlen [512]*32 causal", [512] * 32, 128, True, {}),
    ("dense 16x1K D64 causal", [1024] * 16, 64, True, {}),
    ("dense 8x2K D64 causal", [2048] * 8, 64, True, {}),
    ("dense 4x4K D128 window 512", [4096] * 4, 128, True, {"window_size": (512, 0)}),
    ("dense 4x4K D128 softcap", [4096] * 4, 128, True, {"softcap": 30.0}),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    os.environ["ATTENTION_KERNELS_GLUON"] = "0"  # the rule is the portable kernel's
    rows = []
    for name, lens, d, causal, feats in CASES:
        total = sum(lens)
        q = torch.randn(total, HEADS, d, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(total, KV_HEADS, d, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
        c = cu(lens)
        fl = flops(lens, lens, HEADS, d, causal)

        def fp8(c=c, q=q, k8=k8, v8=v8, ks=ks, vs=vs, causal=causal, feats=feats):
            return prefill(q, k8, v8, c, causal=causal, k_scale=ks, v_scale=vs, **feats)

        def bf16(c=c, q=q, k=k, v=v, causal=causal, feats=feats):
            return prefill(q, k, v, c, causal=causal, **feats)

        samples: dict[str, list[float]] = {}
        outs = {}
        for _ in range(a.rounds):
            for side, keys in (("tiles", 1 << 62), ("widened", 0), ("bf16", 0)):
                prefill_kernel.FP8_WIDEN_MIN_KEYS_SEEN = keys
                prefill_kernel._PLANS.clear()
                fn = bf16 if side == "bf16" else fp8
                outs[side] = fn().float()
                samples.setdefault(side + " ms", []).append(bench(fn))
                samples.setdefault(side + " graph us", []).append(graph_us(fn))
        err = ((outs["widened"] - outs["tiles"]).norm() / outs["tiles"].norm()).item()
        row = {"case": name, "head_dim": d, "causal": causal, "rel_diff": err,
               **{key: statistics.median(vals) for key, vals in samples.items()}}
        for side in ("tiles", "widened", "bf16"):
            row[side + " TFLOP/s"] = fl / row[side + " graph us"] / 1e6
        rows.append(row)
        print(f"{name:28s} per call ms tiles {row['tiles ms']:.4f} widened "
              f"{row['widened ms']:.4f} bf16 {row['bf16 ms']:.4f} | GPU us tiles "
              f"{row['tiles graph us']:.1f} widened {row['widened graph us']:.1f} bf16 "
              f"{row['bf16 graph us']:.1f} | TFLOP/s {row['tiles TFLOP/s']:.0f} / "
              f"{row['widened TFLOP/s']:.0f} / {row['bf16 TFLOP/s']:.0f} | diff {err:.1e}",
              flush=True)
        assert math.isfinite(err) and err < 2e-2, (name, err)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "tune_fp8_widen.json").write_text(json.dumps(
            {"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
