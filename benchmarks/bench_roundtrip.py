"""Where the time of one remote prefill goes: round trip vs kernel vs raw gRPC transfer.

Starts two servers in their own processes on loopback: the attention service and a bare gRPC
"transfer" server that receives the same request bytes in the same chunk size and streams back
as many bytes as the attention output. Then, from this process:

- ``round trip``: ``AttentionClient.attention`` wall time (encode, upload, validate, queue,
  h2d, kernel, d2h, stream back, assemble), checked against the float64 reference first;
- ``server stages``: queue/h2d/kernel/d2h as the server reports them (``last_stats``);
- ``kernel``: ``attention_kernels.prefill`` timed in this process with CUDA events;
- ``raw gRPC``: the same bytes up and down through the transfer server.

    python benchmarks/bench_roundtrip.py --tokens 8192 --heads 16 --head-dim 128 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from datetime import date
from pathlib import Path

import grpc
import torch

ROOT = Path(__file__).resolve().parents[1]
TRANSFER_METHOD = "/bench.Transfer/Echo"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---- the bare transfer server (runs in its own process) -------------------------------------
def _serve_transfer() -> None:
    """Receive a stream of chunks; the first 8 bytes of the first one say how many bytes to send
    back, which go out in chunks of the same size as the largest chunk received."""

    def echo(request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        first = next(request_iterator)
        reply_bytes = int.from_bytes(first[:8], "little")
        chunk = len(first)
        for msg in request_iterator:
            chunk = max(chunk, len(msg))
        payload = bytes(chunk)
        sent = 0
        while sent < reply_bytes:
            n = min(chunk, reply_bytes - sent)
            yield payload[:n]
            sent += n

    handler = grpc.method_handlers_generic_handler(
        "bench.Transfer", {"Echo": grpc.stream_stream_rpc_method_handler(echo)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"listening on port {port}", flush=True)
    server.wait_for_termination()


# ---- helpers ----------------------------------------------------------------------------------
def _start(
    cmd: list[str], env: dict[str, str], timeout: float = 300.0
) -> tuple[subprocess.Popen, int]:
    """Start a server process and read its port from its 'listening on port N' line."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stderr.write(f"  [server] {line}")
        m = re.search(r"listening on port (\d+)", line)
        if m:
            # Keep draining its output so a chatty server never blocks on a full pipe.
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, int(m.group(1))
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"{cmd} did not report a port")


