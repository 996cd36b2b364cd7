"""FP8 (e4m3) K/V kernels on a GPU: which conversion, which tiles, TMA or not.

    python tools/tuning/tune_fp8.py [--out DIR] [--quick]

Prints and writes (``tune_fp8_<gpu>.json``):
* the PTX of an e4m3 -> bf16 and an e4m3 -> fp16 conversion for sm_90 (conversion
  instructions per element: why the kernels' dots run in fp16, see ``_fp8_dot``);
* decode (32 q / 8 kv heads, D 128, bf16 queries), GPU time from a CUDA graph: bf16 K/V, then
  FP8 K/V with the default config, then FP8 tile configs (the dots in bf16, the path before
  ``_fp8_dot``, are in git history: ``benchmarks/results/issue13/h200_2026-11-23/tune_fp8.log``);
* paged decode (the KV-cache kernel, 16-token pages): bf16 pages, FP8 pages per tile config;
* dense prefill (16 heads, D 128, 16K tokens): bf16 K/V, FP8 K/V, descriptor
  (TMA) loads of FP8 tiles, then FP8 tile configs.

Every FP8 output is checked against the bf16 K/V output first (``bench_kernels.FP8_CHECK_TOL``).
Decode GB/s count the K/V bytes read (FP8: one byte per element).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_kernels import FP8_CHECK_TOL, bench, cu, flops, graph_us, rel

from attention_kernels import (
    decode,
    paged_decode,
    prefill,
    prefill_kernel,
    quantize_kv,
)
from attention_kernels.configs import DecodeConfig, PrefillConfig

DECODE_SHAPES = [(1, 4096), (1, 32768), (1, 131072), (16, 4096), (16, 32768), (64, 8192),
                 (128, 2048)]
DECODE_CONFIGS = [DecodeConfig(n, w, s) for n in (64, 128) for w in (4, 8) for s in (2, 3, 4)]
PREFILL_CONFIGS = [PrefillConfig(*c) for c in [
    (128, 128, 8, 3), (128, 128, 8, 4), (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4),
    (128, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4)]]


def conversion_ptx() -> dict[str, dict[str, int]]:
    """Conversion instructions in the sm_90 PTX of 256 e4m3 values to bf16 and to fp16."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def convert(X, Y, DT: tl.constexpr):
        o = tl.arange(0, 256)
        tl.store(Y + o, tl.load(X + o).to(DT))

    out = {}
    for name, ty, dt_ in (("bf16", "*bf16", tl.bfloat16), ("fp16", "*fp16", tl.float16)):
        src = ASTSource(fn=convert, signature={"X": "*fp8e4nv", "Y": ty, "DT": "constexpr"},
                        constexprs={"DT": dt_})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": 1}).asm["ptx"]
        counts: dict[str, int] = {}
        for m in re.finditer(r"^\s*(cvt\.[\w.]+)", ptx, re.M):
            if "e4m3" in m.group(1) or "bf16" in m.group(1):
                counts[m.group(1)] = counts.get(m.group(1), 0) + 1
        out[name] = counts
        print(f"e4m3 -> {name}, per 256 values (8 per thread x 32): {counts}")
    return out


