"""Load generation for bench_service.py: worker processes of asyncio clients over raw stubs.

Each worker builds a pool of requests once (random tensor bytes, serialized to wire messages
ahead of time, so the client spends its CPU on gRPC alone), then, per measurement point, runs
its share of the concurrent clients until a common wall-clock deadline and sends back the
latencies of the calls that completed inside the window. Needs grpcio, protobuf, numpy and
the ``attention_client`` package (for the generated messages), not torch.

``path="shm"``: the same-host path. Each worker writes its pool's tensors once into a POSIX
shared-memory object of its own, registers it with the server of each point, and sends
header-only requests that name spans of it; every concurrent client has its own output span
there, so a call is one small message up and one stats message back.

``spread`` (the default, as the client library's): before a point, each client's connection
that the kernel hashed to a crowded front end is replaced, by the library's own rule
(``attention_client._channel.crowded`` / ``spread_tries``). Without it, 64 connections hashed
over 8 front ends leave some with 13 or more and others with 4 or fewer.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from attention_wire import grpc_defaults

grpc_defaults.apply()  # the client library's grpc I/O settings, before grpc loads

import grpc
import numpy as np

from attention_client._call_streams import AsyncStreamCall
from attention_client._channel import SPREAD_TIMEOUT_S, CallSettings, crowded, spread_tries
from attention_client._tensors import WireTensor
from attention_wire import unary_method
from attention_wire.messages import DEFAULT_CHUNK_BYTES, encode_messages
from attention_wire.pb import attention_pb2 as pb

PREFILL_METHOD = "/attention.v1.AttentionService/Prefill"
DECODE_METHOD = "/attention.v1.AttentionService/Decode"
INFO_METHOD = "/attention.v1.AttentionService/GetServerInfo"
STEPS = "Steps"  # PrefillSteps / DecodeSteps: the stream rpc of each
NO_SETTINGS = CallSettings(deadline=None, metadata=(), wait_for_ready=None)
LOCAL_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # a channel's own connection
DTYPES = {"bf16": (pb.BFLOAT16, 2), "fp16": (pb.FLOAT16, 2), "fp32": (pb.FLOAT32, 4)}


@dataclass(frozen=True)
class LoadSpec:
    mode: str  # prefill | decode | mix
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str  # bf16 | fp16 | fp32
    min_len: int
    max_len: int
    decode_seqs: int  # sequences per decode request
    causal: bool
    pool: int  # distinct requests per worker
    seed: int
    path: str = "grpc"  # grpc | shm
    # How a one-message request goes (as attention_client sends it: "steps"): on a kept-open
    # PrefillSteps/DecodeSteps stream per client, a unary twin call each ("unary"), or a
    # request stream each ("stream", which every larger request takes).
    send: str = "steps"
    connections: int = 1  # per client, its calls round-robin over them (the client's channels=)
    spread: bool = True  # place connections as the client library does (its spread=)
    # Tensor bytes per message (the client's max_chunk_bytes): a request that fits one goes
    # as one message on a step stream, a larger one as a request stream of such chunks.
    chunk_bytes: int = DEFAULT_CHUNK_BYTES


@dataclass
class ShmPool:
    """A worker's shared-memory object: the pool's inputs, then one output slot per client."""

    key: str
    name: str
    mapping: Any
    headers: list[Any]  # per request: its header with input spans set (out span per call)
    out_bytes: list[int]
    slot_bytes: int
    slots_at: int
    cache: dict[tuple[int, int], bytes]
    registered: set[str]


@dataclass
class Request:
    method: str
    messages: list[bytes]  # serialized PrefillRequest / DecodeRequest messages
    tokens: int


def loguniform_lengths(rng: np.random.Generator, n: int, lo: int, hi: int) -> np.ndarray:
    """Skewed like real prompts: most short, a long tail (median sqrt(lo * hi))."""
    return np.exp(rng.uniform(math.log(lo), math.log(hi + 1), n)).astype(np.int64).clip(lo, hi)


def _random_bytes(rng: np.random.Generator, n_elems: int, dtype: str) -> bytes:
    x = rng.standard_normal(n_elems, dtype=np.float32)
    if dtype == "bf16":  # the top half of a float32 is its bfloat16 (truncated)
        return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return (x.astype(np.float16) if dtype == "fp16" else x).tobytes()


def _messages(header: Any, tensors: list[tuple[int, bytes]], code: int,
              chunk_bytes: int) -> list[bytes]:
    """The request's messages as ``attention_client`` sends them (its own encoder): the header
    with as many tensor bytes as fit in ``chunk_bytes``, so a small request is one message (a
    call on a kept-open PrefillSteps/DecodeSteps stream, as the client makes it) and a large
    one a request stream of such chunks."""
    wire = [WireTensor(name, np.frombuffer(data, np.uint8), code)
            for name, (_, data) in zip("qkv", tensors, strict=True)]
    return list(encode_messages(header.SerializeToString(), wire, chunk_bytes))


class _Slicer:
    """Tensor bytes as slices of one random buffer: contents don't matter for speed."""

    def __init__(self, rng: np.random.Generator, n_elems: int, dtype: str) -> None:
        self._rng = rng
        self._esize = DTYPES[dtype][1]
        self._buf = _random_bytes(rng, n_elems, dtype)

    def take(self, n_elems: int) -> bytes:
        nbytes = n_elems * self._esize
        start = int(self._rng.integers(0, len(self._buf) - nbytes + 1)) // self._esize
        return self._buf[start * self._esize : start * self._esize + nbytes]


