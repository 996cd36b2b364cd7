"""A/B of one client's same-host region call: a kept-open call stream vs a unary call each.

Two ``AttentionClient``s on one server, one with ``call_streams`` on (the default) and one
with it off, call in turn (ABAB...), each with q/k/v and ``out=`` in its own registered region
(``--path``: ``ipc-out`` a CUDA IPC region, ``shm-out`` system shared memory), so drift of the
host or the GPU hits both sides alike. Per side: p10/p50/p90 of the round trip (the call and,
for CUDA, a synchronize: what a caller waits for), and the median of the paired differences.

    python benchmarks/ab_call_streams.py --frontends 1,8 --out benchmarks/results/issue10/x
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_roundtrip import ROOT, _free_port, _stop, _wait_serving

SIDES = ("streams", "unary")


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * (len(s) - 1) + 0.5))]


def measure(target: str, args: argparse.Namespace) -> dict[str, Any]:
    from attention_client import AttentionClient

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    shape = (args.tokens, args.heads, args.head_dim)
    g = torch.Generator().manual_seed(0)
    host = [torch.randn(shape, generator=g).to(dtype) for _ in range(3)]
    cu = torch.tensor([0, args.tokens], dtype=torch.int32)
    nbytes = 4 * host[0].numel() * host[0].element_size() + (1 << 20)
    cuda = args.path == "ipc-out"
    clients, calls = {}, {}
    for side in SIDES:
        c = clients[side] = AttentionClient(target, timeout=600, call_streams=side == "streams")
        region = c.register_cuda(nbytes) if cuda else c.register_shm(nbytes)
        q, k, v = (region.empty(t.shape, t.dtype).copy_(t) for t in host)
        out = region.empty(host[0].shape, host[0].dtype)
        calls[side] = (c, q, k, v, out)
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    try:
        for i in range(args.warm + args.calls):
            for side in SIDES:
                c, q, k, v, out = calls[side]
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                c.attention(q, k, v, cu, out=out)
                if cuda:
                    torch.cuda.synchronize()
                if i >= args.warm:
                    times[side].append((time.perf_counter() - t0) * 1e3)
        kernel_ms = 1e3 * float((clients["streams"].last_stats or {}).get("kernel_seconds", 0))
    finally:
        for c in clients.values():
            c.close()
    diffs = [a - b for a, b in zip(times["streams"], times["unary"], strict=True)]
    return {
        "sides": {side: {"p10_ms": _pct(t, 0.1), "p50_ms": _pct(t, 0.5),
                         "p90_ms": _pct(t, 0.9)} for side, t in times.items()},
        "paired_diff_p50_ms": statistics.median(diffs),
        "kernel_ms": kernel_ms,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--path", choices=["ipc-out", "shm-out"], default="ipc-out")
    p.add_argument("--device", default="auto", help="server device: auto, cuda or cpu")
    p.add_argument("--frontends", default="1,8", help="comma list of front-end counts")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--calls", type=int, default=200, help="measured calls per side")
    p.add_argument("--warm", type=int, default=20)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    rows = []
    device = "cpu"
    for n in [int(x) for x in args.frontends.split(",") if x]:
        port = _free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "attention_service", "--host", "127.0.0.1", "--port",
             str(port), "--device", args.device, "--metrics-port", "-1", "--frontends", str(n),
             "--log-level", "WARNING"], env=env, cwd=ROOT)
        target = f"127.0.0.1:{port}"
        try:
            _wait_serving(target)
            from attention_client import AttentionClient

            with AttentionClient(target) as c:
                device = c.info()["device"]
            rows.append({"frontends": n, **measure(target, args)})
        finally:
            _stop(proc)
    lines = [
        f"# ab_call_streams: {device}, {date.today().isoformat()}", "",
        f"`python benchmarks/ab_call_streams.py {' '.join(sys.argv[1:])}`", "",
        f"--path {args.path}: {args.tokens} x {args.heads} x {args.head_dim} {args.dtype}, "
        f"{args.calls} calls per side, alternating; host {os.cpu_count()} cpus.", "",
        "| front ends | side | p10 ms | p50 ms | p90 ms | kernel ms |", "|---|---|---|---|---|---|",
    ]
    for r in rows:
        for side in SIDES:
            s = r["sides"][side]
            lines.append(f"| {r['frontends']} | {side} | {s['p10_ms']:.3f} | {s['p50_ms']:.3f} "
                         f"| {s['p90_ms']:.3f} | {r['kernel_ms']:.3f} |")
        lines.append(f"| {r['frontends']} | streams - unary (paired p50) | | "
                     f"{r['paired_diff_p50_ms']:+.3f} | | |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"ab_call_streams_{args.path}_{time.strftime('%Y%m%d_%H%M%S')}"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(
        {"command": " ".join(sys.argv), "device": device, "path": args.path,
         "shape": [args.tokens, args.heads, args.head_dim, args.dtype], "rows": rows},
        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
