"""Prefill program order on a GPU: which (query-block slot, head) programs run side by side.

    python tools/tuning/tune_prefill_order.py [--out DIR] [--rounds 2]

The prefill grid runs ``_prefill_slots.SLOT_RUN`` slots of one head, then the same slots of the
next head. A run of 1 (every head of a slot, then the next slot) starts all heads of causal's
heaviest tiles together; longer runs keep the ~132 resident programs of an H100 on fewer
heads, whose K/V tiles then stay in L2; 0 runs every slot of a head before the next head.
Each shape is timed at each run length, alternating ``--rounds`` times, with SDPA cuDNN and
FLASH in the same run; outputs are checked against cuDNN first. bf16, do_bench medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_kernels import CHECK_TOL, DTYPE, bench, cu, flops, rel, sdpa

from attention_kernels import prefill
from attention_kernels import prefill_kernel as pk
from attention_kernels._prefill_slots import SLOT_RUN

RUNS = (1, 4, 8, 16, 32, 0)  # slots per head run (_prefill_slots.SLOT_RUN); 0: all of them
# (name, head dim, q heads, kv heads, lengths, causal)
CASES = [
    *[(f"dense N={n}", d, 2048 // d, 2048 // d, [n] * (16384 // n), c)
      for d in (128, 64) for c in (False, True) for n in (4096, 8192, 16384)],
    ("gqa 32/8 N=8192", 128, 32, 8, [8192] * 2, True),
    ("varlen [8192,16x4]", 128, 16, 16, [8192, 16, 16, 16, 16], True),
    ("varlen [512]*32", 128, 16, 16, [512] * 32, True),
]


def run_case(name: str, d: int, heads: int, kv_heads: int, lens: list[int], causal: bool,
             rounds: int) -> dict:
    total = sum(lens)
    q = torch.randn(total, heads, d, dtype=DTYPE, device="cuda")
    k = torch.randn(total, kv_heads, d, dtype=DTYPE, device="cuda")
    v = torch.randn(total, kv_heads, d, dtype=DTYPE, device="cuda")
    cus = cu(lens)
    fl = flops(lens, lens, heads, d, causal)
    row: dict = {"case": name, "D": d, "H": heads, "Hkv": kv_heads, "causal": causal}
    if len(set(lens)) == 1:  # dense peers on [B, H, N, D]
        b, n = len(lens), lens[0]
        qd, kd, vd = (t.view(b, n, -1, d).transpose(1, 2) for t in (q, k, v))
        gqa = heads != kv_heads
        for peer, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                fn = sdpa(backend, qd, kd, vd, causal, gqa=gqa)
                want = fn().transpose(1, 2).reshape(total, heads, d)
                row[f"{peer}_TFLOPs"] = fl / bench(fn) / 1e9
                row.setdefault("ref", want)
            except RuntimeError as e:
                row[f"{peer}_error"] = str(e).splitlines()[0][:100]
    ref = row.pop("ref", None)
    times: dict[int, list[float]] = {r: [] for r in RUNS}
    default = SLOT_RUN[causal]
    for _ in range(rounds):
        for run in RUNS:
            SLOT_RUN[causal] = run
            pk._PLANS.clear()
            fn = lambda: prefill(q, k, v, cus, causal=causal)  # noqa: E731
            out = fn()
            if ref is not None:
                err = rel(out, ref)
                if not err < CHECK_TOL:
                    raise SystemExit(f"{name}: slot run {run}: check failed ({err:.3g})")
            times[run].append(bench(fn))
    SLOT_RUN[causal] = default
    pk._PLANS.clear()
    row["TFLOPs"] = {run: fl / statistics.median(t) / 1e9 for run, t in times.items()}
    base = row["TFLOPs"][1]
    cells = " | ".join(f"{run or 'all'}: {tf:6.1f} ({tf / base:.3f})"
                       for run, tf in row["TFLOPs"].items())
    print(f"{name:<22} D={d:<3d} causal={causal!s:<5} cuDNN "
          f"{row.get('cudnn_TFLOPs', float('nan')):6.1f} | FLASH "
          f"{row.get('flash_TFLOPs', float('nan')):6.1f} | slots per head run: {cells}",
          flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    rows = [run_case(*case, rounds=args.rounds) for case in CASES]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tune_prefill_order.json").write_text(json.dumps(
            {"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
