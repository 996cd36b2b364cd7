"""The Gluon Hopper prefill (``attention_kernels.prefill_hopper``): checks, then tiles against
the portable kernel (``ATTENTION_KERNELS_GLUON=0``) and SDPA cuDNN / FLASH in the same run.

    python tools/tuning/tune_hopper_prefill.py                 # checks + sweep, H100/H200
    python tools/tuning/tune_hopper_prefill.py --no-sweep      # checks only

Checks: the kernel against the float64 reference (odd lengths, empty sequences, causal with
q != k lengths, GQA, fp16/bf16, D 64/128, every swept tile) with poisoned outputs, and a
neighbour sequence full of inf/NaN. Sweep: dense ``[B, H, N, D]`` bf16 with ``B * N = 16K``
and ``H * D = 2048`` (bench_kernels' dense rows), TFLOP/s from ``do_bench`` medians.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_kernels import bench, cu, dense_inputs, dense_shapes, flops, rel, sdpa

from attention_kernels import prefill, prefill_ref
from attention_kernels.configs import num_sms
from attention_kernels.prefill_hopper import hopper_prefill_ws

LOG2E = 1.4426950408889634
# (block_n, stages, consumer warpgroups of 64 rows, programs) per head dim. programs 0: one
# per tile; 1: one per SM (persistent, every SM-count-th tile); -1: one per SM claiming tiles
# from a counter (dynamic); n > 1 / n < -1: n programs, static / dynamic (the checks: many
# tiles per program). An optional fifth value: 1 / 0 ends each sequence's tiles at its last /
# starts them at its first row (``end_tiles``; -1 or none: the default, at the end when causal
# with 192-row tiles); a sixth: 1 / 0 consumers issue their GEMMs in turns or not
# (``pingpong``; none: the default).
TILES = {128: [(128, 2, 2, 0), (128, 2, 2, -1)], 64: [(128, 3, 3, 0), (128, 3, 3, -1)]}


def tile_name(tile) -> str:
    bn, st, cons, progs = tile[:4]
    kind = "p" if progs > 0 else "d"
    return (f"{cons * 64}x{bn}x{st}" + ("" if progs == 0 else kind if abs(progs) == 1
                                        else f"{kind}{abs(progs)}")
            + ("" if len(tile) < 5 or tile[4] < 0 else "e" if tile[4] else "s")
            + ("" if len(tile) < 6 else "+pp" if tile[5] else "-pp"))


def run(q, k, v, cu_q, cu_k, causal: bool, tile, lse: bool = True):
    out = torch.full_like(q, float("nan"))
    lse_t = torch.full((q.shape[1], q.shape[0]), float("nan"), device="cuda") if lse else None
    launch(q, k, v, cu_q, cu_k, out, lse_t, causal, tile)
    return out, lse_t


def launch(q, k, v, cu_q, cu_k, out, lse, causal: bool, tile) -> None:
    bn, st, cons, progs = tile[:4]
    programs = (None if progs == 0 else num_sms(q.device.index or 0) if abs(progs) == 1
                else abs(progs))
    hopper_prefill_ws(q, k, v, cu_q, cu_k, out, lse, causal, LOG2E / math.sqrt(q.shape[2]),
                      block_n=bn, stages=st, consumers=cons, programs=programs,
                      dynamic=progs < 0,
                      end_tiles=None if len(tile) < 5 or tile[4] < 0 else bool(tile[4]),
                      **({} if len(tile) < 6 else {"pingpong": bool(tile[5])}))


def check_tiles(d: int) -> list[tuple]:
    """The swept tiles plus each on 3 programs (many tiles per program: ring and Q-buffer
    phases carried from tile to tile, tiles without keys in between)."""
    tiles = list(TILES[d])
    for base, pp in dict.fromkeys((t[:3], t[5:6]) for t in TILES[d]):
        tail = (-1,) + pp if pp else ()
        tiles += [base + (3,) + tail, base + (-3,) + tail, base + (-3, 1) + pp,
                  base + (-3, 0) + pp]
    return tiles


def check(failures: list[str]) -> int:
    cases = [  # lens_q, lens_k, heads, kv_heads
        ([1], None, 4, 4), ([17], None, 4, 2), ([127, 129], None, 4, 1), ([0, 1, 17], None, 4, 4),
        ([5, 0, 33, 0], None, 8, 2), ([78, 40, 130], None, 8, 8), ([1000], None, 16, 4),
        ([78, 40, 2050], None, 4, 4), ([300, 1], [700, 5], 4, 2), ([64, 200], [10, 600], 4, 4),
        ([256, 128], None, 8, 8), ([4096], None, 16, 2),
        ([300, 1, 2000, 0, 700], [700, 5, 10, 0, 2000], 8, 2),
    ]
    n = 0
    t0 = time.perf_counter()
    for d in TILES:
        for dtype in (torch.bfloat16, torch.float16):
            for causal in (False, True):
                print(f"  checking D{d} {dtype} causal={causal} ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
                for lens_q, lens_k, h, hk in cases:
                    for tile in check_tiles(d):
                        lens_k = lens_k or lens_q
                        cq, ck = cu(lens_q), cu(lens_k)
                        q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=dtype)
                        k = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=dtype)
                        v = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=dtype)
                        if q.shape[0] == 0 or k.shape[0] == 0:
                            continue
                        out, lse = run(q, k, v, cq, ck, causal, tile)
                        ref, ref_lse = prefill_ref(q.double(), k.double(), v.double(), cq, ck,
                                                   causal=causal, return_lse=True)
                        err = rel(out.double(), ref)
                        fin = torch.isfinite(ref_lse)
                        lerr = (lse[fin].double() - ref_lse[fin]).abs().max().item() \
                            if fin.any() else 0.0
                        bad_empty = bool((lse[~fin] != float("-inf")).any()) or bool(
                            (out[~fin.t()] != 0).any())
                        n += 1
                        if not (err < 2e-2 and lerr < 2e-2) or bad_empty or torch.isnan(out).any():
                            failures.append(f"d={d} {dtype} causal={causal} q={lens_q} "
                                            f"k={lens_k} h={h}/{hk} tile={tile}: err {err:.3g} "
                                            f"lse {lerr:.3g} empty-rows-wrong {bad_empty}")
    # A neighbour's inf/NaN must not leak (values past a sequence's end meet p = 0).
    for d in TILES:
        for causal in (False, True):
            lens = [2000, 77, 3000]
            cq = cu(lens)
            q = torch.randn(sum(lens), 16, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(sum(lens), 2, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            a, b = lens[0], lens[0] + lens[1]
            v[a:b] = float("inf")
            k[a:b, :, 0] = float("nan")
            for tile in check_tiles(d):
                out, _ = run(q, k, v, cq, cq, causal, tile, lse=False)
                keep = torch.ones(sum(lens), dtype=torch.bool, device="cuda")
                keep[a:b] = False
                k2, v2 = k.clone(), v.clone()
                k2[a:b] = 0
                v2[a:b] = 0
                ref = prefill_ref(q.double(), k2.double(), v2.double(), cq, causal=causal)
                err = rel(out[keep], ref[keep])
                n += 1
                if not torch.isfinite(out[keep]).all() or not err < 2e-2:
                    failures.append(f"leak d={d} causal={causal} tile={tile}: err {err:.3g}")
    return n


def compile_sm90(causal: bool, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128,
                 tile: tuple[int, int, int] = (128, 2, 2), q_bufs: int = 1,
                 dynamic: bool = False, pingpong: bool | None = None,
                 kv_scales: bool = False, fp8: bool = False, out_dim: int = 0) -> dict:
    """Build the kernel as ``prefill`` launches it for sm_90a, on any machine (Triton compiles
    without a GPU and ships ptxas): spill bytes, ``setmaxnreg`` targets, async-wgmma waits,
    and how much of the softmax runs under its own PV in the SASS (``ex2_under_pv``).
    ``kv_scales``: the build for FP8 K/V (widened, with their scales). ``fp8``: the build for
    FP8 queries, keys and values (both dots in e4m3, V transposed; implies ``kv_scales``).
    ``out_dim``: the output's head dim when narrower than ``head_dim`` (a zero-padded launch)."""
    import os.path
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from attention_kernels.prefill_hopper import (
        _REGS,
        _hopper_prefill_ws_kernel,
        descriptor,
        tile_options,
        transposed_values_ref,
        values_descriptor,
    )

    fn = _hopper_prefill_ws_kernel
    if fp8:
        dtype, kv_scales = torch.float8_e4m3fn, True
    t = torch.empty(256, 2, head_dim, dtype=dtype)  # descriptors read only shape and dtype
    bn, st, cons = tile
    descs = {"desc_q": descriptor(t, 64), "desc_k": descriptor(t, bn),
             "desc_v": descriptor(t, bn)}
    if fp8:
        vt = transposed_values_ref(t, torch.tensor([0, 256], dtype=torch.int32), bn)
        descs["desc_v"] = values_descriptor(vt, head_dim, bn)
    end_tiles, pingpong = tile_options(causal, cons, pingpong=pingpong)
    # A padded launch reads q as it is only where its heads start on 16-byte boundaries.
    q_d = out_dim if out_dim and out_dim * t.element_size() % 16 == 0 else head_dim
    const = dict(HEAD_DIM=head_dim, Q_D=q_d, OUT_D=out_dim or head_dim,
                 BLOCK_N=bn, BLOCK_B=64, STAGES=st, CONSUMERS=cons,
                 Q_BUFS=q_bufs, DYNAMIC=dynamic, IS_CAUSAL=causal, END_TILES=end_tiles,
                 RETURN_LSE=True, PINGPONG=pingpong, KV_SCALES=kv_scales, FP8=fp8,
                 CONSUMER_REGS=_REGS[cons][0], PRODUCER_REGS=_REGS[cons][1])
    elem = "*bf16" if dtype == torch.bfloat16 else "*fp16"
    ptrs = {"V": "*fp8e4nv" if fp8 else elem, "Out": "*bf16" if fp8 else elem,
            "Lse": "*fp32", "cu_q": "*i32", "cu_k": "*i32", "Counter": "*i32",
            "KScale": "*fp32", "VScale": "*fp32"}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name in descs:
            sig[name] = mangle_type(descs[name])
        elif name in ptrs:
            sig[name] = ptrs[name]
            if not (name == "Out" and out_dim):  # a narrower out starts anywhere
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
            if name == "stride_vt" or (name in ("stride_ot", "stride_oh") and not out_dim):
                attrs[(i,)] = [["tt.divisibility", 16]]  # multiples of 16 on launch
    kernel = triton.compile(GluonASTSource(fn, sig, const, attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = kernel.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        raise FileNotFoundError(ptxas)
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        info = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", src, "-o", cubin],
                              capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([os.path.join(os.path.dirname(ptxas), "cuobjdump"), "-sass",
                               cubin], capture_output=True, text=True, check=True).stdout
    return {
        "spill_bytes": sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", info)),
        "setmaxnreg_inc": sorted({int(x) for x in re.findall(
            r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx)}),
        # Waits that leave wgmma in flight past the QK^T: the PV (16-bit: 1), the PV and the
        # row sums (FP8: 2).
        "wgmma_wait_1": len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)),
        "wgmma_wait_2": len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+2;", ptx)),
        # The consumers' turns (``pingpong``): named barriers of 256 threads by register id.
        "turn_syncs": len(re.findall(r"bar\.sync\s+%r\d+, 256;", ptx)),
        "shared_bytes": kernel.metadata.shared,
        "ex2_under_pv": ex2_under_pv(sass),
        # FP8: the row sums' ones tile written as whole words of e4m3 1.0 (``_pv_issue``; a
        # converted constant lost half its bytes in ptxas).
        "ones_words": sass.count("0x38383838"),
        # FP8: the output's rescale behind a warp-uniform branch (``_rescale_skip``).
        "rescale_skips": len(re.findall(r"\bVOTE\.ANY\b", sass)),
        "key_loop_spills": key_loop_spills(sass),
    }


