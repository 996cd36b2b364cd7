"""The engine's Python per stateless request, stage by stage, on one thread: what each request
costs the engine process's GIL on its way in (a channel read of Submit frames through
``FrontendConnection`` into ``EngineCore.submit`` and the batch queue), through the dispatcher
(the queue's batch, ``BatchPlan``) and out (``Executor._complete``: stats, ``done``, the
corked Done frames). No device, no other thread competing: the floor a change to the request
path moves.

    python tools/engine/engine_request_path.py [--batch 16] [--rounds 400] [--repeats 5]

Prints microseconds per request for each stage: the best and the median over ``--repeats``
runs, each the median of ``--rounds`` batches.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from attention_service.config import ServerConfig
from attention_service.engine.core import EngineCore, FrontendConnection
from attention_service.engine.executor import _Issued
from attention_service.engine.jobs import BatchPlan, LaunchTimes
from attention_service.ipc.channel import Channel, Submit, _frame, corked
from attention_service.params import Op, make_params
from attention_wire.pb import attention_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_backend import HostOnlyBackend  # noqa: E402

LENGTHS = (17, 33, 64, 100, 128, 200, 250, 16)  # within bench_service's 16..256


class _Done:
    def wait(self) -> LaunchTimes:
        return LaunchTimes()


class _Parked(HostOnlyBackend):
    """A backend whose first launch never returns until released: it parks the dispatcher
    thread, so the stages below run on this thread alone."""

    max_inflight = 1
    async_launch = False

    def __init__(self) -> None:
        self.release = threading.Event()
        self.parked = threading.Event()

    def launch(self, plan: BatchPlan) -> _Done:
        self.parked.set()
        self.release.wait()
        return _Done()


def _run(args: argparse.Namespace) -> tuple[float, float, float]:
    h, hk, d = args.heads, args.kv_heads, args.head_dim
    backend = _Parked()
    core = EngineCore(ServerConfig(device="cpu", kv_cache_bytes=0, max_queue_size=100_000),
                      backend, delivery_scope=corked)  # type: ignore[arg-type]
    ex = core.executor
    arena = torch.zeros((args.batch + 1) << 21, dtype=torch.uint8)  # 2 MiB a job
    mine, theirs = socket.socketpair()
    conn = FrontendConnection(0, core, arena, ThreadPoolExecutor(1), lambda m: None)
    channel = Channel(mine, conn.on_message, conn.on_channel_close, "engine",
                      batch_scope=ex.deferring)
    conn.attach(channel)

    def drain() -> None:
        while theirs.recv(1 << 20):
            pass

    threading.Thread(target=drain, daemon=True).start()
    params = [make_params(Op.PREFILL, pb.BFLOAT16, (n, h, d), (n, hk, d), [0, n], [0, n],
                          causal=True) for n in LENGTHS]
    subs = []
    for j in range(args.batch):
        n = LENGTHS[j % len(LENGTHS)]
        q, kv, at = n * h * d * 2, n * hk * d * 2, j << 21
        subs.append(Submit(1000 + j, j % len(LENGTHS), {
            "q": (at, q), "k": (at + q, kv), "v": (at + q + kv, kv),
            "out": (at + q + 2 * kv, q)}, "", params[j] if j < len(LENGTHS) else None))
    frames = b"".join(_frame(m, 0) for m in subs)
    channel._deliver(frames[: len(_frame(subs[0], 0))], [])  # parks the dispatcher
    assert backend.parked.wait(10)
    reads, plans, completes = [], [], []
    for r in range(args.rounds + 20):
        t0 = time.perf_counter()
        channel._deliver(frames, [])
        t1 = time.perf_counter()
        with ex._cond:
            batch, _ = ex._queue.next_batch(time.perf_counter(), device_idle=True)
            ex._waiting.difference_update(batch)
        plan = BatchPlan(batch, batch[0].key)
        t2 = time.perf_counter()
        with ex._cond:
            ex._inflight += 1
        issued = _Issued(batch, plan, _Done(), t1, t2)
        t3 = time.perf_counter()
        ex._complete(issued)
        t4 = time.perf_counter()
        assert len(batch) == args.batch, (r, len(batch))
        if r >= 20:  # warmed up
            n = len(batch)
            reads.append((t1 - t0) / n * 1e6)
            plans.append((t2 - t1) / n * 1e6)
            completes.append((t4 - t3) / n * 1e6)
    backend.release.set()
    channel.close()
    core.close()
    return statistics.median(reads), statistics.median(plans), statistics.median(completes)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=400)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args()
    runs: list[Any] = [_run(args) for _ in range(args.repeats)]
    print(f"engine Python per request, batches of {args.batch} small causal prefills "
          f"(H{args.heads}/{args.kv_heads} D{args.head_dim} bf16), one thread, us")
    print("| stage | best | median |")
    print("|---|---|---|")
    for i, name in enumerate(("read + submit", "queue + plan", "complete + answer")):
        col = [r[i] for r in runs]
        print(f"| {name} | {min(col):.1f} | {statistics.median(col):.1f} |")
    total = [sum(r) for r in runs]
    print(f"| total | {min(total):.1f} | {statistics.median(total):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
