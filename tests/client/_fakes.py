"""An in-process fake AttentionService for the client's unit tests.

It speaks the wire contract but not the math: OUT echoes q's bytes (so every row's placement is
checkable), LSE is ``row * 1000 + column`` (so reshapes are checkable), and the received q, k,
v and headers are recorded. Knobs make it misbehave on purpose (drop or repeat a row slice,
abort, stall) to exercise the client's error paths.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from attention_wire.pb import attention_pb2 as pb
from attention_wire.pb import attention_pb2_grpc as pb_grpc

STORAGE = {pb.FLOAT16: np.dtype("<f2"), pb.BFLOAT16: np.dtype("<i2"), pb.FLOAT32: np.dtype("<f4")}


@dataclass
class Knobs:
    out_rows: int = 3  # rows per OUT slice
    reverse: bool = False  # send slices last-first
    drop_slice: int | None = None  # index of an OUT slice never sent
    repeat_slice: int | None = None  # index of an OUT slice sent twice
    skip_stats: bool = False
    fail_first: int = 0  # abort this many attempts with UNAVAILABLE
    abort: tuple[grpc.StatusCode, str] | None = None
    sleep: float = 0.0  # stall before answering
    attempts: int = 0
    fail_info_first: int = 0  # the same for GetServerInfo (a unary rpc)
    info_attempts: int = 0
    crowded_first: int = 0  # GetServerInfo(connections) says "crowded" to this many asks
    counted_peers: list[str] = field(default_factory=list)  # the asks' client addresses
    call_peers: list[str] = field(default_factory=list)  # compute calls' client addresses
    headers: list[Any] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    message_sizes: list[int] = field(default_factory=list)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


class FakeAttention(pb_grpc.AttentionServiceServicer):
    def __init__(self) -> None:
        self.knobs = Knobs()
        self._lock = threading.Lock()

    # --- request side --------------------------------------------------------------------------
    def _receive(self, request_iterator: Any, context: grpc.ServicerContext) -> Any:
        knobs = self.knobs
        with self._lock:
            knobs.attempts += 1
            knobs.metadata.append(dict(context.invocation_metadata()))
            knobs.call_peers.append(context.peer())
        first = next(request_iterator)
        header = first.header
        knobs.headers.append(header)
        specs = {pb.Q: header.q, pb.K: header.k, pb.V: header.v}
        bufs = {
            f: bytearray(int(np.prod(s.shape, dtype=np.int64)) * STORAGE[s.dtype].itemsize)
            for f, s in specs.items()
        }
        got = dict.fromkeys(bufs, 0)
        for i, msg in enumerate(itertools.chain([first], request_iterator)):
            knobs.message_sizes.append(msg.ByteSize())
            if i and msg.HasField("header"):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "header repeated")
            for c in msg.chunks:
                if c.offset != got[c.field]:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad offset {c.offset}")
                bufs[c.field][c.offset : c.offset + len(c.data)] = c.data
                got[c.field] += len(c.data)
        for f, buf in bufs.items():
            if got[f] != len(buf):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"field {f} incomplete")
        arrays = {
            name: np.frombuffer(bufs[f], STORAGE[specs[f].dtype]).reshape(tuple(specs[f].shape))
            for f, name in ((pb.Q, "q"), (pb.K, "k"), (pb.V, "v"))
        }
        knobs.arrays.update(arrays)  # the last call's, for tests to look at
        with self._lock:
            if knobs.fail_first > 0:
                knobs.fail_first -= 1
                context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
        if knobs.abort is not None:
            context.abort(*knobs.abort)
        if knobs.sleep:
            time.sleep(knobs.sleep)
        return header, arrays

    # --- response side -------------------------------------------------------------------------
    def _respond(self, header: Any, lse_shape: tuple[int, ...], arrays: dict[str, Any]) -> Any:
        """OUT is the call's own q (concurrent calls each get theirs back)."""
        knobs = self.knobs
        q = arrays["q"]
        spec = pb.TensorSpec(dtype=header.q.dtype, shape=q.shape)
        slices = [
            pb.AttentionResponse(
                chunk=pb.OutputChunk(
                    field=pb.OUT, spec=spec, row_start=r, row_count=min(knobs.out_rows, len(q) - r),
                    data=q[r : r + knobs.out_rows].tobytes(),
                )
            )
            for r in range(0, len(q), knobs.out_rows)
        ]
        if knobs.repeat_slice is not None:
            slices.append(slices[knobs.repeat_slice])
        if knobs.drop_slice is not None:
            del slices[knobs.drop_slice]
        if knobs.reverse:
            slices.reverse()
        yield from slices
        if header.return_lse:
            rows, cols = lse_shape
            lse = (np.arange(rows)[:, None] * 1000 + np.arange(cols)[None, :]).astype("<f4")
            lspec = pb.TensorSpec(dtype=pb.FLOAT32, shape=lse_shape)
            for r in range(rows):  # one row per message
                yield pb.AttentionResponse(
                    chunk=pb.OutputChunk(
                        field=pb.LSE, spec=lspec, row_start=r, row_count=1, data=lse[r].tobytes()
                    )
                )
        if not knobs.skip_stats:
            yield pb.AttentionResponse(
                stats=pb.RequestStats(bytes_in=sum(a.nbytes for a in arrays.values()),
                                      bytes_out=q.nbytes, batch_requests=1, flops=1.5)
            )

    def Prefill(self, request_iterator: Any, context: grpc.ServicerContext) -> Any:
        header, arrays = self._receive(request_iterator, context)
        total_q, heads = header.q.shape[0], header.q.shape[1]
        yield from self._respond(header, (heads, total_q), arrays)

    def Decode(self, request_iterator: Any, context: grpc.ServicerContext) -> Any:
        header, arrays = self._receive(request_iterator, context)
        batch, heads = header.q.shape[0], header.q.shape[1]
        yield from self._respond(header, (batch, heads), arrays)

    def GetServerInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        knobs = self.knobs
        with self._lock:
            knobs.metadata.append(dict(context.invocation_metadata()))
            knobs.info_attempts += 1
            if knobs.fail_info_first > 0:
                knobs.fail_info_first -= 1
                context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
        if knobs.abort is not None:
            context.abort(*knobs.abort)
        if knobs.sleep:
            time.sleep(knobs.sleep)
        info = pb.ServerInfo(
            device="fake", backend="cpu", dtypes=[pb.FLOAT16, pb.BFLOAT16], head_dims=[64, 128],
            max_request_bytes=1 << 30, chunk_bytes=1 << 20, server_version="0.0-fake",
        )
        if request.connections:  # as a group of two front ends would count them
            with self._lock:
                knobs.counted_peers.append(context.peer())
                crowded = knobs.crowded_first > 0
                knobs.crowded_first -= crowded
            info.frontends = 2
            info.frontend_connections, info.fewest_frontend_connections = (3, 0) if crowded \
                else (1, 1)
        return info


