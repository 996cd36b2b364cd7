"""Offloaded decode: model hosts keep their KV caches on the attention server and send one
decode step per layer per token through the real client.

Each host (its own process) holds ``--layers`` sets of ``--batch`` caches of ``--context``
tokens (appended once) and loops steps: q ``[B, H, D]`` and one new k/v token per sequence
``[B, H_kv, D]`` (``store=False`` unless ``--store``, so the caches do not grow). A step goes
on layer ``i % L``, through one ``decode_steps()`` handle (``--client``: the sync or the
asyncio client); ``--inflight k``: k steps outstanding on it (``submit``: the next layer's step
is sent before the last one's answer is read; k <= L, so steps in flight are on disjoint
caches).
``--transport``: tensors as gRPC bytes, or in a registered system shared-memory region (``shm``),
CUDA IPC region (``cuda``, tensors on the server's GPU) or NIXL region of host or GPU memory
(``nixl``, ``nixl-gpu``: UCX moves them, the way it would for a host on another machine)
with the outputs written there (``out=``); ``socket``, ``socket-shm``, ``socket-cuda``,
``socket-nixl``, ``socket-nixl-gpu``: the steps through the server's step socket
(``decode_steps(step_socket=True)``) instead of gRPC (with NIXL regions: a NIXL step's own cost
without gRPC's, though a host on another machine has no step socket).
All hosts start together against one server (started here, or ``--target``), or against
several running ones (``--target A,B``: host i drives server i mod their count, e.g. two
engine processes sharing one GPU; the pool check is per server).

Per point (B, context, hosts, inflight): step latency p50/p99 over all hosts, aggregate
steps/s, tokens/s (= B x steps/s: one layer's step of one sequence; divide by L for model
tokens), client CPU per step (median over hosts of process_time / steps), server CPU per step
(psutil, the server and its children, over the window from the hosts' common start to their
common end), wire bytes per step, and the calls per launch the steps saw (their
``batch_requests``: steps merged into one launch). On cuda: ``paged_decode`` timed here (CUDA
events, median) on a paged cache of B sequences and of the merged hosts x B, and the fraction
of the kernel's rate = (B x steps/s) / (hosts x B / merged kernel time). ``--floor`` (default
on): the peer for the host side, a bare Python gRPC stream that echoes messages of the step's
sizes (its tensor bytes plus header, or the header alone with regions) from a server process
of its own, measured in the same run: its p50 and client CPU per step are what Python gRPC
costs for those bytes before any work. Writes ``bench_offload_<UTC>.json/md``.

    python benchmarks/bench_offload.py                                   # GPU defaults
    python benchmarks/bench_offload.py --device cpu --heads 4 --kv-heads 2 --head-dim 32 \
        --context 16 --batch 1,8 --hosts 1,2 --inflight 1,2 --steps 20 --warmup 5 \
        --layers 2 --out /tmp/bo                                         # quick cpu check
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import inspect
import json
import math
import multiprocessing as mp
import os
import queue
import shlex
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from attention_wire import grpc_defaults

grpc_defaults.apply()  # the client library's grpc I/O settings, before grpc loads

import grpc
import numpy as np
import psutil
import torch

import attention_client
from attention_wire.messages import MAX_CHUNK_BYTES

# --transport's choices (each but bytes a region kind, registered in ``_round_on``); with
# ``socket`` the steps go through the server's step socket instead of gRPC.
TRANSPORTS = ("bytes", "shm", "cuda", "nixl", "nixl-gpu", "socket", "socket-shm",
              "socket-cuda", "socket-nixl", "socket-nixl-gpu")


def _route(transport: str) -> tuple[bool, str]:
    """(through the step socket, the tensors' place: bytes or a region kind)."""
    if transport == "socket":
        return True, "bytes"
    via, _, kind = transport.partition("socket-")
    return (True, kind) if not via else (False, transport)
DTYPES = {"bf16": (torch.bfloat16, "bfloat16", 2), "fp16": (torch.float16, "float16", 2)}
ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731


# ---- model hosts (spawned processes) ------------------------------------------------------

def servers_of(idx: int, targets: list[str], spread: str) -> list[str]:
    """Host ``idx``'s servers: one of ``targets`` in turn (``hosts``), or every one (``layers``:
    its layer i on the i mod len-th)."""
    return [targets[idx % len(targets)]] if spread == "hosts" else targets


def _host(idx: int, spec: dict[str, Any], barrier: Any, out: Any) -> None:
    """One model host: caches made once, then a measured round per inflight value: warm-up
    steps, two barrier waits shared with the main process (it samples the server between
    them), the measured steps, a third wait (it samples the server again).
    Its server: one of ``--target`` in turn; with ``--spread layers`` every one, layer i's
    caches on server i mod their count."""
    torch.set_num_threads(1)
    B, L, ctx, t = spec["batch"], spec["layers"], spec["context"], spec["timeout"]
    tdt, name, _ = DTYPES[spec["dtype"]]
    h, hkv, d = spec["heads"], spec["kv_heads"], spec["head_dim"]
    ids = [[f"{spec['tag']}-h{idx}-l{i}-s{b}" for b in range(B)] for i in range(L)]
    rnd = lambda *s: (torch.randn(*s) * 0.5).to(tdt)  # noqa: E731 (values do not matter)
    qs = [rnd(B, h, d) for _ in range(L)]
    ks, vs = [rnd(B, hkv, d) for _ in range(L)], [rnd(B, hkv, d) for _ in range(L)]
    targets = servers_of(idx, spec["target"], spec["spread"])
    # One message per step even at B=256 bf16 (3 MiB): the stream path, not the fallback.
    kw = {"timeout": 60.0, "max_chunk_bytes": MAX_CHUNK_BYTES}
    try:
        with contextlib.ExitStack() as stack:
            clients = [stack.enter_context(attention_client.AttentionClient(x, **kw))
                       for x in targets]
            caches = [stack.enter_context(c.kv_cache(hkv, d, name)) for c in clients]
            per = max(1, 65536 // ctx)  # sequences per append: a bounded upload buffer
            k0, v0 = rnd(per * ctx, hkv, d), rnd(per * ctx, hkv, d)
            for i, layer in enumerate(ids):
                for s in range(0, B, per):
                    n = min(per, B - s)
                    caches[i % len(caches)].append(layer[s:s + n], k0[:n * ctx], v0[:n * ctx],
                                                   [i * ctx for i in range(n + 1)])
            for transport in spec["transports"]:
                for k in spec["inflight"]:
                    # The handles' session headers: their step streams reach their replicas
                    # behind Envoy (a server reached directly ignores them).
                    metas = [c.session_metadata for c in caches]
                    out.put(asyncio.run(_round(clients, targets, spec, transport, k, kw, ids,
                                               qs, ks, vs, barrier, t, metas)))
    except BaseException as exc:  # reported to the main process, which stops the group
        barrier.abort()
        out.put({"error": f"host {idx}: {type(exc).__name__}: {exc}"})


def _region_bytes(tensors: list[list[Any]]) -> int:
    """Room for every tensor of the round, each rounded up as a region lays it out."""
    return sum(t.numel() * t.element_size() + 4096 for group in tensors for t in group)


def _placed(region: Any, transport: str, qs: list[Any], ks: list[Any], vs: list[Any]
            ) -> tuple[list[Any], list[Any], list[Any], list[Any | None]]:
    """The round's q, k, v and outputs: the host tensors for ``bytes``; copies inside the
    registered region (on the GPU for ``cuda``) for ``shm``/``cuda``, outputs there too."""
    if region is None:
        return qs, ks, vs, [None] * len(qs)

    def inside(x: Any) -> Any:
        t = region.empty(tuple(x.shape), x.dtype)
        t.copy_(x)
        return t

    return ([inside(x) for x in qs], [inside(x) for x in ks], [inside(x) for x in vs],
            [region.empty(tuple(x.shape), x.dtype) for x in qs])


async def _round(clients: list[Any], targets: list[str], spec: dict[str, Any], transport: str,
                 k: int, kw: dict[str, Any], ids: list[list[str]], qs: list[Any],
                 ks: list[Any], vs: list[Any], barrier: Any, t: float, metas: list[Any]
                 ) -> dict[str, Any]:
    """The host's handles, k steps outstanding in all: step i + k is sent once step i is
    read. A step's latency runs from its send to its result (on cuda: the output on the
    GPU). The host's sync clients (``--client sync``) or asyncio clients made here
    (``async``): the same calls, awaited when the client's give awaitables."""
    from attention_client.aio import AsyncAttentionClient

    async def done(x: Any) -> Any:
        return (await x) if inspect.isawaitable(x) else x

    if spec["client"] == "async":
        async with contextlib.AsyncExitStack() as stack:
            aio = [await stack.enter_async_context(AsyncAttentionClient(x, **kw))
                   for x in targets]
            return await _round_on(aio, spec, transport, k, ids, qs, ks, vs, barrier, t,
                                   metas, done)
    return await _round_on(clients, spec, transport, k, ids, qs, ks, vs, barrier, t, metas,
                           done)


async def _round_on(clients: list[Any], spec: dict[str, Any], transport: str, k: int,
                    ids: list[list[str]], qs: list[Any], ks: list[Any], vs: list[Any],
                    barrier: Any, t: float, metas: list[Any], done: Any) -> dict[str, Any]:
    L, n, lat = spec["layers"], len(clients), []
    shared: list[int] = []  # per step: the calls its launch served (steps merged into one)
    via_socket, place = _route(transport)
    regions: list[Any] = [None] * n
    if place != "bytes":  # one region per server, with room for every layer's tensors
        nbytes = 2 * _region_bytes([qs, ks, vs])
        register = {"shm": "register_shm", "cuda": "register_cuda", "nixl": "register_nixl",
                    "nixl-gpu": "register_nixl"}[place]
        extra = {"device": "cuda"} if place == "nixl-gpu" else {}
        regions = [await done(getattr(c, register)(nbytes, **extra)) for c in clients]
    # Layer x's tensors in its server's region (bytes: as any client sends them, no region
    # arguments).
    placed = [_placed(regions[x % n], place, qs[x:x + 1], ks[x:x + 1], vs[x:x + 1])
              for x in range(L)]
    qs, ks, vs, outs = ([p[j][0] for p in placed] for j in range(4))
    kw = [{} if o is None else {"out": o, "use_regions": True} for o in outs]
    spin = {"spin_us": spec["spin_us"]} if spec["spin_us"] else {}
    steps = [c.decode_steps(metadata=m, step_socket=True, **spin) if via_socket
             else c.decode_steps(metadata=m) for c, m in zip(clients, metas, strict=True)]

    async def read(t0: float, pending: Any, client: Any, timed: bool) -> None:
        await done(pending.result())
        if place in ("cuda", "nixl-gpu"):
            torch.cuda.synchronize()  # the answer is on the GPU when it returns
        if timed:
            lat.append(time.perf_counter() - t0)
            shared.append(client.last_stats["batch_requests"])

    async def run(count: int, timed: bool) -> None:
        window: collections.deque[tuple[float, Any, Any]] = collections.deque()
        for i in range(count):
            if len(window) == k:
                await read(*window.popleft(), timed)
            x = i % L
            window.append((time.perf_counter(), await done(steps[x % n].submit(
                qs[x], ids[x], ks[x], vs[x], store=spec["store"], **kw[x])), clients[x % n]))
        while window:
            await read(*window.popleft(), timed)

    await run(spec["warmup"], False)
    # In a thread: an asyncio client's own tasks keep running on the loop meanwhile. Two
    # waits: the main process samples the server between them, before any measured step.
    for _ in range(2):
        await asyncio.to_thread(barrier.wait, t)
    c0 = time.process_time()
    await run(spec["steps"], True)
    cpu = time.process_time() - c0
    await asyncio.to_thread(barrier.wait, t)
    for s in steps:
        await done(s.close())
    for region in regions:
        if region is not None:
            await region.aclose()  # either client's region (a sync one's closes at once)
    return {"lat": lat, "cpu_s": cpu, "steps": len(lat), "launch_calls": shared}


# ---- main process -------------------------------------------------------------------------

# ---- the gRPC floor: a bare echo of the step's sizes -------------------------------------

_ECHO = "/bench.Echo/Steps"
_ECHO_OPTS = [("grpc.max_receive_message_length", 64 << 20),
              ("grpc.max_send_message_length", 64 << 20)]


def _echo_server(port: Any, reply_bytes: int) -> None:
    """A process: a grpc.aio server whose one stream rpc answers each message with
    ``reply_bytes`` bytes (no parsing: raw bytes both ways). Puts its port in ``port``."""
    async def serve() -> None:
        reply = b"\0" * reply_bytes

        async def steps(requests: Any, context: Any) -> Any:
            async for _ in requests:
                yield reply

        server = grpc.aio.server(options=_ECHO_OPTS)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "bench.Echo", {"Steps": grpc.stream_stream_rpc_method_handler(steps)}),))
        port.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def grpc_floor(up: int, down: int, steps: int, warmup: int) -> tuple[float, float]:
    """(p50 ms, client CPU ms) per exchange of ``up`` bytes out and ``down`` back on one
    kept-open stream, the sync client as ``decode_steps()`` drives it (a request iterator fed
    from a queue, the answer read in the caller's thread)."""
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    proc = ctx.Process(target=_echo_server, args=(port_q, down), daemon=True)
    proc.start()
    try:
        port = port_q.get(timeout=60)
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=_ECHO_OPTS) as channel:
            feed: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
            answers = channel.stream_stream(_ECHO)(iter(feed.get, None))
            message, lat = b"\1" * up, []
            for _ in range(warmup):
                feed.put(message)
                next(answers)
            c0 = time.process_time()
            for _ in range(steps):
                t0 = time.perf_counter()
                feed.put(message)
                next(answers)
                lat.append(time.perf_counter() - t0)
            cpu = time.process_time() - c0
            feed.put(None)
        return 1e3 * statistics.median(lat), 1e3 * cpu / steps
    finally:
        proc.kill()
        proc.join(5)


