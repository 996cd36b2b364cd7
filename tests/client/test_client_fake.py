"""The clients against the in-process fake server: transport, metadata, retries, errors.

The fake echoes q as OUT and sends LSE[r, c] = 1000 r + c, so these tests check the plumbing
(placement, reshapes, dtypes, types) and leave the math to the end-to-end tests.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest

from attention_client import AsyncAttentionClient, AttentionClient, AttentionError, ProtocolError

from ._fakes import start_fake

ml_dtypes = pytest.importorskip("ml_dtypes")
torch = pytest.importorskip("torch")

RNG = np.random.default_rng(0)


def _np(*shape, dtype=np.float16):
    return RNG.standard_normal(shape).astype(dtype)


def _lse_ref(rows, cols):
    return (np.arange(rows)[:, None] * 1000 + np.arange(cols)[None, :]).astype(np.float32)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, ml_dtypes.bfloat16])
def test_numpy_round_trip_3d(fake, dtype):
    servicer, target = fake
    q, k = _np(11, 4, 16, dtype=dtype), _np(13, 2, 16, dtype=dtype)
    with AttentionClient(target) as client:
        out, lse = client.attention(q, k, k * 2, return_lse=True)
        stats = client.last_stats
    assert isinstance(out, np.ndarray) and out.dtype == q.dtype and out.shape == q.shape
    assert np.array_equal(out.view(np.uint8), q.view(np.uint8))
    assert np.array_equal(lse, _lse_ref(4, 11)) and lse.dtype == np.float32
    assert np.array_equal(servicer.knobs.arrays["v"].view(np.uint8), (k * 2).view(np.uint8))
    assert stats["batch_requests"] == 1 and stats["bytes_out"] == q.nbytes


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_torch_round_trip_4d(fake, dtype):
    servicer, target = fake
    q, k = torch.randn(3, 5, 4, 16).to(dtype), torch.randn(3, 7, 2, 16).to(dtype)
    with AttentionClient(target) as client:
        out, lse = client.attention(q, k, k, causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == q.shape
    assert torch.equal(out, q)
    assert lse.dtype == torch.float32 and lse.shape == (3, 4, 5)
    ref = torch.from_numpy(_lse_ref(4, 15)).reshape(4, 3, 5).permute(1, 0, 2)
    assert torch.equal(lse, ref)
    header = servicer.knobs.headers[-1]
    assert list(header.cu_seqlens_q) == [0, 5, 10, 15] and header.causal


def test_varlen_and_decode(fake):
    servicer, target = fake
    q, k = _np(6, 2, 8), _np(9, 1, 8)
    with AttentionClient(target) as client:
        out = client.attention(q, k, k, [0, 2, 6], np.array([0, 4, 9]))
        assert np.array_equal(out, q)
        dq = torch.randn(3, 2, 8).to(torch.bfloat16)
        out, lse = client.decode(dq, torch.randn(9, 1, 8).to(torch.bfloat16),
                                 torch.randn(9, 1, 8).to(torch.bfloat16),
                                 torch.tensor([0, 2, 5, 9], dtype=torch.int32),
                                 num_splits=2, softmax_scale=0.25, return_lse=True)
    assert torch.equal(out, dq) and out.dtype == torch.bfloat16
    assert torch.equal(lse, torch.from_numpy(_lse_ref(3, 2)))
    h = servicer.knobs.headers[-1]
    assert h.num_splits == 2 and h.softmax_scale == 0.25 and list(h.cu_seqlens_k) == [0, 2, 5, 9]


def test_request_over_four_mib_with_default_limits(fake):
    servicer, target = fake
    q = _np(4096, 8, 64, dtype=np.float32)  # 8 MiB; k and v 4 MiB each
    k = _np(2048, 8, 64, dtype=np.float32)
    with AttentionClient(target) as client:
        out = client.attention(q, k, k)
    assert np.array_equal(out, q)
    assert max(servicer.knobs.message_sizes) < 1024 * 1024 + 1024
    assert len(servicer.knobs.message_sizes) >= 16


def test_small_chunks_many_messages(fake):
    servicer, target = fake
    q = _np(100, 4, 32)
    with AttentionClient(target, max_chunk_bytes=4096) as client:
        out = client.attention(q, q, q)
    assert np.array_equal(out, q)
    assert max(servicer.knobs.message_sizes) <= 4096 + 200
    assert len(servicer.knobs.message_sizes) >= 3 * q.nbytes // 4096


def test_token_metadata_and_interceptor(fake):
    servicer, target = fake
    seen = []

    class Tag(grpc.StreamStreamClientInterceptor):
        def intercept_stream_stream(self, continuation, details, request_iterator):
            seen.append(details.method)
            return continuation(details, request_iterator)

    q = _np(2, 1, 8)
    with AttentionClient(target, token="s3cret", interceptors=[Tag()]) as client:
        client.attention(q, q, q)
    assert servicer.knobs.metadata[-1]["authorization"] == "Bearer s3cret"
    # The fake has neither PrefillSteps nor PrefillUnary (unary: not this interceptor's).
    assert seen == ["/attention.v1.AttentionService/PrefillSteps",
                    "/attention.v1.AttentionService/Prefill"]


def test_info_and_health(fake):
    _, target = fake
    with AttentionClient(target) as client:
        info = client.info()
        assert client.health() == "SERVING"
        with pytest.raises(AttentionError) as exc:
            client.health("no.such.Service")
    assert info["device"] == "fake" and info["dtypes"] == ["FLOAT16", "BFLOAT16"]
    assert exc.value.code == grpc.StatusCode.NOT_FOUND


def test_unavailable_is_retried(fake):
    """gRPC retries UNAVAILABLE on the unary rpcs (the compute calls' unary twins included)."""
    servicer, target = fake
    servicer.knobs.fail_info_first = 2
    with AttentionClient(target, spread=False) as client:  # no look at construction
        assert client.info()["device"] == "fake"
    assert servicer.knobs.info_attempts == 3


def test_retries_give_up_after_five_attempts(fake):
    servicer, target = fake
    servicer.knobs.fail_info_first = 10
    with AttentionClient(target, spread=False) as client, pytest.raises(AttentionError) as exc:
        client.info()
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE and exc.value.details == "warming up"
    assert servicer.knobs.info_attempts == 5


@pytest.mark.parametrize("rows", [4, 4096], ids=["small", "past_the_retry_buffer"])
def test_streamed_requests_are_not_replayed(fake, rows):
    """A chunked upload the server refuses with UNAVAILABLE fails at once (grpcio hung past
    the deadline replaying one when the server then went away: the next test)."""
    servicer, target = fake
    servicer.knobs.fail_first = 1
    q = _np(rows, 8, 64, dtype=np.float32)
    with AttentionClient(target) as client, pytest.raises(AttentionError) as exc:
        client.attention(q, q, q)
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE and servicer.knobs.attempts == 1


@pytest.mark.timeout(60)
def test_a_stream_cut_off_by_a_server_that_goes_away_fails_in_time():
    """A draining or crashed server answers a chunked upload UNAVAILABLE and then its port
    closes. With gRPC's retry policy on the upload rpcs (a 2 MiB request fits its replay
    buffer) grpcio 1.85 hung in the replay past the call's 5 s deadline, for good."""
    from concurrent import futures

    def refuse(requests, context):  # reads the request, then the engine is "gone"
        for _ in requests:
            pass
        time.sleep(0.3)
        context.abort(grpc.StatusCode.UNAVAILABLE, "the engine process is gone")

    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "attention.v1.AttentionService",
        {"Prefill": grpc.stream_stream_rpc_method_handler(refuse)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    threading.Timer(0.5, server.stop, args=(0,)).start()
    q = _np(2048, 8, 32, dtype=np.float32)  # 2 MiB a tensor: chunked
    t0 = time.monotonic()
    client = AttentionClient(f"127.0.0.1:{port}", timeout=5, unary=False, call_streams=False)
    with client, pytest.raises(AttentionError) as exc:
        client.attention(q, q, q)
    assert time.monotonic() - t0 < 4.0
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rows", [4, 64], ids=["one_row", "a_few_rows"])
def test_a_call_stream_refused_by_a_server_that_goes_away_fails_in_time(rows):
    """A server shutting down refuses a call on a kept-open step stream (UNAVAILABLE) and
    exits a moment later. With gRPC's retry policy on the step rpcs, grpcio 1.85 replayed the
    stream into the closing server and hung past the call's deadline (6 of 7 tries, once over
    10 minutes; the operator's review of 2026-11-25)."""
    from concurrent import futures

    calls = []

    def refuse(request, context):
        calls.append(request)
        time.sleep(0.3)
        context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")

    def refuse_step(requests, context):
        refuse(next(requests), context)

    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "attention.v1.AttentionService",
        {"PrefillSteps": grpc.stream_stream_rpc_method_handler(refuse_step),
         "PrefillUnary": grpc.unary_unary_rpc_method_handler(refuse)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    threading.Timer(0.5, server.stop, args=(0,)).start()
    q = _np(rows, 8, 64, dtype=np.float16)
    t0 = time.monotonic()
    with (AttentionClient(f"127.0.0.1:{port}", timeout=5) as client,
          pytest.raises(AttentionError) as exc):
        client.attention(q, q[:, :2], q[:, :2])
    assert time.monotonic() - t0 < 5.5
    assert exc.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert 1 <= len(calls) <= 6  # the stream's, then the unary call's attempts (5 at most)


def test_server_error_carries_status(fake):
    servicer, target = fake
    servicer.knobs.abort = (grpc.StatusCode.INVALID_ARGUMENT, "q: head_dim 12 unsupported")
    q = _np(4, 2, 8)
    with AttentionClient(target) as client, pytest.raises(AttentionError) as exc:
        client.attention(q, q, q)
    err = exc.value
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details == "q: head_dim 12 unsupported"
    assert str(err) == "Prefill failed: INVALID_ARGUMENT: q: head_dim 12 unsupported"


def test_deadline(fake):
    servicer, target = fake
    servicer.knobs.sleep = 2.0
    q = _np(4, 2, 8)
    with AttentionClient(target, timeout=0.3) as client, pytest.raises(AttentionError) as exc:
        client.attention(q, q, q)
    assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize(
    ("knob", "match"),
    [("drop_slice", "missing 3 of 10 rows"), ("repeat_slice", "more than once"),
     ("skip_stats", "without RequestStats")],
)
def test_broken_streams_raise(fake, knob, match):
    servicer, target = fake
    setattr(servicer.knobs, knob, True if knob == "skip_stats" else 1)
    q = _np(10, 2, 8)
    with AttentionClient(target) as client, pytest.raises(ProtocolError, match=match):
        client.attention(q, q, q)
    assert client.last_stats is None


def test_reversed_slices_are_fine(fake):
    servicer, target = fake
    servicer.knobs.reverse = True
    q = _np(10, 2, 8)
    with AttentionClient(target) as client:
        assert np.array_equal(client.attention(q, q, q), q)


def test_connection_refused_is_unavailable():
    q = _np(2, 1, 8)
    start = time.monotonic()
    with AttentionClient("localhost:1", timeout=10) as client, pytest.raises(AttentionError) as e:
        client.attention(q, q, q)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - start > 0.1  # at least one backoff happened


def test_bad_arguments():
    with pytest.raises(ValueError, match="timeout"):
        AttentionClient("localhost:1", timeout=0)
    with pytest.raises(ValueError, match="tls"):
        AttentionClient("localhost:1", tls=3.5)
    with pytest.raises(ValueError, match="max_chunk_bytes"):
        AttentionClient("localhost:1", max_chunk_bytes=10)


def test_async_client(fake):
    servicer, target = fake

    seen = []

    class Tag(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation, details, request_iterator):
            method = details.method
            seen.append(method.decode() if isinstance(method, bytes) else method)
            return await continuation(details, request_iterator)

    async def main():
        async with AsyncAttentionClient(target, token="t", interceptors=[Tag()]) as client:
            q = torch.randn(2, 6, 4, 16).to(torch.bfloat16)
            outs = await asyncio.gather(*[client.attention(q, q, q) for _ in range(4)])
            out, lse = await client.decode(_np(3, 4, 16), _np(5, 2, 16), _np(5, 2, 16),
                                           [0, 1, 3, 5], return_lse=True)
            info, status = await client.info(), await client.health()
            servicer.knobs.abort = (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
            with pytest.raises(AttentionError) as exc:
                await client.attention(q, q, q)
            return q, outs, lse, info, status, exc.value, client.last_stats

    q, outs, lse, info, status, err, stats = asyncio.run(main())
    assert all(torch.equal(o, q) for o in outs)
    assert np.array_equal(lse, _lse_ref(3, 4))
    assert info["server_version"] == "0.0-fake" and status == "SERVING"
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in str(err)
    assert servicer.knobs.metadata[0]["authorization"] == "Bearer t"
    assert stats["batch_requests"] == 1
    assert seen.count("/attention.v1.AttentionService/Prefill") == 5
    assert seen.count("/attention.v1.AttentionService/Decode") == 1


def test_async_errors(fake):
    servicer, target = fake

    async def main():
        q = _np(10, 2, 8)
        async with AsyncAttentionClient(target, timeout=0.3) as client:
            servicer.knobs.drop_slice = 0
            with pytest.raises(ProtocolError):
                await client.attention(q, q, q)
            servicer.knobs.drop_slice = None
            servicer.knobs.sleep = 2.0
            with pytest.raises(AttentionError) as exc:
                await client.attention(q, q, q)
            return exc.value

    assert asyncio.run(main()).code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_tls_with_custom_root(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost"],
        check=True, capture_output=True,
    )
    creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    server, _, port = start_fake(creds)
    try:
        q = _np(3, 1, 8)
        for tls in (str(cert), cert.read_bytes()):
            with AttentionClient(f"localhost:{port}", tls=tls) as client:
                assert np.array_equal(client.attention(q, q, q), q)
        with AttentionClient(f"localhost:{port}", timeout=3) as plain, pytest.raises(
            AttentionError
        ) as exc:
            plain.attention(q, q, q)
        assert exc.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)


class _AbandonedCall:
    """A call whose caller goes away while it streams (a killed greenlet, Ctrl-C)."""

    def __init__(self) -> None:
        self.cancelled = False

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    def __aiter__(self):  # type: ignore[no-untyped-def]
        return self

    async def __anext__(self):  # type: ignore[no-untyped-def]
        raise asyncio.CancelledError

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def test_abandoned_call_is_cancelled_not_half_closed():
    """Before the fix a killed caller left gRPC uploading the rest of the request (204 MB
    in 1 s in a gevent test) and the server could see a truncated, half-closed stream.
    (Streams only: a unary call's one message is sent whole.)"""
    q = np.zeros((2, 4, 8), np.float16)
    calls: list[_AbandonedCall] = []

    def stream(*_args, **_kwargs):  # type: ignore[no-untyped-def]
        calls.append(_AbandonedCall())
        return calls[-1]

    client = AttentionClient("127.0.0.1:1", unary=False, spread=False)
    client._lanes = [{m: stream for m in lane} for lane in client._lanes]
    with pytest.raises(KeyboardInterrupt):
        client.attention(q, q, q)
    assert calls and calls[-1].cancelled
    client.close()

    async def run() -> None:
        aclient = AsyncAttentionClient("127.0.0.1:1", unary=False, spread=False)
        aclient._lanes = [{m: stream for m in lane} for lane in aclient._lanes]
        with pytest.raises(asyncio.CancelledError):
            await aclient.decode(q, q, q, [0, 1, 2])
        assert calls[-1].cancelled
        await aclient.close()

    asyncio.run(run())