def checked(fn, ref: torch.Tensor, label: str, measure) -> float:
    """``measure(fn)`` once ``fn``'s output matches ``ref`` (``FP8_CHECK_TOL``); NaN, and why,
    for a config that does not compile or misses."""
    try:
        err = rel(fn(), ref)
    except Exception as e:  # noqa: BLE001 - a config that does not compile: say so
        print(f"  {label}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
        return float("nan")
    if not err < FP8_CHECK_TOL:
        print(f"  {label}: check failed ({err:.3g})")
        return float("nan")
    return measure(fn)


def _with_flag(module, name: str, value: bool, fn):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        return fn()
    finally:
        setattr(module, name, old)


def decode_rows(quick: bool) -> list[dict]:
    rows = []
    heads, kv_heads, d = 32, 8, 128
    for b, ctx in DECODE_SHAPES[:3] if quick else DECODE_SHAPES:
        q = torch.randn(b, heads, d, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(b * ctx, kv_heads, d, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        cus = cu([ctx] * b)
        (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
        ref = decode(q, k, v, cus)
        row: dict = {"B": b, "ctx": ctx, "bf16_us": graph_us(lambda: decode(q, k, v, cus))}
        kv_bytes = 2 * k.numel()

        def fp8(cfg=None, q=q, k8=k8, v8=v8, ks=ks, vs=vs, cus=cus):
            return lambda: decode(q, k8, v8, cus, k_scale=ks, v_scale=vs, _config=cfg)

        for cfg in (None, *DECODE_CONFIGS):  # None: the default one
            label = "fp8" if cfg is None else f"cfg_{cfg.block_n}_{cfg.num_warps}_{cfg.num_stages}"
            row[f"{label}_us"] = checked(fp8(cfg), ref, label, graph_us)
        cfg_us = {k_: v_ for k_, v_ in row.items() if k_.startswith("cfg_")}
        best = min(cfg_us, key=lambda k_: cfg_us[k_] if cfg_us[k_] == cfg_us[k_] else 1e30)
        row["best_cfg"], row["best_cfg_us"] = best, cfg_us[best]
        print(f"decode B={b:<4} ctx={ctx:<7} bf16 {row['bf16_us']:7.1f} us "
              f"({2 * kv_bytes / row['bf16_us'] / 1e3:5.0f} GB/s) | fp8 {row['fp8_us']:7.1f} us "
              f"({kv_bytes / row['fp8_us'] / 1e3:5.0f} GB/s) | best {best} "
              f"{row['best_cfg_us']:7.1f} us -> {row['bf16_us'] / row['best_cfg_us']:.2f}x bf16")
        rows.append(row)
    return rows


PAGED_SHAPES = [(1, 32768), (16, 32768), (64, 8192), (128, 2048)]
PAGED_CONFIGS = [DecodeConfig(64, 4, 3), DecodeConfig(128, 4, 3), DecodeConfig(128, 4, 4),
                 DecodeConfig(128, 8, 3)]


def paged_rows(quick: bool, page_tokens: int = 16) -> list[dict]:
    """Paged decode (the KV-cache sessions' kernel), ``page_tokens`` per page, each sequence's
    pages in order: bf16 pages with the default config, FP8 pages with each config."""
    rows = []
    heads, kv_heads, d = 32, 8, 128
    for b, ctx in PAGED_SHAPES[:2] if quick else PAGED_SHAPES:
        per = ctx // page_tokens
        q = torch.randn(b, heads, d, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(b * per, page_tokens, kv_heads, d, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        table = torch.arange(b * per, dtype=torch.int32, device="cuda").view(b, per)
        lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
        ref = paged_decode(q, k, v, table, lens)
        row: dict = {"B": b, "ctx": ctx, "page_tokens": page_tokens,
                     "bf16_us": graph_us(lambda: paged_decode(q, k, v, table, lens))}
        for cfg in PAGED_CONFIGS:
            fn = (lambda cfg=cfg, q=q, k8=k8, v8=v8, table=table, lens=lens, ks=ks, vs=vs:
                  paged_decode(q, k8, v8, table, lens, k_scale=ks, v_scale=vs, _config=cfg))
            label = f"fp8_cfg_{cfg.block_n}_{cfg.num_warps}_{cfg.num_stages}"
            row[f"{label}_us"] = checked(fn, ref, label, graph_us)
        print(f"paged decode B={b:<4} ctx={ctx:<6} page {page_tokens}: bf16 "
              f"{row['bf16_us']:7.1f} us | fp8 " + " | ".join(
                  f"{k_[8:-3]} {v_:7.1f}" for k_, v_ in row.items() if k_.startswith("fp8_")))
        rows.append(row)
    return rows


def prefill_rows(quick: bool) -> list[dict]:
    rows = []
    heads, d = 16, 128
    for causal in (False, True):
        for n in (8192,) if quick else (4096, 8192):
            b = 16384 // n
            q, k, v = (torch.randn(b * n, heads, d, dtype=torch.bfloat16, device="cuda")
                       for _ in range(3))
            cus = cu([n] * b)
            fl = flops([n] * b, [n] * b, heads, d, causal)
            (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
            ref = prefill(q, k, v, cus, causal=causal)
            row: dict = {"N": n, "B": b, "causal": causal,
                         "bf16_TFLOPs": fl / bench(lambda: prefill(q, k, v, cus,
                                                                   causal=causal)) / 1e9}

            def fp8(cfg=None, q=q, k8=k8, v8=v8, ks=ks, vs=vs, cus=cus, causal=causal):
                return lambda: prefill(q, k8, v8, cus, causal=causal, k_scale=ks, v_scale=vs,
                                       _config=cfg)

            def timed(fn, label, ref=ref, fl=fl):
                return checked(fn, ref, label, lambda f: fl / bench(f) / 1e9)

            row["fp8_TFLOPs"] = timed(fp8(), "fp8")
            row["fp8_tma_TFLOPs"] = _with_flag(
                prefill_kernel, "TMA_FP8", True, lambda: timed(fp8(), "tma"))
            for cfg in PREFILL_CONFIGS:
                label = f"cfg_{cfg.block_m}_{cfg.block_n}_{cfg.num_warps}_{cfg.num_stages}"
                row[f"{label}_TFLOPs"] = timed(fp8(cfg), label)
                row[f"{label}_tma_TFLOPs"] = _with_flag(
                    prefill_kernel, "TMA_FP8", True, lambda cfg=cfg, label=label: timed(
                        fp8(cfg), label + "_tma"))
            cfgs = {k_: v_ for k_, v_ in row.items() if k_.startswith("cfg_")}
            best = max(cfgs, key=lambda k_: cfgs[k_] if cfgs[k_] == cfgs[k_] else -1.0)
            row["best_cfg"], row["best_cfg_TFLOPs"] = best, cfgs[best]
            print(f"prefill N={n:<6} causal={causal!s:<5} bf16 {row['bf16_TFLOPs']:6.1f} | "
                  f"fp8 {row['fp8_TFLOPs']:6.1f} | +TMA {row['fp8_tma_TFLOPs']:6.1f}"
                  f" | best {best} {row['best_cfg_TFLOPs']:6.1f} TFLOP/s")
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("tools/tuning/results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["decode", "paged", "prefill"], action="append",
                    help="run these parts only (repeatable; default: all)")
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    meta = {"command": "python tools/tuning/tune_fp8.py " + " ".join(sys.argv[1:]), "gpu": gpu,
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "torch": torch.__version__}
    print(json.dumps(meta))
    parts = {"decode": decode_rows, "paged": paged_rows, "prefill": prefill_rows}
    result: dict = {"meta": meta, "ptx": conversion_ptx()}
    for name, fn in parts.items():
        if not args.only or name in args.only:
            result[name] = fn(args.quick)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "_".join(args.only) if args.only else "all"
    path = args.out / f"tune_fp8_{tag}_{gpu.replace(' ', '_')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
