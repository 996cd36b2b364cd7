"""Test helpers: a real server on a background event loop, and raw-stub request encoding.

Deliberately independent of the client package's AttentionClient (only its generated stubs):
these tests pin the wire protocol the server speaks.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import urllib.request
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import Any, TypeVar

import grpc
import torch
from prometheus_client.parser import text_string_to_metric_families

from attention_kernels import decode_ref, prefill_ref
from attention_service.config import ServerConfig
from attention_service.engine.backends import Backend
from attention_service.server import AttentionServer, create_server
from attention_wire.pb import attention_pb2 as pb
from attention_wire.pb import attention_pb2_grpc as pb_grpc

T = TypeVar("T")
PB_DTYPE = {torch.float16: pb.FLOAT16, torch.bfloat16: pb.BFLOAT16, torch.float32: pb.FLOAT32,
            torch.float8_e4m3fn: pb.FLOAT8_E4M3}
TORCH_DTYPE = {v: k for k, v in PB_DTYPE.items()}
# Server (float32 compute, rounded to dtype) vs float64 oracle.
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}
MiB = 1 << 20


def make_config(**overrides: Any) -> ServerConfig:
    base = dict(host="127.0.0.1", port=0, device="cpu", metrics_port=-1, batching=False)
    base.update(overrides)
    return ServerConfig(**base)  # type: ignore[arg-type]


class ServerHandle:
    """A server on its own event loop thread, so tests can use plain synchronous stubs."""

    def __init__(self, config: ServerConfig, backend: Backend | None = None) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server: AttentionServer
        # A cuda server compiles every kernel variant before it serves: about 60-70 s on an
        # H100 host with a cold Triton cache (old and new code alike, 2026-11-23), seconds
        # with a warm one.
        start = 280.0 if config.device == "cuda" else 60.0
        self.server, self.port = self.run(create_server(config, backend=backend), start)
        self._channels: list[grpc.Channel] = []

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def channel(
        self, credentials: grpc.ChannelCredentials | None = None, **kw: Any
    ) -> grpc.Channel:
        if credentials is None:
            ch = grpc.insecure_channel(self.target, **kw)
        else:
            ch = grpc.secure_channel(self.target, credentials, **kw)
        self._channels.append(ch)
        return ch

    def stub(self) -> pb_grpc.AttentionServiceStub:
        return pb_grpc.AttentionServiceStub(self.channel())

    def scrape(self) -> dict[str, Any]:
        """/metrics parsed: family name -> family."""
        assert self.server.metrics_port is not None
        url = f"http://127.0.0.1:{self.server.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        return {f.name: f for f in text_string_to_metric_families(text)}

    def close(self, grace: float = 0.0) -> None:
        for ch in self._channels:
            ch.close()
        try:
            self.run(self.server.stop(grace))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()


def sample(metrics: dict[str, Any], family: str, sample_name: str, **labels: str) -> float:
    """Sum of the samples of ``family`` named ``sample_name`` whose labels include ``labels``."""
    fam = metrics[family]
    return sum(
        s.value for s in fam.samples
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def request_codes(handle: ServerHandle, rpc: str | None = None) -> set[str]:
    """The status codes the server has counted (``attention_requests_total`` above 0), of
    ``rpc`` or of every rpc."""
    return {
        s.labels["code"] for s in handle.scrape()["attention_requests"].samples
        if s.name == "attention_requests_total" and s.value > 0
        and (rpc is None or s.labels["rpc"] == rpc)
    }


def header_then_wait(msgs: list[Any], release: threading.Event) -> Iterator[Any]:
    """A request stream that sends its first message, then waits for ``release``."""
    yield msgs[0]
    release.wait(20)
    yield from msgs[1:]


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def spec(t: torch.Tensor) -> pb.TensorSpec:
    return pb.TensorSpec(dtype=PB_DTYPE[t.dtype], shape=list(t.shape))


def chunk_messages(
    cls: type, tensors: dict[int, torch.Tensor], chunk: int = 1 * MiB
) -> Iterator[Any]:
    """Chunk-only request messages carrying the tensors' bytes, <= ``chunk`` bytes each."""
    for field, t in tensors.items():
        data = memoryview(raw_bytes(t))
        for off in range(0, len(data), chunk):
            part = bytes(data[off : off + chunk])
            yield cls(chunks=[pb.TensorChunk(field=field, offset=off, data=part)])


def prefill_messages(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int],
    cu_k: list[int] | None = None, *, causal: bool = False, scale: float | None = None,
    return_lse: bool = False, chunk: int = 1 * MiB,
) -> Iterator[pb.PrefillRequest]:
    header = pb.PrefillHeader(
        q=spec(q), k=spec(k), v=spec(v), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k or [],
        causal=causal, return_lse=return_lse,
    )
    if scale is not None:
        header.softmax_scale = scale
    yield pb.PrefillRequest(header=header)
    yield from chunk_messages(pb.PrefillRequest, {pb.Q: q, pb.K: k, pb.V: v}, chunk)


