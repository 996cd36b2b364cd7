"""The batching executor alone: dynamic batching on vs off with no gRPC in the way.

bench_service.py measures the whole service, where one Python process moving ~5 MB per request
through gRPC is the ceiling for both sides. This script asks the other question: what the
batching executor (queue + packed launches + stream overlap) gives when requests arrive as fast
as the executor takes them. N asyncio tasks in this process submit ready jobs (pinned host
tensors, lengths log-uniform in [--min-len, --max-len], the same distribution and seed as
bench_service.py; ``--mode decode``: one query over that many cached keys) straight to the
engine's ``Executor`` over one backend (batching off: every job its own launch, through the
same queue and launch path), for ``--duration`` seconds per point; each side's answers are
checked against the float64 reference first. Prints requests/s, p50/p95/p99 latency (submit
to result), mean batch size, queue wait, kernel busy, side by side with on/off ratios, and
writes JSON + CSV.

    python benchmarks/bench_batching.py                                    # GPU: defaults
    python benchmarks/bench_batching.py --device cpu --clients 1,4 --duration 1 --max-len 48 \
        --heads 4 --kv-heads 2 --head-dim 32                               # a quick cpu check
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attention_kernels import decode_ref, prefill_ref
from attention_service.config import ServerConfig
from attention_service.engine.backends import Backend, make_backend
from attention_service.engine.dtypes import WIRE_DTYPES
from attention_service.engine.executor import Executor
from attention_service.engine.jobs import Job
from attention_service.params import Op, make_params

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_service import (
    SUMMARY_SERIES,
    _f,
    _slug,
    add_common_args,
    parse_common,
    summarize,
    table,
    write_outputs,
)
from service_load import loguniform_lengths

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOLERANCE = {"bf16": 3e-2, "fp16": 4e-3, "fp32": 2e-3}


class LaunchTally:
    """LaunchObserver that sums what bench_service.py reads from /metrics, under the same
    names, so its summary and table code apply unchanged."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.totals: dict[str, float] = dict.fromkeys(SUMMARY_SERIES, 0.0)

    def observe_launch(self, op: Op, *, requests: int, tokens: int, kernel: float,
                       **_: object) -> None:
        with self._lock:
            self.totals["attention_batch_requests_sum"] += requests
            self.totals["attention_batch_requests_count"] += 1
            self.totals["attention_batch_tokens_sum"] += tokens
            self.totals["attention_stage_seconds_sum"] += kernel

    def queue_wait(self, seconds: float) -> None:
        with self._lock:
            self.totals["attention_queue_wait_seconds_sum"] += seconds
            self.totals["attention_queue_wait_seconds_count"] += 1

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.totals)


