"""Where a small launch spends its host time: per-call wall time of our decode / prefill
wrappers in a loop (host-bound shapes, so the loop measures the Python path), the same for a
bare Triton kernel with as many arguments (the launcher's floor), and a cProfile of the
wrapper (top functions by own time).

    python benchmarks/profile_host.py [--calls 2000] [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import sdpa
from small_shapes import host_us
from torch.nn.attention import SDPBackend

from attention_kernels import decode, prefill


@triton.jit
def _noop(a, b, c, d, e, f, g, h, i, j, n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11,
          n12, n13, n14, x0, x1, x2, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    pid = tl.program_id(0)
    if pid < 0:
        tl.store(a, n0)


def _profile(fn, calls: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
    return s.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    dt = torch.bfloat16
    q = torch.randn(1, 32, 128, dtype=dt, device=dev)
    k = torch.randn(4096, 8, 128, dtype=dt, device=dev)
    v = torch.randn_like(k)
    cu_k = torch.tensor([0, 4096], dtype=torch.int32, device=dev)
    qp = torch.randn(256, 32, 128, dtype=dt, device=dev)
    cu = torch.tensor([0, 64, 192, 256], dtype=torch.int32, device=dev)
    kp = torch.randn(256, 8, 128, dtype=dt, device=dev)
    out_d = torch.empty_like(q)
    buf = torch.zeros(16, device=dev)
    cases = {
        "decode 1x4K": lambda: decode(q, k, v, cu_k, max_seqlen_k=4096),
        "decode 1x4K out=": lambda: decode(q, k, v, cu_k, max_seqlen_k=4096, out=out_d),
        "decode 1x4K window 1024": lambda: decode(q, k, v, cu_k, max_seqlen_k=4096,
                                                  window_size=(1024, -1)),
        "prefill [64,128,64] causal": lambda: prefill(qp, kp, kp, cu, max_seqlen_q=128,
                                                       max_seqlen_k=128, causal=True),
        "bare triton launch, 28 args": lambda: _noop[(1,)](
            buf, buf, buf, buf, buf, buf, buf, buf, buf, buf, *range(1, 16), 0.5, 1.5, None,
            BLOCK=16, FLAG=True),
        "torch.empty x2": lambda: (torch.empty(4096, device=dev), torch.empty(64, device=dev)),
    }
    # The peer: one SDPA cuDNN call on the same decode shape (GQA heads expanded by SDPA).
    cases["SDPA cuDNN decode 1x4K"] = sdpa(
        SDPBackend.CUDNN_ATTENTION, q.view(1, 32, 1, 128), k[None].transpose(1, 2),
        v[None].transpose(1, 2), causal=False, gqa=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "calls": args.calls, "host_us": {}}
    for name, fn in cases.items():
        us = host_us(fn, args.calls)
        result["host_us"][name] = us
        print(f"{name:32s} {us:8.1f} us per call (host loop)", flush=True)
    for name in ("decode 1x4K", "decode 1x4K window 1024", "prefill [64,128,64] causal"):
        text = _profile(cases[name], args.calls)
        result[f"profile {name}"] = text
        print(f"\n==== cProfile: {name}, {args.calls} calls\n{text}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_host.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