def decode_messages(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_k: list[int], *,
    scale: float | None = None, num_splits: int = 0, return_lse: bool = False,
    chunk: int = 1 * MiB,
) -> Iterator[pb.DecodeRequest]:
    header = pb.DecodeHeader(
        q=spec(q), k=spec(k), v=spec(v), cu_seqlens_k=cu_k, num_splits=num_splits,
        return_lse=return_lse,
    )
    if scale is not None:
        header.softmax_scale = scale
    yield pb.DecodeRequest(header=header)
    yield from chunk_messages(pb.DecodeRequest, {pb.Q: q, pb.K: k, pb.V: v}, chunk)


class Response:
    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] = {}
        self.rows_seen: dict[int, int] = {}
        self.stats: pb.RequestStats | None = None
        self.messages = 0
        self.max_data = 0

    @property
    def out(self) -> torch.Tensor:
        return self.tensors[pb.OUT]

    @property
    def lse(self) -> torch.Tensor | None:
        return self.tensors.get(pb.LSE)


def collect(responses: Iterable[pb.AttentionResponse]) -> Response:
    """Reassemble OUT/LSE row slices, checking they arrive in order and cover every row."""
    r = Response()
    for msg in responses:
        r.messages += 1
        assert r.stats is None, "stats must be the last message"
        if msg.HasField("stats"):
            r.stats = msg.stats
            continue
        c = msg.chunk
        shape = tuple(c.spec.shape)
        dtype = TORCH_DTYPE[c.spec.dtype]
        if c.field not in r.tensors:
            r.tensors[c.field] = torch.empty(shape, dtype=dtype)
            r.rows_seen[c.field] = 0
        t = r.tensors[c.field]
        assert c.row_start == r.rows_seen[c.field]
        row_bytes = math.prod(shape[1:]) * t.element_size()
        assert len(c.data) == c.row_count * row_bytes
        r.max_data = max(r.max_data, len(c.data))
        if not c.data:  # an empty tensor's one message (torch.frombuffer refuses b"")
            r.rows_seen[c.field] += c.row_count
            continue
        rows = torch.frombuffer(bytearray(c.data), dtype=torch.uint8).view(dtype)
        t[c.row_start : c.row_start + c.row_count] = rows.view(c.row_count, *shape[1:])
        r.rows_seen[c.field] += c.row_count
    assert r.stats is not None, "no stats message"
    for field, t in r.tensors.items():
        assert r.rows_seen[field] == t.shape[0]
    return r


def prefill_oracle(q, k, v, cu_q, cu_k=None, **kw):  # type: ignore[no-untyped-def]
    as64 = lambda t: t.double()  # noqa: E731
    cu_q_t = torch.tensor(cu_q, dtype=torch.int32)
    cu_k_t = torch.tensor(cu_k, dtype=torch.int32) if cu_k else None
    return prefill_ref(as64(q), as64(k), as64(v), cu_q_t, cu_k_t, return_lse=True, **kw)


def decode_oracle(q, k, v, cu_k, **kw):  # type: ignore[no-untyped-def]
    cu = torch.tensor(cu_k, dtype=torch.int32)
    return decode_ref(q.double(), k.double(), v.double(), cu, return_lse=True, **kw)


