"""Load generation for bench_service.py: worker processes of asyncio clients over raw stubs.

Each worker builds a pool of requests once (random tensor bytes, serialized to wire messages
ahead of time, so the client spends its CPU on gRPC alone), then, per measurement point, runs
its share of the concurrent clients until a common wall-clock deadline and sends back the
latencies of the calls that completed inside the window. Needs grpcio, protobuf, numpy and
the ``attention_client`` package (for the generated messages), not torch.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import grpc
import numpy as np

from attention_wire.pb import attention_pb2 as pb

PREFILL_METHOD = "/attention.v1.AttentionService/Prefill"
DECODE_METHOD = "/attention.v1.AttentionService/Decode"
CHUNK_BYTES = 1 << 20
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


def _chunks(cls: Any, tensors: list[tuple[int, bytes]]) -> list[bytes]:
    msgs = []
    for field, data in tensors:
        for off in range(0, len(data), CHUNK_BYTES):
            chunk = pb.TensorChunk(field=field, offset=off, data=data[off : off + CHUNK_BYTES])
            msgs.append(cls(chunks=[chunk]).SerializeToString())
    return msgs


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
    first = pb.PrefillRequest(header=header).SerializeToString()
    return Request(PREFILL_METHOD, [first, *_chunks(pb.PrefillRequest, tensors)], n)


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
    first = pb.DecodeRequest(header=header).SerializeToString()
    return Request(DECODE_METHOD, [first, *_chunks(pb.DecodeRequest, tensors)], total)


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


async def _client(
    calls: dict[str, Any], pool: list[Request], rng: np.random.Generator,
    window: tuple[float, float], latencies: list[float], errors: Counter[str],
) -> None:
    t_measure, t_end = window
    while time.time() < t_end:
        req = pool[int(rng.integers(len(pool)))]
        t0 = time.perf_counter()
        try:
            async for _ in calls[req.method](iter(req.messages)):
                pass
        except grpc.aio.AioRpcError as err:
            if t_measure <= time.time() <= t_end:
                errors[err.code().name] += 1
            await asyncio.sleep(0.01)  # a failing server must not turn this into a spin
            continue
        done = time.time()
        if t_measure <= done <= t_end:
            latencies.append(time.perf_counter() - t0)


async def _run_point(
    target: str, pool: list[Request], n_clients: int, seed: int,
    t_start: float, t_measure: float, t_end: float,
) -> dict[str, Any]:
    # A few HTTP/2 connections per worker: one would serialize every client on one socket.
    channels = [grpc.aio.insecure_channel(target) for _ in range(min(n_clients, 4))]
    try:
        calls = [
            {m: ch.stream_stream(m) for m in (PREFILL_METHOD, DECODE_METHOD)}
            for ch in channels
        ]
        await asyncio.sleep(max(0.0, t_start - time.time()))
        latencies: list[float] = []
        errors: Counter[str] = Counter()
        rngs = np.random.default_rng(seed).spawn(n_clients)
        await asyncio.gather(*(
            _client(calls[i % len(calls)], pool, rngs[i], (t_measure, t_end), latencies, errors)
            for i in range(n_clients)
        ))
        return {"latencies": latencies, "errors": dict(errors)}
    finally:
        for ch in channels:
            await ch.close()


def worker_main(conn: Connection, spec: LoadSpec, worker: int) -> None:
    """Process entry: build the pool, say ready, then serve one command per point."""
    pool = build_requests(spec, worker)
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd is None:
            return
        conn.send(asyncio.run(_run_point(pool=pool, **cmd)))
