"""Sliding window, softcap and ALiBi in our kernels on a GPU: what the window skips, what the
logit modifiers cost.

    python benchmarks/bench_features.py [--out benchmarks/results] [--quick]
    TRITON_INTERPRET=1 python benchmarks/bench_features.py --smoke --out /tmp/x  # CPU, tiny (CI)

Rows (bf16, 32 q / 8 kv heads, D 128, one sequence):

* window prefill, causal, N = 8192 and 16384, left window full / 4096 / 1024 / 256: our time,
  TFLOP/s counted on the *visible* (query, key) pairs (``4 * pairs * H * D``), and the speedup
  over our full-causal run of the same N (the key blocks the window skips). Peers in the same
  run: ``torch.nn.attention.varlen.varlen_attn`` with ``window_size=(left, 0)`` (FlashAttention,
  which also skips), and SDPA with an explicit boolean ``[N, N]`` mask (memory-efficient or
  cuDNN backend; K/V heads expanded for it): a mask cannot skip anything, so SDPA does the
  full-causal work whatever the window, which is what an app without window support pays.
  Flex attention (a block mask would skip) is left out: it needs torch.compile on the host.
* softcap 50 and ALiBi (flash_attn's slopes ``2^(-8 (h+1) / H)``) at N 8192, causal: our time and
  the overhead over plain causal. No peer here takes either.
* decode, batch 1 and 16 x 32K cached keys, window 4096 vs full: GB/s on the K/V bytes the
  window makes visible (``min(ctx, left + 1)`` keys per sequence), GPU time from CUDA-graph
  replays (batch 1 is host-bound), and the speedup over the full context. Peer:
  ``varlen_attn`` with one query per sequence and the same window.

Every output is checked against a peer or the reference before it is timed (a failed check
aborts). Times are ``bench`` / ``graph_us`` of bench_kernels.py (do_bench medians, L2 cleared).
Writes ``features_<gpu>.json`` and ``features_<gpu>.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import CHECK_TOL, DTYPE, Timer, _varlen_attn_fn, rel

from attention_kernels import decode, decode_ref, prefill, prefill_ref
from attention_service.params import visible_pairs

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
PREFILL_NS = [8192, 16384]
WINDOWS = [-1, 4096, 1024, 256]  # left; -1: the whole causal prefix
OVERHEAD_N = 8192
SOFTCAP = 50.0
DECODE_SHAPES = [(1, 32768), (16, 32768)]  # (batch, cached keys)
DECODE_WINDOW = 4096
# --smoke: the same code paths on the CPU under TRITON_INTERPRET=1, on shapes it can run.
SMOKE = {"heads": 2, "kv_heads": 1, "head_dim": 32, "ns": [40], "windows": [-1, 8],
         "overhead_n": 24, "decode": [(2, 60)], "decode_window": 20}


def alibi_slopes(heads: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)],
                        dtype=torch.float32, device=device)


def window_mask(n: int, left: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[n, n]`` (True: attend) of a causal window of ``left`` keys back."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    keep = j <= i
    if left >= 0:
        keep &= j >= i - left
    return keep


def checked(name: str, got: torch.Tensor, want: torch.Tensor, row: dict) -> None:
    row[f"{name}_check_rel_err"] = rel(got, want)
    if not row[f"{name}_check_rel_err"] < CHECK_TOL:
        raise SystemExit(f"{name} check failed: {row}")


def try_peer(row: dict, name: str, fn: Callable[[], torch.Tensor], timer: Timer, work: float,
             unit: str, ours: torch.Tensor, reshape: Callable | None = None) -> None:
    """Time a peer into ``row[name_<unit>]`` after checking that it agrees with ``ours``
    (``<name>_check_rel_err``); a peer that cannot run this shape leaves its error in the row
    instead. A peer that runs but disagrees aborts the benchmark."""
    try:
        out = fn()
        checked(name, reshape(out) if reshape else out, ours, row)
        row[f"{name}_ms"] = timer.ms(fn)
        # work / ms: FLOPs -> TFLOP/s is / 1e9; bytes -> GB/s is / 1e6.
        row[f"{name}_{unit}"] = work / row[f"{name}_ms"] / (1e9 if unit == "TFLOPs" else 1e6)
    except (RuntimeError, TypeError) as e:
        row[f"{name}_{unit}"] = math.nan
        row[f"{name}_error"] = str(e).splitlines()[0][:160]
        print(f"  ({name}: {row[f'{name}_error']})")


def window_rows(ns: list[int], windows: list[int], heads: int, kv_heads: int, d: int,
                timer: Timer, device: torch.device) -> list[dict]:
    rows = []
    varlen_attn, has_gqa = _varlen_attn_fn() if device.type == "cuda" else (None, False)
    for n in ns:
        q = torch.randn(n, heads, d, dtype=DTYPE, device=device)
        k = torch.randn(n, kv_heads, d, dtype=DTYPE, device=device)
        v = torch.randn(n, kv_heads, d, dtype=DTYPE, device=device)
        cu = torch.tensor([0, n], dtype=torch.int32, device=device)
        group = heads // kv_heads
        # SDPA's dense layout, K/V heads expanded (the masked backends take no GQA).
        qd = q.transpose(0, 1)[None]
        kd, vd = (t.repeat_interleave(group, 1).transpose(0, 1)[None] for t in (k, v))
        full_ms = math.nan
        for left in windows:
            ws = (left, 0)
            pairs = visible_pairs([n], [n], True, (left, 0))
            work = 4.0 * pairs * heads * d
            ours = lambda: prefill(q, k, v, cu, max_seqlen_q=n, max_seqlen_k=n, causal=True,
                                   window_size=ws)
            got = ours()
            row = {"kind": "window", "N": n, "left": left, "H": heads, "Hkv": kv_heads, "D": d,
                   "visible_pairs": pairs}
            if varlen_attn is not None:
                kk, vv = (k, v) if has_gqa else (t.repeat_interleave(group, 1) for t in (k, v))
                extra = {"enable_gqa": True} if has_gqa else {}
                if not has_gqa:
                    row["varlen_note"] = "kv heads expanded (no enable_gqa)"
                peer = lambda: varlen_attn(q, kk, vv, cu, cu, n, n, window_size=ws, **extra)
                try_peer(row, "varlen", peer, timer, work, "TFLOPs", got)
            mask = window_mask(n, left, device)
            backends = ([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
                        if device.type == "cuda" else [SDPBackend.MATH])

            def sdpa_masked() -> torch.Tensor:
                with sdpa_kernel(backends):
                    return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask)

            try_peer(row, "sdpa_mask", sdpa_masked, timer, work, "TFLOPs", got,
                     reshape=lambda o: o[0].transpose(0, 1))
            if not any(key.endswith("_check_rel_err") for key in row):
                # No peer ran (so none checked ours): the reference, fp32 on the device.
                checked("ours", got, prefill_ref(q, k, v, cu, causal=True, window_size=ws), row)
            row["ours_ms"] = timer.ms(ours)
            row["ours_TFLOPs"] = work / row["ours_ms"] / 1e9
            if left == -1:
                full_ms = row["ours_ms"]
            row["speedup_vs_full_causal"] = full_ms / row["ours_ms"]
            rows.append(row)
            print_row(row)
    return rows


def overhead_rows(n: int, heads: int, kv_heads: int, d: int, timer: Timer,
                  device: torch.device) -> list[dict]:
    rows = []
    q = torch.randn(n, heads, d, dtype=DTYPE, device=device)
    k = torch.randn(n, kv_heads, d, dtype=DTYPE, device=device)
    v = torch.randn(n, kv_heads, d, dtype=DTYPE, device=device)
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    slopes = alibi_slopes(heads, device)
    work = 4.0 * visible_pairs([n], [n], True) * heads * d
    plain_ms = math.nan
    for name, feats in (("plain", {}), ("softcap", {"softcap": SOFTCAP}),
                        ("alibi", {"alibi_slopes": slopes}),
                        ("softcap+alibi", {"softcap": SOFTCAP, "alibi_slopes": slopes})):
        ours = lambda: prefill(q, k, v, cu, causal=True, **feats)
        row = {"kind": "overhead", "feature": name, "N": n, "H": heads, "Hkv": kv_heads, "D": d}
        # The reference on the GPU in fp32 (row chunks bound its memory).
        checked("ours", ours(), prefill_ref(q, k, v, cu, causal=True, **feats), row)
        row["ours_ms"] = timer.ms(ours)
        row["ours_TFLOPs"] = work / row["ours_ms"] / 1e9
        if name == "plain":
            plain_ms = row["ours_ms"]
        row["overhead_pct"] = 100.0 * (row["ours_ms"] / plain_ms - 1.0)
        rows.append(row)
        print_row(row)
    return rows


def decode_rows(shapes: list[tuple[int, int]], left: int, heads: int, kv_heads: int, d: int,
                timer: Timer, device: torch.device) -> list[dict]:
    rows = []
    varlen_attn, has_gqa = _varlen_attn_fn() if device.type == "cuda" else (None, False)
    for batch, ctx in shapes:
        q = torch.randn(batch, heads, d, dtype=DTYPE, device=device)
        k = torch.randn(batch * ctx, kv_heads, d, dtype=DTYPE, device=device)
        v = torch.randn(batch * ctx, kv_heads, d, dtype=DTYPE, device=device)
        cu_k = torch.arange(0, (batch + 1) * ctx, ctx, dtype=torch.int32, device=device)
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
        full_us = math.nan
        for win in (-1, left):
            ws = (win, -1)
            keys = ctx if win < 0 else min(ctx, win + 1)
            nbytes = 2.0 * batch * keys * kv_heads * d * k.element_size()
            ours = lambda: decode(q, k, v, cu_k, max_seqlen_k=ctx, window_size=ws)
            got = ours()
            row = {"kind": "decode", "B": batch, "ctx": ctx, "left": win, "H": heads,
                   "Hkv": kv_heads, "D": d, "bytes_visible": nbytes}
            if varlen_attn is not None:
                kk, vv = (k, v) if has_gqa else (t.repeat_interleave(heads // kv_heads, 1)
                                                 for t in (k, v))
                extra = {"enable_gqa": True} if has_gqa else {}
                peer = lambda: varlen_attn(q, kk, vv, cu_q, cu_k, 1, ctx,
                                           window_size=(win, 0), **extra)
                try_peer(row, "varlen", peer, timer, nbytes, "GBps", got)
                if not math.isnan(row["varlen_GBps"]):
                    row["varlen_graph_us"] = timer.graph_us(peer)
                    row["varlen_gpu_GBps"] = nbytes / row["varlen_graph_us"] / 1e3
            if "varlen_check_rel_err" not in row:
                checked("ours", got, decode_ref(q, k, v, cu_k, window_size=ws), row)
            row["ours_ms"] = timer.ms(ours)
            row["ours_GBps"] = nbytes / row["ours_ms"] / 1e6
            row["ours_graph_us"] = timer.graph_us(ours)
            row["ours_gpu_GBps"] = nbytes / row["ours_graph_us"] / 1e3
            if win < 0:
                full_us = row["ours_graph_us"] if not timer.smoke else row["ours_ms"] * 1e3
            now_us = row["ours_graph_us"] if not timer.smoke else row["ours_ms"] * 1e3
            row["speedup_vs_full"] = full_us / now_us
            rows.append(row)
            print_row(row)
    return rows


def print_row(row: dict) -> None:
    nan = math.nan
    if row["kind"] == "window":
        print(f"window N={row['N']:<6d} left={row['left']:<5d} ours {row['ours_ms']:8.3f} ms "
              f"{row['ours_TFLOPs']:6.1f} TFLOP/s (visible) | x{row['speedup_vs_full_causal']:5.2f}"
              f" vs full causal | varlen_attn {row.get('varlen_TFLOPs', nan):6.1f} | SDPA mask "
              f"{row.get('sdpa_mask_TFLOPs', nan):6.1f}", flush=True)
    elif row["kind"] == "overhead":
        print(f"logits N={row['N']:<6d} {row['feature']:<14} ours {row['ours_ms']:8.3f} ms "
              f"{row['ours_TFLOPs']:6.1f} TFLOP/s | overhead {row['overhead_pct']:+6.1f}%",
              flush=True)
    else:
        print(f"decode B={row['B']:<3d} ctx={row['ctx']:<6d} left={row['left']:<5d} ours "
              f"{row['ours_GBps']:7.0f} GB/s per call, {row['ours_gpu_GBps']:7.0f} GPU (visible)"
              f" | GPU {row['ours_graph_us']:7.1f} us | "
              f"x{row['speedup_vs_full']:5.2f} vs full | varlen_attn "
              f"{row.get('varlen_GBps', nan):7.0f} GB/s, GPU {row.get('varlen_graph_us', nan):7.1f}"
              " us", flush=True)


def markdown(rows: list[dict], meta: dict) -> str:
    def f(x: object, digits: int = 0) -> str:
        return "-" if not isinstance(x, (int, float)) or math.isnan(x) else f"{x:.{digits}f}"

    def left(r: dict) -> str:
        return "full" if r["left"] < 0 else str(r["left"])

    h, hkv, d = meta["heads"], meta["kv_heads"], meta["head_dim"]
    lines = [f"# Sliding window, softcap, ALiBi: {meta['gpu']} ({meta['date']})", "",
             f"`{meta['command']}`; torch {meta['torch']}, triton {meta['triton']}. bf16, "
             f"{h} q / {hkv} kv heads, D {d}, one sequence.", "",
             "## Causal prefill with a left window: TFLOP/s of visible pairs", "",
             "SDPA with a mask cannot skip masked blocks: its time is the full-causal one "
             "whatever the window.", "",
             "| N | left | ours ms | ours TFLOP/s | speedup vs our full causal | varlen_attn "
             "TFLOP/s | SDPA mask TFLOP/s | ours / varlen_attn |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "window":
            lines.append(f"| {r['N']} | {left(r)} | {f(r['ours_ms'], 3)} | "
                         f"{f(r['ours_TFLOPs'], 1)} | {f(r['speedup_vs_full_causal'], 2)} | "
                         f"{f(r.get('varlen_TFLOPs', math.nan), 1)} | "
                         f"{f(r.get('sdpa_mask_TFLOPs', math.nan), 1)} | "
                         f"{f(r['ours_TFLOPs'] / r.get('varlen_TFLOPs', math.nan), 2)} |")
    lines += ["", f"## Logit modifiers, causal prefill (softcap {SOFTCAP:g}, ALiBi slopes "
              "2^(-8(h+1)/H))", "",
              "| N | feature | ours ms | TFLOP/s | overhead vs plain |", "|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "overhead":
            lines.append(f"| {r['N']} | {r['feature']} | {f(r['ours_ms'], 3)} | "
                         f"{f(r['ours_TFLOPs'], 1)} | {f(r['overhead_pct'], 1)}% |")
    lines += ["", "## Decode with a left window: GB/s of the visible K/V bytes", "",
              "Per call: do_bench time of one Python call (launch path included); GPU: a CUDA "
              "graph replay of the same call.", "",
              "| B | ctx | left | ours GB/s per call | ours GB/s GPU | ours GPU us | speedup vs "
              "full (GPU) | varlen_attn GB/s per call | varlen_attn GB/s GPU | varlen_attn GPU us "
              "| ours / varlen_attn (GPU) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "decode":
            vg = r.get("varlen_graph_us", math.nan)
            lines.append(f"| {r['B']} | {r['ctx']} | {left(r)} | {f(r['ours_GBps'])} | "
                         f"{f(r.get('ours_gpu_GBps', math.nan))} | "
                         f"{f(r['ours_graph_us'], 1)} | {f(r['speedup_vs_full'], 2)} | "
                         f"{f(r.get('varlen_GBps', math.nan))} | "
                         f"{f(r.get('varlen_gpu_GBps', math.nan))} | {f(vg, 1)} | "
                         f"{f(vg / r['ours_graph_us'], 2)} |")
    errors = [f"- {r['kind']} {r.get('N', r.get('B'))} {r.get('left', '')}: {k}: {v}"
              for r in rows for k, v in r.items() if k.endswith("_error")]
    if errors:
        lines += ["", "Peers that did not run:", "", *errors]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for JSON/markdown")
    parser.add_argument("--quick", action="store_true", help="N 8192 only, batch-1 decode only")
    parser.add_argument("--only", choices=["window", "overhead", "decode"], action="append")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU (needs TRITON_INTERPRET=1): checks the "
                             "script, times nothing meaningful")
    args = parser.parse_args()
    if args.smoke:
        from attention_kernels.configs import interpreting

        if not interpreting():
            raise SystemExit("--smoke runs the kernels on the CPU: set TRITON_INTERPRET=1")
        device, gpu = torch.device("cpu"), "cpu-interpreter"
        heads, kv_heads, d = SMOKE["heads"], SMOKE["kv_heads"], SMOKE["head_dim"]
        ns, windows, overhead_n = SMOKE["ns"], SMOKE["windows"], SMOKE["overhead_n"]
        decode_shapes, decode_window = SMOKE["decode"], SMOKE["decode_window"]
    elif not torch.cuda.is_available():
        raise SystemExit("bench_features.py needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    else:
        device, gpu = torch.device("cuda"), torch.cuda.get_device_name()
        heads, kv_heads, d = HEADS, KV_HEADS, HEAD_DIM
        ns, windows, overhead_n = PREFILL_NS[:1] if args.quick else PREFILL_NS, WINDOWS, OVERHEAD_N
        decode_shapes = DECODE_SHAPES[:1] if args.quick else DECODE_SHAPES
        decode_window = DECODE_WINDOW
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": " ".join(["python", *sys.argv]), "gpu": gpu, "smoke": args.smoke,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "triton": triton.__version__,
        "heads": heads, "kv_heads": kv_heads, "head_dim": d,
    }
    print(json.dumps(meta), flush=True)
    timer = Timer(args.smoke)
    only = set(args.only or ["window", "overhead", "decode"])
    rows: list[dict] = []
    if "window" in only:
        rows += window_rows(ns, windows, heads, kv_heads, d, timer, device)
    if "overhead" in only:
        rows += overhead_rows(overhead_n, heads, kv_heads, d, timer, device)
    if "decode" in only:
        rows += decode_rows(decode_shapes, decode_window, heads, kv_heads, d, timer, device)
    stamp = f"features_{gpu.replace(' ', '_')}"
    (out / f"{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / f"{stamp}.md").write_text(markdown(rows, meta))
    print(f"wrote {out}/{stamp}.{{json,md}}")


if __name__ == "__main__":
    main()
