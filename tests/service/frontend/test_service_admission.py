"""Admission limits (issue 12): no request may cost the server more than its size allows.
Each limit answers RESOURCE_EXHAUSTED naming the field, the value and the flag; oversized
repeated fields and messages of countless tiny fields are refused at once, and the server
stays responsive meanwhile."""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from attention_service.errors import RequestError
from attention_service.frontend.streams import (
    UPLOAD_STEP_BYTES,
    Upload,
    UploadBudget,
    upload_caller,
)
from attention_wire.messages import MAX_FIELDS_PER_MESSAGE, varint
from attention_wire.pb import attention_pb2 as pb

from ..svc_helpers import (
    ServerHandle,
    declared_prefill,
    decode_messages,
    header_then_wait,
    health_status,
    make_config,
    prefill_messages,
    random_qkv,
    six_mib_prefill,
    small_prefill,
    wait_until,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_tracebacks")]


@pytest.fixture(scope="module")
def tight() -> Any:
    handle = ServerHandle(make_config(max_sequences=4, max_heads_ratio=4,
                                      max_request_flops=1e6))
    yield handle
    handle.close()


def _refused(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    return info.value


def _prefill(lengths: list[int], heads: int, kv_heads: int) -> list[Any]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    q, k, v = random_qkv(cu[-1], cu[-1], heads, kv_heads, 8, torch.float32)
    return list(prefill_messages(q, k, v, cu))


@pytest.mark.parametrize(("rpc", "msgs", "field", "flag"), [
    ("Prefill", lambda: _prefill([1] * 5, 2, 1), "header.cu_seqlens_q", "--max-sequences"),
    ("Decode", lambda: list(decode_messages(*random_qkv(5, 5, 2, 1, 8, torch.float32),
                                            [0, 1, 2, 3, 4, 5])),
     "header.q.shape[0]", "--max-sequences"),
    ("Prefill", lambda: _prefill([2], 8, 1), "header.q.shape[1]", "--max-heads-ratio"),
    ("Prefill", lambda: _prefill([64, 64], 4, 1), "header", "--max-request-flops"),
])
def test_each_limit_names_field_value_and_flag(tight: ServerHandle, rpc: str, msgs: Any,
                                               field: str, flag: str) -> None:
    err = _refused(getattr(tight.stub(), rpc)(iter(msgs()), timeout=10))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details().startswith(field + ": ")
    assert flag in err.details()
    # Within the limits the same server serves.
    assert list(tight.stub().Prefill(iter(_prefill([3, 2], 4, 1)), timeout=10))[-1].HasField(
        "stats")


def test_a_huge_cu_seqlens_is_refused_before_it_is_read(server: ServerHandle) -> None:
    # 1M sequence boundaries (~4 MiB of varints): refused by count, in well under a second.
    n = 1 << 20
    header = pb.PrefillHeader(
        q=pb.TensorSpec(dtype=pb.FLOAT32, shape=[n, 1, 8]),
        k=pb.TensorSpec(dtype=pb.FLOAT32, shape=[n, 1, 8]),
        v=pb.TensorSpec(dtype=pb.FLOAT32, shape=[n, 1, 8]), cu_seqlens_q=list(range(n + 1)),
    )
    t0 = time.perf_counter()
    err = _refused(server.stub().Prefill(iter([pb.PrefillRequest(header=header)]), timeout=30))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details().startswith("header.cu_seqlens_q: sequences: 1048576")
    assert time.perf_counter() - t0 < 2.0
    assert health_status(server.channel()) == "SERVING"


@pytest.mark.parametrize("kind", ["empty_unknown_fields", "empty_chunks"])
def test_a_message_of_countless_tiny_fields_is_refused(server: ServerHandle, kind: str) -> None:
    msgs = [m.SerializeToString() for m in small_prefill()]
    if kind == "empty_unknown_fields":  # field 15, varint 0: two bytes each
        junk = (varint(15 << 3) + b"\x00") * (MAX_FIELDS_PER_MESSAGE * 100)
    else:  # empty TensorChunk messages
        junk = (varint(2 << 3 | 2) + b"\x00") * (MAX_FIELDS_PER_MESSAGE * 100)
    call = server.channel().stream_stream("/attention.v1.AttentionService/Prefill",
                                          request_serializer=None,
                                          response_deserializer=pb.AttentionResponse.FromString)
    t0 = time.perf_counter()
    err = _refused(call(iter([msgs[0], junk, *msgs[1:]]), timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"more than {MAX_FIELDS_PER_MESSAGE} fields" in err.details()
    assert time.perf_counter() - t0 < 2.0
    assert list(server.stub().Prefill(iter(small_prefill()), timeout=10))[-1].HasField("stats")


def test_uploads_in_flight_share_one_budget_of_reserved_bytes(start_server: Any) -> None:
    import threading

    from ..svc_helpers import header_then_wait, wait_until

    # small_prefill reserves 8x2x8 q + 2 x 8x1x8 k/v + 8x2x8 out floats = 1536 bytes.
    srv = start_server(max_request_bytes=2048, max_upload_bytes=2048, max_upload_share=1.0)
    release = threading.Event()
    first = srv.stub().Prefill(header_then_wait(small_prefill(), release), timeout=30)
    uploads = srv.server.servicer._uploads
    assert wait_until(lambda: uploads.used == 1536)  # reserved at the header, no bytes yet
    err = _refused(srv.stub().Prefill(iter(small_prefill()), timeout=10))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-upload-bytes" in err.details() and err.details().startswith("header: ")
    release.set()
    assert list(first)[-1].HasField("stats")
    assert wait_until(lambda: uploads.used == 0)  # given back when the call ends
    assert list(srv.stub().Prefill(iter(small_prefill()), timeout=10))[-1].HasField("stats")
    # A refused or failed upload gives its reservation back too.
    bad = small_prefill()[:1]  # header only: missing bytes
    assert _refused(srv.stub().Prefill(iter(bad), timeout=10)).code() == (
        grpc.StatusCode.INVALID_ARGUMENT)
    assert uploads.used == 0


def test_health_stays_fast_under_a_flood_of_costly_small_requests(server: ServerHandle) -> None:
    # The attack: concurrent requests that are cheap to send and costly to parse
    # (the largest admitted cu_seqlens list, messages of fields just under the cap). A liveness
    # probe (kubelet's default timeout is 1 s) must answer promptly throughout.
    import threading

    n = 65536  # --max-sequences default: admitted by count, then read and checked in full
    cu = list(range(n + 1))
    cu[-1] = n + 7  # wrong end: refused only after the whole list was parsed and checked
    header = pb.PrefillHeader(
        q=pb.TensorSpec(dtype=pb.FLOAT32, shape=[n, 1, 8]),
        k=pb.TensorSpec(dtype=pb.FLOAT32, shape=[n, 1, 8]),
        v=pb.TensorSpec(dtype=pb.FLOAT32, shape=[n, 1, 8]), cu_seqlens_q=cu,
    )
    long_cu = pb.PrefillRequest(header=header).SerializeToString()
    fields = (varint(15 << 3) + b"\x00") * (MAX_FIELDS_PER_MESSAGE - 8)
    first = small_prefill()[0].SerializeToString()
    call = server.channel().stream_stream("/attention.v1.AttentionService/Prefill",
                                          request_serializer=None,
                                          response_deserializer=pb.AttentionResponse.FromString)
    stop = threading.Event()
    codes: list[grpc.StatusCode] = []

    def flood(msgs: list[bytes]) -> None:
        while not stop.is_set():
            try:
                list(call(iter(msgs), timeout=10))
            except grpc.RpcError as e:
                codes.append(e.code())

    floods = [threading.Thread(target=flood, args=(m,), daemon=True)
              for m in ([long_cu], [first, *[fields] * 50]) * 3]
    for t in floods:
        t.start()
    latencies = []
    try:
        end = time.perf_counter() + 2.0
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            assert health_status(server.channel()) == "SERVING"
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.02)
        t0 = time.perf_counter()
        assert list(server.stub().Prefill(iter(small_prefill()), timeout=10))[-1].HasField(
            "stats")
        good_call = time.perf_counter() - t0
    finally:
        stop.set()
        for t in floods:
            t.join(timeout=15)
    assert len(codes) >= 6 and set(codes) == {grpc.StatusCode.INVALID_ARGUMENT}, set(codes)
    assert max(latencies) < 1.0, sorted(latencies)[-5:]
    assert good_call < 2.0


# ---- issue 63, defect 1: a slow or idle upload must not starve the others -------------------


def _idle_streams(handle: ServerHandle, count: int, msg: Any,
                  **kw: Any) -> tuple[threading.Event, list[Any]]:
    """``count`` streams that send ``msg`` and then nothing until the event is set."""
    release = threading.Event()
    calls = [handle.stub().Prefill(header_then_wait([msg], release), timeout=60, **kw)
             for _ in range(count)]
    return release, calls


@pytest.mark.parametrize("idle", [3, 10])
def test_idle_header_only_streams_do_not_starve_honest_uploads(server: ServerHandle,
                                                                idle: int) -> None:
    # Each idle stream declares 3 x 340 MiB (plus 340 MiB of output: 1.33 GiB) and sends no
    # byte. They used to reserve all of that at the header: three held the default 4 GiB.
    uploads = server.server.servicer._uploads
    release, calls = _idle_streams(server, idle, declared_prefill(85 * 1024 * 16))
    try:
        assert wait_until(lambda: uploads.used == idle * UPLOAD_STEP_BYTES)
        msgs = six_mib_prefill()
        for _ in range(3):
            t0 = time.perf_counter()
            assert list(server.stub().Prefill(iter(msgs), timeout=10))[-1].HasField("stats")
            assert time.perf_counter() - t0 < 1.0
        assert uploads.used == idle * UPLOAD_STEP_BYTES  # one step each, not 1.33 GiB
    finally:
        for c in calls:
            c.cancel()
        release.set()
    assert wait_until(lambda: uploads.used == 0 and not uploads.by_caller)


def test_a_pinned_link_charges_the_whole_upload_at_its_header(start_server: Any) -> None:
    # On cuda with one process the buffers are page-locked when allocated: counted in full.
    srv = start_server(max_request_bytes=2048, max_upload_bytes=4096)
    srv.server.servicer._link.lazy_buffers = False
    uploads = srv.server.servicer._uploads
    release, calls = _idle_streams(srv, 1, small_prefill()[0])
    try:
        assert wait_until(lambda: uploads.used == 1536)
    finally:
        release.set()
    assert _refused(calls[0]).code() == grpc.StatusCode.INVALID_ARGUMENT  # no bytes came
    assert wait_until(lambda: uploads.used == 0)


@pytest.mark.parametrize("sent, field", [("header", "chunks"), ("nothing", "header")])
def test_an_idle_upload_ends_after_the_timeout_with_its_budget_back(
    start_server: Any, sent: str, field: str,
) -> None:
    """Idle after its header, or before any message (that wait had no timeout: a silent
    stream stayed in flight, and held a graceful stop, for ever)."""
    srv = start_server(upload_idle_timeout=0.5)
    uploads = srv.server.servicer._uploads
    msgs = small_prefill()
    release = threading.Event()

    def stalled() -> Iterator[pb.PrefillRequest]:
        yield from msgs[:1] if sent == "header" else ()
        release.wait(20)

    t0 = time.perf_counter()
    try:
        err = _refused(srv.stub().Prefill(stalled(), timeout=60))
    finally:
        release.set()
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert err.details().startswith(f"{field}: no message for 0.5 s")
    assert "--upload-idle-timeout" in err.details()
    assert 0.4 < time.perf_counter() - t0 < 5.0
    assert wait_until(lambda: uploads.used == 0 and not uploads.by_caller)
    # The same server serves a complete upload at once.
    assert list(srv.stub().Prefill(iter(msgs), timeout=10))[-1].HasField("stats")


def test_an_upload_under_the_minimum_rate_ends(start_server: Any) -> None:
    # One chunk of 4 bytes every 0.1 s: never idle for 0.3 s, but far under 1 MiB/s.
    srv = start_server(upload_idle_timeout=0.3, min_upload_rate=1 << 20)
    uploads = srv.server.servicer._uploads
    header = small_prefill()[0]

    def dribble() -> Iterator[pb.PrefillRequest]:
        yield header
        for off in range(0, 512, 4):
            time.sleep(0.1)
            yield pb.PrefillRequest(chunks=[pb.TensorChunk(field=pb.Q, offset=off,
                                                           data=b"\0" * 4)])

    err = _refused(srv.stub().Prefill(dribble(), timeout=30))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details().startswith("chunks: ") and "--min-upload-rate" in err.details()
    assert wait_until(lambda: uploads.used == 0)


def test_one_caller_holds_at_most_its_share_of_the_budget(start_server: Any) -> None:
    # Two tokens, a 4096-byte budget, half each: a's second 1536-byte upload would pass its
    # 2048, b's still fits.
    srv = start_server(max_request_bytes=2048, max_upload_bytes=4096, auth_token="a,b")
    uploads = srv.server.servicer._uploads
    a = [("authorization", "Bearer a")]
    b = [("authorization", "Bearer b")]
    release, calls = _idle_streams(srv, 1, small_prefill()[0], metadata=a)
    try:
        assert wait_until(lambda: uploads.used == 1536)
        err = _refused(srv.stub().Prefill(iter(small_prefill()), timeout=10, metadata=a))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.details().startswith("header: ")
        assert "--max-upload-share 0.5" in err.details()
        assert list(srv.stub().Prefill(iter(small_prefill()), timeout=10,
                                       metadata=b))[-1].HasField("stats")
    finally:
        release.set()
    _refused(calls[0])
    assert wait_until(lambda: uploads.used == 0 and not uploads.by_caller)


@pytest.mark.parametrize("trusted", ["127.0.0.1", ""])
def test_behind_a_trusted_proxy_each_client_named_has_its_share(start_server: Any,
                                                                trusted: str) -> None:
    # Envoy forwards every client from its own address and names the client in
    # x-attention-caller. From a trusted proxy the two named clients hold a share each;
    # from any other peer the header is ignored, so both are one caller.
    srv = start_server(max_request_bytes=2048, max_upload_bytes=4096, trusted_proxies=trusted)
    uploads = srv.server.servicer._uploads
    a = [("x-attention-proxied", "1"), ("x-attention-caller", "10.1.0.1")]
    b = [("x-attention-proxied", "1"), ("x-attention-caller", "10.1.0.2")]
    release, calls = _idle_streams(srv, 1, small_prefill()[0], metadata=a)
    try:
        assert wait_until(lambda: uploads.used == 1536)
        err = _refused(srv.stub().Prefill(iter(small_prefill()), timeout=10, metadata=a))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-upload-share 0.5" in err.details()
        if trusted:
            assert set(uploads.by_caller) == {"10.1.0.1 via ipv4:127.0.0.1"}
            assert list(srv.stub().Prefill(iter(small_prefill()), timeout=10,
                                           metadata=b))[-1].HasField("stats")
        else:
            assert set(uploads.by_caller) == {"ipv4:127.0.0.1"}
            err = _refused(srv.stub().Prefill(iter(small_prefill()), timeout=10, metadata=b))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        release.set()
    _refused(calls[0])
    assert wait_until(lambda: uploads.used == 0 and not uploads.by_caller)


def test_upload_charges_grow_in_steps_and_go_back_whole() -> None:
    budget = UploadBudget(1 << 30, 0.5)
    up = Upload(budget, "x", 100 << 20)
    up.cover(1000)
    assert up.charged == budget.used == UPLOAD_STEP_BYTES
    up.cover(UPLOAD_STEP_BYTES + 1)
    assert up.charged == 2 * UPLOAD_STEP_BYTES
    up.cover(100 << 20)
    assert up.charged == 100 << 20 and budget.by_caller == {"x": 100 << 20}
    with pytest.raises(RequestError) as info:
        Upload(budget, "x", 500 << 20).cover(500 << 20, "chunks")
    assert info.value.details.startswith("chunks: ") and "--max-upload-share" in info.value.details
    up.release()
    assert budget.used == 0 and budget.by_caller == {}
    assert upload_caller("", "ipv4:10.0.0.7:51234") == "ipv4:10.0.0.7"
    assert upload_caller("", "ipv6:[::1]:51234") == "ipv6:[::1]"
    assert upload_caller("tok", "ipv4:10.0.0.7:51234") == "tok"
    # A proxy's naming counts from a trusted peer only, and never over a token.
    lan = (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("fd00::/8"))
    assert upload_caller("", "ipv4:10.0.0.7:51234", "192.0.2.9", lan) == (
        "192.0.2.9 via ipv4:10.0.0.7")
    assert upload_caller("", "ipv6:%5Bfd00::5%5D:51234", "192.0.2.9", lan) == (
        "192.0.2.9 via ipv6:%5Bfd00::5%5D")  # grpc's form of an IPv6 peer
    assert upload_caller("", "ipv4:192.0.2.1:51234", "192.0.2.9", lan) == "ipv4:192.0.2.1"
    assert upload_caller("", "ipv4:10.0.0.7:51234", "", lan) == "ipv4:10.0.0.7"
    assert upload_caller("", "unix:/tmp/s", "192.0.2.9", lan) == "unix:/tmp/s"
    assert upload_caller("tok", "ipv4:10.0.0.7:51234", "192.0.2.9", lan) == "tok"