def _tree_cpu(pid: int | None) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (the front ends)."""
    if pid is None:
        return math.nan
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return math.nan
    total = 0.0
    for p in procs:
        try:
            c = p.cpu_times()
            total += c.user + c.system
        except psutil.Error:  # ended meanwhile
            pass
    return total


def run_group(args: argparse.Namespace, target: list[str], B: int, ctx: int, hosts: int,
              inflight: list[int], server_pid: int | None, tag: str,
              metrics_url: str | None = None) -> list[dict[str, Any]]:
    """Spawn ``hosts`` hosts for (B, ctx) and measure one row per inflight value (with
    ``metrics_url``, the server's: also the mean NIXL transfer per direction)."""
    from bench_service import nixl_transfer_seconds

    h, hkv, d, e = args.heads, args.kv_heads, args.head_dim, DTYPES[args.dtype][2]
    t = 120.0 + 2.0 * (args.warmup + args.steps)  # a round's bound (steps have 60 s each)
    # Spawn + imports + the appends (at a pessimistic 50 MB/s in all).
    setup_t = 180.0 + hosts * B * args.layers * ctx * 2 * hkv * d * e / 5e7
    spec = {"target": target, "batch": B, "context": ctx, "layers": args.layers, "heads": h,
            "kv_heads": hkv, "head_dim": d, "dtype": args.dtype, "store": args.store,
            "warmup": args.warmup, "steps": args.steps, "inflight": inflight, "tag": tag,
            "transports": args.transport, "client": args.client, "spread": args.spread,
            "spin_us": args.spin_us, "timeout": max(t, setup_t)}
    from bench_service import worker_context

    mpc = worker_context()
    barrier, out = mpc.Barrier(hosts + 1), mpc.Queue()
    procs = [mpc.Process(target=_host, args=(i, spec, barrier, out), daemon=True)
             for i in range(hosts)]
    for p in procs:
        p.start()
    rows, errors = [], []
    try:
        rounds = [(tr, k) for tr in args.transport for k in inflight]  # the hosts' order
        for n, (transport, k) in enumerate(rounds):
            row: dict[str, Any] = {"batch": B, "context": ctx, "hosts": hosts, "inflight": k,
                                   "transport": transport}
            rows.append(row)
            try:
                barrier.wait(setup_t if n == 0 else t)  # every host warmed up
                # Sampled before the measured steps start: sampled after, a loaded machine's
                # scrape once came back after a CPU run's 8 steps (no NIXL transfer between
                # the samples).
                x0 = nixl_transfer_seconds(metrics_url)
                c0, w0 = _tree_cpu(server_pid), time.perf_counter()
                barrier.wait(t)  # the measured steps start
                barrier.wait(t)  # ... and end
                c1, w1 = _tree_cpu(server_pid), time.perf_counter()
                x1 = nixl_transfer_seconds(metrics_url)
                res = [out.get(timeout=60) for _ in procs]
            except (threading.BrokenBarrierError, queue.Empty) as exc:
                barrier.abort()
                errors.append(f"{type(exc).__name__} (a host failed or timed out)")
                break
            errors += [r["error"] for r in res if "error" in r]
            if errors:
                break
            lat = np.array([x for r in res for x in r["lat"]]) * 1e3
            steps = int(lat.size)
            sps = steps / (w1 - w0)
            row.update(
                p50_ms=float(np.percentile(lat, 50)), p99_ms=float(np.percentile(lat, 99)),
                steps=steps, window_s=w1 - w0, steps_per_s=sps, tokens_per_s=B * sps,
                client_cpu_ms=1e3 * statistics.median(r["cpu_s"] / r["steps"] for r in res),
                server_cpu_ms=1e3 * (c1 - c0) / steps,
                calls_per_launch=float(np.mean([x for r in res for x in r["launch_calls"]])),
                wire_out_bytes=B * (h + 2 * hkv) * d * e, wire_back_bytes=B * h * d * e)
            for direction, (n1, s1) in x1.items():  # NIXL transports: the engine's transfers
                n0, s0 = x0.get(direction, (0.0, 0.0))
                if n1 > n0:
                    row[f"nixl_{direction}_us"] = 1e6 * (s1 - s0) / (n1 - n0)
    finally:
        while True:  # errors a host put after the break
            try:
                got = out.get(timeout=0.5)
            except queue.Empty:
                break
            if "error" in got:
                errors.append(got["error"])
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
    if errors:
        rows[-1]["errors"] = sorted(set(errors))
        print(f"  errors: {rows[-1]['errors']}", flush=True)
    return [r for r in rows if "steps" in r or "errors" in r]


def kernel_us(nseq: int, ctx: int, args: argparse.Namespace, page_bytes: int) -> float:
    """Median ``paged_decode`` time (us) of one step of ``nseq`` sequences of ``ctx`` cached
    keys plus the new one, pages laid out as the server's pool lays them out."""
    from attention_kernels import paged_decode

    tdt, _, e = DTYPES[args.dtype]
    h, hkv, d, keys = args.heads, args.kv_heads, args.head_dim, ctx + 1
    page_tokens, page_elems = page_bytes // (2 * hkv * d * e), page_bytes // e
    per_seq = -(-keys // page_tokens)
    n_pages = nseq * per_seq
    try:
        pool = torch.randn(n_pages * page_elems, dtype=tdt, device="cuda")
        shape, strides = (n_pages, page_tokens, hkv, d), (page_elems, hkv * d, d, 1)
        k_pages = pool.as_strided(shape, strides, 0)
        v_pages = pool.as_strided(shape, strides, page_tokens * hkv * d)  # V after K
        table = torch.randperm(n_pages, device="cuda").to(torch.int32).view(nseq, per_seq)
        lens = torch.full((nseq,), keys, dtype=torch.int32, device="cuda")
        q = torch.randn(nseq, h, d, dtype=tdt, device="cuda")
        o = torch.empty_like(q)
        run = lambda: paged_decode(q, k_pages, v_pages, table, lens, max_seqlen_k=keys,  # noqa: E731
                                   out=o)
        for _ in range(10):  # compiles and warms
            run()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(args.kernel_reps)]
        for a, b in ev:
            a.record()
            run()
            b.record()
        torch.cuda.synchronize()
        return 1e3 * statistics.median(a.elapsed_time(b) for a, b in ev)
    except torch.OutOfMemoryError:
        return math.nan
    finally:
        pool = k_pages = v_pages = None  # noqa: F841 (freed before the next shape)
        torch.cuda.empty_cache()


def _f(x: Any, nd: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| B | context | hosts | transport | inflight | p50 ms | p99 ms | steps/s | tokens/s "
            "| client CPU ms/step | server CPU ms/step | tensor KiB out/back | kernel us (step) "
            "| kernel us (merged) | fraction | gRPC echo p50 ms | echo client CPU ms "
            "| calls per launch | NIXL us in/out |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "steps" not in r:
            lines.append(f"| {r['batch']} | {r['context']} | {r['hosts']} | {r['transport']} | "
                         f"{r['inflight']} | failed: {'; '.join(r['errors'])[:200]} |" + " |" * 13)
            continue
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['hosts']} | {r['transport']} | "
            f"{r['inflight']} | {_f(r['p50_ms'], 3)} | {_f(r['p99_ms'], 3)} | "
            f"{r['steps_per_s']:.1f} | {r['tokens_per_s']:.0f} | {_f(r['client_cpu_ms'], 3)} | "
            f"{_f(r['server_cpu_ms'], 3)} | {r['wire_out_bytes'] / 1024:.1f}/"
            f"{r['wire_back_bytes'] / 1024:.1f} | {_f(r.get('kernel_us'), 1)} | "
            f"{_f(r.get('merged_kernel_us'), 1)} | {_f(r.get('fraction'), 3)} | "
            f"{_f(r.get('echo_p50_ms'), 3)} | {_f(r.get('echo_client_cpu_ms'), 3)} | "
            f"{_f(r.get('calls_per_launch'), 2)} | {_f(r.get('nixl_in_us'), 0)}/"
            f"{_f(r.get('nixl_out_us'), 0)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=ints, default=ints("1,8,64,256"), help="sequences per host")
    p.add_argument("--context", type=ints, default=ints("1024,2048"), help="cached tokens")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hosts", type=ints, default=ints("1,8"))
    p.add_argument("--client", choices=("sync", "async"), default="sync",
                   help="the model hosts' client: AttentionClient or AsyncAttentionClient")
    p.add_argument("--inflight", type=ints, default=ints("1,2"),
                   help="steps outstanding on a host's one handle (submit), each <= --layers")
    p.add_argument("--transport", type=lambda x: x.split(","), default=["bytes"],
                   help="bytes (gRPC messages), shm (a registered system shared-memory "
                   "region), cuda (a CUDA IPC region on the server's GPU), nixl / nixl-gpu (a "
                   "NIXL region of host / GPU memory); socket, socket-shm, socket-cuda, "
                   "socket-nixl, socket-nixl-gpu: the same through the server's step socket: "
                   "comma-separated")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--steps", type=int, default=400, help="measured steps per host per point")
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--store", action="store_true", help="store the new tokens (default off)")
    p.add_argument("--spin-us", type=float, default=0,
                   help="step-socket points, sync client: wait for each answer by polling up "
                        "to this long first (decode_steps(spin_us=))")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--frontends", type=int, help="passed to the server (default: its own)")
    p.add_argument("--server-args", help="more server flags, e.g. '--max-queue-delay-ms 1'")
    p.add_argument("--target", help="drive this running server (loopback) instead; several, "
                   "comma-separated: host i drives the (i mod count)-th")
    p.add_argument("--spread", choices=["hosts", "layers"], default="hosts",
                   help="with several --target: each host on one server in turn (hosts), or "
                   "each host on all, its layer i's caches on server i mod their count (layers: "
                   "e.g. a host's two micro-batches on two engines of one GPU)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--kernel", action=argparse.BooleanOptionalAction, default=True,
                   help="time the local paged_decode kernel (cuda only)")
    p.add_argument("--kernel-reps", type=int, default=50)
    p.add_argument("--floor", action=argparse.BooleanOptionalAction, default=True,
                   help="measure a bare gRPC echo of each point's message sizes (one host)")
    # What bench_service.Server reads from the namespace.
    p.set_defaults(max_batch_tokens=None, max_queue_delay_ms=None, server_log_level="WARNING",
                   startup_timeout=600.0, server_cpus=None)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.layers < 1:
        p.error("--steps >= 1, --warmup >= 0, --layers >= 1")
    if args.spin_us and args.client != "sync":
        p.error("--spin-us: the sync client's (the asyncio client waits on its event loop)")
    if not set(args.transport) <= set(TRANSPORTS):
        p.error(f"--transport: {args.transport}: use {', '.join(TRANSPORTS)}")
    via_socket = any(_route(t)[0] for t in args.transport)
    if via_socket and not args.target:  # the server started here opens one
        path = f"/tmp/bench-offload-{os.getpid()}.sock"
        args.server_args = f"{args.server_args or ''} --step-socket {path}".strip()
    inflight = [k for k in args.inflight if 1 <= k <= args.layers]
    if inflight != args.inflight:
        print(f"inflight values outside 1..layers skipped: {args.inflight} -> {inflight}")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_service import Server, server_info

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    server = None if args.target else Server(args, True, out_dir / "bench_offload_server.log")
    targets = args.target.split(",") if args.target else [server.target]
    pid = server.proc.pid if server is not None else None
    rows: list[dict[str, Any]] = []
    transports: list[dict[str, str]] = []
    try:
        info = server_info(targets[0])
        _, name, e = DTYPES[args.dtype]
        page_bytes = info.kv_page_bytes or 256 << 10
        page_tokens = page_bytes // (2 * args.kv_heads * args.head_dim * e)
        print(f"{info.device} ({info.backend}), {info.frontends} front end(s), pool "
              f"{info.kv_cache_bytes >> 20} MiB, {page_tokens} tokens/page", flush=True)
        # Pool pages a group needs (store=False: the caches keep their context).
        grow = len(inflight) * (args.warmup + args.steps) if args.store else 0
        for ctx in args.context:
            for B in args.batch:
                for hosts in args.hosts:
                    per = -(-hosts // len(targets))  # hosts on the busiest server
                    pages = per * args.layers * B * -(-(ctx + grow) // page_tokens)
                    if info.kv_cache_bytes and pages * page_bytes > info.kv_cache_bytes:
                        print(f"B={B} ctx={ctx} hosts={hosts}: needs {pages * page_bytes >> 20}"
                              f" MiB of pool, skipped", flush=True)
                        continue
                    tag = f"bo{os.getpid()}-{B}-{ctx}-{hosts}"
                    for r in run_group(args, targets, B, ctx, hosts, inflight, pid, tag,
                                       server.metrics_url if server is not None else None):
                        rows.append(r)
                        if "steps" in r:
                            print(f"B={B} ctx={ctx} hosts={hosts} {r['transport']} "
                                  f"inflight={r['inflight']}: "
                                  f"p50 {r['p50_ms']:.3f} ms, {r['steps_per_s']:.1f} steps/s",
                                  flush=True)
        # Which transport UCX picked for NIXL regions, if any (as a user reads them).
        with attention_client.AttentionClient(targets[0], spread=False) as c:
            transports = c.info()["nixl_transports"]
    finally:
        if server is not None:
            server.stop()  # frees its pool for the kernel timings below
    if args.floor:
        floors: dict[tuple[int, int], tuple[float, float]] = {}
        for r in rows:
            if "steps" not in r:
                continue
            # The step's message: its tensors unless in a region, plus ~40 header bytes per
            # cache id and ~200 of the rest; the answer: out unless in a region, the stats.
            tensors = _route(r["transport"])[1] == "bytes"
            up = (r["wire_out_bytes"] if tensors else 0) + 200 + 40 * r["batch"]
            down = (r["wire_back_bytes"] if tensors else 0) + 120
            if (up, down) not in floors:
                floors[(up, down)] = grpc_floor(up, down, args.steps, args.warmup)
            r["echo_p50_ms"], r["echo_client_cpu_ms"] = floors[(up, down)]
    use_kernel = args.kernel and info.backend == "cuda" and torch.cuda.is_available()
    if use_kernel:
        times: dict[tuple[int, int], float] = {}
        for r in rows:
            if "steps" not in r:
                continue
            for key, n in (("kernel_us", r["batch"]),
                           ("merged_kernel_us", r["hosts"] * r["batch"])):
                if (n, r["context"]) not in times:
                    times[(n, r["context"])] = kernel_us(n, r["context"], args, page_bytes)
                r[key] = times[(n, r["context"])]
            # Service sequences/s over the kernel's, running merged batches back to back.
            r["fraction"] = r["steps_per_s"] * r["merged_kernel_us"] * 1e-6 / r["hosts"]
    meta = {"command": shlex.join([sys.executable, *sys.argv]) if argv is None else
            shlex.join(["bench_offload.py", *argv]),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": info.device, "backend": info.backend, "frontends": info.frontends,
            "server_version": info.server_version, "grpcio": grpc.__version__,
            "torch": torch.__version__, "kernel": use_kernel, "page_tokens": page_tokens,
            "nixl_transports": transports, "args": vars(args)}
    md = (f"# bench_offload: {info.device}, {meta['date']}\n\n`{meta['command']}`\n\n"
          f"{info.frontends} front end(s); H={args.heads}, H_kv={args.kv_heads}, "
          f"D={args.head_dim} {name}, {args.layers} layers, store={args.store}, "
          f"{args.steps} steps/host/point; grpcio {grpc.__version__}, torch {torch.__version__}"
          f"\n\n{table(rows)}\n")
    if transports:
        md += "\nUCX's transports for NIXL regions: " + "; ".join(
            f"{t['op']} {t['local_memory']} <-> {t['remote_memory']} ({t['peer']}): "
            f"{t['transport']}" for t in transports) + "\n"
    print("\n" + md)
    stamp = f"{datetime.now(timezone.utc):%Y%m%d_%H%M%S}"
    (out_dir / f"bench_offload_{stamp}.md").write_text(md)
    (out_dir / f"bench_offload_{stamp}.json").write_text(json.dumps({**meta, "rows": rows},
                                                                    indent=2, default=str))
    print(f"wrote {out_dir}/bench_offload_{stamp}.{{json,md}}")
    return 1 if any("errors" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