def key_loop_spills(sass: str) -> int | None:
    """Local-memory loads and stores (``LDL``/``STL``: spills) inside the key loops: the
    innermost SASS loops (a branch back to a lower address) that hold ``MUFU.EX2``. None where
    no such loop is found (a branch form this does not read), rather than a count of 0."""
    import re

    ins = [(int(m.group(1), 16), m.group(2)) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, text in ins:
        back = re.search(r"\bBRA(?:\.\w+)*\s+(?:!?U?P\w+,\s*)?0x([0-9a-f]+)", text)
        if back and int(back.group(1), 16) < addr:
            body = [t for a, t in ins if int(back.group(1), 16) <= a <= addr]
            if any("MUFU.EX2" in t for t in body):
                loops.append((int(back.group(1), 16), addr, body))
    inner = [lp for lp in loops  # no other loop's branch back inside it
             if not any(o is not lp and lp[0] <= o[1] < lp[1] for o in loops)]
    if not inner:
        return None
    return sum(1 for _, _, body in inner for t in body if re.search(r"\b(LDL|STL)\b", t))


def ex2_under_pv(sass: str) -> int:
    """The most ``MUFU.EX2`` (the softmax's exponentials) in the SASS between a wait for the
    QK^T wgmma (``WARPGROUP.DEPBAR.LE gsb0, 0x1``, or ``0x2`` where the FP8 row sums' wgmma
    follows the PV: those issued after it may run on) and the next wait for every wgmma
    (``... 0x0``): the softmax work that runs while this warpgroup's own PV does. 0 where
    ptxas moved the PV's wait above the softmax."""
    best = count = 0
    open_ = False
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line or "WARPGROUP.DEPBAR.LE gsb0, 0x2" in line:
            open_, count = True, 0
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line:
            if open_:
                best = max(best, count)
            open_ = False
        elif open_ and "MUFU.EX2" in line:
            count += 1
    return best


def sweep(ns: list[int], dtype: torch.dtype = torch.bfloat16, rounds: int = 1) -> list[dict]:
    """TFLOP/s per tile; with ``rounds`` > 1 the tiles are timed in turn that many times and
    the median kept (``_runs``: every round): the first tile timed in a row once read 7-17%
    below the same code timed second (call1_tune.log, 2026-11-24)."""
    rows = []
    for d, heads, causal, n, b in dense_shapes(tuple(sorted(TILES, reverse=True)), ns):
        (q, k, v), (qp, kp, vp), cus = dense_inputs(b, heads, n, d, dtype)
        fl = flops([n] * b, [n] * b, heads, d, causal)
        row = {"D": d, "N": n, "B": b, "H": heads, "causal": causal,
               "dtype": str(dtype).removeprefix("torch.")}
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("flash", SDPBackend.FLASH_ATTENTION)):
            row[name] = fl / bench(sdpa(backend, q, k, v, causal)) / 1e9
        os.environ["ATTENTION_KERNELS_GLUON"] = "0"  # prefill() as it was before Gluon
        ref = prefill(qp, kp, vp, cus, causal=causal)
        row["portable"] = fl / bench(lambda: prefill(qp, kp, vp, cus, causal=causal)) / 1e9
        os.environ.pop("ATTENTION_KERNELS_GLUON")
        out = torch.empty_like(qp)
        for _ in range(rounds):
            for tile in TILES[d]:
                def ours(tile=tile):
                    launch(qp, kp, vp, cus, cus, out, None, causal, tile)
                key = f"gluon_{tile_name(tile)}"
                if key + "_runs" not in row:
                    ours()
                    row[key + "_err"] = rel(out, ref)
                    if not row[key + "_err"] < 2e-2:  # NaN fails too (rel: inf)
                        raise SystemExit(f"check failed: {row}")
                    row[key + "_runs"] = []
                row[key + "_runs"].append(fl / bench(ours) / 1e9)
                row[key] = statistics.median(row[key + "_runs"])
        best = max(v for kk, v in row.items() if kk.startswith("gluon") and
                   not kk.endswith(("_err", "_runs")))
        mask = "causal" if causal else "full  "
        print(f"{row['dtype']} D{d} {mask} N {n:5d}: cudnn {row['cudnn']:6.1f} "
              f"flash {row['flash']:6.1f} portable {row['portable']:6.1f} | "
              + " ".join(f"{kk[6:]} {v:6.1f}" + (
                          "" if rounds == 1 else " (" + "/".join(
                              f"{x:.0f}" for x in row[kk + "_runs"]) + ")")
                         for kk, v in row.items()
                         if kk.startswith("gluon") and not kk.endswith(("_err", "_runs")))
              + f" | best/cudnn {best / row['cudnn']:.2f} "
              f"portable/cudnn {row['portable'] / row['cudnn']:.2f}", flush=True)
        rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--ns", default="4096,8192,16384")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                   help="the sweep's dtype (the checks run both)")
    p.add_argument("--compile-only", action="store_true",
                   help="no GPU needed: build for sm_90a and print spills / registers as JSON "
                        "(exit 3 when this triton ships no ptxas)")
    p.add_argument("--causal", action="store_true", help="with --compile-only")
    p.add_argument("--head-dim", type=int, default=128, help="with --compile-only")
    p.add_argument("--out-dim", type=int, default=0,
                   help="with --compile-only: store this many output columns (padded launch)")
    p.add_argument("--kv-scales", action="store_true",
                   help="with --compile-only: the FP8 K/V build (scales per tile)")
    p.add_argument("--fp8", action="store_true",
                   help="with --compile-only: the FP8 Q/K/V build (both dots in e4m3)")
    p.add_argument("--tile", default="128,2,2",
                   help="with --compile-only: block_n,stages,consumers")
    p.add_argument("--tiles", help="replace the tile lists: "
                   "'D:block_n,stages[,consumers[,persistent[,end]]];...'")
    p.add_argument("--rounds", type=int, default=1,
                   help="time the tiles in turn this many times, keep the median")
    p.add_argument("--out", default="tools/tuning/results")
    args = p.parse_args()
    if args.tiles:
        TILES.clear()
        for item in args.tiles.split(";"):
            d, tile = item.split(":")
            vals = [int(x) for x in tile.split(",")]
            TILES.setdefault(int(d), []).append(tuple(vals + [2, 0][len(vals) - 2:]))
    if args.compile_only:
        try:
            tile = tuple(int(x) for x in args.tile.split(","))
            print(json.dumps(compile_sm90(args.causal, head_dim=args.head_dim, tile=tile,
                                          kv_scales=args.kv_scales, fp8=args.fp8,
                                          out_dim=args.out_dim)))
        except FileNotFoundError as e:
            print(f"no ptxas in this triton wheel: {e}")
            return 3
        return 0
    failures: list[str] = []
    if not args.no_check:
        n = check(failures)
        print(f"checks: {n - len(failures)} / {n} passed", flush=True)
        for f in failures:
            print("  FAIL", f, flush=True)
    rows = [] if args.no_sweep else sweep([int(x) for x in args.ns.split(",")],
                                          getattr(torch, args.dtype), args.rounds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name().replace(" ", "_")
    (out / f"tune_hopper_prefill_{args.dtype}_{name}.json").write_text(json.dumps({
        "command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
        "date": datetime.now(timezone.utc).isoformat(), "torch": torch.__version__,
        "triton": triton.__version__, "failures": failures, "rows": rows}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
