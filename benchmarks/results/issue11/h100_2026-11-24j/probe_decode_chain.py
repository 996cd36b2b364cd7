"""Kept as the record of what ran (calls 1-2 of 2026-11-24j), against a tree with a change that
was then dropped: ``decode_kernel.TABLE_AHEAD_MAX`` / ``TABLE_AHEAD_ALL`` (``_paging.row_ahead``
read the first table entries of a row with the sequence length and ``ahead_page`` picked a
block's page out of them with a masked sum; ``"in-loop"`` looked each block's page up in its own
iteration). It does not run against the committed tree. Call 2 also ran an ``identity`` mode
(pages computed from the key index, as ``../h100_2026-11-24d/probe_identity_pages.py`` does);
its table was an identity over the whole launch, not per sequence, so it failed its own check
at 8 x 8K and gave no numbers; it is left out here.

Probe: how much of a small decode's GPU time is the chain of dependent loads before its first
key block (contiguous: ``cu_seqlens_k`` -> keys; paged: the length -> the split's table entry ->
keys)? GPU time of CUDA-graph replays (``bench_kernels.graph_us``), 32q/8kv x 128 bf16.

    python benchmarks/probe_decode_chain.py MODE [--rounds R]

MODE (one per process, since the kernels compile once per process):
  off     paged decode looks each block's page up (``TABLE_AHEAD_MAX = 0``: the old path)
  first   the row's table entries are read with the length; the first page comes from them
  all     every block's page from those registers (``TABLE_AHEAD_ALL``)
  inloop  each block looks its own page up in its own iteration (not carried)
  oracle  upper bound: the length and first key row are constants (``ORACLE_CTX``, uniform
          batches only), so no load precedes the keys; paged as ``all``
With no MODE the script runs every mode in its own process, ``--rounds`` times, interleaved,
and prints the medians.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import triton
import triton.language as tl

SHAPES = [(1, 4096), (1, 32768), (8, 8192), (64, 8192), (128, 2048)]
MODES = ("off", "first", "all", "inloop", "oracle")
ORACLE_N = None  # the oracle's constant length (a tl.constexpr in its process)


def run_mode(mode: str) -> dict[str, float]:
    import torch

    from attention_kernels import decode_kernel as dk

    if mode == "off":
        dk.TABLE_AHEAD_MAX = 0
    if mode in ("all", "oracle"):
        dk.TABLE_AHEAD_ALL = True
    if mode == "inloop":
        dk.TABLE_AHEAD_MAX = 0
        dk.TABLE_AHEAD_ALL = "in-loop"
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_kernels import graph_us

    from attention_kernels import decode, paged_decode

    H, HK, D = 32, 8, 128
    res: dict[str, float] = {}
    shapes = SHAPES
    if mode == "oracle":
        ctx = int(os.environ["ORACLE_CTX"])
        global ORACLE_N
        ORACLE_N = tl.constexpr(ctx)
        shapes = [s for s in SHAPES if s[1] == ctx]

        @triton.jit
        def oracle_keys(lens, seq, PAGED: tl.constexpr):
            if PAGED:
                return 0, seq * 0 + ORACLE_N
            return seq * ORACLE_N, seq * 0 + ORACLE_N

        from attention_kernels import _paging
        dk.seq_keys = oracle_keys
        _paging.seq_keys = oracle_keys
    for batch, ctx in shapes:
        q = torch.randn(batch, H, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(batch * ctx, HK, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        cu = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * ctx
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        ref = decode(q, k, v, cu)
        res[f"{batch}x{ctx} contig"] = graph_us(lambda: decode(q, k, v, cu))
        for page in (64, 16):
            kp, vp = k.view(-1, page, HK, D), v.view(-1, page, HK, D)
            # A shuffled table, as a pool hands pages out.
            table = torch.randperm(kp.shape[0], device="cuda").to(torch.int32).view(batch, -1)
            kp2, vp2 = torch.empty_like(kp), torch.empty_like(vp)
            kp2[table.view(-1).long()] = kp
            vp2[table.view(-1).long()] = vp
            got = paged_decode(q, kp2, vp2, table, lens)
            err = (got.float() - ref.float()).abs().max().item()
            assert err < 2e-2, (mode, batch, ctx, page, err)
            res[f"{batch}x{ctx} page{page}"] = graph_us(
                lambda: paged_decode(q, kp2, vp2, table, lens))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", nargs="?", choices=MODES)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.mode:
        print("RESULT " + json.dumps(run_mode(a.mode)), flush=True)
        return
    runs: dict[str, dict[str, list[float]]] = {}
    for r in range(a.rounds):
        for mode in MODES:
            ctxs = [4096] if mode == "oracle" else [None]
            for ctx in ctxs:
                env = dict(os.environ)
                if ctx:
                    env["ORACLE_CTX"] = str(ctx)
                p = subprocess.run([sys.executable, __file__, mode], env=env, text=True,
                                   capture_output=True)
                line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
                if p.returncode or not line:
                    print(f"{mode} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}", flush=True)
                    continue
                got = json.loads(line[0][7:])
                print(f"round {r} {mode}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()),
                      flush=True)
                for k, v in got.items():
                    runs.setdefault(k, {}).setdefault(mode, []).append(v)
    print("\nmedian GPU us | " + " | ".join(MODES))
    for k, by in runs.items():
        print(f"{k:18s} | " + " | ".join(
            f"{statistics.median(by[m]):7.2f}" if m in by else "      -" for m in MODES))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
