"""Single-message Prefill/Decode calls on kept-open PrefillSteps/DecodeSteps streams (cpu
backend): reuse, concurrency, failures, timeouts, a restarted server, the opt-out."""

from __future__ import annotations

import asyncio
import time
from concurrent import futures

import numpy as np
import pytest

from attention_client import (
    AsyncAttentionClient,
    AttentionClient,
    AttentionInputError,
    AttentionTimeoutError,
)

from ._fakes import silent_server
from ._server import start_server
from .test_client_e2e import RpcNames, check_out, f64, make

reference = pytest.importorskip("attention_kernels.reference")
pytestmark = pytest.mark.timeout(120)


def _qkv(seed: int, n: int = 9):
    q = make("numpy", "float32", n, 2, 16, seed=seed)
    k = make("numpy", "float32", n, 1, 16, seed=seed + 1)
    v = make("numpy", "float32", n, 1, 16, seed=seed + 2)
    return q, k, v


def _check(out, q, k, v, causal: bool = True) -> None:
    import torch

    cu = torch.tensor([0, len(q)], dtype=torch.int32)
    check_out(out, reference.prefill_ref(f64(q), f64(k), f64(v), cu, causal=causal),
              "float32", q)


def test_concurrent_calls_share_a_few_streams(server):
    """16 threads x 6 calls on one client: every result right, at most one stream per thread
    (an idle one is reused), and no unary call."""
    opened = RpcNames()
    with AttentionClient(server.target, interceptors=[opened], spread=False) as client:
        def work(t: int) -> None:
            for i in range(6):
                q, k, v = _qkv(100 * t + 10 * i, n=3 + (t + i) % 7)
                _check(client.attention(q, k, v, causal=True), q, k, v)

        with futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(work, range(16)))
    assert set(opened.names) == {"PrefillSteps"}
    assert 1 <= len(opened.names) <= 16


def test_a_failed_call_ends_its_stream_and_the_next_one_opens_another(server):
    opened = RpcNames()
    with AttentionClient(server.target, interceptors=[opened], spread=False) as client:
        q, k, v = _qkv(1)
        _check(client.attention(q, k, v, causal=True), q, k, v)
        # Refused by the server (the client does not check the heads' ratio):
        # INVALID_ARGUMENT naming the caller's argument, as the unary call says it.
        bad = make("numpy", "float32", 4, 3, 64, seed=3)
        with pytest.raises(AttentionInputError, match=r"\bk\b"):
            client.attention(bad, bad[:, :2], bad[:, :2])
        _check(client.attention(q, k, v, causal=True), q, k, v)
    assert opened.names == ["PrefillSteps", "PrefillSteps"]


def test_metadata_of_its_own_opens_a_stream_of_its_own(server):
    opened = RpcNames()
    with AttentionClient(server.target, interceptors=[opened], spread=False) as client:
        q, k, v = _qkv(4)
        for metadata in (None, {"x-tenant": "a"}, None, {"x-tenant": "a"}, {"x-tenant": "b"}):
            _check(client.attention(q, k, v, causal=True, metadata=metadata), q, k, v)
    assert opened.names == ["PrefillSteps"] * 3


def test_call_streams_off_sends_unary_calls(server):
    opened = RpcNames()
    with AttentionClient(server.target, interceptors=[opened], call_streams=False,
                         spread=False) as client:
        q, k, v = _qkv(5)
        for _ in range(2):
            _check(client.attention(q, k, v, causal=True), q, k, v)
        client.decode(q[:2], k, v, [0, 4, 9])
    assert opened.names == ["PrefillUnary", "PrefillUnary", "DecodeUnary"]


def test_an_idle_stream_to_a_restarted_server_is_replaced():
    """The server goes away between two calls (its drain ends the idle stream) and comes back
    on the same port: the next call opens a new stream and succeeds."""
    first = start_server()
    port = first.port
    try:
        with AttentionClient(f"127.0.0.1:{port}", wait_for_ready=True, timeout=60) as client:
            q, k, v = _qkv(6)
            _check(client.attention(q, k, v, causal=True), q, k, v)
            first.stop()
            second = start_server("--port", str(port))
            try:
                _check(client.attention(q, k, v, causal=True), q, k, v)
                out, = asyncio.run(_async_calls(f"127.0.0.1:{port}", [(q, k, v)]))
                _check(out, q, k, v)
            finally:
                second.stop()
    finally:
        first.stop()


async def _async_calls(target: str, calls):
    async with AsyncAttentionClient(target) as client:
        return await asyncio.gather(*(client.attention(q, k, v, causal=True)
                                      for q, k, v in calls))


def test_async_calls_share_streams_and_match_solo_calls(server):
    calls = [_qkv(200 + i, n=2 + i % 5) for i in range(12)]
    outs = asyncio.run(_async_calls(server.target, calls))
    for out, (q, k, v) in zip(outs, calls, strict=True):
        _check(out, q, k, v)
    with AttentionClient(server.target) as client:
        for out, (q, k, v) in zip(outs, calls, strict=True):
            np.testing.assert_array_equal(out, client.attention(q, k, v, causal=True))


def test_a_call_timeout_cancels_its_stream():
    server, port, cancelled, step_timeouts = silent_server("PrefillSteps")
    q, k, v = _qkv(7)
    try:
        with AttentionClient(f"127.0.0.1:{port}") as client:
            t0 = time.monotonic()
            with pytest.raises(AttentionTimeoutError, match="timeout ran out"):
                client.attention(q, k, v, timeout=0.5)
            assert 0.45 < time.monotonic() - t0 < 5.0
            # The call's own deadline went along (the server counts the cancel by it): what
            # was left of the 500 ms when the step went out (a loaded box has spent 119 ms of
            # it on the async client's first connection, so no tighter lower bound).
            assert len(step_timeouts) == 1 and 0 < step_timeouts[0] <= 500
            assert cancelled.wait(5.0)  # the server saw the stream go
            assert client._streams.take(
                client._streams.key(0, "Prefill", client._settings())) is None

        async def main():
            async with AsyncAttentionClient(f"127.0.0.1:{port}", timeout=0.5) as client:
                with pytest.raises(AttentionTimeoutError):
                    await client.attention(q, k, v)

        cancelled.clear()
        asyncio.run(main())
        assert cancelled.wait(5.0)
        assert len(step_timeouts) == 2 and 0 < step_timeouts[1] <= 500
    finally:
        server.stop(None)
