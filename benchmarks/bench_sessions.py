"""Decode through server-side KV caches vs re-sending the cache: wire bytes, steps/s, latency.

Every client owns one sequence with a ``--context``-token prompt. "sessions" clients create a
cache, append the prompt once (AppendKV), then loop CacheDecode steps that carry one token's
q/k/v (stored). "resend" clients loop the stateless Decode with the whole K/V every step (what
a client had to do before caches). Each point runs ``--warmup`` + ``--duration`` seconds with N
clients spread over ``--workers`` load processes (one gRPC connection per client), against a
server started here (``python -m attention_service``, batching on, and off for sessions), or
against ``--target``. Requests are packed and sent as attention_client sends them (a step is
one message on a CacheDecodeSteps stream the client keeps open, as ``client.decode_steps()``
sends it; the "on-unary" side sends each step as a CacheDecodeUnary call; other one-message
calls go through the unary twins, and ``--no-unary`` streams them).

Reports per point: steps/s, p50/p99 step latency, wire bytes per step (serialized requests),
the kernel's own time per step (RequestStats.kernel_seconds, CUDA events on a GPU) and the
p50 service overhead (p50 latency minus p50 kernel time); plus the analytic bytes per step for
contexts 1K-32K, and the floor under any Python gRPC step on this host: the p50 of a bare
grpc.aio server that answers at once, same request and reply sizes, measured in the same run
(the overhead target of issue 11 is judged above it). Writes JSON and a markdown table to
``--out``.

    python benchmarks/bench_sessions.py --out OUT                             # GPU defaults
    python benchmarks/bench_sessions.py --device cpu --heads 4 --kv-heads 2 --head-dim 32 \
        --context 64 --clients 1,2 --duration 1 --warmup 0.5                  # quick cpu check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import shlex
import sys
import time
import weakref
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from attention_wire import grpc_defaults

grpc_defaults.apply()  # the client library's grpc I/O settings, before grpc loads

import grpc
import numpy as np

from attention_client._tensors import WireTensor
from attention_wire import unary_method
from attention_wire.messages import encode_messages
from attention_wire.pb import attention_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_service import Server, cpu_list, server_info, split_cpus

ELEM = {"bf16": (pb.BFLOAT16, 2), "fp16": (pb.FLOAT16, 2), "fp32": (pb.FLOAT32, 4)}
METHOD = "/attention.v1.AttentionService/"
CHUNK = 1 << 20
# side: (label, mode, batching, steps on one CacheDecodeSteps stream)
SIDES = {"on": ("sessions, batching on", "sessions", True, True),
         "on-unary": ("sessions, batching on, a unary call per step", "sessions", True, False),
         "off": ("sessions, batching off", "sessions", False, True),
         "resend": ("resend (Decode), batching on", "resend", True, False)}


def _tensor_messages(header: Any, q: bytes, k: bytes, v: bytes) -> list[bytes]:
    """The request messages attention_client sends (its own encoder): header and tensor bytes
    packed <= 1 MiB per message, so a decode step is a single message."""
    tensors = [WireTensor(n, np.frombuffer(b, dtype=np.uint8), header.k.dtype)
               for n, b in (("q", q), ("k", k), ("v", v))]
    return list(encode_messages(header.SerializeToString(), tensors, CHUNK))


FP8_SCALE = 1 / 64  # e4m3 values stand for value * this: the keys' and values' scale


def _bytes(rng: np.random.Generator, n: int, dtype: str) -> bytes:
    if dtype == "fp8":
        # Random e4m3 bit patterns with both signs, never 0x7f/0xff (NaN): |x| <= 448.
        mag = rng.integers(0, 0x7F, n, dtype=np.uint8)
        return (mag | (rng.integers(0, 2, n, dtype=np.uint8) << 7)).tobytes()
    # Values do not matter for speed; small normals keep every dtype finite.
    arr = (rng.standard_normal(n, dtype=np.float32) * 0.5).astype(np.float32)
    if dtype == "fp32":
        return arr.tobytes()
    if dtype == "fp16":
        return arr.astype(np.float16).tobytes()
    return (arr.view(np.uint32) >> 16).astype(np.uint16).tobytes()  # bf16: the top half


class Shapes:
    def __init__(self, a: argparse.Namespace) -> None:
        self.h, self.hkv, self.d, self.ctx, self.dtype = (a.heads, a.kv_heads, a.head_dim,
                                                          a.context, a.dtype)
        self.wire, self.elem = ELEM[a.dtype]
        # Keys and values: the queries' dtype, or FP8 (e4m3, one byte, per-head scales).
        self.kv_dtype = a.kv_dtype or a.dtype
        self.kv_wire, self.kv_elem = (pb.FLOAT8_E4M3, 1) if a.kv_dtype == "fp8" else (
            self.wire, self.elem)

    @property
    def fp8(self) -> bool:
        return self.kv_wire == pb.FLOAT8_E4M3

    def spec(self, *shape: int, kv: bool = False) -> pb.TensorSpec:
        return pb.TensorSpec(dtype=self.kv_wire if kv else self.wire, shape=list(shape))

    def scales(self) -> pb.KvScales:
        return pb.KvScales(k=[FP8_SCALE] * self.hkv, v=[FP8_SCALE] * self.hkv)

    def layout(self) -> pb.CacheLayout:
        lay = pb.CacheLayout(dtype=self.wire, num_kv_heads=self.hkv, head_dim=self.d)
        if self.fp8:
            lay.kv_dtype = self.kv_wire
            lay.kv_scales.CopyFrom(self.scales())
        return lay

    def step_bytes(self, context: int, sessions: bool) -> int:
        """Tensor bytes one decode step sends."""
        q = self.h * self.d * self.elem
        kv_rows = 1 if sessions else context
        return q + 2 * kv_rows * self.hkv * self.d * self.kv_elem


def _requests(s: Shapes, mode: str, cache_id: str, seed: int) -> tuple[list[bytes], list[bytes]]:
    """(setup messages: the AppendKV of the prompt, or none; one step's messages)."""
    rng = np.random.default_rng(seed)
    q = _bytes(rng, s.h * s.d, s.dtype)
    kv_shape = (s.ctx, s.hkv, s.d)
    k, v = (_bytes(rng, s.ctx * s.hkv * s.d, s.kv_dtype) for _ in range(2))
    if mode == "resend":
        header = pb.DecodeHeader(q=s.spec(1, s.h, s.d), k=s.spec(*kv_shape, kv=True),
                                 v=s.spec(*kv_shape, kv=True), cu_seqlens_k=[0, s.ctx])
        if s.fp8:
            header.kv_scales.CopyFrom(s.scales())
        return [], _tensor_messages(header, q, k, v)
    append = pb.PrefillHeader(k=s.spec(*kv_shape, kv=True), v=s.spec(*kv_shape, kv=True),
                              cu_seqlens_k=[0, s.ctx], cache=pb.CacheTarget(cache_ids=[cache_id]))
    setup = _tensor_messages(append, b"", k, v)
    kn, vn = (_bytes(rng, s.hkv * s.d, s.kv_dtype) for _ in range(2))
    header = pb.DecodeHeader(q=s.spec(1, s.h, s.d), k=s.spec(1, s.hkv, s.d, kv=True),
                             v=s.spec(1, s.hkv, s.d, kv=True),
                             cache=pb.CacheTarget(cache_ids=[cache_id], store=True))
    step = _tensor_messages(header, q, kn, vn)
    return setup, step


_CALLABLES: weakref.WeakKeyDictionary[grpc.aio.Channel, dict[tuple[str, bool], Any]] = (
    weakref.WeakKeyDictionary())


def _callable(channel: grpc.aio.Channel, method: str, unary: bool) -> Any:
    """The channel's multicallable for ``method``, made once (as attention_client does: one
    made per call cost the client tens of microseconds a step)."""
    per_channel = _CALLABLES.setdefault(channel, {})
    got = per_channel.get((method, unary))
    if got is None:
        if unary:
            got = channel.unary_unary(METHOD + unary_method(method), request_serializer=None,
                                      response_deserializer=pb.AttentionResult.FromString)
        else:
            got = channel.stream_stream(METHOD + method, request_serializer=None,
                                        response_deserializer=pb.AttentionResponse.FromString)
        per_channel[(method, unary)] = got
    return got


async def _call(channel: grpc.aio.Channel, method: str, msgs: list[bytes],
                unary: bool = False, metadata: Any = None) -> pb.RequestStats:
    """One call; ``unary`` and a one-message request: through the rpc's unary twin, as
    attention_client sends such a call (a decode step is one). ``metadata``: the session's
    header, for a server behind Envoy."""
    if unary and len(msgs) == 1:
        return (await _callable(channel, method, True)(msgs[0], timeout=60,
                                                         metadata=metadata)).stats
    call = _callable(channel, method, False)
    stats = None
    async for reply in call(iter(msgs), timeout=60, metadata=metadata):
        if reply.HasField("stats"):
            stats = reply.stats
    assert stats is not None
    return stats


class _StepStream:
    """Steps on one CacheDecodeSteps stream, as ``client.decode_steps()`` sends them (opened
    again after a failed step)."""

    def __init__(self, channel: grpc.aio.Channel, metadata: Any = None) -> None:
        self._rpc = channel.stream_stream(METHOD + "CacheDecodeSteps", request_serializer=None,
                                          response_deserializer=pb.AttentionResult.FromString)
        self._call: Any = None
        self._metadata = metadata

    async def step(self, message: bytes) -> pb.RequestStats:
        if self._call is None or self._call.done():
            self._call = self._rpc(metadata=self._metadata)
        try:
            await self._call.write(message)
            reply = await asyncio.wait_for(self._call.read(), 60)
        except BaseException:
            self._call.cancel()
            self._call = None
            raise
        if reply is grpc.aio.EOF:
            raise RuntimeError("the step stream ended")
        return reply.stats

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()


async def _client(target: str, s: Shapes, mode: str, cache_id: str, seed: int,
                  t_measure: float, t_end: float, out: dict[str, Any], unary: bool,
                  step_stream: bool = False) -> None:
    setup, step = _requests(s, mode, cache_id, seed)
    method = "CacheDecode" if mode == "sessions" else "Decode"
    # The cache's session: all its calls reach one replica behind Envoy (ignored direct).
    meta = (("x-attention-session", cache_id),) if mode == "sessions" else None
    # A connection per client, as separate user processes would have (grpc otherwise shares
    # one among a process's equal channels, and a multi-front-end server spreads connections).
    async with grpc.aio.insecure_channel(
        target, options=[("grpc.use_local_subchannel_pool", 1)]
    ) as ch:
        if mode == "sessions":
            create = ch.unary_unary(METHOD + "CreateCaches",
                                    request_serializer=pb.CreateCachesRequest.SerializeToString,
                                    response_deserializer=pb.CreateCachesResponse.FromString)
            await create(pb.CreateCachesRequest(cache_ids=[cache_id], layout=s.layout()),
                         timeout=60, metadata=meta)
            await _call(ch, "AppendKV", setup, metadata=meta)
        out["step_bytes"] = sum(len(m) for m in step)
        steps = _StepStream(ch, meta) if step_stream and len(step) == 1 else None
        while time.time() < t_end:
            t0 = time.perf_counter()
            try:
                stats = await (steps.step(step[0]) if steps is not None
                               else _call(ch, method, step, unary, meta))
            except grpc.aio.AioRpcError as exc:
                out["errors"][exc.code().name] = out["errors"].get(exc.code().name, 0) + 1
                continue
            if time.time() >= t_measure:
                out["lat"].append(time.perf_counter() - t0)
                out["kernel"].append(stats.kernel_seconds)
                out["batch"].append(stats.batch_requests)
        if steps is not None:
            steps.close()
        if mode == "sessions":
            release = ch.unary_unary(METHOD + "ReleaseCaches",
                                     request_serializer=pb.ReleaseCachesRequest.SerializeToString,
                                     response_deserializer=pb.ReleaseCachesResponse.FromString)
            await release(pb.ReleaseCachesRequest(cache_ids=[cache_id]), timeout=60,
                          metadata=meta)


def _echo_server(q: Any, reply_bytes: int) -> None:
    """A bare grpc.aio server that answers ``reply_bytes`` bytes at once: per unary call
    (``Call``) and per message of a stream (``Steps``)."""
    reply = b"\0" * reply_bytes

    async def echo(request: bytes, context: Any) -> bytes:
        return reply

    async def steps(requests: Any, context: Any) -> Any:
        async for _ in requests:
            yield reply

    async def serve() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "echo.Echo", {"Call": grpc.unary_unary_rpc_method_handler(echo),
                          "Steps": grpc.stream_stream_rpc_method_handler(steps)}),))
        q.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def echo_floor(request: bytes, reply_bytes: int, seconds: float,
               stream: bool = False, cpus: str | None = None) -> float:
    """p50 ms of a unary call (``stream``: of one message each way on an open stream) to a
    bare Python gRPC server that does nothing (same request, a reply of the step's size, one
    aio client, loopback): the floor under any Python gRPC service's step on this host,
    measured in the same run (on ``cpus``, a taskset list, when given: the servers' CPUs)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_echo_server, args=(q, reply_bytes), daemon=True)
    proc.start()
    if cpus:
        os.sched_setaffinity(proc.pid, cpu_list(cpus))
    try:
        port = q.get(timeout=60)

        async def drive() -> list[float]:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                if stream:
                    steps = ch.stream_stream("/echo.Echo/Steps")()

                    async def call(message: bytes, timeout: float) -> None:
                        await steps.write(message)
                        await steps.read()
                else:
                    call = ch.unary_unary("/echo.Echo/Call")
                lat, t_end = [], time.perf_counter() + seconds
                for _ in range(50):  # warm the connection
                    await call(request, timeout=60)
                while time.perf_counter() < t_end:
                    t0 = time.perf_counter()
                    await call(request, timeout=60)
                    lat.append(time.perf_counter() - t0)
                if stream:
                    steps.cancel()
                return lat

        return float(np.percentile(asyncio.run(drive()), 50)) * 1e3
    finally:
        proc.terminate()
        proc.join(10)


def _worker(target: str, args: argparse.Namespace, mode: str, clients: list[int],
            t_measure: float, t_end: float, q: Any, step_stream: bool = False) -> None:
    s = Shapes(args)
    out: dict[str, Any] = {"lat": [], "kernel": [], "batch": [], "errors": {}, "step_bytes": 0}

    async def main() -> None:
        await asyncio.gather(*(_client(target, s, mode, f"bench-{os.getpid()}-{i}", i,
                                       t_measure, t_end, out, args.unary, step_stream)
                               for i in clients))

    try:
        asyncio.run(main())
    except Exception as exc:  # reported, not hidden
        out["errors"][type(exc).__name__] = out["errors"].get(type(exc).__name__, 0) + 1
    q.put(out)


def run_point(target: str, args: argparse.Namespace, mode: str, n: int,
              step_stream: bool = False) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    workers = min(args.workers, n)
    setup = 3.0 + args.context * n / 2e5  # time for the prompts' AppendKV before the clock
    t_measure = time.time() + setup + args.warmup
    t_end = t_measure + args.duration
    procs = [ctx.Process(target=_worker, args=(target, args, mode, list(range(w, n, workers)),
                                               t_measure, t_end, q, step_stream))
             for w in range(workers)]
    for p in procs:
        p.start()
    outs = [q.get(timeout=setup + args.warmup + args.duration + 120) for _ in procs]
    for p in procs:
        p.join(30)
    lat = np.array([x for o in outs for x in o["lat"]]) * 1e3
    kern = np.array([x for o in outs for x in o["kernel"]]) * 1e3
    batch = np.array([x for o in outs for x in o["batch"]], dtype=np.float64)
    errors: dict[str, int] = {}
    for o in outs:
        for k, v in o["errors"].items():
            errors[k] = errors.get(k, 0) + v
    pct = lambda a, p: float(np.percentile(a, p)) if a.size else math.nan  # noqa: E731
    return {
        "mode": mode, "clients": n, "steps": int(lat.size), "steps_per_s": lat.size / args.duration,
        "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "kernel_p50_ms": pct(kern, 50),
        "overhead_p50_ms": pct(lat, 50) - pct(kern, 50),
        "mean_batch": float(batch.mean()) if batch.size else math.nan,
        "wire_bytes_per_step": max(o["step_bytes"] for o in outs), "errors": errors,
    }


def _f(x: float, nd: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The server device and the step's shape (what ``Shapes`` and ``Server`` read); the
    caller adds ``--kv-dtype`` or sets it to None."""
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=list(ELEM))
    p.add_argument("--context", type=int, default=4096, help="prompt tokens per sequence")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p)
    p.add_argument("--kv-dtype", choices=["fp8"], help="keys and values in FP8 (e4m3, per-head "
                   "scales; with bf16/fp16 --dtype): FP8 caches, and FP8 resent caches")
    p.add_argument("--clients", default="1,8,64")
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--workers", type=int, default=min(8, max(1, (os.cpu_count() or 2) // 2)))
    p.add_argument("--frontends", type=int, help="passed to the servers (default: theirs)")
    p.add_argument("--no-unary", dest="unary", action="store_false",
                   help="stream every call (default: one-message calls use the unary twin "
                        "rpcs, as attention_client does)")
    p.add_argument("--sides", default="on,off,resend,on-unary",
                   help="which sides to run: on/off = sessions with batching on/off (steps on "
                        "one CacheDecodeSteps stream per client, as client.decode_steps() sends "
                        "them), resend, on-unary = on with a CacheDecodeUnary call per step")
    p.add_argument("--target", help="drive this running server instead of starting one per "
                   "side (its batching setting is whatever it was started with)")
    p.add_argument("--server-args",
                   help="more flags for the servers, e.g. '--max-queue-delay-ms 1'")
    p.add_argument("--server-cpus", help="CPUs of the servers (taskset list, e.g. 0-11)")
    p.add_argument("--client-cpus", help="CPUs of this script and its clients (e.g. 12-15): "
                   "apart from --server-cpus, as for clients on other hosts")
    p.add_argument("--out", default="benchmarks/results")
    # What bench_service.Server reads from the namespace.
    p.set_defaults(max_batch_tokens=None, max_queue_delay_ms=None, server_log_level="WARNING",
                   startup_timeout=600.0)
    args = p.parse_args(argv)
    if args.kv_dtype == "fp8" and args.dtype == "fp32":
        p.error("--kv-dtype fp8 goes with --dtype bf16 or fp16")
    args.server_cpus = split_cpus(args.server_cpus, args.client_cpus)
    counts = [int(x) for x in args.clients.split(",")]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    s = Shapes(args)
    rows: list[dict[str, Any]] = []
    info = None
    sides = [SIDES[x] for x in args.sides.split(",")]
    for label, mode, batching, step_stream in sides:
        server = None if args.target else Server(
            args, batching,
            out_dir / f"bench_sessions_server_{mode}_{batching}{'' if step_stream else '_u'}.log")
        target = args.target or server.target
        try:
            info = server_info(target)
            print(f"{label}: {info.device} ({info.backend}), pool {info.kv_cache_bytes >> 20} MiB",
                  flush=True)
            for n in counts:
                row = run_point(target, args, mode, n, step_stream)
                row.update(side=label, batching=batching)
                rows.append(row)
                print(f"  {n:3d} clients: {row['steps_per_s']:9.1f} steps/s  p50 "
                      f"{_f(row['p50_ms'])}  p99 {_f(row['p99_ms'])} ms  kernel p50 "
                      f"{_f(row['kernel_p50_ms'], 3)} ms  batch {_f(row['mean_batch'])}  "
                      f"{row['wire_bytes_per_step']} B/step  errors {row['errors']}", flush=True)
        finally:
            if server is not None:
                server.stop()
    # The step's request and reply sizes: q/k/v in, out + stats back (~the q's bytes + 64).
    step = _requests(s, "sessions", "echo", 0)[1][0]
    floor_ms = echo_floor(step, s.h * s.d * s.elem + 64, min(args.duration, 4.0),
                          cpus=args.server_cpus)
    stream_floor_ms = echo_floor(step, s.h * s.d * s.elem + 64, min(args.duration, 4.0),
                                 stream=True, cpus=args.server_cpus)
    print(f"bare gRPC echo p50 (the floor): {floor_ms:.3f} ms per unary call, "
          f"{stream_floor_ms:.3f} ms per message on an open stream", flush=True)
    by = {(r["side"], r["clients"]): r for r in rows}
    ratios: dict[str, float] = {}
    top = max(counts)
    on = by.get(("sessions, batching on", top))
    off = by.get(("sessions, batching off", top))
    resend = by.get(("resend (Decode), batching on", top))
    if on and resend:
        ratios[f"sessions/resend steps/s at {top} clients"] = on["steps_per_s"] / max(
            resend["steps_per_s"], 1e-9)
    if on and off:
        ratios[f"sessions batching on/off steps/s at {top} clients"] = on["steps_per_s"] / max(
            off["steps_per_s"], 1e-9)
        ratios[f"sessions batching on/off p99 at {top} clients"] = on["p99_ms"] / max(
            off["p99_ms"], 1e-9)
    one = by.get(("sessions, batching on", 1))
    ratios["bare Python gRPC echo p50, same request and reply sizes (ms)"] = floor_ms
    ratios["the same, one message each way on an open stream (ms)"] = stream_floor_ms
    if one is not None:
        ratios["p50 overhead over kernel at 1 client (ms)"] = one["overhead_p50_ms"]
        ratios["p50 overhead over kernel and the echo floor at 1 client (ms)"] = (
            one["overhead_p50_ms"] - stream_floor_ms)
    one_unary = by.get(("sessions, batching on, a unary call per step", 1))
    if one_unary is not None:
        ratios["p50 overhead over kernel at 1 client, a unary call per step (ms)"] = (
            one_unary["overhead_p50_ms"])
    analytic = [{"context": c, "sessions_bytes": s.step_bytes(c, True),
                 "resend_bytes": s.step_bytes(c, False),
                 "ratio": s.step_bytes(c, False) / s.step_bytes(c, True)}
                for c in (1024, 2048, 4096, 8192, 16384, 32768)]
    lines = [
        f"# bench_sessions: {info.device if info else '?'}, {datetime.now(timezone.utc):%Y-%m-%d}",
        "", f"`python benchmarks/bench_sessions.py {shlex.join(argv or sys.argv[1:])}`", "",
        f"H={s.h}, H_kv={s.hkv}, D={s.d} {s.dtype} (keys/values {s.kv_dtype}), context "
        f"{s.ctx} tokens per client; "
        + "sessions steps on one CacheDecodeSteps stream per client (the on/off sides, as "
        "client.decode_steps() sends them); other "
        + ("one-message calls through the unary rpcs" if args.unary
           else "calls streamed (--no-unary)"), "",
        "| side | clients | steps/s | p50 ms | p99 ms | kernel p50 ms | overhead p50 ms | "
        "mean batch | wire B/step | errors |", "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['side']} | {r['clients']} | {r['steps_per_s']:.1f} | "
                     f"{_f(r['p50_ms'])} | {_f(r['p99_ms'])} | {_f(r['kernel_p50_ms'], 3)} | "
                     f"{_f(r['overhead_p50_ms'], 3)} | {_f(r['mean_batch'])} | "
                     f"{r['wire_bytes_per_step']} | {sum(r['errors'].values())} |")
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" if "(ms)" in k else f"| {k} | {v:.2f} |"
              for k, v in ratios.items()]
    lines += ["", "Tensor bytes per decode step (one sequence):", "",
              "| context | sessions | resend | resend / sessions |", "|---|---|---|---|"]
    lines += [f"| {a['context']} | {a['sessions_bytes']} | {a['resend_bytes']} | "
              f"{a['ratio']:.0f}x |" for a in analytic]
    table = "\n".join(lines) + "\n"
    print(table)
    stamp = f"{datetime.now(timezone.utc):%Y%m%d_%H%M%S}"
    (out_dir / f"bench_sessions_{stamp}.md").write_text(table)
    (out_dir / f"bench_sessions_{stamp}.json").write_text(json.dumps(
        {"args": vars(args), "rows": rows, "ratios": ratios, "bytes_per_step": analytic,
         "device": info.device if info else None}, indent=2))
    errors = sum(sum(r["errors"].values()) for r in rows)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
