"""Packing a batch from page-locked host memory: one ``copy_segments`` launch (what the engine
does for batches of two or more jobs, ``engine/cuda_launch.py``) against one DMA copy per job
(``copy_(non_blocking=True)``, the copy engines; what ``ATTENTION_PACK_KERNEL=0`` does), over
job sizes and batch sizes, on an idle GPU and on one kept busy by a matmul loop on another
stream (the kernel needs SMs, the copy engines do not).

Prints a table (GB/s of host-to-device bytes and the kernel's time over the copies') and
writes JSON. Needs a CUDA device that reads host pointers (``can_use_host_pointers``).

    python tools/tuning/bench_copy_segments.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "kernels"))
from attention_kernels.copy_segments import (  # noqa: E402
    ROW,
    can_use_host_pointers,
    copy_segments,
    unit_of,
    warm,
)

KiB, MiB = 1 << 10, 1 << 20


def _time(fn: Any, iters: int, stream: torch.cuda.Stream) -> float:
    """Median milliseconds of ``fn`` on ``stream`` (CUDA events around each run)."""
    times = []
    with torch.cuda.stream(stream):
        for _ in range(iters + 2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def measure(jobs: int, job_bytes: int, busy: bool, iters: int, device: torch.device
            ) -> dict[str, Any]:
    srcs = [torch.randint(0, 255, (job_bytes,), dtype=torch.uint8).pin_memory()
            for _ in range(jobs)]
    dst = torch.empty(jobs * job_bytes, dtype=torch.uint8, device=device)
    rows = [(s.data_ptr(), dst.data_ptr() + i * job_bytes, job_bytes, 0)
            for i, s in enumerate(srcs)]
    unit = unit_of(*(v for r in rows for v in r[:3]))
    table = torch.tensor([[a, b, n // unit, 0] for a, b, n, _ in rows], dtype=torch.int64,
                         device=device).reshape(-1, ROW)
    max_units = job_bytes // unit

    def kernel() -> None:
        copy_segments(table, unit, max_units)

    def copies() -> None:
        for i, s in enumerate(srcs):
            dst[i * job_bytes : (i + 1) * job_bytes].copy_(s, non_blocking=True)

    # Correctness first: both leave the same bytes.
    stream = torch.cuda.Stream(device)
    for fn in (kernel, copies):
        dst.fill_(0)
        with torch.cuda.stream(stream):
            fn()
        stream.synchronize()
        assert torch.equal(dst.cpu(), torch.cat(srcs)), fn.__name__

    side = torch.cuda.Stream(device)
    total = jobs * job_bytes

    def hog() -> None:
        # Matmuls (~1.5 ms each, every SM) queued on another stream for longer than the
        # timed runs take at 20 GB/s, so they run beside every one of them.
        if not busy:
            return
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        c = torch.empty_like(a)
        n = max(20, int(total / 20e9 * (iters + 2) / 1.5e-3))
        with torch.cuda.stream(side):
            for _ in range(n):
                torch.mm(a, a, out=c)

    hog()
    t_kernel = _time(kernel, iters, stream)
    side.synchronize()
    hog()
    t_copies = _time(copies, iters, stream)
    side.synchronize()
    return {"jobs": jobs, "job_bytes": job_bytes, "busy": busy, "unit": unit,
            "kernel_ms": t_kernel, "copies_ms": t_copies,
            "kernel_GBps": total / t_kernel / 1e6, "copies_GBps": total / t_copies / 1e6,
            "kernel_over_copies": t_kernel / t_copies}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", default="2,8,32")
    p.add_argument("--sizes", default="16K,256K,1M,4M,24M",
                   help="bytes per job (K and M suffixes)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=ROOT / "tools" / "tuning" / "results")
    args = p.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    if not can_use_host_pointers(device.index):
        print("this device does not read host pointers: nothing to compare")
        return 1
    warm(device)

    def size(s: str) -> int:
        return int(s[:-1]) * {"K": KiB, "M": MiB}[s[-1]] if s[-1] in "KM" else int(s)

    rows = []
    name = torch.cuda.get_device_name(device)
    print(f"{name}: pinned host -> device, one copy_segments launch vs one copy_ per job")
    print(f"{'busy':>5} {'jobs':>5} {'per job':>9} {'kernel GB/s':>12} {'copies GB/s':>12} "
          f"{'kernel/copies':>14}")
    for busy in (False, True):
        for jobs in (int(j) for j in args.jobs.split(",")):
            for s in args.sizes.split(","):
                n = size(s)
                if jobs * n > 2 << 30:
                    continue
                r = measure(jobs, n, busy, args.iters, device)
                rows.append(r)
                print(f"{'yes' if busy else 'no':>5} {jobs:>5} {s:>9} {r['kernel_GBps']:>12.1f} "
                      f"{r['copies_GBps']:>12.1f} {r['kernel_over_copies']:>14.2f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"copy_segments_{name.replace(' ', '_')}.json"
    path.write_text(json.dumps({
        "device": name, "torch": torch.__version__, "command": " ".join(sys.argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "rows": rows,
    }, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
