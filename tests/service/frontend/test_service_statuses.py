"""Every failure gets its true status (issue 12): uploads cut off by a cancel or a deadline
are counted as such, a corrupt unary request is INVALID_ARGUMENT, a host allocation failure is
RESOURCE_EXHAUSTED without internals, and an unauthenticated caller is refused before any of
its bytes are parsed."""

from __future__ import annotations

import threading
from typing import Any

import grpc
import pytest

from ..svc_helpers import (
    GatedBackend,
    ServerHandle,
    header_then_wait,
    make_config,
    one_message,
    request_codes,
    small_prefill,
    wait_until,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_tracebacks")]
METHOD = "/attention.v1.AttentionService/"


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_cut_off_upload_is_counted_as_cancelled_or_expired(start_server: Any, how: str) -> None:
    srv = start_server(metrics_port=0)
    release = threading.Event()
    try:
        call = srv.stub().Prefill(header_then_wait(small_prefill(), release),
                                  timeout=0.5 if how == "deadline" else 30)
        if how == "cancel":
            assert wait_until(lambda: srv.server.servicer.tracker.inflight == 1)
            call.cancel()
        with pytest.raises(grpc.RpcError):
            list(call)
    finally:
        release.set()
    want = "CANCELLED" if how == "cancel" else "DEADLINE_EXCEEDED"
    assert wait_until(lambda: want in request_codes(srv, "Prefill"))
    assert "INVALID_ARGUMENT" not in request_codes(srv, "Prefill")  # never a client error


@pytest.mark.parametrize("method", ["GetServerInfo", "ListRegions", "CreateCaches"])
def test_a_corrupt_unary_request_is_invalid_argument(server: ServerHandle, method: str) -> None:
    call = server.channel().unary_unary(METHOD + method, request_serializer=None,
                                        response_deserializer=None)
    with pytest.raises(grpc.RpcError) as info:
        call(b"\xff\xff\xff", timeout=10)  # field 0x1fff.. with a truncated varint
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("message: not a valid ")
    assert "INVALID_ARGUMENT" in request_codes(server, method)  # counted like any refusal
    assert list(server.stub().Prefill(iter(small_prefill()), timeout=10))[-1].HasField("stats")


def test_a_host_allocation_failure_is_resource_exhausted(start_server: Any,
                                                         monkeypatch: Any) -> None:
    srv = start_server(metrics_port=0)
    link = srv.server.servicer._link
    real = link.allocate

    async def fail(sizes: dict[str, int]) -> Any:
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc at pinned.cpp:123)")

    monkeypatch.setattr(link, "allocate", fail)
    with pytest.raises(grpc.RpcError) as info:
        list(srv.stub().Prefill(iter(small_prefill()), timeout=10))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details().startswith("header: the server could not reserve ")
    assert "cudaHostAlloc" not in info.value.details()  # no internals
    monkeypatch.setattr(link, "allocate", real)
    assert list(srv.stub().Prefill(iter(small_prefill()), timeout=10))[-1].HasField("stats")


@pytest.fixture(scope="module")
def auth_server() -> Any:
    handle = ServerHandle(make_config(auth_token="tok", metrics_port=0))
    yield handle
    handle.close()


@pytest.mark.parametrize("method", ["Prefill", "GetServerInfo", "CreateCaches"])
def test_unauthenticated_bytes_are_never_parsed(auth_server: ServerHandle, method: str) -> None:
    # Garbage that any parse would refuse as INVALID_ARGUMENT: the caller must learn only
    # that it is not authenticated.
    streaming = method == "Prefill"
    ch = auth_server.channel()
    if streaming:
        call = ch.stream_stream(METHOD + method, request_serializer=None,
                                response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            list(call(iter([b"\xff\xff\xff"] * 3), timeout=10))
    else:
        call = ch.unary_unary(METHOD + method, request_serializer=None,
                              response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xff\xff", timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "INVALID_ARGUMENT" not in request_codes(auth_server, method)


@pytest.mark.parametrize(("remaining", "code"), [
    (None, "CANCELLED"), (5.0, "CANCELLED"), (0.2, "CANCELLED"), (0.01, "DEADLINE_EXCEEDED"),
    (0.0, "DEADLINE_EXCEEDED"), (-0.5, "DEADLINE_EXCEEDED"),
])
def test_a_call_the_client_ended_counts_as_its_deadline_or_a_cancel(remaining: float | None,
                                                                     code: str) -> None:
    # The server's deadline trails the client's by the headers' transit: a cut-off seen with a
    # few milliseconds left is the deadline, not a cancel.
    from attention_service.frontend.servicer import _gone_code

    class Context:
        def time_remaining(self) -> float | None:
            return remaining

    assert _gone_code(Context()) == code  # type: ignore[arg-type]


@pytest.mark.parametrize(("step_timeout_ms", "code"), [
    (150, "DEADLINE_EXCEEDED"), (60_000, "CANCELLED"), (0, "CANCELLED"),
])
def test_a_step_cut_off_at_its_own_deadline_counts_as_expired(
    start_server: Any, step_timeout_ms: int, code: str,
) -> None:
    """A kept-open step stream has no deadline per call: its client cancels the stream when a
    call's time runs out. With the call's ``step_timeout_ms`` the server counts that as
    DEADLINE_EXCEEDED; a cancel before it (or a call without one) stays CANCELLED."""
    gate = GatedBackend()
    gate.release.set()  # warm up, then close the gate
    srv = start_server(backend=gate, metrics_port=0)
    gate.release.clear()
    message = one_message(small_prefill())
    message.step_timeout_ms = step_timeout_ms
    stop = threading.Event()

    def requests() -> Any:
        yield message
        stop.wait(20)

    call = srv.stub().PrefillSteps(requests())
    try:
        assert gate.entered.wait(10)
        threading.Event().wait(0.3)  # past 150 ms, well before 60 s
        call.cancel()
        with pytest.raises(grpc.RpcError):
            list(call)
        # Counted while the gate still holds the compute: the client hears its cancel at once,
        # the server a moment later; a gate opened before that lets the step end OK.
        assert wait_until(lambda: code in request_codes(srv, "Prefill"))
    finally:
        stop.set()
        gate.release.set()
    assert request_codes(srv, "Prefill") == {code}


def test_a_client_call_that_times_out_on_a_kept_open_stream_counts_as_expired(
    start_server: Any,
) -> None:
    """End to end: ``attention_client`` sends a one-message call on a kept-open PrefillSteps
    stream with its deadline in the message; when the call times out, the client cancels the
    stream and the server counts DEADLINE_EXCEEDED (it used to count CANCELLED)."""
    import numpy as np

    from attention_client import AttentionClient, AttentionTimeoutError

    gate = GatedBackend()
    gate.release.set()  # warm up, then close the gate
    srv = start_server(backend=gate, metrics_port=0)
    gate.release.clear()
    q = np.ones((4, 2, 8), np.float32)
    try:
        with AttentionClient(srv.target, spread=False) as client:
            with pytest.raises(AttentionTimeoutError):
                client.attention(q, q, q, timeout=0.3)
            assert gate.entered.is_set()  # it reached the engine on the step stream
        # Counted before the gate opens (else the step could still end OK on a slow server).
        assert wait_until(lambda: "DEADLINE_EXCEEDED" in request_codes(srv, "Prefill"))
    finally:
        gate.release.set()
    assert request_codes(srv, "Prefill") == {"DEADLINE_EXCEEDED"}
