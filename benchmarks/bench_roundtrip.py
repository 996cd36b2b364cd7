"""Where the time of a remote prefill goes, per data path, with the machine's ceilings beside.

One run, one machine (loopback), in this order:

1. ceilings: host memcpy GB/s (one thread), H2D and D2H GB/s from pinned memory, raw gRPC of
   the request's bytes through a bare transfer server (one Python process), and the kernel in
   this process (CUDA events);
2. the service with one process (``--frontends 1``), then with ``--frontends N`` for each N of
   ``--frontends``: one call's round trip (median of ``--iters`` calls, more while they
   total under ``--min-seconds``) per path:
   ``grpc host`` / ``grpc cuda`` (tensor bytes through gRPC from host / cuda tensors),
   ``shm in region`` (tensors in a registered system region), ``shm staged`` (host tensors
   copied into one), ``shm out=`` (output written in place too), ``cuda ipc in region`` and
   ``cuda ipc out=`` (CUDA IPC region: the bytes never leave the GPU), ``nixl in region`` /
   ``nixl staged`` / ``nixl out=`` (a NIXL region: the engine pulls and pushes the bytes over
   UCX, when the server has NIXL), ``nixl gpu in region`` / ``nixl gpu out=`` (a NIXL region
   of GPU memory, on cuda: GPU to GPU through UCX's cuda_ipc; ``nixl gpu1 ...``: the same
   from the host's second GPU, when it has two), and the two ``out=``
   paths again with a unary call each (``... unary``: call_streams off); every path's answer is
   checked against the float64 reference first;
3. aggregate gRPC payload: ``--clients`` client processes, each with its own connection,
   calling for ``--agg-seconds`` with ``--agg-tokens`` tokens per request (bytes in + out per
   second, all clients together), against each server of step 2;
4. with ``--baseline-tree DIR`` (a source tree of an earlier commit, e.g. ``git archive``
   of the one before the process group), the aggregate against that tree's server too, before
   step 2 and again after it, with the same clients: issue 10 asks for 4x "today's single
   process", the server as it was, whose single process was slower than ``--frontends 1`` is
   now. Only the server comes from DIR (its ``kernels/`` and ``service/``); the clients are
   this tree's.

    python benchmarks/bench_roundtrip.py --tokens 8192 --heads 16 --head-dim 128 --out DIR
    python benchmarks/bench_roundtrip.py --device cpu --tokens 256 --heads 4 --head-dim 32 \\
        --frontends 2 --clients 2 --agg-tokens 128 --agg-seconds 1 --iters 3   # a cpu check
    git archive 8091d8f | tar x -C /tmp/base && python benchmarks/bench_roundtrip.py \
        --baseline-tree /tmp/base ...      # issue 10's baseline: the server before it
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from datetime import date
from pathlib import Path
from typing import Any

from attention_wire import grpc_defaults

grpc_defaults.apply()  # the client library's grpc I/O settings, before grpc loads

import grpc
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_service import (
    _children,
    _free_port,
    _healthy,
    cpu_list,
    split_cpus,
    worker_context,
)

ROOT = Path(__file__).resolve().parents[1]
TRANSFER_METHOD = "/bench.Transfer/Echo"
# --server-cpus: every server this script starts runs on these CPUs (None: wherever).
SERVER_CPUS: set[int] | None = None
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---- the bare transfer server (runs in its own process) -------------------------------------
def serve_transfer(options: list[tuple[str, Any]] | None = None) -> None:
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
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[
        ("grpc.max_receive_message_length", 8 << 20), *(options or [])])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"listening on port {port}", flush=True)
    server.wait_for_termination()


# ---- helpers ----------------------------------------------------------------------------------
def _popen(cmd: list[str], **kwargs: Any) -> subprocess.Popen:
    """A server process, moved onto ``SERVER_CPUS`` before it has imported anything (its
    front ends and threads inherit the set; the engine counts its cores from it)."""
    proc = subprocess.Popen(cmd, **kwargs)
    if SERVER_CPUS:
        os.sched_setaffinity(proc.pid, SERVER_CPUS)
    return proc


def cpus_of_tree(pid: int) -> list[int]:
    """The CPUs process ``pid`` and its descendants may run on (all of them together): what
    a server's front ends and engine ended up with."""
    seen: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            seen |= os.sched_getaffinity(p)
        todo += _children(p)
    return sorted(seen)


