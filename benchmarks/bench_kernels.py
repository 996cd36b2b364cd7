"""Kernel benchmark on a GPU: our Triton prefill/decode against the kernels users would pick.

    python benchmarks/bench_kernels.py [--out benchmarks/results] [--quick]

Peers, measured in the same run:
* prefill, dense bf16 ``[B, H, N, D]``: torch SDPA with the FLASH (FlashAttention-2) and CUDNN
  backends; ours runs on the same data packed as ``[B*N, H, D]`` with equal-length cu_seqlens.
* prefill, packed varlen batches (16 q / 8 kv heads, D 128): ``torch.nn.attention.varlen
  .varlen_attn`` (causal via ``window_size=(-1, 0)``).
* decode (32 q / 8 kv heads, D 128, bf16, one query token): SDPA CUDNN and FLASH with
  ``enable_gqa=True`` on dense ``[B, H, L, D]`` caches; ours reads the same bytes packed.
* ceilings: device-to-device copy bandwidth (read + write bytes) and an 8192^3 bf16 matmul.
* FP8 K/V (``quantize_kv``: e4m3 with per-kv-head scales, bf16 queries): ours again on the
  same data quantized, decode GB/s counting the FP8 bytes read (half), dense prefill at D 64
  and 128.

Varlen and decode rows also give the GPU time alone (``*_graph_us``: the launches replayed from
a CUDA graph), since at their smallest shapes the host's launch cost exceeds the kernel's. A
replay repeats one call on the same inputs, so a small decode reads its cache from L2 there;
decode rows add ``*_cold_us``, the GPU time over rotating copies of the inputs (``COLD_BYTES``),
which is what a model's decode sees layer after layer.

``--only fp8``: FP8 queries, keys and values (``quantize_queries`` / ``quantize_kv``: e4m3
with per-kv-head scales, FlashAttention-3's descale convention), dense D 128 and 64, against
our bf16 prefill and SDPA cuDNN on the same (unquantized) data in the same run, and one
accuracy row: RMSE and max error against a float64 reference on FlashAttention-3's test
distribution, beside quantizing Q/K/V alone and FlashAttention-3's published RMSE.

``--only headdim``: head dims that are not multiples of 16 (issue 65's list) against the next
multiple of 16 on the same shapes, ours both sides: a varlen causal prefill (4 x 4096 tokens,
16 q / 8 kv heads) and decodes from 1 x 16384 to 128 x 2048 (32 q / 8 kv heads,
``HEAD_DIM_DECODES``), GPU time from a CUDA graph, and the ratios (the target: within
1.15x). Each dim is checked against the float64 reference first: a small prefill, a small
decode and one of 2 x 16384 keys (the span route's). The JSON is rewritten after each dim,
marked ``unfinished`` until the run ends, so a run cut short keeps the dims it finished.

Prefill TFLOP/s count ``4 * Lq * Lk * H * D`` per sequence, halved for causal. Decode GB/s
count the K and V bytes read. Every kernel output is checked against a peer (or the reference)
before it is timed; a failed check aborts the row. Writes CSV, JSON and a PNG plot.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import inspect
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention_kernels import decode, for_cuda_graphs, prefill, prefill_ref, quantize_kv
from attention_kernels.fp8 import dequantize_kv, dequantize_queries, quantize_queries

DTYPE = torch.bfloat16
CHECK_TOL = 2e-2  # relative-norm agreement with the peer (both bf16, different summation order)
# FP8 K/V against the bf16 peer: e4m3 rounding of K and V (tests/kernels/test_fp8.py: 0.03-0.04)
FP8_CHECK_TOL = 6e-2
# FP8 Q/K/V (P in e4m3 too) against the bf16 peer: 0.048-0.055 measured (H200, 2026-11-30).
FP8_QKV_CHECK_TOL = 8e-2
# FlashAttention-3's FP8 accuracy (arXiv 2407.08608, section 4.3; "2.6x lower numerical error"
# in its abstract): RMSE against an exact reference, Q/K/V entries N(0, 1) with 0.1% outliers
# N(0, 10).
FA3_FP8_RMSE = {"baseline FP8 (per-tensor scales)": 2.4e-2,
                "FlashAttention-3 FP8 (block quantization, incoherent processing)": 9.1e-3}


def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds; do_bench clears L2 between runs and times with CUDA events."""
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def for_graphs(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` as a CUDA-graph user calls it: under ``for_cuda_graphs()`` (on Hopper the split
    decode merges in a PDL kernel, not in the split kernel as eager calls do)."""

    def run() -> object:
        with for_cuda_graphs():
            return fn()

    return run


def graph_us(fn: Callable[[], object]) -> float:
    """GPU time alone, in microseconds: the launches replayed from a CUDA graph (no host cost).
    Small launches (decode at batch 1, varlen of a few hundred tokens) run for 10-30 us while a
    Python launch costs 50-130 us on the benchmark VM, so ``bench`` there times the host.

    Synchronizes first: ``do_bench_cudagraph`` captures and replays on a stream of its own,
    which does not wait for this stream's work (inputs just made, a previous shape's buffers
    being reused). Without it a tune_fp8 run hit an illegal address in the first graph of a new
    shape (H200, 2026-11-23; under CUDA_LAUNCH_BLOCKING=1, and eagerly, every output matched).

    Our calls run under ``for_cuda_graphs()`` (``for_graphs``); it changes nothing for the
    peers."""
    torch.cuda.synchronize()
    try:
        return triton.testing.do_bench_cudagraph(for_graphs(fn), rep=100,
                                                 return_mode="median") * 1e3
    except Exception as e:  # a peer that cannot be captured: say so, keep the row
        print(f"  (no CUDA graph: {type(e).__name__}: {str(e).splitlines()[0][:80]})")
        return float("nan")


# Bytes of inputs a cold-L2 timing cycles through: several times the L2 (50 MB on an H100).
COLD_BYTES = 256 << 20
MAX_COLD_SETS = 32


def cold_set_count(nbytes: int) -> int:
    """How many input sets of ``nbytes`` a cold-L2 timing cycles through (``COLD_BYTES``)."""
    return max(1, min(MAX_COLD_SETS, -(-COLD_BYTES // max(1, nbytes))))


def graph_cold_us(make: Callable[[], Callable[[], object]], nbytes: int) -> float:
    """GPU time per call with the keys and values cold in L2: ``graph_us`` of one call on each
    of R input sets in turn (``make()`` gives a call on fresh copies of K and V), R sets of
    ``nbytes`` covering ``COLD_BYTES``, divided by R. ``graph_us`` alone replays one call on
    the same inputs, so a cache that fits in L2 (1 x 4K decode: 16 MiB) is read from L2 there,
    where a model's decode, layer after layer, reads it from HBM. The calls share the small
    inputs (queries, ``cu_seqlens``, block tables), as a step's layers share their metadata,
    which stays in L2."""
    sets = cold_set_count(nbytes)
    calls = [make() for _ in range(sets)]

    def run() -> None:
        for call in calls:
            call()

    return graph_us(run) / sets


@dataclass(frozen=True)
class Timer:
    """``bench`` and ``graph_us`` on a GPU; under ``--smoke`` (the interpreter, on the CPU) the
    wall-clock time of one call (nothing compiles there to warm up; the smoke run checks the
    script's code paths, it times nothing meaningful), and no GPU time (NaN)."""

    smoke: bool

    def ms(self, fn: Callable[[], object]) -> float:
        if not self.smoke:
            return bench(fn)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def graph_us(self, fn: Callable[[], object]) -> float:
        return math.nan if self.smoke else graph_us(fn)

    def cold_us(self, make: Callable[[], Callable[[], object]], nbytes: int) -> float:
        return math.nan if self.smoke else graph_cold_us(make, nbytes)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    if torch.isnan(a).any():
        return math.inf
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def cu(lengths: list[int]) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device="cuda")


def flops(lens_q: list[int], lens_k: list[int], heads: int, d: int, causal: bool) -> float:
    total = 0.0
    for lq, lk in zip(lens_q, lens_k, strict=True):
        total += 4.0 * lq * lk * heads * d / (2.0 if causal else 1.0)
    return total


def ceilings() -> dict[str, float]:
    n = 1 << 30  # 2 GiB of bf16: several times the L2
    src = torch.empty(n, dtype=DTYPE, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    copy_gbs = 2 * n * 2 / ms / 1e6
    a = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    b = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    ms = bench(lambda: a @ b)
    return {"copy_GBps": copy_gbs, "matmul_bf16_TFLOPs": 2 * 8192**3 / ms / 1e9}


def sdpa(backend: SDPBackend, q, k, v, causal: bool, gqa: bool = False):
    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return run


def dense_inputs(b: int, heads: int, n: int, d: int, dtype: torch.dtype | None = None):
    """Random SDPA inputs ``[b, heads, n, d]`` (``dtype``: default ``DTYPE``) and the same values
    in our packed layout (``[b * n, heads, d]``) with their ``cu_seqlens``: ``(q, k, v), (qp, kp,
    vp), cu``."""
    sdpa_in = tuple(torch.randn(b, heads, n, d, dtype=dtype or DTYPE, device="cuda")
                    for _ in range(3))
    packed = tuple(t.transpose(1, 2).reshape(b * n, heads, d).contiguous() for t in sdpa_in)
    return sdpa_in, packed, cu([n] * b)


def tflops_in_turn(row: dict, timed: dict[str, Callable[[], object]], fl: float,
                   rounds: int) -> None:
    """``row[name + "_TFLOPs"]``: each side of ``timed`` (``fl`` FLOPs a call) timed in turn
    ``rounds`` times, the median kept (``_runs``: every round, when more than one)."""
    runs: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(rounds):
        for name, fn in timed.items():
            runs[name].append(fl / bench(fn) / 1e9)
    for name, vals in runs.items():
        row[f"{name}_TFLOPs"] = statistics.median(vals)
        if rounds > 1:
            row[f"{name}_TFLOPs_runs"] = vals


def dense_shapes(head_dims: tuple[int, ...], ns: list[int]
                 ) -> Iterator[tuple[int, int, bool, int, int]]:
    """(D, heads, causal, N, batch) of the dense rows: ``B * N`` = 16K tokens and
    ``H * D`` = 2048, non-causal then causal."""
    for d in head_dims:
        for causal in (False, True):
            for n in ns:
                yield d, 2048 // d, causal, n, 16384 // n


def dense_prefill_rows(quick: bool, rounds: int = 1) -> list[dict]:
    """``rounds`` > 1: the row's timings are taken in turn (cuDNN, FLASH, ours, ours FP8) that
    many times and the medians kept (``*_runs``: every round). One timing each read D 128
    non-causal N 8K-16K anywhere in 560-640 TFLOP/s (H100, 2026-11-24h): a single sample of
    each side compares two draws."""
    rows = []
    ns = [1024, 2048, 4096, 8192, 16384] if not quick else [4096, 16384]
    for d, heads, causal, n, b in dense_shapes((64, 128), ns):
        (q, k, v), (qp, kp, vp), cus = dense_inputs(b, heads, n, d)
        ours = lambda: prefill(  # noqa: E731
            qp, kp, vp, cus, max_seqlen_q=n, max_seqlen_k=n, causal=causal)
        fl = flops([n] * b, [n] * b, heads, d, causal)
        row = {"kind": "dense", "D": d, "H": heads, "B": b, "N": n, "causal": causal}
        timed: dict[str, Callable[[], object]] = {}
        ref = None
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                              ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                fn = sdpa(backend, q, k, v, causal)
                out = fn()
                ref = out if ref is None else ref
                timed[name] = fn
            except RuntimeError as e:  # backend unavailable for this shape
                row[f"{name}_TFLOPs"] = float("nan")
                row[f"{name}_error"] = str(e).splitlines()[0][:120]
        got = ours().reshape(b, n, heads, d).transpose(1, 2)
        row["check_rel_err"] = rel(got, ref) if ref is not None else float("nan")
        if not row["check_rel_err"] < CHECK_TOL:
            raise SystemExit(f"prefill check failed: {row}")
        timed["ours"] = ours
        # FP8 K/V (per-head scales) beside the queries' dtype: error vs 16-bit K/V.
        (k8, ks), (v8, vs) = quantize_kv(kp), quantize_kv(vp)
        fp8 = lambda: prefill(  # noqa: E731
            qp, k8, v8, cus, causal=causal, k_scale=ks, v_scale=vs)
        row["fp8_rel_err"] = rel(fp8().reshape(b, n, heads, d).transpose(1, 2), ref)
        if not row["fp8_rel_err"] < FP8_CHECK_TOL:
            raise SystemExit(f"fp8 prefill check failed: {row}")
        timed["ours_fp8"] = fp8
        tflops_in_turn(row, timed, fl, rounds)
        rows.append(row)
        print_row(row)
    return rows


def fp8_rows(quick: bool, rounds: int = 1) -> list[dict]:
    """FP8 Q/K/V prefill (``prefill(..., q_scale=)``) against our bf16 prefill and SDPA cuDNN,
    sides timed in turn ``rounds`` times (medians), then ``fp8_accuracy_row``."""
    rows = []
    ns = [4096, 8192, 16384] if not quick else [8192]
    for d, heads, causal, n, b in dense_shapes((128, 64), ns):
        (q, k, v), (qp, kp, vp), cus = dense_inputs(b, heads, n, d)
        (q8, qs), (k8, ks), (v8, vs) = (quantize_queries(qp, heads), quantize_kv(kp),
                                        quantize_kv(vp))
        timed: dict[str, Callable[[], object]] = {
            "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, causal),
            "ours": lambda: prefill(qp, kp, vp, cus, causal=causal),  # noqa: B023
            "ours_fp8": lambda: prefill(  # noqa: B023
                q8, k8, v8, cus, causal=causal, q_scale=qs, k_scale=ks, v_scale=vs),
        }
        ref = timed["cudnn"]()
        row = {"kind": "fp8", "D": d, "H": heads, "B": b, "N": n, "causal": causal}
        for name, tol in (("ours", CHECK_TOL), ("ours_fp8", FP8_QKV_CHECK_TOL)):
            got = timed[name]().reshape(b, n, heads, d).transpose(1, 2)  # type: ignore[attr-defined]
            row[f"{name}_rel_err"] = rel(got, ref)
            if not row[f"{name}_rel_err"] < tol:
                raise SystemExit(f"fp8 table check failed: {name} {row}")
        fl = flops([n] * b, [n] * b, heads, d, causal)
        tflops_in_turn(row, timed, fl, rounds)
        row["fp8_over_bf16"] = row["ours_fp8_TFLOPs"] / row["ours_TFLOPs"]
        rows.append(row)
        print_row(row)
    rows.append(fp8_accuracy_row())
    print_row(rows[-1])
    return rows


def fp8_accuracy_row() -> dict:
    """RMSE and max error against float64 on the unquantized inputs, FlashAttention-3's test
    distribution, 2 x 4K x 16 heads, D 128, non-causal: our FP8 prefill, the float64 reference
    on the quantized inputs (the error of quantizing Q/K/V alone), our bf16 prefill."""
    b, n, heads, d = 2, 4096, 16, 128

    def gen() -> torch.Tensor:
        x = torch.randn(b * n, heads, d, device="cuda")
        outlier = torch.rand(b * n, heads, d, device="cuda") < 1e-3
        return torch.where(outlier, torch.randn(b * n, heads, d, device="cuda") * 10, x)

    q, k, v = gen(), gen(), gen()
    cus = cu([n] * b)
    exact = prefill_ref(q.double(), k.double(), v.double(), cus)
    (q8, qs), (k8, ks), (v8, vs) = quantize_queries(q, heads), quantize_kv(k), quantize_kv(v)
    alone = prefill_ref(dequantize_queries(q8, qs, heads, torch.float64),
                        dequantize_kv(k8, ks, torch.float64),
                        dequantize_kv(v8, vs, torch.float64), cus)
    sides = {"ours_fp8": prefill(q8, k8, v8, cus, q_scale=qs, k_scale=ks, v_scale=vs),
             "quantized_inputs_alone": alone,
             "ours_bf16": prefill(q.bfloat16(), k.bfloat16(), v.bfloat16(), cus)}
    row: dict = {"kind": "fp8_accuracy", "D": d, "H": heads, "B": b, "N": n, "causal": False,
                 "fa3_published_rmse": FA3_FP8_RMSE}
    for name, t in sides.items():
        diff = t.double() - exact  # type: ignore[union-attr]
        row[f"{name}_rmse"] = diff.pow(2).mean().sqrt().item()
        row[f"{name}_max_err"] = diff.abs().max().item()
    row["rmse_over_quantizing_alone"] = row["ours_fp8_rmse"] / row["quantized_inputs_alone_rmse"]
    return row


VARLEN_BATCHES = [
    [64, 128, 256], [128, 256, 512], [1024] * 3, [64, 78, 2048], [78, 40, 8192], [512] * 32,
    [8192, 16, 16, 16, 16],
]


def _varlen_attn_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def varlen_prefill_rows(quick: bool) -> list[dict]:
    rows = []
    varlen_attn, has_gqa = _varlen_attn_fn()
    heads, kv_heads, d = 16, 8, 128
    for causal in (True, False):
        for lens in VARLEN_BATCHES:
            total, mx = sum(lens), max(lens)
            q = torch.randn(total, heads, d, dtype=DTYPE, device="cuda")
            k = torch.randn(total, kv_heads, d, dtype=DTYPE, device="cuda")
            v = torch.randn(total, kv_heads, d, dtype=DTYPE, device="cuda")
            cus = cu(lens)
            fl = flops(lens, lens, heads, d, causal)
            row = {"kind": "varlen", "lens": str(lens), "H": heads, "Hkv": kv_heads, "D": d,
                   "causal": causal}
            ours = lambda: prefill(  # noqa: E731
                q, k, v, cus, max_seqlen_q=mx, max_seqlen_k=mx, causal=causal)
            ref = None
            if varlen_attn is not None:
                ws = (-1, 0) if causal else (-1, -1)
                if has_gqa:
                    kk, vv, extra = k, v, {"enable_gqa": True}
                else:  # older torch: expand kv heads (reads more bytes; noted in the row)
                    kk = k.repeat_interleave(heads // kv_heads, 1)
                    vv = v.repeat_interleave(heads // kv_heads, 1)
                    extra = {}
                    row["peer_note"] = "kv heads expanded (no enable_gqa)"
                peer = lambda: varlen_attn(q, kk, vv, cus, cus, mx, mx, window_size=ws, **extra)  # noqa: E731
                try:
                    ref = peer()
                    row["varlen_attn_TFLOPs"] = fl / bench(peer) / 1e9
                    row["varlen_attn_graph_us"] = graph_us(peer)
                except (RuntimeError, TypeError) as e:
                    row["varlen_attn_TFLOPs"] = float("nan")
                    row["varlen_attn_error"] = str(e).splitlines()[0][:120]
            if ref is None:
                from attention_kernels import prefill_ref
                ref = prefill_ref(q, k, v, cus, causal=causal)
            row["check_rel_err"] = rel(ours(), ref)
            if not row["check_rel_err"] < CHECK_TOL:
                raise SystemExit(f"varlen check failed: {row}")
            row["ours_TFLOPs"] = fl / bench(ours) / 1e9
            row["ours_graph_us"] = graph_us(ours)
            rows.append(row)
            print_row(row)
        if quick:
            break
    return rows


DECODE_SHAPES = [(1, 4096), (1, 32768), (1, 131072), (16, 4096), (16, 32768), (64, 8192),
                 (128, 2048)]


def decode_rows(quick: bool) -> list[dict]:
    rows = []
    heads, kv_heads, d = 32, 8, 128
    for batch, ctx in DECODE_SHAPES:
        q = torch.randn(batch, heads, 1, d, dtype=DTYPE, device="cuda")
        k = torch.randn(batch, kv_heads, ctx, d, dtype=DTYPE, device="cuda")
        v = torch.randn(batch, kv_heads, ctx, d, dtype=DTYPE, device="cuda")
        qp = q[:, :, 0, :].contiguous()
        kp = k.transpose(1, 2).reshape(batch * ctx, kv_heads, d).contiguous()
        vp = v.transpose(1, 2).reshape(batch * ctx, kv_heads, d).contiguous()
        cus = cu([ctx] * batch)
        nbytes = 2 * kp.numel() * kp.element_size()
        row = {"kind": "decode", "B": batch, "ctx": ctx, "H": heads, "Hkv": kv_heads, "D": d}
        ref = None
        for name, backend in {"cudnn": SDPBackend.CUDNN_ATTENTION,
                              "flash": SDPBackend.FLASH_ATTENTION}.items():
            try:
                fn = sdpa(backend, q, k, v, False, gqa=True)
                out = fn()
                ref = out[:, :, 0, :] if ref is None else ref
                row[f"{name}_GBps"] = nbytes / bench(fn) / 1e6
                row[f"{name}_graph_us"] = graph_us(fn)
                row[f"{name}_cold_us"] = graph_cold_us(
                    lambda b=backend: sdpa(b, q, k.clone(), v.clone(), False, gqa=True), nbytes)
            except RuntimeError as e:
                row[f"{name}_GBps"] = float("nan")
                row[f"{name}_error"] = str(e).splitlines()[0][:120]
        ours = lambda: decode(qp, kp, vp, cus, max_seqlen_k=ctx)  # noqa: E731
        if ref is None:
            from attention_kernels import decode_ref
            ref = decode_ref(qp, kp, vp, cus)
        # Eager calls and graph calls merge differently (for_graphs): check both.
        row["check_rel_err"] = max(rel(ours(), ref), rel(for_graphs(ours)(), ref))
        if not row["check_rel_err"] < CHECK_TOL:
            raise SystemExit(f"decode check failed: {row}")
        row["ours_GBps"] = nbytes / bench(ours) / 1e6
        row["ours_graph_us"] = graph_us(ours)
        row["ours_cold_us"] = graph_cold_us(lambda: functools.partial(
            decode, qp, kp.clone(), vp.clone(), cus, max_seqlen_k=ctx), nbytes)
        # FP8 K/V (per-head scales): half the bytes; GB/s count the FP8 bytes actually read.
        (k8, ks), (v8, vs) = quantize_kv(kp), quantize_kv(vp)
        fp8 = lambda: decode(qp, k8, v8, cus, max_seqlen_k=ctx, k_scale=ks, v_scale=vs)  # noqa: E731
        row["fp8_rel_err"] = max(rel(fp8(), ref), rel(for_graphs(fp8)(), ref))
        if not row["fp8_rel_err"] < FP8_CHECK_TOL:
            raise SystemExit(f"fp8 decode check failed: {row}")
        row["ours_fp8_GBps"] = nbytes / 2 / bench(fp8) / 1e6
        row["ours_fp8_graph_us"] = graph_us(fp8)
        rows.append(row)
        print_row(row)
        if quick and len(rows) >= 3:
            break
    return rows


# issue 65's head dims; each is timed beside the multiple of 16 at or above it.
HEAD_DIMS = (40, 59, 72, 80, 96, 100, 111, 160, 192, 200, 224, 256)
# The head-dim rows' decodes (32q/8kv): (name, sequences, keys each). Odd dims fell furthest
# behind where few sequences split their keys (8 x 8192, 1 x 16384); 16 x 8192 is one program
# per SM, 128 x 2048 many.
HEAD_DIM_DECODES = (("decode", 64, 4096), ("decode_small", 8, 8192), ("decode_one", 1, 16384),
                    ("decode_mid", 16, 8192), ("decode_many", 128, 2048))


def head_dim_rows(quick: bool, checkpoint: Callable[[list[dict]], None]) -> list[dict]:
    from attention_kernels import decode_ref, prefill_ref

    rows: list[dict] = []
    for d in HEAD_DIMS[:4] if quick else HEAD_DIMS:
        d16 = -(-d // 16) * 16
        row: dict = {"kind": "headdim", "D": d, "D16": d16}
        # Correct first: a small varlen causal prefill and decodes against float64, one of
        # 2 x 16384 keys (the long calls' routes: decode_span's from 16K or 32K keys).
        q = torch.randn(300, 16, d, dtype=DTYPE, device="cuda")
        k = torch.randn(300, 8, d, dtype=DTYPE, device="cuda")
        cus = cu([100, 200])
        ql, kl, vl = (torch.randn(n, h, d, dtype=DTYPE, device="cuda")
                      for n, h in ((2, 32), (2 * 16384, 8), (2 * 16384, 8)))
        cul = cu([16384] * 2)
        row["check_rel_err"] = max(
            rel(prefill(q, k, k, cus, cus, causal=True),
                prefill_ref(q.double(), k.double(), k.double(), cus, cus, causal=True)),
            rel(decode(q[:2], k, k, cus), decode_ref(q[:2].double(), k.double(), k.double(),
                                                      cus)),
            rel(decode(ql, kl, vl, cul, max_seqlen_k=16384),
                decode_ref(ql.double(), kl.double(), vl.double(), cul)))
        del ql, kl, vl
        if not row["check_rel_err"] < CHECK_TOL:
            raise SystemExit(f"head dim check failed: {row}")
        for side, dim in (("", d), ("16", d16)):
            # Keys and values apart: one tensor for both let decode read V from L2 (H200, 64 x
            # 4096: D 112 157 us with k as v, 225 apart; 2026-12-02).
            q = torch.randn(4 * 4096, 16, dim, dtype=DTYPE, device="cuda")
            k, v = (torch.randn(4 * 4096, 8, dim, dtype=DTYPE, device="cuda") for _ in "kv")
            cus = cu([4096] * 4)
            row[f"prefill{side}_us"] = graph_us(
                lambda q=q, k=k, v=v, c=cus: prefill(q, k, v, c, c, causal=True,
                                                     max_seqlen_q=4096, max_seqlen_k=4096))
            del q, k, v
            for name, batch, keys in HEAD_DIM_DECODES:
                qd = torch.randn(batch, 32, dim, dtype=DTYPE, device="cuda")
                kd, vd = (torch.randn(batch * keys, 8, dim, dtype=DTYPE, device="cuda")
                          for _ in "kv")
                cud = cu([keys] * batch)
                row[f"{name}{side}_us"] = graph_us(
                    lambda q=qd, k=kd, v=vd, c=cud, n=keys: decode(q, k, v, c, max_seqlen_k=n))
                del qd, kd, vd
        for name in ("prefill", *(n for n, _, _ in HEAD_DIM_DECODES)):
            row[f"{name}_ratio"] = row[f"{name}_us"] / row[f"{name}16_us"]
        rows.append(row)
        print_row(row)
        checkpoint(rows)  # a run cut short keeps the rows it finished
        torch.cuda.empty_cache()
    return rows


def print_row(row: dict) -> None:
    if row["kind"] == "decode":
        peer = row.get("cudnn_GBps", float("nan"))
        print(f"decode B={row['B']:<4d} ctx={row['ctx']:<7d} ours {row['ours_GBps']:7.0f} GB/s"
              f" | cudnn {peer:7.0f} | flash {row.get('flash_GBps', float('nan')):7.0f}"
              f" | ours/cudnn {row['ours_GBps'] / peer:5.2f} | GPU time (graph) ours "
              f"{row['ours_graph_us']:6.1f} us cudnn {row.get('cudnn_graph_us', math.nan):6.1f}"
              f" -> {row.get('cudnn_graph_us', math.nan) / row['ours_graph_us']:5.2f}"
              f" | cold L2 ours {row['ours_cold_us']:6.1f} us cudnn "
              f"{row.get('cudnn_cold_us', math.nan):6.1f} -> "
              f"{row.get('cudnn_cold_us', math.nan) / row['ours_cold_us']:5.2f}"
              f" | fp8 K/V {row['ours_fp8_GBps']:6.0f} GB/s {row['ours_fp8_graph_us']:6.1f} us"
              f" -> {row.get('cudnn_graph_us', math.nan) / row['ours_fp8_graph_us']:5.2f}",
              flush=True)
    elif row["kind"] == "fp8":
        print(f"fp8    D={row['D']:<3d} N={row['N']:<6d} causal={row['causal']!s:<5} ours FP8 "
              f"{row['ours_fp8_TFLOPs']:6.1f} TFLOP/s | ours bf16 {row['ours_TFLOPs']:6.1f} | "
              f"cudnn bf16 {row['cudnn_TFLOPs']:6.1f} | fp8/bf16 {row['fp8_over_bf16']:5.2f} | "
              f"err vs cudnn {row['ours_fp8_rel_err']:.3f}", flush=True)
    elif row["kind"] == "fp8_accuracy":
        print(f"fp8 accuracy (FA3 distribution) RMSE / max: ours FP8 {row['ours_fp8_rmse']:.2e}"
              f" / {row['ours_fp8_max_err']:.2f} | quantizing Q/K/V alone "
              f"{row['quantized_inputs_alone_rmse']:.2e} / "
              f"{row['quantized_inputs_alone_max_err']:.2f} | ours bf16 "
              f"{row['ours_bf16_rmse']:.2e} / {row['ours_bf16_max_err']:.2f} | FA3 published "
              + ", ".join(f"{k} {v:.1e}" for k, v in row["fa3_published_rmse"].items()),
              flush=True)
    elif row["kind"] == "headdim":
        print(f"head dim {row['D']:<3d} vs {row['D16']:<3d} prefill {row['prefill_us']:7.1f} us"
              f" / {row['prefill16_us']:7.1f} -> {row['prefill_ratio']:4.2f}x | decode "
              + " | ".join(f"{b} x {n} {row[name + '_us']:6.1f} / {row[name + '16_us']:6.1f} "
                           f"-> {row[name + '_ratio']:4.2f}x"
                           for name, b, n in HEAD_DIM_DECODES)
              + f" | check {row['check_rel_err']:.1e}", flush=True)
    elif row["kind"] == "dense":
        fl = row.get("flash_TFLOPs", float("nan"))
        print(f"dense  D={row['D']:<3d} N={row['N']:<6d} causal={row['causal']!s:<5} ours "
              f"{row['ours_TFLOPs']:6.1f} TFLOP/s | flash {fl:6.1f} | cudnn "
              f"{row.get('cudnn_TFLOPs', float('nan')):6.1f} | ours/flash "
              f"{row['ours_TFLOPs'] / fl:5.2f}"
              + (f" | fp8 K/V {row['ours_fp8_TFLOPs']:6.1f}" if "ours_fp8_TFLOPs" in row else ""),
              flush=True)
    else:
        va = row.get("varlen_attn_TFLOPs", float("nan"))
        print(f"varlen {row['lens'][:22]:<22} causal={row['causal']!s:<5} ours "
              f"{row['ours_TFLOPs']:6.1f} TFLOP/s | varlen_attn {va:6.1f} | ratio "
              f"{row['ours_TFLOPs'] / va:5.2f} | GPU time (graph) ours {row['ours_graph_us']:6.1f}"
              f" us peer {row.get('varlen_attn_graph_us', math.nan):6.1f} -> "
              f"{row.get('varlen_attn_graph_us', math.nan) / row['ours_graph_us']:5.2f}",
              flush=True)


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    dense = [r for r in rows if r["kind"] == "dense" and r["D"] == 128]
    for causal, style in ((False, "-"), (True, "--")):
        sel = [r for r in dense if r["causal"] == causal]
        ns = [r["N"] for r in sel]
        for key, label in (("ours_TFLOPs", "ours"), ("flash_TFLOPs", "SDPA flash"),
                           ("cudnn_TFLOPs", "SDPA cudnn")):
            axes[0].plot(ns, [r.get(key, float("nan")) for r in sel], style, marker="o",
                         label=f"{label}{' causal' if causal else ''}")
    axes[0].set(xscale="log", xlabel="N (batch*N = 16K)", ylabel="TFLOP/s",
                title="dense prefill bf16 D128")
    axes[0].legend(fontsize=7)
    var = [r for r in rows if r["kind"] == "varlen" and r["causal"]]
    x = range(len(var))
    axes[1].bar([i - 0.2 for i in x], [r["ours_TFLOPs"] for r in var], 0.4, label="ours")
    axes[1].bar([i + 0.2 for i in x], [r.get("varlen_attn_TFLOPs", 0) for r in var], 0.4,
                label="varlen_attn")
    axes[1].set_xticks(list(x), [r["lens"][:18] for r in var], rotation=30, fontsize=6)
    axes[1].set(ylabel="TFLOP/s", title="varlen causal prefill, 16q/8kv D128")
    axes[1].legend()
    dec = [r for r in rows if r["kind"] == "decode"]
    x = range(len(dec))
    for off, key, label in ((-0.27, "ours_GBps", "ours"), (0, "cudnn_GBps", "SDPA cudnn"),
                            (0.27, "flash_GBps", "SDPA flash")):
        axes[2].bar([i + off for i in x], [r.get(key, 0) for r in dec], 0.27, label=label)
    axes[2].set_xticks(list(x), [f"{r['B']}x{r['ctx']}" for r in dec], rotation=30, fontsize=7)
    axes[2].set(ylabel="GB/s (K+V)", title="decode 32q/8kv D128 bf16")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for CSV/JSON/PNG")
    parser.add_argument("--quick", action="store_true", help="a few rows of each table")
    parser.add_argument("--only", choices=["dense", "varlen", "decode", "headdim", "fp8"],
                        action="append")
    parser.add_argument("--rounds", type=int, default=1,
                        help="dense rows: time the sides in turn this many times, keep medians")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16",
                        help="queries, keys and values (the FP8 rows quantize these keys)")
    args = parser.parse_args()
    global DTYPE
    DTYPE = getattr(torch, args.dtype)
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": " ".join(["python", *sys.argv]),
        "gpu": torch.cuda.get_device_name(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "dtype": args.dtype,
    }
    print(json.dumps(meta))
    meta.update(ceilings())
    print(f"ceilings: copy {meta['copy_GBps']:.0f} GB/s, bf16 matmul "
          f"{meta['matmul_bf16_TFLOPs']:.0f} TFLOP/s", flush=True)
    only = set(args.only or ["dense", "varlen", "decode"])
    stamp = f"kernels_{meta['gpu'].replace(' ', '_')}"
    if only == {"headdim"}:
        stamp += "_headdims"
    if only == {"fp8"}:
        stamp += "_fp8"
    if args.dtype != "bfloat16":
        stamp += f"_{args.dtype}"
    rows: list[dict] = []

    def checkpoint(section: list[dict]) -> None:  # the JSON so far, marked unfinished
        (out / f"{stamp}.json").write_text(json.dumps(
            {"meta": {**meta, "unfinished": True}, "rows": rows + section}, indent=1))

    if "dense" in only:
        rows += dense_prefill_rows(args.quick, args.rounds)
    if "varlen" in only:
        rows += varlen_prefill_rows(args.quick)
    if "headdim" in only:
        rows += head_dim_rows(args.quick, checkpoint)
    if "fp8" in only:
        rows += fp8_rows(args.quick, args.rounds)
    if "decode" in only:
        rows += decode_rows(args.quick)
        for r in rows:
            if r["kind"] == "decode":
                r["ours_pct_of_copy"] = 100 * r["ours_GBps"] / meta["copy_GBps"]
    (out / f"{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    keys = sorted({k for r in rows for k in r})
    with open(out / f"{stamp}.csv", "w") as f:
        f.write("# " + json.dumps(meta) + "\n" + ",".join(keys) + "\n")
        for r in rows:
            f.write(",".join(f'"{r.get(k, "")}"' for k in keys) + "\n")
    plot(rows, out / f"{stamp}.png")
    print(f"wrote {out}/{stamp}.{{json,csv,png}}")


if __name__ == "__main__":
    main()
