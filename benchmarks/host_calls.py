"""Host time of the torch calls a decode-step launch makes (stream switches, event records,
small pinned copies, graph replays), one loop per call, on this GPU host.

    python benchmarks/host_calls.py

Prints microseconds per call (median of 7 loops of ``--calls`` each). The engine's launch of a
decode step is a handful of these; this says which ones its host time is made of.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch


def per_call_us(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> float:
    runs = []
    for _ in range(7):
        sync()
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter_ns() - t0) / calls / 1e3)
        sync()
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    s = torch.cuda.Stream(dev)
    sync = torch.cuda.synchronize
    nbytes_in, nbytes_out = 12 * 1024, 8 * 1024
    pinned_in = torch.empty(nbytes_in, dtype=torch.uint8, pin_memory=True)
    pinned_out = torch.empty(nbytes_out, dtype=torch.uint8, pin_memory=True)
    reg_in = torch.empty(nbytes_in, dtype=torch.uint8)
    reg_out = torch.empty(nbytes_out, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    for t in (reg_in, reg_out):
        assert int(cudart.cudaHostRegister(t.data_ptr(), t.numel(), 0)) == 0
    dev_in = torch.zeros(nbytes_in, dtype=torch.uint8, device=dev)
    dev_out = torch.zeros(nbytes_out, dtype=torch.uint8, device=dev)
    e = torch.cuda.Event(enable_timing=True)
    x = torch.zeros(4096, device=dev)

    def small_graph(with_copies: bool) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        cs = torch.cuda.Stream(dev)
        cs.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(cs):
            x.add_(1)
        cs.synchronize()
        with torch.cuda.graph(g, stream=cs):
            if with_copies:
                dev_in.copy_(reg_in, non_blocking=True)
            x.add_(1)
            if with_copies:
                reg_out.copy_(dev_out, non_blocking=True)
        return g

    g_plain, g_copies = small_graph(False), small_graph(True)
    np_src, np_dst = np.zeros(nbytes_out, np.uint8), np.zeros(nbytes_out, np.uint8)
    buf = (ctypes.c_char * nbytes_out).from_address(reg_out.data_ptr())

    def device_and_stream() -> None:
        with torch.cuda.device(dev), torch.cuda.stream(s):
            pass

    def stream_only() -> None:
        with torch.cuda.stream(s):
            pass

    def set_stream() -> None:
        torch.cuda.set_stream(s)

    def replay_on(g: torch.cuda.CUDAGraph) -> Callable[[], None]:
        def run() -> None:
            with torch.cuda.stream(s):
                g.replay()
        return run

    rows = [
        ("with torch.cuda.device(d), torch.cuda.stream(s): pass", device_and_stream),
        ("with torch.cuda.stream(s): pass", stream_only),
        ("torch.cuda.set_stream(s)", set_stream),
        ("torch.cuda.current_stream()", torch.cuda.current_stream),
        ("event.record(s)", lambda: e.record(s)),
        ("event.query()", e.query),
        ("H2D 12 KB copy_ from torch-pinned (non_blocking)",
         lambda: dev_in.copy_(pinned_in, non_blocking=True)),
        ("H2D 12 KB copy_ from cudaHostRegister'ed (non_blocking)",
         lambda: dev_in.copy_(reg_in, non_blocking=True)),
        ("D2H 8 KB copy_ into torch-pinned (non_blocking)",
         lambda: pinned_out.copy_(dev_out, non_blocking=True)),
        ("D2H 8 KB copy_ into cudaHostRegister'ed (non_blocking)",
         lambda: reg_out.copy_(dev_out, non_blocking=True)),
        ("dev_out[:8] slice", lambda: dev_out[:8]),
        ("torch.frombuffer(8 KB) + view", lambda: torch.frombuffer(buf, dtype=torch.uint8)),
        ("graph.replay(), one kernel, in stream ctx", replay_on(g_plain)),
        ("graph.replay(), kernel + H2D + D2H nodes, in stream ctx", replay_on(g_copies)),
        ("graph.replay(), one kernel, current stream", g_plain.replay),
        ("numpy 8 KB copy", lambda: np.copyto(np_dst, np_src)),
    ]
    print(f"{torch.cuda.get_device_name(dev)}; torch {torch.__version__}; "
          f"{args.calls} calls per loop, median of 7 loops")
    print("| call | us per call |\n|---|---|")
    with torch.cuda.stream(s):
        for name, fn in rows:
            print(f"| {name} | {per_call_us(fn, args.calls, sync):.2f} |", flush=True)


if __name__ == "__main__":
    main()