def random_qkv(
    total_q: int, total_k: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(total_q, heads, dim, generator=g).to(dtype)
    k = torch.randn(total_k, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(total_k, kv_heads, dim, generator=g).to(dtype)
    return q, k, v


def cu_from_lengths(lengths: list[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


class GatedBackend:
    """The cpu backend behind a gate: launches wait until ``release`` is set, polling
    ``plan.cancelled()`` so tests can see whether the server stops compute of a dead call.
    ``heed_cancel=False``: a launch sees the cancel (``saw_cancel``) but still runs to the end
    once released, as a GPU launch already queued does."""

    def __init__(self, heed_cancel: bool = True) -> None:
        self._heed_cancel = heed_cancel
        from attention_service.engine.backends import CpuBackend

        self._inner = CpuBackend()
        self.name, self.device_name = self._inner.name, self._inner.device_name
        self.device, self.max_inflight = self._inner.device, self._inner.max_inflight
        self.alloc_host, self.memory = self._inner.alloc_host, self._inner.memory
        self.entered = threading.Event()
        self.release = threading.Event()
        self.saw_cancel = threading.Event()

    def warmup(self) -> None:
        self._inner.warmup()

    def launch(self, plan):  # type: ignore[no-untyped-def]
        import copy

        from attention_service.errors import Cancelled

        self.entered.set()
        give_up = time.monotonic() + 30
        while not self.release.is_set():
            if plan.cancelled():
                self.saw_cancel.set()
                if self._heed_cancel:
                    raise Cancelled()
            if time.monotonic() > give_up:
                raise RuntimeError("test gate never opened")
            time.sleep(0.005)
        if not self._heed_cancel:  # the inner launch runs as if nobody had gone
            plan = copy.copy(plan)
            plan.cancelled = lambda: False
        return self._inner.launch(plan)


def small_prefill() -> list[pb.PrefillRequest]:
    q, k, v = random_qkv(8, 8, 2, 1, 8, torch.float32)
    return list(prefill_messages(q, k, v, [0, 3, 8]))


def declared_prefill(n_tokens: int, seq: int = 1024, dim: int = 64) -> pb.PrefillRequest:
    """A header declaring q, k, v of ``n_tokens`` x 1 x ``dim`` fp32 in ``seq``-token
    sequences, with no bytes (85 * 1024 * 16 tokens: just under the 1 GiB request limit)."""
    t = pb.TensorSpec(dtype=pb.FLOAT32, shape=[n_tokens, 1, dim])
    cu = [*range(0, n_tokens, seq), n_tokens]
    return pb.PrefillRequest(header=pb.PrefillHeader(q=t, k=t, v=t, cu_seqlens_q=cu))


def six_mib_prefill() -> list[pb.PrefillRequest]:
    """An honest 6 MiB prefill: q, k, v of 8192 x 1 x 64 fp32 in 128-token sequences."""
    q, k, v = random_qkv(8192, 8192, 1, 1, 64, torch.float32)
    return list(prefill_messages(q, k, v, list(range(0, 8193, 128))))


def wait_until(predicate: Any, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def health_status(channel: grpc.Channel, service: str = "") -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    resp = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=5
    )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


# ---- the unary twins and step streams: one message per call ------------------------------


def unary_rpc(handle: Any, method: str) -> Callable[..., pb.AttentionResult]:
    """A compute rpc's unary twin (``method``, e.g. "CacheDecodeUnary") on ``handle``."""
    return handle.channel().unary_unary(
        "/attention.v1.AttentionService/" + method,
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=pb.AttentionResult.FromString,
    )


def one_message(messages: Iterable[Any]) -> Any:
    """A request stream's messages as one message (header and every chunk)."""
    msgs = list(messages)
    first = type(msgs[0])(header=msgs[0].header)
    for m in msgs:
        first.chunks.extend(m.chunks)
    return first


def collect_result(result: pb.AttentionResult) -> Response:
    """An AttentionResult read as the stream it stands for (checks rows and stats alike)."""
    return collect([pb.AttentionResponse(chunk=c) for c in result.chunks]
                   + [pb.AttentionResponse(stats=result.stats)])


def same_answer(a: Response, b: Response) -> None:
    assert a.tensors.keys() == b.tensors.keys()
    for field, t in a.tensors.items():
        assert torch.equal(t, b.tensors[field]), pb.OutputField.Name(field)
    sa, sb = a.stats, b.stats
    assert sa is not None and sb is not None
    for name in ("bytes_in", "bytes_out", "flops", "batch_requests", "batch_tokens"):
        assert getattr(sa, name) == getattr(sb, name), name
    assert list(sa.cache_lengths) == list(sb.cache_lengths)


def span_jobs(
    u8: torch.Tensor, lengths: list[tuple[list[int], list[int]]], heads: int, kv_heads: int,
    dim: int, dtype: torch.dtype, seed: int = 0, decode: bool = False,
) -> tuple[list[Any], list[tuple[torch.Tensor, ...]]]:
    """Prefill jobs (causal; ``decode``: decode jobs, one query per key length, the query
    lengths unused) whose q, k, v and (NaN-poisoned) out lie in ``u8`` as byte spans, as a
    front end's arena hands them to the engine: (jobs, each job's (q, k, v) as written)."""
    from attention_service.engine.dtypes import WIRE_DTYPES
    from attention_service.engine.jobs import ByteBase, Job
    from attention_service.params import Op, make_params

    base = ByteBase(u8)
    jobs, inputs, at = [], [], 0
    for i, (len_q, len_k) in enumerate(lengths):
        cu_k = cu_from_lengths(len_k)
        cu_q = None if decode else cu_from_lengths(len_q)
        rows = len(len_k) if cu_q is None else cu_q[-1]
        q, k, v = random_qkv(rows, cu_k[-1], heads, kv_heads, dim, dtype, seed=seed + i)
        params = make_params(Op.DECODE if decode else Op.PREFILL, WIRE_DTYPES[dtype],
                             tuple(q.shape), tuple(k.shape), cu_k, cu_q, causal=not decode)
        spans = {}
        for name, t in (("q", q), ("k", k), ("v", v), ("out", torch.full_like(q, math.nan))):
            n = t.numel() * t.element_size()
            u8[at : at + n].copy_(t.reshape(-1).view(torch.uint8))
            spans[name] = (base, at, dtype, tuple(t.shape))
            at += -(-(n + 1) // 256) * 256  # a gap after each: a copy past its end shows
        jobs.append(Job(params, spans=spans))
        inputs.append((q, k, v))
    return jobs, inputs
