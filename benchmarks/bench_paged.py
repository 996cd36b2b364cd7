"""Paged-KV kernel benchmark on a GPU: paged_decode / paged_prefill against our contiguous kernels.

    python benchmarks/bench_paged.py [--out benchmarks/results] [--page-tokens 16,64] [--quick]
    TRITON_INTERPRET=1 python benchmarks/bench_paged.py --smoke --out /tmp/x  # CPU, tiny (CI)

The pages are laid out as the server's pool lays them out: one byte pool cut into pages of
``page_tokens`` tokens (rounded up to 256 bytes), K then V in each page as ``as_strided`` views,
pages handed to sequences in shuffled order. The same keys, packed, feed the peers:

* decode (32 q / 8 kv heads, D 128 and one D 64 row, bf16, one query per sequence): our
  contiguous ``decode`` and SDPA cuDNN with ``enable_gqa`` on dense ``[B, H_kv, L, D]`` caches
  (as in bench_kernels.py). GB/s count the K and V bytes read.
* prefill (causal, bottom-right aligned): 4 sequences of 512 new queries over 4K cached keys
  (plus themselves), and 1 x 16K; against our contiguous ``prefill``. TFLOP/s count the visible
  (query, key) pairs exactly: ``4 * pairs * H * D``.

Times are triton.testing.do_bench medians (``bench`` of bench_kernels.py: L2 cleared, CUDA
events), plus the GPU time alone from CUDA-graph replays (``*_graph_us``) since the smallest
decode shapes are host-bound, and with a cold L2 (``*_cold_us``: rotating copies of the
inputs; one replayed call reads a small cache from L2). Every paged output is checked against
the contiguous kernel before it is timed. Writes ``paged_<gpu>.json`` and ``paged_<gpu>.md``
into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import math
import os
import sys
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import CHECK_TOL, DTYPE, Timer, rel, sdpa

from attention_kernels import decode, paged_decode, paged_prefill, prefill
from attention_service.params import causal_pairs

HEADS, KV_HEADS = 32, 8
DECODE_SHAPES = [(1, 4096, 128), (1, 32768, 128), (8, 8192, 128), (64, 8192, 128),
                 (128, 2048, 128), (8, 8192, 64)]  # (batch, context, head dim)
# (name, query lengths, key lengths): keys include the new queries (appended before the call).
PREFILL_CASES = [("4x(4K cached + 512 new)", [512] * 4, [4096 + 512] * 4),
                 ("1x16K", [16384], [16384])]
# --smoke: the same code paths on the CPU under TRITON_INTERPRET=1, on shapes it can run.
SMOKE_HEADS, SMOKE_KV_HEADS = 4, 2
SMOKE_DECODE = [(2, 40, 64), (1, 100, 32)]
SMOKE_PREFILL = [("2x(32 cached + 8 new)", [8] * 2, [40] * 2), ("1x48", [48], [48])]
PAGE_ALIGN = 256


def page_order(num_pages: int, page_bytes: int, order: str,
               gen: torch.Generator) -> torch.Tensor:
    """The pool's pages in the order sequences take them: ``shuffled`` (any page anywhere, as
    a pool long in use hands them out), ``sequential``, or ``runs`` (runs of 2 MiB of
    consecutive pages, the runs shuffled)."""
    if order == "sequential":
        return torch.arange(num_pages, dtype=torch.int32)
    if order == "shuffled":
        return torch.randperm(num_pages, generator=gen).to(torch.int32)
    run = max(1, (2 << 20) // page_bytes)
    starts = torch.randperm(triton.cdiv(num_pages, run), generator=gen) * run
    ids = (starts[:, None] + torch.arange(run)[None, :]).flatten()
    return ids[ids < num_pages].to(torch.int32)


def paged_copy(k: torch.Tensor, v: torch.Tensor, lens: list[int], page_tokens: int,
               gen: torch.Generator, like: tuple[torch.Tensor, torch.Tensor] | None = None,
               order: str = "shuffled",
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``k, v [total, H_kv, D]`` packed by ``lens`` copied into a page pool laid out as the
    server's (K then V in each page, the page rounded up to 256 bytes), pages taken in
    ``order`` (``page_order``). Returns ``(k_pages, v_pages, block_table, seqlens_k)``.
    ``like``: an earlier call's ``(block_table, seqlens_k)``, returned again with a pool of
    their layout (another layer's cache)."""
    _, kv_heads, d = k.shape
    row, itemsize = kv_heads * d, k.element_size()
    page_bytes = triton.cdiv(2 * page_tokens * row * itemsize, PAGE_ALIGN) * PAGE_ALIGN
    per_seq = [triton.cdiv(n, page_tokens) for n in lens]
    num_pages = sum(per_seq)
    typed = torch.empty(num_pages * page_bytes, dtype=torch.uint8, device=k.device).view(k.dtype)
    shape = (num_pages, page_tokens, kv_heads, d)
    strides = (page_bytes // itemsize, row, d, 1)
    k_pages = typed.as_strided(shape, strides, 0)
    v_pages = typed.as_strided(shape, strides, page_tokens * row)
    if like is None:
        perm = page_order(num_pages, page_bytes, order, gen)
        table = torch.full((len(lens), max(per_seq)), -1, dtype=torch.int32)
        first = 0
        for b, n in enumerate(per_seq):
            table[b, :n] = perm[first : first + n]
            first += n
        table = table.to(k.device)
        seqlens = torch.tensor(lens, dtype=torch.int32, device=k.device)
    else:
        table, seqlens = like
    # Scatter each key to (page, slot): one indexed copy per tensor.
    seq = torch.repeat_interleave(torch.arange(len(lens), device=k.device), seqlens.long())
    starts = torch.cumsum(seqlens.long(), 0) - seqlens.long()
    pos = torch.arange(k.shape[0], device=k.device) - starts[seq]
    page, slot = table[seq, pos // page_tokens].long(), pos % page_tokens
    k_pages[page, slot] = k
    v_pages[page, slot] = v
    return k_pages, v_pages, table, seqlens


def cu(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


def decode_rows(shapes: list[tuple[int, int, int]], page_sizes: list[int], heads: int,
                kv_heads: int, timer: Timer, device: torch.device,
                orders: tuple[str, ...] = ("shuffled",)) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for batch, ctx, d in shapes:
        q = torch.randn(batch, heads, d, dtype=DTYPE, device=device)
        k = torch.randn(batch * ctx, kv_heads, d, dtype=DTYPE, device=device)
        v = torch.randn(batch * ctx, kv_heads, d, dtype=DTYPE, device=device)
        lens = [ctx] * batch
        cus = cu(lens, device)
        nbytes = 2 * k.numel() * k.element_size()
        contiguous = lambda: decode(q, k, v, cus, max_seqlen_k=ctx)
        want = contiguous()
        base = {"kind": "decode", "B": batch, "ctx": ctx, "H": heads, "Hkv": kv_heads, "D": d,
                "contiguous_GBps": nbytes / timer.ms(contiguous) / 1e6,
                "contiguous_graph_us": timer.graph_us(contiguous),
                "contiguous_cold_us": timer.cold_us(
                    lambda: functools.partial(decode, q, k.clone(), v.clone(), cus,
                                              max_seqlen_k=ctx),
                    nbytes)}
        if not timer.smoke:  # SDPA cuDNN on dense [B, H_kv, L, D] caches, as bench_kernels
            qd = q[:, :, None, :]
            kd, vd = (t.view(batch, ctx, kv_heads, d).transpose(1, 2).contiguous()
                      for t in (k, v))
            try:
                fn = sdpa(SDPBackend.CUDNN_ATTENTION, qd, kd, vd, False, gqa=True)
                base["cudnn_check_rel_err"] = rel(fn()[:, :, 0, :], want)
                if not base["cudnn_check_rel_err"] < CHECK_TOL:
                    raise SystemExit(f"decode check against cuDNN failed: {base}")
                base["cudnn_GBps"] = nbytes / timer.ms(fn) / 1e6
                base["cudnn_graph_us"] = timer.graph_us(fn)
                base["cudnn_cold_us"] = timer.cold_us(
                    lambda: sdpa(SDPBackend.CUDNN_ATTENTION, qd, kd.clone(), vd.clone(),
                                 False, gqa=True), nbytes)
            except RuntimeError as e:  # backend unavailable for this shape
                base["cudnn_error"] = str(e).splitlines()[0][:120]
            del kd, vd
        for page_tokens, order in ((p, o) for p in page_sizes for o in orders):
            k_pages, v_pages, table, seqlens = paged_copy(k, v, lens, page_tokens, gen,
                                                          order=order)
            paged = lambda: paged_decode(q, k_pages, v_pages, table, seqlens, max_seqlen_k=ctx)
            row = {**base, "page_tokens": page_tokens, "order": order,
                   "check_rel_err": rel(paged(), want)}
            if not row["check_rel_err"] < CHECK_TOL:
                raise SystemExit(f"paged decode check failed: {row}")
            row["paged_GBps"] = nbytes / timer.ms(paged) / 1e6
            row["paged_graph_us"] = timer.graph_us(paged)
            row["paged_cold_us"] = timer.cold_us(  # pools of other layers, one block table
                lambda pt=page_tokens, meta=(table, seqlens): functools.partial(
                    paged_decode, q, *paged_copy(k, v, lens, pt, gen, meta), max_seqlen_k=ctx),
                nbytes)
            row["paged_over_contiguous_cold"] = row["contiguous_cold_us"] / row["paged_cold_us"]
            row["paged_over_cudnn_cold"] = (row.get("cudnn_cold_us", math.nan)
                                            / row["paged_cold_us"])
            row["paged_over_contiguous"] = row["paged_GBps"] / row["contiguous_GBps"]
            row["paged_over_cudnn"] = row["paged_GBps"] / row.get("cudnn_GBps", math.nan)
            # The same ratios from GPU time alone (the small shapes' do_bench is host-bound).
            row["paged_over_contiguous_graph"] = row["contiguous_graph_us"] / row["paged_graph_us"]
            row["paged_over_cudnn_graph"] = (row.get("cudnn_graph_us", math.nan)
                                             / row["paged_graph_us"])
            rows.append(row)
            print_row(row)
    return rows


def prefill_rows(cases: list[tuple[str, list[int], list[int]]], page_sizes: list[int],
                 heads: int, kv_heads: int, d: int, timer: Timer,
                 device: torch.device) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(1)
    for name, lens_q, lens_k in cases:
        q = torch.randn(sum(lens_q), heads, d, dtype=DTYPE, device=device)
        k = torch.randn(sum(lens_k), kv_heads, d, dtype=DTYPE, device=device)
        v = torch.randn(sum(lens_k), kv_heads, d, dtype=DTYPE, device=device)
        cu_q, cu_k = cu(lens_q, device), cu(lens_k, device)
        fl = 4.0 * sum(causal_pairs(lq, lk) for lq, lk in zip(lens_q, lens_k, strict=True))
        fl *= heads * d
        contiguous = lambda: prefill(q, k, v, cu_q, cu_k, causal=True)
        want = contiguous()
        base = {"kind": "prefill", "case": name, "H": heads, "Hkv": kv_heads, "D": d,
                "causal": True, "contiguous_TFLOPs": fl / timer.ms(contiguous) / 1e9,
                "contiguous_graph_us": timer.graph_us(contiguous)}
        # The contiguous kernel takes TMA descriptor loads at these sizes (D 128 on Hopper); the
        # paged one cannot (pages are not one tensor): also time contiguous without them.
        os.environ["ATTENTION_KERNELS_TMA"] = "0"
        try:
            base["contiguous_noTMA_TFLOPs"] = fl / timer.ms(contiguous) / 1e9
        finally:
            os.environ.pop("ATTENTION_KERNELS_TMA")
        for page_tokens in page_sizes:
            k_pages, v_pages, table, seqlens = paged_copy(k, v, lens_k, page_tokens, gen)
            paged = lambda: paged_prefill(q, k_pages, v_pages, table, cu_q, seqlens,
                                          max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                                          causal=True)
            row = {**base, "page_tokens": page_tokens, "check_rel_err": rel(paged(), want)}
            if not row["check_rel_err"] < CHECK_TOL:
                raise SystemExit(f"paged prefill check failed: {row}")
            row["paged_TFLOPs"] = fl / timer.ms(paged) / 1e9
            row["paged_graph_us"] = timer.graph_us(paged)
            row["paged_over_contiguous"] = row["paged_TFLOPs"] / row["contiguous_TFLOPs"]
            row["paged_over_contiguous_noTMA"] = (row["paged_TFLOPs"]
                                                  / base["contiguous_noTMA_TFLOPs"])
            rows.append(row)
            print_row(row)
    return rows


def print_row(row: dict) -> None:
    if row["kind"] == "decode":
        print(f"decode B={row['B']:<4d} ctx={row['ctx']:<6d} D={row['D']:<3d} "
              f"page={row['page_tokens']:<3d} {row['order']:<10} paged "
              f"{row['paged_GBps']:7.0f} GB/s | contiguous "
              f"{row['contiguous_GBps']:7.0f} | cudnn {row.get('cudnn_GBps', math.nan):7.0f} | "
              f"paged/contig {row['paged_over_contiguous']:5.2f} | paged/cudnn "
              f"{row['paged_over_cudnn']:5.2f} | GPU time (graph) us paged "
              f"{row['paged_graph_us']:6.1f} contig {row['contiguous_graph_us']:6.1f} cudnn "
              f"{row.get('cudnn_graph_us', math.nan):6.1f} -> paged/contig "
              f"{row['paged_over_contiguous_graph']:5.2f} | cold L2 us paged "
              f"{row['paged_cold_us']:6.1f} contig {row['contiguous_cold_us']:6.1f} cudnn "
              f"{row.get('cudnn_cold_us', math.nan):6.1f} -> paged/contig "
              f"{row['paged_over_contiguous_cold']:5.2f}", flush=True)
    else:
        print(f"prefill {row['case']:<24} page={row['page_tokens']:<3d} paged "
              f"{row['paged_TFLOPs']:6.1f} TFLOP/s | contiguous {row['contiguous_TFLOPs']:6.1f} "
              f"| no TMA {row['contiguous_noTMA_TFLOPs']:6.1f} | paged/contig "
              f"{row['paged_over_contiguous']:5.2f} | paged/contig no TMA "
              f"{row['paged_over_contiguous_noTMA']:5.2f}", flush=True)


def markdown(rows: list[dict], meta: dict) -> str:
    def f(x: object, digits: int = 0) -> str:
        return "-" if not isinstance(x, float) or math.isnan(x) else f"{x:.{digits}f}"

    lines = [f"# Paged KV kernels, {meta['gpu']} ({meta['date']})", "",
             f"`{meta['command']}`; torch {meta['torch']}, triton {meta['triton']}.", "",
             f"## Decode ({HEADS if not meta['smoke'] else SMOKE_HEADS} q / "
             f"{KV_HEADS if not meta['smoke'] else SMOKE_KV_HEADS} kv heads, bf16): GB/s of "
             "K+V read (do_bench median)", "",
             "| B | ctx | D | page | pages taken | paged | contiguous | cuDNN | paged/contig "
             "| paged/cuDNN "
             "| GPU us paged | GPU us contig | GPU us cuDNN | paged/contig (GPU) "
             "| paged/cuDNN (GPU) | cold us paged | cold us contig | cold us cuDNN "
             "| paged/contig (cold) | paged/cuDNN (cold) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "decode":
            lines.append(
                f"| {r['B']} | {r['ctx']} | {r['D']} | {r['page_tokens']} | {r['order']} | "
                f"{f(r['paged_GBps'])} | {f(r['contiguous_GBps'])} | "
                f"{f(r.get('cudnn_GBps', math.nan))} | {f(r['paged_over_contiguous'], 2)} | "
                f"{f(r['paged_over_cudnn'], 2)} | {f(r['paged_graph_us'], 1)} | "
                f"{f(r['contiguous_graph_us'], 1)} | {f(r.get('cudnn_graph_us', math.nan), 1)} "
                f"| {f(r['paged_over_contiguous_graph'], 2)} | "
                f"{f(r['paged_over_cudnn_graph'], 2)} | {f(r['paged_cold_us'], 1)} | "
                f"{f(r['contiguous_cold_us'], 1)} | {f(r.get('cudnn_cold_us', math.nan), 1)} | "
                f"{f(r['paged_over_contiguous_cold'], 2)} | "
                f"{f(r['paged_over_cudnn_cold'], 2)} |")
    lines += ["", "GPU us: CUDA-graph replays (no host time) of one call, its inputs in L2 "
              "where they fit; cold: the same over rotating copies of the inputs (a model's "
              "decode, layer after layer, reads from HBM). Ratios > 1: paged faster.", "",
              "## Prefill (causal, bottom-right): TFLOP/s of visible pairs", "",
              "| case | D | page | paged | contiguous | contiguous no TMA | paged/contig "
              "| paged/contig no TMA |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "prefill":
            lines.append(f"| {r['case']} | {r['D']} | {r['page_tokens']} | "
                         f"{f(r['paged_TFLOPs'], 1)} | {f(r['contiguous_TFLOPs'], 1)} | "
                         f"{f(r['contiguous_noTMA_TFLOPs'], 1)} | "
                         f"{f(r['paged_over_contiguous'], 2)} | "
                         f"{f(r['paged_over_contiguous_noTMA'], 2)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for JSON/markdown")
    parser.add_argument("--page-tokens", default="16,64",
                        help="comma-separated page sizes in tokens (default 16,64)")
    parser.add_argument("--quick", action="store_true", help="first three decode shapes only")
    parser.add_argument("--page-order", default="shuffled",
                        help="decode: the order sequences take the pool's pages in, comma-"
                             "separated: shuffled (default; a pool long in use), sequential, "
                             "runs (2 MiB runs of consecutive pages, the runs shuffled)")
    parser.add_argument("--shapes", default="",
                        help="decode shapes B:ctx:D, comma-separated (default: the six above)")
    parser.add_argument("--only", choices=["decode", "prefill"], action="append")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU (needs TRITON_INTERPRET=1): checks the "
                             "script, times nothing meaningful")
    args = parser.parse_args()
    page_sizes = [int(p) for p in args.page_tokens.split(",") if p]
    orders = tuple(x for x in args.page_order.split(",") if x)
    if not orders or set(orders) - {"shuffled", "sequential", "runs"}:
        parser.error("--page-order takes shuffled, sequential and/or runs")
    if not page_sizes or min(page_sizes) < 1:
        parser.error("--page-tokens needs positive integers")
    if args.smoke:
        from attention_kernels.configs import interpreting

        if not interpreting():
            raise SystemExit("--smoke runs the kernels on the CPU: set TRITON_INTERPRET=1")
        device = torch.device("cpu")
        gpu = "cpu-interpreter"
    elif not torch.cuda.is_available():
        raise SystemExit("bench_paged.py needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    else:
        device = torch.device("cuda")
        gpu = torch.cuda.get_device_name()
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": " ".join(["python", *sys.argv]), "gpu": gpu, "smoke": args.smoke,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "triton": triton.__version__,
        "page_tokens": page_sizes,
    }
    print(json.dumps(meta), flush=True)
    timer = Timer(args.smoke)
    heads, kv_heads = (SMOKE_HEADS, SMOKE_KV_HEADS) if args.smoke else (HEADS, KV_HEADS)
    only = set(args.only or ["decode", "prefill"])
    rows: list[dict] = []
    if "decode" in only:
        shapes = SMOKE_DECODE if args.smoke else DECODE_SHAPES[: 3 if args.quick else None]
        if args.shapes:
            shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")]
        rows += decode_rows(shapes, page_sizes, heads, kv_heads, timer, device, orders)
    if "prefill" in only:
        cases = SMOKE_PREFILL if args.smoke else PREFILL_CASES
        rows += prefill_rows(cases, page_sizes, heads, kv_heads, 64 if args.smoke else 128,
                             timer, device)
    stamp = f"paged_{gpu.replace(' ', '_')}"
    (out / f"{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / f"{stamp}.md").write_text(markdown(rows, meta))
    print(f"wrote {out}/{stamp}.{{json,md}}")


if __name__ == "__main__":
    main()
