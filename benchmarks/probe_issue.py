"""Host time of one batched prefill launch as the engine's dispatcher issues it (``BatchPlan``
plus ``CudaBackend.launch``: packing table, cu_seqlens, three kernels, four events), alone,
beside threads that take the GIL the way the engine's channel readers do, and with those
readers on a host whose other CPUs are kept busy too (as front ends and a load generator keep
them); and the C calls one launch makes. Diagnostic, not a benchmark of record: it says
whether a batch's issue time in the service (``attention_launch_issue_seconds``) is the
launch's own work or waiting for CPU and the GIL, and lets a change to the launch path be
tried in one process instead of a service A/B.

    python benchmarks/probe_issue.py [--batches 1,4,16] [--channels 8] [--rate 4300]
    python benchmarks/probe_issue.py --busy-procs 13 --cpus 0-2 --busy-cpus 3-15  # placed

The ``witness`` row counts the GIL hand-offs in one launch (``_witness_rounds``).

Jobs are laid out in one page-locked arena, as a front end's arena is, with lengths
log-uniform in [--min-len, --max-len] (bench_service.py's distribution), bf16, causal. Each
round issues a fresh batch (no cu_seqlens memo hits), times the issue, then waits for the GPU
(untimed). Readers: ``probe_gil_contention``'s feeder process and one thread per channel.
Busy: ``--busy-procs`` processes that each spin ``--busy-duty`` of every 10 ms (8 front ends
used ~70% of a core each under 64 clients of small prefills).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_gil_contention import _feed, _reader_threads  # noqa: E402

from attention_service.cpus import parse_cpu_list, pin_process  # noqa: E402
from attention_service.engine.backends import WIRE_DTYPES, CudaBackend  # noqa: E402
from attention_service.engine.batch_plan import BatchPlan, batch_key  # noqa: E402
from attention_service.engine.jobs import ByteBase, CancelEvent, Job  # noqa: E402
from attention_service.engine.regions import pin  # noqa: E402
from attention_service.params import Op, make_params  # noqa: E402

_ALIGN = 256


def _jobs(base: ByteBase, lengths: list[int], at: int, heads: int, kv_heads: int, dim: int
          ) -> tuple[list[Job], int]:
    """One job per length, its q/k/v/out laid out from byte ``at`` of ``base``."""
    jobs = []
    dt = torch.bfloat16
    for n in lengths:
        spans = {}
        for name, h in (("q", heads), ("k", kv_heads), ("v", kv_heads), ("out", heads)):
            spans[name] = (base, at, dt, (n, h, dim))
            at += -(-n * h * dim * 2 // _ALIGN) * _ALIGN
        params = make_params(Op.PREFILL, WIRE_DTYPES[dt], (n, heads, dim), (n, kv_heads, dim),
                             (0, n), (0, n), causal=True)
        jobs.append(Job(params, spans=spans))
    return jobs, at


def _rounds(backend: CudaBackend, batches: list[list[Job]], seconds: float) -> np.ndarray:
    key = batch_key(batches[0][0])
    flag = CancelEvent()
    times = []
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end:
        jobs = batches[i % len(batches)]
        i += 1
        t0 = time.perf_counter()
        pending = backend.launch(BatchPlan(jobs, key), flag)
        times.append(time.perf_counter() - t0)
        pending.wait()
    return np.array(times) * 1e3


def _witness_rounds(backend: CudaBackend, batches: list[list[Job]], seconds: float,
                    interval: float) -> np.ndarray:
    """``_rounds`` beside a thread that spins in Python, with a switch interval of
    ``interval``: each time the launch lets the GIL go the spinner takes it, and the launch
    gets it back only once it asks to for ``interval``. So the launch's extra time over
    ``interval`` counts the GIL hand-offs in one launch (a call that lets the GIL go but
    returns before the spinner wakes is not counted: nor would it cost in the engine)."""
    stop = False

    def spin() -> None:
        n = 0
        while not stop:
            n += 1

    previous = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        return _rounds(backend, batches, seconds)
    finally:
        stop = True
        thread.join()
        sys.setswitchinterval(previous)


def _c_calls(backend: CudaBackend, jobs: list[Job]) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()

    def prof(frame: object, event: str, arg: object) -> None:
        if event == "c_call":
            counts[getattr(arg, "__qualname__", None) or repr(arg)] += 1

    key = batch_key(jobs[0])
    sys.setprofile(prof)
    try:
        pending = backend.launch(BatchPlan(jobs, key), CancelEvent())
    finally:
        sys.setprofile(None)
    pending.wait()
    return counts


def _spin(duty: float, stop: float, cpus: frozenset[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    while time.perf_counter() < stop:
        end = time.perf_counter() + 0.01 * duty
        while time.perf_counter() < end:
            pass
        time.sleep(0.01 * (1 - duty))


@contextlib.contextmanager
def _contenders(args: argparse.Namespace, readers: bool, busy: bool) -> Iterator[None]:
    """Reader threads in this process (and their feeder), and busy processes, while inside."""
    stop = time.perf_counter() + args.seconds + 1.0
    ctx = mp.get_context("fork")  # the children never touch CUDA
    procs = []
    mine: list[socket.socket] = []
    if readers:
        pairs = [socket.socketpair() for _ in range(args.channels)]
        mine, theirs = [a for a, _ in pairs], [b for _, b in pairs]
        procs.append(ctx.Process(target=_feed, args=(theirs, args.rate, stop)))
        procs[-1].start()
        for s in theirs:
            s.close()
        for r in _reader_threads(mine, args.work_us):
            r.start()
    if busy:
        cpus = parse_cpu_list(args.busy_cpus) if args.busy_cpus else None
        for _ in range(args.busy_procs):
            procs.append(ctx.Process(target=_spin, args=(args.busy_duty, stop, cpus)))
            procs[-1].start()
    time.sleep(0.3)
    try:
        yield
    finally:
        for p in procs:
            p.join()
        for s in mine:
            s.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,4,16", help="requests per launch")
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--channels", type=int, default=8)
    p.add_argument("--rate", type=float, default=4300.0, help="messages/s over all channels")
    p.add_argument("--work-us", type=float, default=50.0, help="Python work per message")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--busy-procs", type=int, default=12,
                   help="processes keeping CPUs busy in the last mode (0: skip that mode)")
    p.add_argument("--busy-duty", type=float, default=0.7)
    p.add_argument("--busy-cpus", default="", help="CPU list of the busy processes (all)")
    p.add_argument("--cpus", default="", help="CPU list of this process (as placed)")
    p.add_argument("--switch-interval", type=float, default=0.0,
                   help="sys.setswitchinterval for the run (0: leave the default)")
    p.add_argument("--witness-interval", type=float, default=0.001,
                   help="switch interval of the hand-off count (0: skip it)")
    args = p.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    torch.set_num_threads(1)
    if args.cpus:
        pin_process(parse_cpu_list(args.cpus))
    backend = CudaBackend(cuda_graphs=False)
    arena_bytes = 512 << 20
    arena = torch.empty(arena_bytes, dtype=torch.uint8)
    unpin = pin(arena, arena_bytes)
    base = ByteBase(arena)
    rng = np.random.default_rng(0)
    sizes = [int(b) for b in args.batches.split(",")]
    print(f"{torch.cuda.get_device_name()}; switch interval {sys.getswitchinterval() * 1e6:.0f}"
          f" us; readers: {args.channels} channels, {args.rate:.0f} msg/s, {args.work_us:.0f} "
          f"us of Python each; busy: {args.busy_procs} processes at {args.busy_duty:.0%} "
          f"on CPUs {args.busy_cpus or 'any'}; this process on CPUs {args.cpus or 'any'}")
    print(f"{'batch':>5}  {'mode':>7}  {'rounds':>6}  {'mean ms':>8}  "
          f"{'p50 ms':>7}  {'p90 ms':>7}")
    for n in sizes:
        at, batches = 0, []
        for _ in range(32):
            lengths = np.exp(rng.uniform(np.log(args.min_len), np.log(args.max_len + 1), n))
            jobs, at = _jobs(base, [int(x) for x in lengths], at, 16, 8, 128)
            batches.append(jobs)
            if at > arena_bytes - (64 << 20):
                at = 0
        _rounds(backend, batches, 1.0)  # compile and warm
        calls = _c_calls(backend, batches[0])
        alone = None
        for mode in ("alone", "witness", "readers", "busy"):
            if (mode == "busy" and not args.busy_procs) or (
                    mode == "witness" and not args.witness_interval):
                continue
            if mode == "witness":
                t = _witness_rounds(backend, batches, args.seconds, args.witness_interval)
            else:
                with _contenders(args, readers=mode != "alone", busy=mode == "busy"):
                    t = _rounds(backend, batches, args.seconds)
            extra = ""
            if mode == "alone":
                alone = float(np.median(t))
            elif mode == "witness" and alone is not None:
                handoffs = (float(np.median(t)) - alone) / (args.witness_interval * 1e3)
                extra = f"  GIL hand-offs per launch ~{handoffs:.1f}"
            print(f"{n:5d}  {mode:>7}  {t.size:6d}  {t.mean():8.3f}  "
                  f"{np.median(t):7.3f}  {np.percentile(t, 90):7.3f}{extra}", flush=True)
        print(f"      C calls in one launch of {n}: {sum(calls.values())}; "
              + ", ".join(f"{k} {v}" for k, v in calls.most_common(40)))
    unpin()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
