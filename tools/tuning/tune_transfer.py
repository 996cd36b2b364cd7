"""Transfer tuning by measurement: message (chunk) size, HTTP/2 settings, channels per client.

1. raw gRPC: the request's bytes up and the output's bytes down through a bare echo server
   (its own process), for each message size x gRPC option set (applied on both sides);
2. the service, one process: one call's round trip from host tensors for each message size
   (the client's ``max_chunk_bytes`` and the server's ``--chunk-bytes`` together);
3. channels per client: one asyncio client process with ``--concurrency`` calls in flight
   against ``--frontends`` front ends, for each channel count (connections spread over front
   ends by SO_REUSEPORT).

    python tools/tuning/tune_transfer.py --out DIR                       # GPU host defaults
    python tools/tuning/tune_transfer.py --mib-in 4 --mib-out 1 --iters 2 --tokens 256 \\
        --heads 4 --head-dim 32 --device cpu --frontends 2 --concurrency 4 --seconds 1 \\
        --channels 1,2                                                 # a quick cpu check
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

from attention_wire import grpc_defaults

grpc_defaults.apply()  # the client library's grpc I/O settings, before grpc loads

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_roundtrip import (
    _start,
    _stop,
    _wait_serving,
    serve_transfer,
    transfer_seconds,
)
from bench_service import _free_port

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
OPTION_SETS: dict[str, list[tuple[str, Any]]] = {
    "default": [],
    "frame-16M": [("grpc.http2.max_frame_size", 16 * MiB - 1)],
    "window-64M": [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 64 * MiB)],
    "write-buffer-8M": [("grpc.http2.write_buffer_size", 8 * MiB)],
}


def raw(port: int, options: list[tuple[str, Any]], up: int, down: int, chunk: int,
        iters: int) -> float:
    """Median seconds of one round trip of ``up`` bytes in ``chunk``-byte messages."""
    return statistics.median(transfer_seconds(port, up, down, chunk, iters, options))


def service_round_trip(args: argparse.Namespace, chunk: int) -> float:
    import torch

    from attention_client import AttentionClient

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "attention_service", "--host", "127.0.0.1", "--port", str(port),
         "--device", args.device, "--metrics-port", "-1", "--frontends", "1",
         "--chunk-bytes", str(min(chunk, 4 * MiB - 4096)), "--log-level", "WARNING"], cwd=ROOT)
    try:
        _wait_serving(f"127.0.0.1:{port}")
        n, h, d = args.tokens, args.heads, args.head_dim
        q, k, v = (torch.randn(n, h, d).bfloat16() for _ in range(3))
        cu = torch.tensor([0, n], dtype=torch.int32)
        with AttentionClient(f"127.0.0.1:{port}", timeout=600, use_regions=False,
                             max_chunk_bytes=chunk) as c:
            c.attention(q, k, v, cu)
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                c.attention(q, k, v, cu)
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        _stop(proc)


def channels_point(target: str, args: argparse.Namespace, channels: int) -> float:
    """GB/s (in + out) of one asyncio client with ``concurrency`` calls in flight."""
    code = (
        "import asyncio, time, torch, sys\n"
        "from attention_client import AsyncAttentionClient\n"
        f"n, h, d = {args.agg_tokens}, {args.heads}, {args.head_dim}\n"
        "q, k, v = (torch.randn(n, h, d).bfloat16() for _ in range(3))\n"
        "cu = torch.tensor([0, n], dtype=torch.int32)\n"
        "async def main():\n"
        f"    async with AsyncAttentionClient({target!r}, timeout=600, use_regions=False,\n"
        f"                                    channels={channels}) as c:\n"
        f"        await asyncio.gather(*(c.attention(q, k, v, cu) for _ in range({channels})))\n"
        "        calls = 0\n"
        f"        end = time.perf_counter() + {args.seconds}\n"
        "        async def loop():\n"
        "            nonlocal calls\n"
        "            while time.perf_counter() < end:\n"
        "                await c.attention(q, k, v, cu)\n"
        "                calls += 1\n"
        f"        await asyncio.gather(*(loop() for _ in range({args.concurrency})))\n"
        "        print(calls)\n"
        "asyncio.run(main())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, check=True).stdout
    calls = int(out.split()[-1])
    return calls * 4 * args.agg_tokens * args.heads * args.head_dim * 2 / args.seconds / 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mib-in", type=int, default=96)
    p.add_argument("--mib-out", type=int, default=32)
    p.add_argument("--chunks", default="262144,1048576,3670016", help="message sizes (bytes)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--device", default="auto")
    p.add_argument("--frontends", type=int, default=4)
    p.add_argument("--channels", default="1,2,4,8")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--agg-tokens", type=int, default=2048)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--out", type=Path, default=ROOT / "tools" / "tuning" / "results")
    p.add_argument("--serve", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve is not None:
        serve_transfer(OPTION_SETS[args.serve])
        return 0
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    chunks = [int(x) for x in args.chunks.split(",")]
    up, down = args.mib_in * MiB, args.mib_out * MiB
    result: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": date.today().isoformat(), "grpcio": grpc.__version__, "cpus": os.cpu_count(),
        "raw_GBps": {}, "service_ms": {}, "channels_GBps": {},
    }
    print(f"raw gRPC, {args.mib_in} MiB up + {args.mib_out} MiB down, GB/s (median of "
          f"{args.iters}):")
    print("options".ljust(18) + "".join(f"{c // 1024:>10d}K" for c in chunks))
    for name, options in OPTION_SETS.items():
        proc, port = _start([sys.executable, __file__, "--serve", name], env)
        try:
            row = {c: (up + down) / raw(port, options, up, down, c, args.iters) / 1e9
                   for c in chunks}
        finally:
            _stop(proc)
        result["raw_GBps"][name] = {str(c): g for c, g in row.items()}
        print(name.ljust(18) + "".join(f"{row[c]:11.2f}" for c in chunks))
    print(f"service round trip, {args.tokens} x {args.heads} x {args.head_dim} bf16, ms:")
    for c in chunks:
        ms = 1e3 * service_round_trip(args, c)
        result["service_ms"][str(c)] = ms
        print(f"  chunk {c // 1024:6d}K: {ms:8.2f}")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "attention_service", "--host", "127.0.0.1", "--port", str(port),
         "--device", args.device, "--metrics-port", "-1", "--frontends", str(args.frontends),
         "--log-level", "WARNING"], cwd=ROOT)
    try:
        _wait_serving(f"127.0.0.1:{port}")
        print(f"one client process, {args.concurrency} calls in flight, {args.frontends} front "
              f"ends, {args.agg_tokens}-token requests, GB/s:")
        for n in (int(x) for x in args.channels.split(",")):
            gbps = channels_point(f"127.0.0.1:{port}", args, n)
            result["channels_GBps"][str(n)] = gbps
            print(f"  channels {n:2d}: {gbps:6.2f}")
    finally:
        _stop(proc)
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    tag = re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name() if
                 torch.cuda.is_available() else "cpu").strip("_")
    path = args.out / f"tune_transfer_{tag}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