def _prefill(spec: LoadSpec, n: int, data: _Slicer) -> Request:
    code = DTYPES[spec.dtype][0]
    h, hk, d = spec.heads, spec.kv_heads, spec.head_dim
    header = pb.PrefillHeader(
        q=pb.TensorSpec(dtype=code, shape=[n, h, d]),
        k=pb.TensorSpec(dtype=code, shape=[n, hk, d]),
        v=pb.TensorSpec(dtype=code, shape=[n, hk, d]),
        cu_seqlens_q=[0, n], causal=spec.causal,
    )
    tensors = [(pb.Q, data.take(n * h * d)), (pb.K, data.take(n * hk * d)),
               (pb.V, data.take(n * hk * d))]
    return Request(PREFILL_METHOD, _messages(header, tensors, code, spec.chunk_bytes), n)


def _decode(spec: LoadSpec, lengths: list[int], data: _Slicer) -> Request:
    code = DTYPES[spec.dtype][0]
    h, hk, d = spec.heads, spec.kv_heads, spec.head_dim
    b, total = len(lengths), sum(lengths)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    header = pb.DecodeHeader(
        q=pb.TensorSpec(dtype=code, shape=[b, h, d]),
        k=pb.TensorSpec(dtype=code, shape=[total, hk, d]),
        v=pb.TensorSpec(dtype=code, shape=[total, hk, d]), cu_seqlens_k=cu,
    )
    tensors = [(pb.Q, data.take(b * h * d)), (pb.K, data.take(total * hk * d)),
               (pb.V, data.take(total * hk * d))]
    return Request(DECODE_METHOD, _messages(header, tensors, code, spec.chunk_bytes), total)


def build_shm_pool(spec: LoadSpec, worker: int, reqs: list[Request], max_clients: int) -> ShmPool:
    """Move the pool's tensor bytes into a shared-memory object; keep header-only messages."""
    from attention_wire import shm
    from attention_wire.alloc import align

    esize = DTYPES[spec.dtype][1]
    parsed = []
    for r in reqs:
        cls = pb.PrefillRequest if r.method == PREFILL_METHOD else pb.DecodeRequest
        msgs = [cls.FromString(m) for m in r.messages]
        tensors: dict[int, bytes] = {}
        for m in msgs:
            for c in m.chunks:
                tensors[c.field] = tensors.get(c.field, b"") + c.data
        parsed.append((msgs[0].header, tensors))
    sizes = [sum(align(len(b)) for b in t.values()) for _, t in parsed]
    slot = align(max(h.q.shape[0] * h.q.shape[1] * h.q.shape[2] * esize for h, _ in parsed))
    total = sum(sizes) + slot * max_clients
    key = shm.new_key(f"attention-bench-w{worker}")
    mapping = shm.map_object(key, 0, total, create=True)
    buf = np.frombuffer(mapping.mm, dtype=np.uint8)
    name = f"bench-{worker}-{key[-8:]}"
    headers, out_bytes, at = [], [], 0
    for header, tensors in parsed:
        regions = pb.TensorRegions()
        for field, data in tensors.items():
            buf[at : at + len(data)] = np.frombuffer(data, np.uint8)
            span = pb.RegionSpan(region=name, offset=at, byte_size=len(data))
            getattr(regions, {pb.Q: "q", pb.K: "k", pb.V: "v"}[field]).CopyFrom(span)
            at += align(len(data))
        header.regions.CopyFrom(regions)
        headers.append(header)
        out_bytes.append(header.q.shape[0] * header.q.shape[1] * header.q.shape[2] * esize)
    return ShmPool(key, name, mapping, headers, out_bytes, slot, at, {}, set())