def _start(
    cmd: list[str], env: dict[str, str], timeout: float = 300.0
) -> tuple[subprocess.Popen, int]:
    """Start a server process and read its port from its 'listening on port N' line."""
    proc = _popen(
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


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def _wait_serving(
    target: str, timeout: float = 300.0, proc: subprocess.Popen | None = None
) -> None:
    end = time.monotonic() + timeout
    while not _healthy(target):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before SERVING")
        if time.monotonic() > end:
            raise RuntimeError("server never SERVING")
        time.sleep(0.5)


def against_baseline(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each server's aggregate runs of one kind (client count and settings) against all the
    baseline's runs at that client count, like for like: median over median and best over
    best (one run against another is at the mercy of either's luck: the baseline's 8-client
    runs spread 2.16-2.42 GB/s in one call)."""
    theirs: dict[int, list[float]] = {}
    for entry in result.get("baseline", []):
        for a in entry["aggregate"]:
            theirs.setdefault(a["clients"], []).append(a["GBps"])
    rows = []
    for s in result["servers"]:
        ours: dict[tuple[int, str], list[float]] = {}
        for a in s["aggregate"]:
            ours.setdefault((a["clients"], _agg_label(a)), []).append(a["GBps"])
        for (clients, label), runs in ours.items():
            base = theirs.get(clients)
            if not base:
                continue
            rows.append({
                "frontends": s["frontends"], "clients": clients, "label": label,
                "runs": len(runs), "baseline_runs": len(base),
                "median_GBps": statistics.median(runs), "best_GBps": max(runs),
                "baseline_median_GBps": statistics.median(base),
                "baseline_best_GBps": max(base),
                "median_ratio": statistics.median(runs) / statistics.median(base),
                "best_ratio": max(runs) / max(base),
            })
    return rows


MAX_ITERS = 1000


def _median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples) if samples else float("nan")


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.to(ref.device).double()
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _timed(fn: Callable[[], Any], iters: int, cuda: bool = False,
           min_seconds: float = 0.0) -> list[float]:
    """``iters`` timed calls after a warm one, and more while they total under ``min_seconds``
    (at most MAX_ITERS): a path of a few ms gets a median over hundreds of calls, not 3."""
    fn()  # warm: compiles, first allocations, region scratch
    times: list[float] = []
    while len(times) < iters or (sum(times) < min_seconds and len(times) < MAX_ITERS):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def transfer_seconds(
    port: int, in_bytes: int, out_bytes: int, chunk: int, iters: int,
    options: list[tuple[str, Any]] | None = None,
) -> list[float]:
    """Round trips of ``in_bytes`` up in ``chunk``-byte messages and ``out_bytes`` down."""
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
        ("grpc.max_receive_message_length", 8 << 20), *(options or [])])
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


def ceilings(iters: int, mib: int = 256) -> dict[str, float]:
    """GB/s the machine itself gives: host memcpy (one thread), H2D/D2H from pinned memory, of
    ``mib`` MiB buffers."""
    n = mib << 20
    src = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t = min(_timed(lambda: np.copyto(dst, src), iters))
    out = {"host_memcpy_GBps": n / t / 1e9}
    if torch.cuda.is_available():
        h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        d = torch.empty(n, dtype=torch.uint8, device="cuda")
        out["h2d_pinned_GBps"] = n / min(_timed(lambda: d.copy_(h, non_blocking=True), iters,
                                                cuda=True)) / 1e9
        out["d2h_pinned_GBps"] = n / min(_timed(lambda: h.copy_(d, non_blocking=True), iters,
                                                cuda=True)) / 1e9
    return out


# ---- one call per path ------------------------------------------------------------------------
def paths(target: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
          causal: bool, ref: torch.Tensor, tol: float, iters: int,
          stripes: Sequence[int] = (), min_seconds: float = 0.0) -> dict[str, Any]:
    """Round trip (median ms) per data path, each checked against the reference first."""
    from attention_client import AttentionClient

    rows: dict[str, Any] = {}
    stats: dict[str, dict[str, float]] = {}
    counts: dict[str, int] = {}  # calls timed per path
    nbytes = sum(t.numel() * t.element_size() for t in (q, k, v)) + q.numel() * q.element_size()

    def measure(name: str, client: AttentionClient, call: Callable[[], Any], cuda: bool) -> None:
        err = _rel_err(call(), ref)
        if err > tol:
            raise SystemExit(f"{name}: output differs from the reference: {err:.2e}")
        times = _timed(call, iters, cuda, min_seconds)
        rows[name] = _median_ms(times)
        counts[name] = len(times)
        stats[name] = dict(client.last_stats or {})

    with AttentionClient(target, timeout=600, use_regions=False) as c:
        measure("grpc host", c, lambda: c.attention(q, k, v, cu, causal=causal), False)
        if torch.cuda.is_available():
            qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
            measure("grpc cuda", c, lambda: c.attention(qc, kc, vc, cu, causal=causal), True)
    for n in stripes:  # one call split over n connections (``stripes=``)
        with AttentionClient(target, timeout=600, use_regions=False, stripes=n) as c:
            for _ in range(2 * n):  # every connection opened
                c.attention(q, k, v, cu, causal=causal)
            measure(f"grpc host x{n}", c, lambda: c.attention(q, k, v, cu, causal=causal), False)
    def unary(run: Callable[[], None]) -> None:
        """``run`` with this client's region calls sent unary (call_streams off), as an A/B
        of the kept-open call streams in the same run."""
        c.call_streams = False
        try:
            run()
        finally:
            c.call_streams = True

    with AttentionClient(target, timeout=600) as c:
        if not c.info()["regions"]:
            return {"round_trip_ms": rows, "stats": stats, "calls_timed": counts,
                    "note": "regions off"}
        room = 2 * nbytes + (64 << 20)

        def region_rows(label: str, region: Any, cuda: bool, staged: bool = False,
                        unary_out: bool = False) -> None:
            """One region's rows: tensors in it, host tensors staged into it, ``out=`` in it
            too (and that call unary), then the region closed."""
            qr, kr, vr = (region.empty(t.shape, t.dtype).copy_(t) for t in (q, k, v))
            measure(f"{label} in region", c, lambda: c.attention(qr, kr, vr, cu, causal=causal),
                    cuda)
            if staged:
                measure(f"{label} staged", c, lambda: c.attention(q, k, v, cu, causal=causal),
                        cuda)
            out = region.empty(q.shape, q.dtype)

            def call() -> Any:
                return c.attention(qr, kr, vr, cu, causal=causal, out=out)

            measure(f"{label} out=", c, call, cuda)
            if unary_out:
                unary(lambda: measure(f"{label} out= unary", c, call, cuda))
            region.close()

        region_rows("shm", c.register_shm(room), False, staged=True, unary_out=True)
        nixl = c.info().get("nixl")
        if nixl:  # NIXL regions: the same calls, bytes moved by UCX
            region_rows("nixl", c.register_nixl(room), False, staged=True)
        if torch.cuda.is_available() and c.info()["backend"] == "cuda":
            region_rows("cuda ipc", c.register_cuda(room), True, unary_out=True)
            if nixl:  # GPU memory through NIXL: UCX moves it GPU to GPU
                region_rows("nixl gpu", c.register_nixl(room, device="cuda"), True)
                if torch.cuda.device_count() > 1:  # from another GPU than the server's
                    region_rows("nixl gpu1", c.register_nixl(room, device="cuda:1"), True)
    return {"round_trip_ms": rows, "stats": stats, "calls_timed": counts}


# ---- aggregate gRPC throughput ------------------------------------------------------------
def _agg_worker(target: str, tokens: int, heads: int, dim: int, dtype: str, seconds: float,
                channels: int, stripes: int, spread: bool, start: Any, conn: Any) -> None:
    import torch as _torch

    from attention_client import AttentionClient
    from attention_wire.pb import attention_pb2 as pb
    from attention_wire.pb import attention_pb2_grpc as pb_grpc

    g = _torch.Generator().manual_seed(os.getpid())
    q, k, v = (_torch.randn(tokens, heads, dim, generator=g).to(DTYPES[dtype]) for _ in range(3))
    cu = _torch.tensor([0, tokens], dtype=_torch.int32)
    moved = 4 * q.numel() * q.element_size()  # q, k, v in; out back
    with AttentionClient(target, timeout=600, use_regions=False, channels=channels,
                         stripes=stripes, spread=spread) as c:
        for _ in range(2 * c.channels):  # every connection opened and warm
            c.attention(q, k, v, cu)
        # Which front-end process holds each of this client's connections (SO_REUSEPORT
        # hashes connections to them; servers before GetServerInfo.frontend say 0).
        frontends = [
            pb_grpc.AttentionServiceStub(ch).GetServerInfo(pb.GetServerInfoRequest(),
                                                           timeout=30).frontend
            for ch in c._base_channels
        ]
        conn.send("ready")
        start.wait()
        cpu0 = time.process_time()  # all of this process's threads (grpc's too)
        t_end = time.perf_counter() + seconds
        calls, lat = 0, []
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            c.attention(q, k, v, cu)
            lat.append(time.perf_counter() - t0)
            calls += 1
    conn.send({"calls": calls, "bytes": calls * moved, "latencies": lat, "frontends": frontends,
               "cpus": sorted(os.sched_getaffinity(0)), "cpu_s": time.process_time() - cpu0})


def aggregate(target: str, clients: int, tokens: int, heads: int, dim: int, dtype: str,
              seconds: float, channels: int = 1, stripes: int = 1,
              spread: bool = False) -> dict[str, Any]:
    """``clients`` processes, each calling in a loop over ``channels`` connections (round
    robin), each call split into ``stripes`` kv-head groups sent at once (``stripes=``; at
    least as many connections). The kernel spreads connections, not calls, over the front ends
    that share the port (SO_REUSEPORT hashes each connection to one of them): with one
    connection per client some front ends serve two clients while others idle; ``spread``:
    each client moves its connections off crowded front ends as it starts (``spread=``)."""
    ctx = worker_context()
    start = ctx.Event()
    pipes, procs = [], []
    for _ in range(clients):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_agg_worker,
                        args=(target, tokens, heads, dim, dtype, seconds, channels, stripes,
                              spread, start, child))
        p.start()
        pipes.append(parent)
        procs.append(p)
    for parent in pipes:  # each client imported, connected and warm: then all start at once
        if not parent.poll(300) or parent.recv() != "ready":
            raise RuntimeError("an aggregate client did not get ready within 300 s")
    start.set()
    results = [p.recv() for p in pipes]
    for p in procs:
        p.join(60)
    lat = [x for r in results for x in r["latencies"]]
    return {
        "clients": clients, "channels": max(channels, stripes), "stripes": stripes,
        "spread": spread,
        "calls": sum(r["calls"] for r in results),
        "GBps": sum(r["bytes"] for r in results) / seconds / 1e9,
        "p50_ms": _median_ms(lat), "p99_ms": 1e3 * float(np.percentile(lat, 99)) if lat else 0,
        "client_cpus": sorted({c for r in results for c in r["cpus"]}),
        # Cores each client process used, on average and at most: near 1 is a client whose
        # Python is the limit, not the server.
        "client_cores_mean": sum(r["cpu_s"] for r in results) / clients / seconds,
        "client_cores_max": max(r["cpu_s"] for r in results) / seconds,
        # Per client: its calls, and the front end(s) its connection(s) landed on. Clients
        # that share a front end share its one Python thread: they complete fewer calls.
        "calls_per_client": [r["calls"] for r in results],
        "frontends_per_client": [r["frontends"] for r in results],
    }


def _spread(a: dict[str, Any], frontends: int) -> str:
    """How the clients' connections fell on the front ends, and what each client got."""
    if frontends < 2 or "frontends_per_client" not in a:
        return ""
    load = [0] * frontends
    for fes in a["frontends_per_client"]:
        for fe in fes:
            load[fe] += 1
    calls = a["calls_per_client"]
    return (f"; connections per front end {load} ({sum(1 for n in load if n)} of {frontends} "
            f"used), calls per client {min(calls)}..{max(calls)}")


def _agg_label(a: dict[str, Any]) -> str:
    stripes = a.get("stripes", 1)
    return (f"clients {a['clients']:3d} x {a['channels']} ch"
            + (f" x{stripes} stripes" if stripes > 1 else "")
            + (" spread" if a.get("spread") else ""))


def baseline_env(tree: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` for a server of source tree ``tree``: its ``kernels/``, ``service/`` and
    ``client/`` (older servers took their stubs from the client) ahead of anything else, and
    grpc's own I/O defaults, as that server ran (this process's ``grpc_defaults`` setting is
    not passed on: an empty GRPC_EXPERIMENTS changes nothing)."""
    path = os.pathsep.join(str(tree / part) for part in ("kernels", "service", "client"))
    return dict(env, PYTHONPATH=os.pathsep.join(filter(None, [path, env.get("PYTHONPATH")])),
                **{grpc_defaults.ENV: ""})


@contextlib.contextmanager
def primed_server(
    cmd: list[str], env: dict[str, str], cwd: Path, device: str, tokens: int, heads: int,
    dim: int, dtype: str,
) -> Iterator[tuple[subprocess.Popen, str]]:
    """(process, target) of a server started by ``cmd`` on a free loopback port with the flags
    every version had, SERVING, and primed by one call of the request's shape (no warm-up:
    that call compiles what the load runs); stopped at the end."""
    from attention_client import AttentionClient

    port = _free_port()
    proc = _popen(
        [*cmd, "--host", "127.0.0.1", "--port", str(port), "--device", device,
         "--metrics-port", "0", "--log-level", "WARNING", "--no-warmup"], env=env, cwd=cwd)
    target = f"127.0.0.1:{port}"
    try:
        _wait_serving(target, proc=proc)
        q = torch.randn(tokens, heads, dim).to(DTYPES[dtype])
        with AttentionClient(target, timeout=600, use_regions=False) as c:
            c.attention(q, q, q, torch.tensor([0, tokens], dtype=torch.int32))
        yield proc, target
    finally:
        _stop(proc)


def baseline_aggregate(
    tree: Path, device: str, env: dict[str, str], client_counts: list[int],
    configs: list[tuple[int, int, bool]], tokens: int, heads: int, dim: int, dtype: str,
    seconds: float,
) -> dict[str, Any]:
    """The aggregate against the server of source tree ``tree`` (one process)."""
    with primed_server([sys.executable, "-m", "attention_service"], baseline_env(tree, env),
                       tree, device, tokens, heads, dim, dtype) as (proc, target):
        return {"tree": str(tree), "cpus": cpus_of_tree(proc.pid), "aggregate": [
            aggregate(target, nc, tokens, heads, dim, dtype, seconds, ch, st, sp)
            for nc in client_counts for ch, st, sp in configs
        ]}


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
    p.add_argument("--min-seconds", type=float, default=0.5,
                   help="per one-call path (and the in-process kernel): more calls than "
                        "--iters while they total under this (a path of a few ms: hundreds)")
    p.add_argument("--device", default="auto", help="server device: auto, cuda or cpu")
    p.add_argument("--frontends", default="4", help="comma list of N > 1 to compare with N=1")
    p.add_argument("--clients", default="8", help="comma list of aggregate client counts")
    p.add_argument("--agg-tokens", type=int, default=2048, help="tokens per aggregate request")
    p.add_argument("--agg-channels", default="1",
                   help="comma list of connections per aggregate client (channels=)")
    p.add_argument("--stripes", default="1",
                   help="comma list of stripes= per client: one-call rows 'grpc host xK' and "
                        "aggregate runs for each K > 1 (the aggregate's too for 1)")
    p.add_argument("--agg-spread", default="0",
                   help="comma list of 0/1: aggregate clients with spread= off / on")
    p.add_argument("--agg-seconds", type=float, default=8.0)
    p.add_argument("--baseline-tree", type=Path, default=None,
                   help="source tree of an earlier commit whose server's aggregate is measured "
                        "too, before and after this tree's servers")
    p.add_argument("--server-cpus", help="CPUs of every server started (taskset list, e.g. "
                   "0-15): with --client-cpus, as a server host whose clients are elsewhere")
    p.add_argument("--client-cpus", help="CPUs of this script and its client processes "
                   "(e.g. 16-31), apart from --server-cpus")
    p.add_argument("--ceiling-mib", type=int, default=256,
                   help="MiB copied per ceiling measurement (memcpy, H2D, D2H): several times "
                        "the caches; less only for a quick check of the script")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--serve-transfer", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_transfer:
        serve_transfer()
        return 0
    global SERVER_CPUS
    servers = split_cpus(args.server_cpus, args.client_cpus)  # the clients inherit the rest
    SERVER_CPUS = cpu_list(servers) if servers else None

    from attention_kernels.reference import prefill_ref
    from attention_wire.messages import DEFAULT_CHUNK_BYTES

    env = dict(os.environ, PYTHONUNBUFFERED="1")
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
    ref_dev = "cuda" if torch.cuda.is_available() else "cpu"
    ref = prefill_ref(q.to(ref_dev), k.to(ref_dev), v.to(ref_dev), cu.to(ref_dev),
                      causal=args.causal, compute_dtype=torch.float64)
    tol = {torch.float32: 1e-3}.get(dtype, 1e-2)

    result: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": date.today().isoformat(), "torch": torch.__version__, "grpcio": grpc.__version__,
        "host_cpus": os.cpu_count(), "server_cpus": args.server_cpus,
        "client_cpus": args.client_cpus,
        "shape": {"tokens": n, "seqs": args.seqs, "heads": h, "kv_heads": hk, "head_dim": d,
                  "dtype": args.dtype, "causal": args.causal},
        "bytes_in": in_bytes, "bytes_out": out_bytes,
    }
    result["ceilings"] = ceilings(args.iters, args.ceiling_mib)
    transfer, tport = _start([sys.executable, __file__, "--serve-transfer"], env)
    try:
        raw = transfer_seconds(tport, in_bytes, out_bytes, DEFAULT_CHUNK_BYTES, args.iters)
    finally:
        _stop(transfer)
    result["ceilings"]["raw_grpc_ms"] = _median_ms(raw)
    result["ceilings"]["raw_grpc_GBps"] = (in_bytes + out_bytes) / statistics.median(raw) / 1e9
    kernel: list[float] = []
    if torch.cuda.is_available():
        from attention_kernels import prefill

        qd, kd, vd, cud = q.cuda(), k.cuda(), v.cuda(), cu.cuda()
        while (len(kernel) < args.iters + 3
               or (sum(kernel[3:]) < args.min_seconds and len(kernel) < MAX_ITERS)):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            prefill(qd, kd, vd, cud, max_seqlen_q=n, max_seqlen_k=n, causal=args.causal)
            e1.record()
            e1.synchronize()
            kernel.append(e0.elapsed_time(e1) / 1e3)
        kernel = kernel[3:]
    result["kernel_ms"] = _median_ms(kernel)

    counts = [1] + [int(x) for x in args.frontends.split(",") if x and int(x) > 1]
    client_counts = [int(x) for x in args.clients.split(",") if x]
    channel_counts = [int(x) for x in args.agg_channels.split(",") if x]
    stripe_counts = [int(x) for x in args.stripes.split(",") if x]
    spreads = [bool(int(x)) for x in args.agg_spread.split(",") if x]
    configs = [(ch, st, sp) for sp in spreads for st in stripe_counts for ch in channel_counts]
    result["servers"] = []
    # The server names its device once it is up; until then (the baseline turn) the GPU here.
    device_name = (torch.cuda.get_device_name() if args.device != "cpu"
                   and torch.cuda.is_available() else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> Path:  # after every server, so a run cut short keeps what it measured
        tag = re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_")
        path = args.out / f"roundtrip_{tag}.json"
        result["server_device"] = device_name
        path.write_text(json.dumps(result, indent=2))
        return path

    def baseline(turn: str) -> None:
        if args.baseline_tree is None:
            return
        entry = baseline_aggregate(args.baseline_tree, args.device, env, client_counts,
                                   configs, args.agg_tokens, h, d, args.dtype,
                                   args.agg_seconds)
        entry["turn"] = turn
        result.setdefault("baseline", []).append(entry)
        print(f"baseline ({turn}): " + ", ".join(
            f"{_agg_label(a)} {a['GBps']:.2f} GB/s" for a in entry["aggregate"]), flush=True)
        save()

    baseline("first")
    for count in counts:
        # A free port of our choosing and WARNING logs: no per-call log line in the way.
        port = _free_port()
        proc = _popen(
            [sys.executable, "-m", "attention_service", "--host", "127.0.0.1", "--port",
             str(port), "--device", args.device, "--metrics-port", "-1", "--frontends",
             str(count), "--log-level", "WARNING"], env=env, cwd=ROOT)
        target = f"127.0.0.1:{port}"
        try:
            _wait_serving(target)
            from attention_client import AttentionClient

            with AttentionClient(target) as c:
                device_name = c.info()["device"]
            entry: dict[str, Any] = {"frontends": count, "cpus": cpus_of_tree(proc.pid)}
            entry.update(paths(target, q, k, v, cu, args.causal, ref, tol, args.iters,
                               [st for st in stripe_counts if st > 1], args.min_seconds))
            entry["aggregate"] = [
                aggregate(target, nc, args.agg_tokens, h, d, args.dtype, args.agg_seconds, ch,
                          st, sp)
                for nc in client_counts for ch, st, sp in configs
            ]
            result["servers"].append(entry)
            print(f"N={count}: " + ", ".join(f"{k_} {v_:.2f} ms" for k_, v_ in
                                             entry["round_trip_ms"].items()) + "; " +
                  ", ".join(f"{_agg_label(a)} {a['GBps']:.2f} GB/s"
                            for a in entry["aggregate"]), flush=True)
            save()
        finally:
            _stop(proc)

    baseline("last")

    print(f"\nprefill {n} tokens x {h} heads ({hk} kv) x {d} {args.dtype}, causal={args.causal}, "
          f"{args.seqs} seq; in {in_bytes / 2**20:.1f} MiB, out {out_bytes / 2**20:.1f} MiB; "
          f"device {device_name}; host {os.cpu_count()} cpus; median of {args.iters} calls per "
          f"path, more while they total under {args.min_seconds} s"
          + (f"; servers on cpus {args.server_cpus}" if args.server_cpus else "")
          + (f", clients on cpus {args.client_cpus}" if args.client_cpus else ""))
    c = result["ceilings"]
    print("ceilings: " + ", ".join(f"{k_} {v_:.2f}" for k_, v_ in c.items()))
    print(f"kernel in-process (CUDA events) {result['kernel_ms']:.2f} ms")
    paths_seen = sorted({name for s in result["servers"] for name in s["round_trip_ms"]},
                        key=lambda x: list(result["servers"][0]["round_trip_ms"]).index(x)
                        if x in result["servers"][0]["round_trip_ms"] else 99)
    head = "round trip (ms)".ljust(22) + "".join(f"{'N=' + str(s['frontends']):>12}"
                                                 for s in result["servers"])
    print(head)
    for name in paths_seen:
        print(name.ljust(22) + "".join(f"{s['round_trip_ms'].get(name, float('nan')):12.2f}"
                                       for s in result["servers"]))
    print(f"aggregate gRPC payload, {args.agg_tokens}-token requests "
          f"({4 * args.agg_tokens * h * d * q.element_size() / 2**20:.0f} MiB in+out each):")
    # The single process's best at each client count, whatever its connections per client.
    base: dict[int, float] = {}
    for a in result["servers"][0]["aggregate"]:
        base[a["clients"]] = max(base.get(a["clients"], 0.0), a["GBps"])
    for s in result["servers"]:
        for a in s["aggregate"]:
            print(f"  N={s['frontends']:<3d} {_agg_label(a)}: "
                  f"{a['GBps']:6.2f} GB/s ({a['GBps'] / base[a['clients']]:.2f}x N=1 best), "
                  f"{a['calls']} calls, "
                  f"p50 {a['p50_ms']:.1f} ms, p99 {a['p99_ms']:.1f} ms, client cores "
                  f"{a['client_cores_mean']:.2f} mean / {a['client_cores_max']:.2f} max"
                  + _spread(a, s["frontends"]))

    if result.get("baseline"):
        # The baseline's better turn at each client count: the ratio is not flattered by a
        # slow first server.
        best: dict[int, float] = {}
        for entry in result["baseline"]:
            for a in entry["aggregate"]:
                best[a["clients"]] = max(best.get(a["clients"], 0.0), a["GBps"])
        print(f"against the baseline tree's server ({args.baseline_tree}), its better turn:")
        for entry in result["baseline"]:
            for a in entry["aggregate"]:
                print(f"  baseline ({entry['turn']}) {_agg_label(a)}: "
                      f"{a['GBps']:6.2f} GB/s, {a['calls']} calls, "
                      f"client cores {a['client_cores_mean']:.2f} mean")
        for s in result["servers"]:
            for a in s["aggregate"]:
                print(f"  N={s['frontends']:<3d} {_agg_label(a)}: "
                      f"{a['GBps'] / best[a['clients']]:.2f}x the baseline")
        result["against_baseline"] = against_baseline(result)
        for row in result["against_baseline"]:
            print(f"  N={row['frontends']:<3d} {row['label']}, {row['runs']} runs against the "
                  f"baseline's {row['baseline_runs']}: median {row['median_GBps']:.2f} / "
                  f"{row['baseline_median_GBps']:.2f} GB/s = {row['median_ratio']:.2f}x, best "
                  f"{row['best_GBps']:.2f} / {row['baseline_best_GBps']:.2f} GB/s = "
                  f"{row['best_ratio']:.2f}x")
    print(f"wrote {save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
