"""Where one client's region call spends its time: client and server, a timestamp at each hand-off.

The same-host paths of issue 10 (CUDA IPC, system shared memory) leave the kernel and a few
small launches on the server, so what a call costs above the kernel is Python on both sides.
This starts a server (``python -m attention_service``) with the hooks of
``benchmarks/step_trace_hooks`` in each of its processes, loads the hooks' client targets into
this process, and runs ``--calls`` prefill calls one after another from one ``AttentionClient``
whose tensors live in a registered region (``--path``):

* ``ipc``: q/k/v in a CUDA IPC region, the output in the region's scratch (copied out);
* ``ipc-out``: the same with ``out=`` in the region (written in place);
* ``shm-out``: q/k/v and ``out=`` in a system shared-memory region.

Each call's events (this process's and the server's, one clock) are put in time order; the
most common order is the call's path, and the table gives the median time between consecutive
events (``trace_step.breakdown``). Wrapped calls cost ~1 us each.

    python benchmarks/trace_call.py --out benchmarks/results/issue10/trace   # 8192 x 16 x 128
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_step import HOOKS, breakdown, traced_run, write_report

PATHS = ("ipc", "ipc-out", "shm-out")


def _client_hooks() -> Any:
    """The hooks module, loaded under its own name, with its client targets installed here."""
    spec = importlib.util.spec_from_file_location("step_trace_hooks",
                                                  HOOKS / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    hooks._install(hooks.CLIENT_TARGETS)
    return hooks


def _drive(target: str, args: argparse.Namespace) -> list[tuple[int, int, float]]:
    """(t0 ns, t1 ns, kernel seconds) of each measured call."""
    from attention_client import AttentionClient

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    shape = (args.tokens, args.heads, args.head_dim)
    g = torch.Generator().manual_seed(0)
    host = [torch.randn(shape, generator=g).to(dtype) for _ in range(3)]
    cu = torch.tensor([0, args.tokens], dtype=torch.int32)
    nbytes = 4 * host[0].numel() * host[0].element_size()
    with AttentionClient(target, timeout=600) as c:
        if args.path.startswith("ipc"):
            region = c.register_cuda(nbytes + (64 << 20))
        else:
            region = c.register_shm(nbytes + (64 << 20))
        q, k, v = (region.empty(t.shape, t.dtype).copy_(t) for t in host)
        out = region.empty(host[0].shape, host[0].dtype) if args.path.endswith("out") else None
        cuda = args.path.startswith("ipc")
        result = []
        for i in range(args.warm_calls + args.calls):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            c.attention(q, k, v, cu, causal=args.causal, out=out)
            if cuda:
                torch.cuda.synchronize()  # the answer is usable: what a caller waits for
            t1 = time.perf_counter_ns()
            if i >= args.warm_calls:
                result.append((t0, t1, float((c.last_stats or {}).get("kernel_seconds", 0.0))))
        region.close()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", choices=PATHS, default="ipc-out")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--warm-calls", type=int, default=30)
    p.add_argument("--device", default="cuda")
    p.add_argument("--frontends", type=int, help="passed to the server (default: its own)")
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(max_batch_tokens=None, max_queue_delay_ms=None, server_log_level="WARNING",
                   startup_timeout=600.0)
    args = p.parse_args(argv)
    if args.path.startswith("ipc") and not torch.cuda.is_available():
        p.error(f"--path {args.path} needs a CUDA device here")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    hooks = _client_hooks()
    calls, info, events = traced_run(args, out_dir, "trace_call",
                                     lambda target: _drive(target, args))
    if not events:
        print("no server events: were the hooks loaded? (see trace_call_server.log)")
        return 1
    events = sorted(events + [(t, f"{label}@client") for label, t in hooks.events])
    result = breakdown(calls, events)
    kernel_us = statistics.median(k for *_, k in calls) * 1e6
    total_us = statistics.median((t1 - t0) / 1e3 for t0, t1, _ in calls)
    summary = (f"--path {args.path}: {args.tokens} x {args.heads} x {args.head_dim} "
               f"{args.dtype}, causal={args.causal}; {len(calls)} calls, "
               f"{result['path_share']:.0%} took the path below. Call p50 {total_us:.0f} us "
               f"(traced), kernel p50 {kernel_us:.1f} us.")
    write_report(out_dir, "trace_call", f"trace_call_{args.path}", info, argv, summary, result,
                 {"args": vars(args), "calls": len(calls), "kernel_p50_us": kernel_us,
                  "call_p50_us": total_us})
    return 0

if __name__ == "__main__":
    sys.exit(main())
