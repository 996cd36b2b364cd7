"""The engine process's host cost per KV-cache decode step, with no gRPC and no GPU.

What caps cached decode at 64 clients is the engine process's Python (one GIL; about 0.3 ms
per step on the H200 host of 2026-11-23, ``profile-sessions``). This drives the real engine
side of one front end -- ``FrontendConnection`` over a ``Channel`` on a socketpair, the
``EngineCore`` with its cache registry, executor and batching -- from a load process that
speaks the channel protocol as a front end does (Submit frames in, Done frames back, one
outstanding step per client, over ``--batch`` caches: 1, or a model host's B as in issue 61,
whose steps store nothing). Only the device work is left out: the backend stages each
CacheDecode launch's tables exactly as ``decode_steps`` does (same layout, same
``Staging.fill``; the copies of the tensors themselves are device work) and returns at once.

Reports steps/s, the engine process's CPU seconds per step and the mean batch, per client
count. Diagnostic (runs anywhere, CPU only); the service-level numbers are bench_sessions.py.

    python tools/engine/bench_engine_steps.py --clients 1,64 --seconds 3
    python tools/engine/bench_engine_steps.py --clients 1,8 --batch 64 --context 2048
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

import torch

from attention_service.config import ServerConfig
from attention_service.engine.core import EngineCore, FrontendConnection
from attention_service.engine.jobs import PINNED, BatchPlan, PendingLaunch
from attention_service.ipc.channel import Channel, ControlCall, Done, Failed, Submit, corked
from attention_service.metrics import Metrics
from attention_service.params import Op, make_params
from attention_wire.pb import attention_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_backend import HostOnlyBackend, StagedSteps, Timed, cpu_seconds, fine_timer_slack

OWNER = ""
# Far above the engine's rate on any host so far (7.5-8.4K steps/s on the dev box).
STEPS_PER_S_BOUND = 50_000


class StagingOnlyBackend(HostOnlyBackend):
    """The cuda backend's host side of a CacheDecode launch (``StagedSteps``), no device:
    every other launch is a no-op."""

    def __init__(self) -> None:
        self.steps = StagedSteps()

    def launch(self, plan: BatchPlan) -> PendingLaunch:
        self.steps.stage(plan)
        # The device's time: a launch "runs" for the H200's measured kernel time of that
        # batch: bench_sessions' steps of one sequence (4K contexts: 0.038 ms alone, 0.327 ms
        # for 46 steps), issue 61's of many (2K contexts: 19 us + 1.83 us a sequence).
        device = max(32e-6 + 6.3e-6 * len(plan), 19e-6 + 1.83e-6 * len(plan.seq_lens))
        return Timed(time.perf_counter() + device)


class _Load:
    """The load process: a front end's side of the channel, one outstanding step per cache."""

    def __init__(self, sock: socket.socket, args: argparse.Namespace) -> None:
        self.args = args
        self.cond = threading.Condition()
        self.replies: dict[int, Any] = {}
        self.channel = Channel(sock, self._on_message, lambda: None, "load")
        self.channel.start()
        self._ids = itertools.count(1)
        self._pids: dict[Any, int] = {}  # Params sent so far, by id

    def _on_message(self, msg: Any, fds: list[int]) -> None:
        with self.cond:
            self.replies[msg.call_id] = msg
            self.cond.notify_all()

    def call(self, msg: Any) -> Any:
        with self.cond:
            self.channel.send(msg)
            self.cond.wait_for(lambda: msg.call_id in self.replies)
            reply = self.replies.pop(msg.call_id)
        if isinstance(reply, Failed):
            raise reply.error
        return reply

    def submit(self, call_id: int, params: Any, spans: Any) -> Submit:
        """A Submit as a front end makes it: Params cross once, with the first call that
        names them (by id after that)."""
        pid = self._pids.get(params)
        if pid is not None:
            return Submit(call_id, pid, spans, OWNER)
        pid = self._pids[params] = len(self._pids)
        return Submit(call_id, pid, spans, OWNER, params)

    def run(self, n: int, seconds: float) -> dict[str, Any]:
        a = self.args
        elem, b = 2, a.batch
        q_bytes, kv_bytes = a.heads * a.head_dim * elem * b, a.kv_heads * a.head_dim * elem * b
        layout = pb.CacheLayout(dtype=pb.BFLOAT16, num_kv_heads=a.kv_heads, head_dim=a.head_dim)
        ids = [f"c{n}-{i}" for i in range(n * b)]
        create = pb.CreateCachesRequest(cache_ids=ids, layout=layout)
        self.call(ControlCall(next(self._ids), "CreateCaches", create.SerializeToString(), OWNER))
        kv = (a.context, a.kv_heads, a.head_dim)
        for cid in ids:  # the prompt: lengths only (no device), as AppendKV leaves them
            p = make_params(Op.APPEND_KV, pb.BFLOAT16, (0, a.heads, a.head_dim), kv,
                            [0, a.context], [0, 0], cache_ids=[cid])
            spans = {"q": (0, 0), "k": (0, a.context * kv_bytes // b),
                     "v": (0, a.context * kv_bytes // b), "out": (0, 0)}
            self.call(self.submit(next(self._ids), p, spans))
        # Each client's step: its own arena block (q, k, v, out), as a front end lays it out.
        block = 2 * q_bytes + 2 * kv_bytes
        steps = []
        for i in range(n):
            at = i * block
            p = make_params(Op.CACHE_DECODE, pb.BFLOAT16, (b, a.heads, a.head_dim),
                            (b, a.kv_heads, a.head_dim), list(range(b + 1)),
                            cache_ids=ids[i * b : (i + 1) * b], store=a.store)
            steps.append((p, {"q": (at, q_bytes),
                                           "k": (at + q_bytes, kv_bytes),
                                           "v": (at + q_bytes + kv_bytes, kv_bytes),
                                           "out": (at + q_bytes + 2 * kv_bytes, q_bytes)}))
        owner_of: dict[int, int] = {}
        t_measure = time.perf_counter() + a.warmup
        t_end = t_measure + seconds
        measured = batch_sum = 0
        cpu0 = cpu = None  # the engine's CPU seconds at t_measure, then over the window

        def send(i: int) -> None:
            cid = next(self._ids)
            owner_of[cid] = i
            self.channel.send(self.submit(cid, steps[i][0], steps[i][1]))

        with self.cond:
            for i in range(n):
                send(i)
            while True:
                self.cond.wait_for(lambda: self.replies)
                now = time.perf_counter()
                for call_id, reply in list(self.replies.items()):
                    del self.replies[call_id]
                    if isinstance(reply, Failed):
                        raise reply.error
                    assert isinstance(reply, Done)
                    if cpu0 is not None and now < t_end:
                        measured += 1
                        batch_sum += reply.stats.batch_requests
                    if now < t_end:
                        send(owner_of.pop(call_id))
                    else:
                        owner_of.pop(call_id)
                if cpu0 is None and now >= t_measure:
                    cpu0 = cpu_seconds(os.getppid())
                    measured = batch_sum = 0
                if now >= t_end:
                    if cpu is None:  # the window's end, not the drain after it
                        cpu = cpu_seconds(os.getppid()) - cpu0
                    if not owner_of:
                        break
        release = pb.ReleaseCachesRequest(cache_ids=ids)
        self.call(ControlCall(next(self._ids), "ReleaseCaches", release.SerializeToString(),
                              OWNER))
        return {"clients": n, "steps_per_s": measured / seconds,
                "engine_cpu_us_per_step": 1e6 * cpu / max(measured, 1),
                "mean_batch": batch_sum / max(measured, 1)}


def _load_main(fd: int, args: argparse.Namespace, q: Any) -> None:
    load = _Load(socket.socket(fileno=fd), args)
    q.put([load.run(n, args.seconds) for n in args.clients])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,8,64")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1,
                   help="sequences (caches) per client step: a model host's B (issue 61)")
    p.add_argument("--store", action=argparse.BooleanOptionalAction, default=None,
                   help="steps store their token (default: with --batch 1 only; a batch "
                        "stores nothing, as issue 61's benchmark, and a context on a page "
                        "boundary then takes and frees a page per sequence every step)")
    p.add_argument("--batching", default="on", choices=["on", "off"])
    p.add_argument("--no-metrics", dest="metrics", action="store_false",
                   help="leave out the launch metrics (the server always has them)")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = p.parse_args()
    fine_timer_slack()
    args.clients = [int(x) for x in args.clients.split(",")]
    if args.store is None:
        args.store = args.batch == 1
    if args.store and args.batch > 1:
        p.error("--store takes --batch 1 (the pool is sized for one token a step)")
    page_bytes = 2 * 64 * args.kv_heads * args.head_dim * 2  # 64-token pages
    # Each step stores one token. The appended tokens of a run are at most its steps (bounded
    # by STEPS_PER_S_BOUND), spread over its caches; a 1-client run of 3 s used to fill a
    # pool sized for 4096 steps per client.
    steps = int(STEPS_PER_S_BOUND * (args.seconds + args.warmup + 1)) if args.store else 0
    pages = max(n * args.batch * (-(-args.context // 64) + 1) + -(-steps // 64)
                for n in args.clients)
    config = ServerConfig(device="cpu", batching=args.batching == "on",
                          kv_cache_bytes=pages * page_bytes, kv_page_bytes=page_bytes,
                          kv_cache_ttl=0)
    backend = StagingOnlyBackend()
    # The pool is never read (no device work): a meta tensor would do, but the views must be
    # real to slice; a lazily touched host block costs nothing until written.
    core = EngineCore(config, backend, observer=Metrics() if args.metrics else None,
                      delivery_scope=corked)  # as the process group runs it
    kv_bytes = args.kv_heads * args.head_dim * 2
    arena = torch.zeros(max(max(args.clients) * args.batch * 2
                            * (args.heads * args.head_dim * 2 + kv_bytes),
                            args.context * kv_bytes), dtype=torch.uint8)
    # Counted as page-locked, as the cuda backend registers an arena: the launches then take
    # the step graphs' host side (``places``, its checks included) as on a GPU.
    PINNED[arena.data_ptr()] = arena.numel()
    mine, theirs = socket.socketpair()
    conn = FrontendConnection(0, core, arena, ThreadPoolExecutor(1), lambda m: None)
    channel = Channel(mine, conn.on_message, conn.on_channel_close, "engine-0",
                      batch_scope=core.executor.deferring)  # as the process group wires it
    conn.attach(channel)
    channel.start()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_load_main, args=(theirs.fileno(), args, q))
    proc.start()
    rows = q.get(timeout=600)
    proc.join(30)
    channel.close()
    core.close()
    print(f"engine host cost per CacheDecode step ({args.batch} sequences a step, "
          f"{args.heads}/{args.kv_heads} heads x {args.head_dim} bf16, {args.context}-token "
          f"caches, store {'on' if args.store else 'off'}, batching {args.batching}, "
          f"metrics {'on' if args.metrics else 'off'}; no gRPC, no device)")
    print("| clients | steps/s | engine CPU us/step | mean batch |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['steps_per_s']:.0f} | {r['engine_cpu_us_per_step']:.1f} "
              f"| {r['mean_batch']:.1f} |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
