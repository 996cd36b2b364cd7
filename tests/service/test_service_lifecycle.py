"""Deadlines, cancellation, device OOM, health, reflection and in-process draining."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from attention_service.params import Op
from attention_wire.pb import attention_pb2 as pb

from .svc_helpers import (
    GatedBackend,
    header_then_wait,
    health_status,
    request_codes,
    small_prefill,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)


def _idle(srv) -> bool:  # type: ignore[no-untyped-def]
    return srv.server.servicer.tracker.inflight == 0 and srv.server.executor.queue_depth(
        Op.PREFILL
    ) == 0


def test_deadline_during_compute_stops_it(start_server) -> None:  # type: ignore[no-untyped-def]
    backend = GatedBackend()
    srv = start_server(backend=backend, metrics_port=0)
    with pytest.raises(grpc.RpcError) as info:
        list(srv.stub().Prefill(iter(small_prefill()), timeout=0.5))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert backend.saw_cancel.wait(10), "compute kept running for a dead call"
    assert wait_until(lambda: _idle(srv))
    backend.release.set()
    assert list(srv.stub().Prefill(iter(small_prefill()), timeout=10))[-1].HasField("stats")
    assert health_status(srv.channel()) == "SERVING"


def test_deadline_while_receiving(server) -> None:  # type: ignore[no-untyped-def]
    release = threading.Event()
    try:
        with pytest.raises(grpc.RpcError) as info:
            list(server.stub().Prefill(header_then_wait(small_prefill(), release), timeout=0.5))
    finally:
        release.set()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: _idle(server))


def test_client_cancel_during_compute(start_server) -> None:  # type: ignore[no-untyped-def]
    backend = GatedBackend()
    srv = start_server(backend=backend, metrics_port=0)
    call = srv.stub().Prefill(iter(small_prefill()), timeout=30)
    assert backend.entered.wait(10)
    call.cancel()
    assert backend.saw_cancel.wait(10), "compute kept running for a cancelled call"
    assert wait_until(lambda: _idle(srv))
    assert wait_until(
        lambda: srv.scrape()["attention_inflight_requests"].samples[0].value == 0
    )
    backend.release.set()
    assert health_status(srv.channel()) == "SERVING"
    assert list(srv.stub().Prefill(iter(small_prefill()), timeout=10))[-1].HasField("stats")
    assert {"CANCELLED", "OK"} <= request_codes(srv)


def test_client_cancel_while_receiving(server) -> None:  # type: ignore[no-untyped-def]
    release = threading.Event()
    call = server.stub().Prefill(header_then_wait(small_prefill(), release), timeout=30)
    assert wait_until(lambda: server.server.servicer.tracker.inflight == 1)
    call.cancel()
    release.set()
    assert wait_until(lambda: _idle(server))
    assert health_status(server.channel()) == "SERVING"


def test_device_oom_is_resource_exhausted(start_server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    srv = start_server()
    real = srv.server.backend.launch
    calls = []

    def oom_once(plan):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(plan)

    monkeypatch.setattr(srv.server.backend, "launch", oom_once)
    with pytest.raises(grpc.RpcError) as info:
        list(srv.stub().Prefill(iter(small_prefill()), timeout=10))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "out of memory" in info.value.details()
    # The server keeps serving.
    assert list(srv.stub().Prefill(iter(small_prefill()), timeout=10))[-1].HasField("stats")
    assert health_status(srv.channel()) == "SERVING"


def test_unexpected_backend_error_is_internal(start_server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    srv = start_server()

    def boom(plan):  # type: ignore[no-untyped-def]
        raise RuntimeError("kaboom")

    monkeypatch.setattr(srv.server.backend, "launch", boom)
    q = torch.zeros(1, 2, 8)
    from .svc_helpers import decode_messages

    with pytest.raises(grpc.RpcError) as info:
        list(srv.stub().Decode(decode_messages(q, q, q, [0, 1]), timeout=10))
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "kaboom" in info.value.details()


def test_health_serving(server) -> None:  # type: ignore[no-untyped-def]
    ch = server.channel()
    assert health_status(ch) == "SERVING"
    assert health_status(ch, "attention.v1.AttentionService") == "SERVING"
    with pytest.raises(grpc.RpcError) as info:
        health_status(ch, "no.such.Service")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_services(server) -> None:  # type: ignore[no-untyped-def]
    stub = reflection_pb2_grpc.ServerReflectionStub(server.channel())
    req = reflection_pb2.ServerReflectionRequest(list_services="")
    names = set()
    for resp in stub.ServerReflectionInfo(iter([req]), timeout=5):
        names |= {s.name for s in resp.list_services_response.service}
    assert {
        "attention.v1.AttentionService", "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names
    req = reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="attention.v1.AttentionService"
    )
    resp = next(iter(stub.ServerReflectionInfo(iter([req]), timeout=5)))
    assert resp.file_descriptor_response.file_descriptor_proto


@pytest.mark.parametrize("method", [
    "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
])
def test_malformed_health_and_reflection_requests_are_invalid_argument(
    server, method: str, caplog: pytest.LogCaptureFixture,  # type: ignore[no-untyped-def]
) -> None:
    """grpc's stock servicers answer bytes that do not parse with UNKNOWN and log a
    traceback; ours refuse them as INVALID_ARGUMENT naming the request, and still serve."""
    ch = server.channel()
    bad = b"\xff\xff\xff"
    with pytest.raises(grpc.RpcError) as info:
        if method.endswith("Check"):
            ch.unary_unary(method)(bad, timeout=5)
        elif method.endswith("Watch"):
            next(iter(ch.unary_stream(method)(bad, timeout=5)))
        else:  # a good request first: the stream answers it, then refuses the bad one
            good = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
            replies = list(ch.stream_stream(method)(iter([good, bad]), timeout=5))
            raise AssertionError(f"the stream ended without an error: {replies}")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert info.value.details().startswith("request:") and method.split("/")[-1] in (
        info.value.details())
    assert health_status(ch) == "SERVING"
    watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=5)
    assert next(iter(watch)).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    assert "Traceback" not in caplog.text


def test_server_info(server) -> None:  # type: ignore[no-untyped-def]
    info = server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert (info.device, info.backend) == ("cpu", "cpu")
    assert set(info.dtypes) == {pb.FLOAT16, pb.BFLOAT16, pb.FLOAT32, pb.FLOAT8_E4M3}
    assert list(info.head_dims) == list(range(1, 257))  # any head dim (issue 65)
    assert info.max_request_bytes == 1 << 30 and info.chunk_bytes == 64 * 1024
    assert info.max_message_bytes == 4 * 1024 * 1024
    assert info.server_version and info.torch_version == torch.__version__
    assert info.cuda_version == "" and info.batching is False


def test_drain_in_process(start_server) -> None:  # type: ignore[no-untyped-def]
    """stop(grace): NOT_SERVING at once, new calls refused, the in-flight call completes."""
    backend = GatedBackend()
    srv = start_server(backend=backend)
    inflight = srv.stub().Prefill(iter(small_prefill()), timeout=30)
    assert backend.entered.wait(10)
    stopping = asyncio.run_coroutine_threadsafe(srv.server.stop(20), srv.loop)
    ch = srv.channel()
    assert wait_until(lambda: health_status(ch) == "NOT_SERVING")
    with pytest.raises(grpc.RpcError) as info:
        list(srv.stub().Prefill(iter(small_prefill()), timeout=5))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in info.value.details()
    backend.release.set()
    resp = list(inflight)
    assert resp[-1].HasField("stats")
    stopping.result(20)


@pytest.mark.parametrize("how", ["grace over", "second signal"])
def test_calls_the_drain_cuts_count_as_unavailable(start_server, how: str) -> None:  # type: ignore[no-untyped-def]
    """A call still running when the grace period ends, or when a second signal cuts the
    drain short (``FrontEnd.cut``), is cancelled by the server: its client sees UNAVAILABLE,
    and metrics and log count it so (not as a client's CANCELLED)."""
    backend = GatedBackend()
    srv = start_server(backend=backend, metrics_port=0)
    inflight = srv.stub().Prefill(iter(small_prefill()), timeout=30)
    assert backend.entered.wait(10)
    if how == "grace over":
        asyncio.run_coroutine_threadsafe(srv.server.stop(0.2), srv.loop).result(20)
    else:
        draining = asyncio.run_coroutine_threadsafe(srv.server.stop(30), srv.loop)
        assert wait_until(lambda: not srv.server.frontend.tracker.accepting)
        asyncio.run_coroutine_threadsafe(srv.server.frontend.cut(), srv.loop).result(20)
        backend.release.set()  # the engine's launch ends; its caller is gone
        draining.result(20)
    with pytest.raises(grpc.RpcError) as info:
        list(inflight)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    registry = srv.server.servicer._metrics.registry  # /metrics stopped with the server

    def codes() -> set[str]:
        return {s.labels["code"] for fam in registry.collect() if fam.name == "attention_requests"
                for s in fam.samples
                if s.name == "attention_requests_total" and s.labels["rpc"] == "Prefill"}

    assert wait_until(lambda: "UNAVAILABLE" in codes())
    assert "CANCELLED" not in codes()


def test_queue_full_is_resource_exhausted(start_server) -> None:  # type: ignore[no-untyped-def]
    backend = GatedBackend()
    srv = start_server(backend=backend, max_queue_size=1)
    running = srv.stub().Prefill(iter(small_prefill()), timeout=30)
    assert backend.entered.wait(10)  # first call holds the device
    queued = srv.stub().Prefill(iter(small_prefill()), timeout=30)
    assert wait_until(lambda: srv.server.executor.queue_depth(Op.PREFILL) == 1)
    with pytest.raises(grpc.RpcError) as info:
        list(srv.stub().Prefill(iter(small_prefill()), timeout=10))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue" in info.value.details()
    backend.release.set()
    assert list(running)[-1].HasField("stats") and list(queued)[-1].HasField("stats")


def test_a_cancelled_long_cpu_sequence_frees_the_device_promptly(server) -> None:  # type: ignore[no-untyped-def]
    # One long sequence (seconds of cpu work): cancelled, it must not hold the next call.
    from .svc_helpers import prefill_messages, random_qkv

    q, k, v = random_qkv(4096, 16384, 8, 8, 64, torch.float32)  # ~9 s for the reference
    call = server.stub().Prefill(prefill_messages(q, k, v, [0, 4096], [0, 16384]), timeout=60)
    executor = server.server.executor
    assert wait_until(lambda: executor._inflight == 1, timeout=30)  # computing now
    time.sleep(0.2)
    call.cancel()
    t0 = time.perf_counter()
    assert list(server.stub().Prefill(iter(small_prefill()), timeout=30))[-1].HasField("stats")
    assert time.perf_counter() - t0 < 1.5
