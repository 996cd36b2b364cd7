"""The engine process under many small prefills, with no gRPC and no GPU: a model of where a
batch's launch issue time goes when the engine's other threads compete for the GIL.

Under 64 clients of small causal prefills a batch of ~16 took 3.5-3.9 ms to issue in the
service (``attention_launch_issue_seconds``) against 0.31 ms in a quiet process
(``benchmarks/probe_issue.py``, in git history; H200, 2026-11-28). This drives the real engine
side of ``--frontends`` front ends -- a ``FrontendConnection`` over a ``Channel`` on a
socketpair each, one ``EngineCore`` with its executor and batching, wired as the process group
wires them -- from one load process that speaks the channel protocol as front ends do
(Submit frames of arena spans, each Params carried by the first that names it, one outstanding
call per client, lengths log-uniform in [--min-len, --max-len]). Only the device is modelled:
a launch spends ``--issue-us`` of Python split by ``--issue-calls`` calls that let the GIL go
(``torch.empty``, as the dispatcher's torch and Triton calls do), then "runs" for
``--kernel-us`` plus ``--kernel-us-per-job`` per job, waited for as an event synchronize is
(GIL let go).

Reports requests/s, the mean batch, the mean launch issue time and the engine's CPU per
request, batching on and off, ``--rounds`` times interleaved. Diagnostic:
the service-level numbers are bench_service.py's; this says which way a change to the
engine's threads moves the issue time, on any host.

    python tools/engine/bench_engine_prefill.py --rounds 3 --seconds 4
    taskset -c 0 python tools/engine/bench_engine_prefill.py --load-cpus 1  # engine on CPU 0
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attention_service.config import ServerConfig
from attention_service.cpus import parse_cpu_list, pin_process
from attention_service.engine.core import EngineCore, FrontendConnection
from attention_service.engine.jobs import BatchPlan, PendingLaunch
from attention_service.ipc.channel import Channel, Done, Failed, Submit, corked
from attention_service.params import Op, make_params
from attention_wire.pb import attention_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_backend import DeviceTimeline, HostOnlyBackend, cpu_seconds, fine_timer_slack  # noqa: E402

OWNER = ""
ELEM = 2  # bf16
LENGTHS_PER_CLIENT = 16  # distinct lengths a client cycles through (each its own Params)


class ModelBackend(HostOnlyBackend):
    """A launch's host work as the cuda backend's (Python split by GIL-releasing calls) and
    its device time as a timed wait; nothing is computed."""

    device_name = "none (launch model)"

    def __init__(self, args: argparse.Namespace) -> None:
        self.calls = max(1, args.issue_calls)
        self.slice_s = args.issue_us / 1e6 / self.calls
        self.kernel_s = args.kernel_us / 1e6
        self.per_job_s = args.kernel_us_per_job / 1e6
        self.issue_seconds: list[float] = []  # per launch, as the executor times it
        self.timeline = DeviceTimeline()  # one launch at a time

    def launch(self, plan: BatchPlan) -> PendingLaunch:
        for _ in range(self.calls):
            end = time.perf_counter() + self.slice_s
            while time.perf_counter() < end:  # Python work between two C calls
                pass
            torch.empty(16)  # lets the GIL go and takes it back
        return self.timeline.run(self.kernel_s + self.per_job_s * len(plan))


class _IssueObserver:
    def __init__(self) -> None:
        self.issue: list[float] = []
        self.batches: list[int] = []

    def observe_launch(self, op: Op, *, requests: int, issue: float | None = None,
                       **_: Any) -> None:
        self.batches.append(requests)
        if issue is not None:
            self.issue.append(issue)


class _Front:
    """One front end's side of a channel: its clients' calls, one outstanding each."""

    def __init__(self, sock: socket.socket, args: argparse.Namespace, index: int,
                 rng: np.random.Generator, counts: list[int]) -> None:
        self.channel = Channel(sock, self._on_message, lambda: None, f"load-{index}")
        self.counts = counts
        self.index = index
        self.lock = threading.Lock()
        self.measuring = False
        self.stopping = False
        self.owner_of: dict[int, int] = {}
        self._ids = itertools.count(1)
        h, hk, d = args.heads, args.kv_heads, args.head_dim
        lo, hi = np.log(args.min_len), np.log(args.max_len)
        self.calls: list[list[tuple[int, dict[str, tuple[int, int]]]]] = []
        pid = itertools.count()
        self._new: dict[int, Any] = {}
        at = 0
        for _ in range(args.clients_per_front):
            mine = []
            lengths = np.exp(rng.uniform(lo, hi, LENGTHS_PER_CLIENT)).astype(int)
            block = 2 * int(lengths.max()) * (h + hk) * d * ELEM
            for n in lengths.tolist():
                p = make_params(Op.PREFILL, pb.BFLOAT16, (n, h, d), (n, hk, d), [0, n], [0, n],
                                causal=True)
                params_id = next(pid)
                self._new[params_id] = p  # sent with the first Submit that names it
                q, kv = n * h * d * ELEM, n * hk * d * ELEM
                spans = {"q": (at, q), "k": (at + q, kv), "v": (at + q + kv, kv),
                         "out": (at + q + 2 * kv, q)}
                mine.append((params_id, spans))
            self.calls.append(mine)
            at += block
        self.turn = [0] * args.clients_per_front

    def _send(self, client: int) -> None:
        params_id, spans = self.calls[client][self.turn[client] % LENGTHS_PER_CLIENT]
        self.turn[client] += 1
        call_id = next(self._ids)
        self.owner_of[call_id] = client
        self.channel.send(Submit(call_id, params_id, spans, OWNER, self._new.pop(params_id, None)))

    def start(self) -> None:
        self.channel.start()
        with self.lock:
            for c in range(len(self.calls)):
                self._send(c)

    def _on_message(self, msg: Any, fds: list[int]) -> None:
        if isinstance(msg, Failed):
            raise msg.error
        assert isinstance(msg, Done)
        with self.lock:
            client = self.owner_of.pop(msg.call_id)
            if self.measuring:
                self.counts[0] += 1
                self.counts[1] += msg.stats.batch_requests
            if not self.stopping:
                self._send(client)

    def drained(self) -> bool:
        with self.lock:
            return not self.owner_of


def _load_main(fds: list[int], args: argparse.Namespace, q: Any, go: Any) -> None:
    if args.load_cpus:
        pin_process(parse_cpu_list(args.load_cpus))
    rng = np.random.default_rng(0)
    counts = [0, 0]  # answered, sum of their batch sizes
    fronts = [_Front(socket.socket(fileno=fd), args, i, rng, counts)
              for i, fd in enumerate(fds)]
    q.put("defined")
    go.wait()
    for f in fronts:
        f.start()
    time.sleep(args.warmup)
    for f in fronts:
        with f.lock:
            f.measuring = True
    q.put(("measuring", time.perf_counter()))
    time.sleep(args.seconds)
    for f in fronts:
        with f.lock:
            f.measuring = False
            f.stopping = True
    q.put(("counts", list(counts)))
    end = time.monotonic() + 30
    while not all(f.drained() for f in fronts) and time.monotonic() < end:
        time.sleep(0.01)
    for f in fronts:
        f.channel.close()


def _run(args: argparse.Namespace, round_: int, batching: bool) -> dict[str, Any]:
    config = ServerConfig(device="cpu", batching=batching, kv_cache_bytes=0)
    backend = ModelBackend(args)
    observer = _IssueObserver()
    core = EngineCore(config, backend, observer=observer,  # type: ignore[arg-type]
                      frontends=args.frontends, delivery_scope=corked)
    h, hk, d = args.heads, args.kv_heads, args.head_dim
    arena_bytes = args.clients_per_front * 2 * args.max_len * (h + hk) * d * ELEM
    pool = ThreadPoolExecutor(1)
    channels, theirs = [], []
    for i in range(args.frontends):
        mine, other = socket.socketpair()
        conn = FrontendConnection(i, core, torch.zeros(arena_bytes, dtype=torch.uint8), pool,
                                  lambda m: None)
        ch = Channel(mine, conn.on_message, conn.on_channel_close, f"engine-{i}",
                     batch_scope=core.executor.deferring)
        conn.attach(ch)
        channels.append(ch)
        theirs.append(other)
    for ch in channels:
        ch.start()
    ctx = mp.get_context("fork")
    # One queue each way: the parent reading a queue it also writes can take back its own
    # "go" (seen once under a busy suite: the load never started and the round hung).
    q, go = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_load_main, args=([s.fileno() for s in theirs], args, q, go))
    proc.start()
    for s in theirs:
        s.close()
    assert q.get(timeout=60) == "defined"
    go.set()
    kind, _ = q.get(timeout=60 + args.warmup)
    assert kind == "measuring"
    cpu0, n_issue = cpu_seconds(os.getpid()), len(observer.issue)
    kind, counts = q.get(timeout=60 + args.seconds)
    cpu = cpu_seconds(os.getpid()) - cpu0
    issue = np.array(observer.issue[n_issue:])
    proc.join(60)
    for ch in channels:
        ch.close()
    core.close()
    pool.shutdown()
    answered = max(counts[0], 1)
    return {"round": round_, "batching": batching, "req_per_s": counts[0] / args.seconds,
            "mean_batch": counts[1] / answered,
            "issue_ms_mean": float(issue.mean() * 1e3) if issue.size else float("nan"),
            "issue_ms_p90": float(np.percentile(issue, 90) * 1e3) if issue.size else float("nan"),
            "engine_cpu_us_per_req": 1e6 * cpu / answered}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--batching", default="on,off", help="on, off or both")
    p.add_argument("--frontends", type=int, default=8)
    p.add_argument("--clients-per-front", type=int, default=8)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--issue-us", type=float, default=250.0,
                   help="Python of one launch's issue (H200 quiet: 0.31 ms for 16 jobs)")
    p.add_argument("--issue-calls", type=int, default=20,
                   help="GIL-releasing calls per launch (probe_issue: ~20)")
    p.add_argument("--kernel-us", type=float, default=40.0)
    p.add_argument("--kernel-us-per-job", type=float, default=4.0)
    p.add_argument("--load-cpus", default="", help="CPUs for the load process (a list)")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = p.parse_args()
    fine_timer_slack()
    torch.set_num_threads(1)
    rows = [_run(args, r, b == "on") for r in range(1, args.rounds + 1)
            for b in args.batching.split(",")]
    print(f"engine model: {args.frontends} front ends x {args.clients_per_front} clients, "
          f"lengths {args.min_len}..{args.max_len}, H{args.heads}/{args.kv_heads} "
          f"D{args.head_dim} bf16 causal; launch {args.issue_us:.0f} us of Python in "
          f"{args.issue_calls} GIL releases, kernel {args.kernel_us:.0f} us + "
          f"{args.kernel_us_per_job:.0f} us/job; {os.cpu_count()} cpus, engine on "
          f"{sorted(os.sched_getaffinity(0))}")
    print("| batching | round | req/s | mean batch | issue ms (mean / p90) | engine CPU us/req |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {'on' if r['batching'] else 'off'} | {r['round']} | {r['req_per_s']:.0f} | "
              f"{r['mean_batch']:.1f} | {r['issue_ms_mean']:.2f} / {r['issue_ms_p90']:.2f} | "
              f"{r['engine_cpu_us_per_req']:.0f} |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