def _median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _transfer_seconds(
    port: int, in_bytes: int, out_bytes: int, chunk: int, iters: int
) -> list[float]:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = channel.stream_stream(TRANSFER_METHOD)
    payload = bytes(chunk)

    def requests() -> Iterator[bytes]:
        sent = 0
        while sent < in_bytes:
            n = min(chunk, in_bytes - sent)
            msg = payload[:n]
            if sent == 0:
                msg = out_bytes.to_bytes(8, "little") + msg[8:]
            yield msg
            sent += n

    times = []
    for i in range(iters + 1):
        t0 = time.perf_counter()
        received = sum(len(m) for m in call(requests()))
        if i:  # the first call warms the channel up
            times.append(time.perf_counter() - t0)
        assert received == out_bytes, (received, out_bytes)
    channel.close()
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seqs", type=int, default=1, help="split the tokens into this many sequences")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default="auto", help="server device: auto, cuda or cpu")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--serve-transfer", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_transfer:
        _serve_transfer()
        return 0

    from attention_client import AttentionClient
    from attention_client._chunks import DEFAULT_CHUNK_BYTES
    from attention_kernels.reference import prefill_ref

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    server, port = _start(
        [sys.executable, "-m", "attention_service", "--host", "127.0.0.1", "--port", "0",
         "--device", args.device, "--metrics-port", "0"], env)
    transfer, tport = _start([sys.executable, __file__, "--serve-transfer"], env)
    try:
        dtype = DTYPES[args.dtype]
        n, h, d = args.tokens, args.heads, args.head_dim
        hk = args.kv_heads or h
        g = torch.Generator().manual_seed(0)
        q = torch.randn(n, h, d, generator=g).to(dtype)
        k = torch.randn(n, hk, d, generator=g).to(dtype)
        v = torch.randn(n, hk, d, generator=g).to(dtype)
        bounds = [round(i * n / args.seqs) for i in range(args.seqs + 1)]
        cu = torch.tensor(bounds, dtype=torch.int32)
        in_bytes = q.nbytes + k.nbytes + v.nbytes + cu.nbytes
        out_bytes = q.nbytes

        with AttentionClient(f"127.0.0.1:{port}", timeout=600) as client:
            info = client.info()
            device_name = info["device"]
            out = client.attention(q, k, v, cu, causal=args.causal)
            ref_dev = "cuda" if torch.cuda.is_available() else "cpu"
            ref = prefill_ref(
                q.to(ref_dev), k.to(ref_dev), v.to(ref_dev), cu.to(ref_dev), causal=args.causal,
                compute_dtype=torch.float64,
            )
            err = _rel_err(out.to(ref_dev), ref)
            del ref
            tol = {torch.float32: 1e-3}.get(dtype, 1e-2)
            if err > tol:
                raise SystemExit(f"round-trip output differs from the reference: {err:.2e}")
            rt, stages = [], []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                client.attention(q, k, v, cu, causal=args.causal)
                rt.append(time.perf_counter() - t0)
                stages.append(client.last_stats)
            rt_cuda: list[float] = []
            if torch.cuda.is_available():  # the user's tensors on the GPU of the calling host
                qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
                for _ in range(args.iters):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    o = client.attention(qc, kc, vc, cu, causal=args.causal)
                    torch.cuda.synchronize()
                    rt_cuda.append(time.perf_counter() - t0)
                assert o.is_cuda
        chunk = int(info["chunk_bytes"]) or DEFAULT_CHUNK_BYTES
        raw = _transfer_seconds(tport, in_bytes, out_bytes, chunk, args.iters)

        kernel: list[float] = []
        if torch.cuda.is_available():
            from attention_kernels import prefill

            qd, kd, vd, cud = q.cuda(), k.cuda(), v.cuda(), cu.cuda()
            for _ in range(args.iters + 3):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                prefill(qd, kd, vd, cud, max_seqlen_q=n, max_seqlen_k=n, causal=args.causal)
                e1.record()
                e1.synchronize()
                kernel.append(e0.elapsed_time(e1) / 1e3)
            kernel = kernel[3:]
    finally:
        for proc in (server, transfer):
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

    def stage(name: str) -> float:
        return _median_ms([s[name] for s in stages])

    rows = [
        ("round trip (host tensors)", _median_ms(rt)),
        ("round trip (cuda tensors)", _median_ms(rt_cuda) if rt_cuda else float("nan")),
        ("  server queue", stage("queue_seconds")),
        ("  server h2d", stage("h2d_seconds")),
        ("  server kernel", stage("kernel_seconds")),
        ("  server d2h", stage("d2h_seconds")),
        ("kernel in-process (CUDA events)", _median_ms(kernel) if kernel else float("nan")),
        ("raw gRPC transfer, same bytes", _median_ms(raw)),
    ]
    print(f"\nprefill {n} tokens x {h} heads ({hk} kv) x {d} {args.dtype}, causal={args.causal}, "
          f"{args.seqs} seq; in {in_bytes / 2**20:.1f} MiB, out {out_bytes / 2**20:.1f} MiB; "
          f"server device {device_name}; median of {args.iters}; rel err {err:.2e}")
    for name, ms in rows:
        print(f"{name:34s} {ms:9.2f} ms")
    gbps = (in_bytes + out_bytes) / statistics.median(raw) / 1e9
    print(f"raw gRPC loopback throughput {gbps:.2f} GB/s")

    args.out.mkdir(parents=True, exist_ok=True)
    tag = re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_")
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": date.today().isoformat(), "server_device": device_name,
        "torch": torch.__version__, "grpcio": grpc.__version__,
        "shape": {"tokens": n, "seqs": args.seqs, "heads": h, "kv_heads": hk, "head_dim": d,
                  "dtype": args.dtype, "causal": args.causal},
        "bytes_in": in_bytes, "bytes_out": out_bytes, "rel_err": err,
        "median_ms": dict(rows), "raw_grpc_GBps": gbps,
        "samples_s": {"round_trip": rt, "round_trip_cuda": rt_cuda, "kernel": kernel, "raw": raw},
    }
    path = args.out / f"roundtrip_{tag}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