def shm_message(pool: ShmPool, index: int, slot: int) -> bytes:
    """Request ``index`` with its output in client ``slot``'s span (built once, then cached)."""
    msg = pool.cache.get((index, slot))
    if msg is None:
        header = pool.headers[index]
        h = type(header)()
        h.CopyFrom(header)
        h.regions.out.CopyFrom(pb.RegionSpan(region=pool.name, offset=pool.slots_at + slot
                                             * pool.slot_bytes, byte_size=pool.out_bytes[index]))
        cls = pb.PrefillRequest if isinstance(h, pb.PrefillHeader) else pb.DecodeRequest
        msg = pool.cache[(index, slot)] = cls(header=h).SerializeToString()
    return msg


async def register_shm(target: str, pool: ShmPool) -> None:
    if target in pool.registered:
        return
    async with grpc.aio.insecure_channel(target) as ch:
        call = ch.unary_unary(
            "/attention.v1.AttentionService/RegisterRegion",
            request_serializer=pb.RegisterRegionRequest.SerializeToString,
            response_deserializer=pb.RegionInfo.FromString,
        )
        await call(pb.RegisterRegionRequest(
            name=pool.name, byte_size=pool.mapping.mm.size(),
            system=pb.SystemRegion(key=pool.key)), timeout=30)
    pool.registered.add(target)


def build_requests(spec: LoadSpec, worker: int) -> list[Request]:
    rng = np.random.default_rng([spec.seed, worker])
    longest = max(spec.max_len * spec.decode_seqs, spec.max_len)
    data = _Slicer(rng, longest * max(spec.heads, spec.kv_heads) * spec.head_dim, spec.dtype)
    reqs = []
    for i in range(spec.pool):
        decode = spec.mode == "decode" or (spec.mode == "mix" and i % 2 == 1)
        if decode:
            lens = loguniform_lengths(rng, spec.decode_seqs, spec.min_len, spec.max_len)
            reqs.append(_decode(spec, [int(x) for x in lens], data))
        else:
            n = int(loguniform_lengths(rng, 1, spec.min_len, spec.max_len)[0])
            reqs.append(_prefill(spec, n, data))
    return reqs


class _CallStreams:
    """One load client's kept-open PrefillSteps/DecodeSteps streams, one per method, driven
    by the client's own ``AsyncStreamCall`` (no deadline: the load has none)."""

    def __init__(self, calls: dict[str, Any]) -> None:
        self._calls = calls
        self._open: dict[str, AsyncStreamCall] = {}

    async def call(self, method: str, message: bytes) -> None:
        """One call on ``method``'s stream; grpc.RpcError if it failed (the stream is
        dropped)."""
        stream = self._open.get(method)
        if stream is None or not stream.alive():
            stream = self._open[method] = AsyncStreamCall(self._calls[method + STEPS],
                                                          NO_SETTINGS)
        try:
            await stream.exchange(message, None)
        except BaseException:
            self._open.pop(method).drop()
            raise

    def close(self) -> None:
        for stream in self._open.values():
            stream.drop()


async def _client(
    connections: list[dict[str, Any]], pool: list[Request], rng: np.random.Generator,
    window: tuple[float, float], latencies: list[float], errors: Counter[str],
    shm_pool: ShmPool | None = None, slot: int = 0,
) -> None:
    """One closed-loop client: its calls go round-robin over its connections (the client's
    ``channels=``), each with its own kept-open call streams."""
    t_measure, t_end = window
    all_streams = [_CallStreams(calls) for calls in connections]
    turn = 0
    try:
        while time.time() < t_end:
            calls, streams = connections[turn], all_streams[turn]
            turn = (turn + 1) % len(connections)
            index = int(rng.integers(len(pool)))
            req = pool[index]
            messages = req.messages if shm_pool is None else [shm_message(shm_pool, index, slot)]
            t0 = time.perf_counter()
            code = None
            try:
                if len(messages) == 1 and req.method + STEPS in calls:
                    await streams.call(req.method, messages[0])
                elif len(messages) == 1 and unary_method(req.method) in calls:
                    await calls[unary_method(req.method)](messages[0])
                else:
                    async for _ in calls[req.method](iter(messages)):
                        pass
            except grpc.RpcError as err:  # AioRpcError, or the stream's own StreamError
                code = err.code().name
            if code is not None:
                if t_measure <= time.time() <= t_end:
                    errors[code] += 1
                await asyncio.sleep(0.01)  # a failing server must not turn this into a spin
                continue
            done = time.time()
            if t_measure <= done <= t_end:
                latencies.append(time.perf_counter() - t0)
    finally:
        for streams in all_streams:
            streams.close()