def make_jobs(args: argparse.Namespace, backend: Backend, count: int, seed: int,
              max_len: int | None = None) -> list[Job]:
    """Jobs as the servicer hands them over (host tensors in the backend's buffers): one
    prefill sequence of n tokens, or one decode query over n cached keys."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    dtype = DTYPES[args.dtype]
    h, hk, d = args.heads, args.kv_heads, args.head_dim
    jobs = []
    for n in loguniform_lengths(rng, count, args.min_len, max_len or args.max_len):
        n = int(n)

        def host(rows: int, heads: int, fill: bool = True) -> torch.Tensor:
            t = torch.randn(rows, heads, d, generator=g).to(dtype)
            buf = backend.alloc_host(t.nbytes).view(dtype).view(t.shape)
            return buf.copy_(t) if fill else buf.fill_(float("nan"))

        if args.mode == "decode":
            params = make_params(Op.DECODE, WIRE_DTYPES[dtype], (1, h, d), (n, hk, d), (0, n))
            jobs.append(Job(params, host(1, h), host(n, hk), host(n, hk), host(1, h, False),
                            None))
            continue
        params = make_params(Op.PREFILL, WIRE_DTYPES[dtype], (n, h, d), (n, hk, d), (0, n),
                             (0, n), causal=args.causal)
        jobs.append(Job(params, host(n, h), host(n, hk), host(n, hk), host(n, h, False), None))
    return jobs


def fresh(job: Job, own_output: bool = False) -> Job:
    """A new submission of the same tensors (own cancel flag and timestamps); the output
    buffer is shared unless ``own_output`` (speed runs don't read it)."""
    out = torch.full_like(job.out, float("nan")) if own_output else job.out
    return Job(job.params, job.q, job.k, job.v, out, job.lse, job.cache)


async def verify(executor: Executor, jobs: list[Job], dtype: str) -> str:
    """All jobs at once (so batching merges them); every caller must get its own rows."""
    runs = [fresh(j, own_output=True) for j in jobs]
    results = await asyncio.gather(*(executor.run(j) for j in runs))
    worst = 0.0
    for job in runs:
        p = job.params
        cu = torch.tensor(p.cu_seqlens_k, dtype=torch.int32)
        if p.op is Op.DECODE:
            ref = decode_ref(job.q, job.k, job.v, cu, compute_dtype=torch.float64)
        else:
            ref = prefill_ref(job.q, job.k, job.v, cu, cu, causal=p.causal,
                              compute_dtype=torch.float64)
        err = (job.out.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
        if not err <= TOLERANCE[dtype]:
            raise SystemExit(f"verify: a result differs from the reference by {err:.3g}")
        worst = max(worst, err)
    batched = max(r.batch_requests for r in results)
    return (f"{len(jobs)} concurrent jobs match the reference (max abs err {worst:.2g}, "
            f"largest launch {batched} requests)")


async def drive(executor: Executor, tally: LaunchTally, pool: list[Job], clients: int,
                warmup: float, duration: float, seed: int) -> dict[str, Any]:
    """``clients`` closed-loop submitters; latencies of the calls that end in the window."""
    loop = asyncio.get_running_loop()
    t_measure = loop.time() + warmup
    t_end = t_measure + duration
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    marks: dict[str, dict[str, float]] = {}

    async def client(rng: np.random.Generator) -> None:
        while loop.time() < t_end:
            job = fresh(pool[int(rng.integers(len(pool)))])
            t0 = time.perf_counter()
            try:
                stats = await executor.run(job)
            except Exception as exc:  # counted, never fatal: the table shows them
                errors[type(exc).__name__] += 1
                continue
            if t_measure <= loop.time() <= t_end:
                latencies.append(time.perf_counter() - t0)
                tally.queue_wait(stats.queue_seconds)

    async def mark() -> None:
        await asyncio.sleep(warmup)
        marks["m0"] = tally.snapshot()
        await asyncio.sleep(duration)
        marks["m1"] = tally.snapshot()

    rngs = np.random.default_rng(seed).spawn(clients)
    await asyncio.gather(mark(), *(client(r) for r in rngs))
    return summarize([{"latencies": latencies, "errors": dict(errors)}], duration,
                     marks["m0"], marks["m1"])


async def run_side(args: argparse.Namespace, backend: Backend, side: str,
                   pool: list[Job], checks: list[Job]) -> list[dict[str, Any]]:
    tally = LaunchTally()
    config = ServerConfig(batching=side == "on", **({"max_batch_tokens": args.max_batch_tokens}
                          if args.max_batch_tokens else {}),
                          **({"max_queue_delay_ms": args.max_queue_delay_ms}
                             if args.max_queue_delay_ms is not None else {}))
    executor = Executor(
        backend, batching=config.batching, max_batch_tokens=config.max_batch_tokens,
        max_queue_delay_s=config.max_queue_delay_ms / 1e3, max_queue_size=config.max_queue_size,
        observer=tally,
    )
    print(f"batching {side}", flush=True)
    try:
        if checks:
            print(f"  verify: {await verify(executor, checks, args.dtype)}", flush=True)
        if args.prime > 0:  # every launch shape compiles once, outside the measured points
            for n in sorted(args.client_counts):
                await drive(executor, LaunchTally(), pool, n, 0.0, args.prime, args.seed + 1)
        rows = []
        for n in args.client_counts:
            row = await drive(executor, tally, pool, n, args.warmup, args.duration, args.seed)
            row.update(side=side, clients=n)
            rows.append(row)
            print(f"  clients {n:4d}: {row['rps']:9.1f} req/s  p50 {_f(row['p50_ms'], 2)}  "
                  f"p99 {_f(row['p99_ms'], 2)} ms  batch {_f(row['mean_batch_requests'], 2)}  "
                  f"queue {_f(row['mean_queue_ms'], 2)} ms  kernel busy "
                  f"{_f(100 * row['kernel_busy'], 1)}%  errors {row['errors']}", flush=True)
        return rows
    finally:
        await asyncio.to_thread(executor.close)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per point")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds per point")
    p.add_argument("--prime", type=float, default=2.0,
                   help="unmeasured seconds at each client count before the measured points")
    p.add_argument("--mode", default="prefill", choices=["prefill", "decode"],
                   help="decode: one query over n cached keys per request")
    p.add_argument("--max-batch-tokens", type=int, help="executor budget (server default)")
    p.add_argument("--max-queue-delay-ms", type=float, help="executor delay (server default)")
    p.add_argument("--pool", type=int, default=64, help="distinct jobs to draw from")
    p.add_argument("--verify", type=int, default=16, help="jobs checked first (0 = skip)")
    return parse_common(p, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    backend = make_backend(args.device)
    backend.warmup()
    pool = make_jobs(args, backend, args.pool, args.seed)
    # Short jobs for the check, so the float64 reference stays quick on the cpu.
    checks = make_jobs(args, backend, args.verify, args.seed + 7,
                       max_len=min(args.max_len, 256)) if args.verify else []
    rows: list[dict[str, Any]] = []
    for side in args.sides:
        rows += asyncio.run(run_side(args, backend, side, pool, checks))
    print()
    causal = " causal" if args.causal and args.mode == "prefill" else ""
    print(f"{backend.device_name}: executor alone (no gRPC), {args.mode} {args.dtype} "
          f"H{args.heads}/{args.kv_heads} D{args.head_dim}{causal}, "
          f"lengths log-uniform {args.min_len}..{args.max_len}, {args.duration:g} s per point")
    print(table(rows, args.client_counts))
    report = {
        "command": " ".join([Path(sys.argv[0]).name,
                             *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "wall_seconds": round(time.time() - t0, 1),
        "device": backend.device_name, "backend": backend.name,
        "torch_version": torch.__version__,
        "config": {k: v for k, v in vars(args).items() if k not in ("client_counts", "sides")},
        "results": rows,
    }
    paths = write_outputs(Path(args.out), f"batching_{args.mode}_{_slug(backend.device_name)}",
                          report)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if all(r["errors"] == 0 and r["completed"] > 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