def start_fake(
    credentials: grpc.ServerCredentials | None = None, port: int = 0
) -> tuple[Any, FakeAttention, int]:
    """A grpc server with default message limits on localhost (``port`` 0: a free one)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    servicer = FakeAttention()
    pb_grpc.add_AttentionServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if credentials is None:
        port = server.add_insecure_port(f"localhost:{port}")
    else:
        port = server.add_secure_port(f"localhost:{port}", credentials)
    server.start()
    return server, servicer, port


def silent_server(method: str) -> tuple[grpc.Server, int, threading.Event, list[int]]:
    """A server whose stream rpc ``method`` (e.g. "PrefillSteps") reads one message and never
    answers; the event is set once the server sees the stream cancelled, and the list gets
    each message's ``step_timeout_ms``."""
    cancelled = threading.Event()
    step_timeouts: list[int] = []

    request = pb.DecodeRequest if "Decode" in method else pb.PrefillRequest

    def steps(requests, context):  # type: ignore[no-untyped-def]
        step_timeouts.append(request.FromString(next(requests)).step_timeout_ms)
        while context.is_active():
            time.sleep(0.01)
        cancelled.set()
        return iter(())

    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "attention.v1.AttentionService",
        {method: grpc.stream_stream_rpc_method_handler(steps)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, cancelled, step_timeouts