async def _place(target: str, channels: list[Any], i: int) -> None:
    """The client library's ``spread`` for ``channels[i]``: while its connection is on a
    crowded front end, replace it by a new one (hashed afresh), up to ``spread_tries`` looks;
    a server that cannot count leaves it as it is."""
    tries = 0
    while True:
        info_call = channels[i].unary_unary(
            INFO_METHOD, request_serializer=pb.GetServerInfoRequest.SerializeToString,
            response_deserializer=pb.ServerInfo.FromString)
        try:
            info = await info_call(pb.GetServerInfoRequest(connections=True),
                                   timeout=SPREAD_TIMEOUT_S)
        except grpc.RpcError:
            return
        tries += 1
        if not crowded(info) or tries >= spread_tries(info):
            return
        old, channels[i] = channels[i], grpc.aio.insecure_channel(target,
                                                                  options=LOCAL_CONNECTION)
        await old.close()


async def _run_point(
    target: str, pool: list[Request], n_clients: int, seed: int,
    t_start: float, t_measure: float, t_end: float, shm_pool: ShmPool | None = None,
    send: str = "steps", connections: int = 1, spread: bool = True,
) -> dict[str, Any]:
    if shm_pool is not None:
        await register_shm(target, shm_pool)
    # A connection per client, as separate user processes would have. Equal channels of one
    # process otherwise share one connection (grpc's global subchannel pool): 8 workers then
    # made 8 connections, and a server's SO_REUSEPORT front ends, which are handed
    # connections, not calls, left 3 of 8 idle (profile_group.py, git history, 2026-11-24).
    channels = [grpc.aio.insecure_channel(target, options=LOCAL_CONNECTION)
                for _ in range(n_clients * connections)]
    try:
        if spread:  # every client places its connections at once, as users starting together
            await asyncio.gather(*(_place(target, channels, i) for i in range(len(channels))))
        methods = (PREFILL_METHOD, DECODE_METHOD)
        calls = [
            {m: ch.stream_stream(m) for m in methods}
            | ({unary_method(m): ch.unary_unary(unary_method(m)) for m in methods}
               if send == "unary" else {})
            | ({m + STEPS: ch.stream_stream(m + STEPS) for m in methods}
               if send == "steps" else {})
            for ch in channels
        ]
        await asyncio.sleep(max(0.0, t_start - time.time()))
        latencies: list[float] = []
        errors: Counter[str] = Counter()
        rngs = np.random.default_rng(seed).spawn(n_clients)
        await asyncio.gather(*(
            _client(calls[i * connections : (i + 1) * connections], pool, rngs[i],
                    (t_measure, t_end), latencies, errors,
                    shm_pool, i)
            for i in range(n_clients)
        ))
        return {"latencies": latencies, "errors": dict(errors)}
    finally:
        for ch in channels:
            await ch.close()


def worker_main(conn: Connection, spec: LoadSpec, worker: int, max_clients: int = 256) -> None:
    """Process entry: build the pool, say ready, then serve one command per point."""
    pool = build_requests(spec, worker)
    shm_pool = build_shm_pool(spec, worker, pool, max_clients) if spec.path == "shm" else None
    conn.send("ready")
    try:
        while True:
            cmd = conn.recv()
            if cmd is None:
                return
            conn.send(asyncio.run(_run_point(pool=pool, shm_pool=shm_pool, send=spec.send,
                                             connections=spec.connections,
                                             spread=spec.spread, **cmd)))
    finally:
        if shm_pool is not None:
            from attention_wire import shm

            shm.unlink(shm_pool.key)
