"""``spread`` (the default of both clients) against the fake server, which counts like a group
of two front ends and says "crowded" to its first ``crowded_first`` asks: crowded connections
are replaced by new ones (new client ports), the small rpcs move with the first channel, the
async client looks once before its first compute call or decode step however many start at
once, and a server that is down or not crowded costs nothing more. The real group's counting
is tested in tests/service/ipc/test_process_group.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

from attention_client import AsyncAttentionClient, AttentionClient, AttentionError
from attention_client._channel import (
    NEVER_IDLE_MS,
    SPREAD_MAX_TRIES,
    SPREAD_MIN_TRIES,
    crowded,
    spread_tries,
)
from attention_wire.pb import attention_pb2 as pb

Q = np.arange(2 * 4 * 8, dtype=np.float16).reshape(2, 4, 8)


def test_a_connection_is_crowded_past_one_more_than_the_least_loaded_front_end():
    def info(frontends: int, mine: int, fewest: int) -> pb.ServerInfo:
        return pb.ServerInfo(frontends=frontends, frontend_connections=mine,
                             fewest_frontend_connections=fewest)

    assert crowded(info(8, 2, 0))
    assert not crowded(info(8, 1, 0)) and not crowded(info(8, 3, 2))
    assert not crowded(info(1, 5, 0))  # one process: nowhere else to go
    assert not crowded(info(8, 0, 0))  # not counted (an older server, or no /proc)


def test_spread_looks_at_more_connections_on_more_front_ends():
    def tries(n: int) -> int:
        return spread_tries(pb.ServerInfo(frontends=n))

    assert tries(0) == tries(1) == SPREAD_MIN_TRIES  # not counted, or one process
    assert tries(2) == 8 and tries(8) == 32
    assert tries(1000) == SPREAD_MAX_TRIES


def test_sync_client_replaces_crowded_connections_at_construction(fake):
    servicer, target = fake
    servicer.knobs.crowded_first = 2
    with AttentionClient(target) as client:
        peers = list(servicer.knobs.counted_peers)
        assert len(peers) == 3 and len(set(peers)) == 3  # two replaced, each a new connection
        np.testing.assert_array_equal(client.attention(Q, Q, Q), Q)  # the fake echoes q
        assert client.info()["device"] == "fake"  # the small rpcs use the kept connection
    assert servicer.knobs.counted_peers == peers  # no look after construction


def test_sync_client_keeps_its_last_try(fake):
    servicer, target = fake
    servicer.knobs.crowded_first = 100
    with AttentionClient(target, channels=2) as client:
        looks = spread_tries(pb.ServerInfo(frontends=2))  # the fake counts as two front ends
        assert len(servicer.knobs.counted_peers) == 2 * looks == 16
        np.testing.assert_array_equal(client.attention(Q, Q, Q), Q)


def test_spread_off_and_a_server_that_is_not_crowded(fake):
    servicer, target = fake
    with AttentionClient(target, spread=False) as client:
        client.attention(Q, Q, Q)
    assert servicer.knobs.counted_peers == []
    with AttentionClient(target, channels=3) as client:
        client.attention(Q, Q, Q)
    assert len(servicer.knobs.counted_peers) == 3  # one look per connection


def test_async_client_looks_once_before_its_first_call(fake):
    servicer, target = fake
    servicer.knobs.crowded_first = 2

    async def run() -> None:
        client = AsyncAttentionClient(target)
        await asyncio.sleep(0.05)
        assert servicer.knobs.counted_peers == []  # nothing at construction
        assert (await client.info())["device"] == "fake"  # small rpcs do not wait for it
        assert servicer.knobs.counted_peers == []
        first = client._channels[0]
        outs = await asyncio.gather(*(client.attention(Q, Q, Q) for _ in range(4)))
        for out in outs:
            np.testing.assert_array_equal(out, Q)
        peers = list(servicer.knobs.counted_peers)
        assert len(peers) == 3 and len(set(peers)) == 3
        assert client._channels[0] is not first and client._channel is client._channels[0]
        assert (await client.info())["device"] == "fake"  # rebound to the new channel
        np.testing.assert_array_equal(await client.attention(Q, Q, Q), Q)
        assert servicer.knobs.counted_peers == peers  # once only
        await client.close()
        assert not client._retiring  # the replaced channels were closed

    asyncio.run(run())


def test_async_decode_steps_made_before_the_first_call_use_the_new_connection(fake):
    servicer, target = fake
    servicer.knobs.crowded_first = 1

    async def run() -> None:
        async with AsyncAttentionClient(target) as client:
            steps = client.decode_steps()
            old = client._lanes[steps._lane_no]
            # The fake has no step streams or caches: the step falls back to CacheDecode,
            # which it does not serve either. What matters is the look came first.
            with pytest.raises(AttentionError):
                await steps.step(Q, ["a", "b"], Q, Q)
            assert len(servicer.knobs.counted_peers) == 2
            assert steps._lane is client._lanes[steps._lane_no] is not old
            await steps.close()

    asyncio.run(run())


def test_an_async_first_call_keeps_its_deadline_and_leaves_the_looks_running(fake):
    """A first call whose deadline passes, or which is cancelled, while the client looks at
    its connections fails as such; the looks go on for the next call."""
    servicer, target = fake
    servicer.knobs.sleep = 0.5  # every answer stalls, GetServerInfo's too
    servicer.knobs.crowded_first = 1

    async def run() -> None:
        async with AsyncAttentionClient(target, timeout=30) as client:
            t0 = time.perf_counter()
            with pytest.raises(AttentionError) as exc:
                await client.attention(Q, Q, Q, timeout=0.1)
            assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.perf_counter() - t0 < 0.4  # not the look's 0.5 s
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.attention(Q, Q, Q), 0.05)  # cancelled
            await asyncio.wait([client._spread_task])  # still running: it ends by itself
            assert len(servicer.knobs.counted_peers) == 2  # crowded, replaced, looked again
            assert client._spread_pending is False
            servicer.knobs.sleep = 0
            np.testing.assert_array_equal(await client.attention(Q, Q, Q), Q)
            assert len(servicer.knobs.counted_peers) == 2

    asyncio.run(run())


def test_closing_an_async_client_while_it_looks(fake):
    servicer, target = fake
    servicer.knobs.sleep = 0.3
    servicer.knobs.crowded_first = 1

    async def run() -> None:
        client = AsyncAttentionClient(target)
        call = asyncio.ensure_future(client.attention(Q, Q, Q))
        await asyncio.sleep(0.1)  # the first look is out
        t0 = time.perf_counter()
        await client.close()
        assert time.perf_counter() - t0 < 2.5
        assert client._spread_task is not None and client._spread_task.done()
        assert len(servicer.knobs.counted_peers) == 1  # no look after close began
        assert not client._retiring
        with pytest.raises(Exception):  # noqa: B017 - the channels are closed under it
            await call

    asyncio.run(run())


def test_async_client_against_no_server_fails_as_before():
    async def run() -> None:
        async with AsyncAttentionClient("127.0.0.1:1", timeout=5) as client:
            t0 = time.perf_counter()
            with pytest.raises(AttentionError) as exc:
                await client.attention(Q, Q, Q)
            assert exc.value.code == grpc.StatusCode.UNAVAILABLE
            assert time.perf_counter() - t0 < 5  # fails fast, the look included
            assert client._spread_pending is False  # and it is not tried again

    asyncio.run(run())


@pytest.mark.parametrize("cls", [AttentionClient, AsyncAttentionClient])
def test_spread_connections_do_not_idle_out(cls) -> None:
    """A placed connection is not closed after grpc's idle timeout (to be hashed afresh at
    the next call): spread turns the timer off; the caller's options still decide."""
    def idle_ms(**kw):
        if cls is AttentionClient:
            with cls("127.0.0.1:9", **kw) as client:  # nothing listens there
                return dict(client._options).get("grpc.client_idle_timeout_ms")

        async def options() -> object:
            client = cls("127.0.0.1:9", **kw)
            await client.close()
            return dict(client._options).get("grpc.client_idle_timeout_ms")

        return asyncio.run(options())

    assert idle_ms(spread=False) is None  # grpc's default (30 minutes)
    assert idle_ms(spread=True) == NEVER_IDLE_MS == 2**31 - 1
    assert idle_ms(spread=True, options=[("grpc.client_idle_timeout_ms", 60_000)]) == 60_000


def _restart(server: grpc.Server, port: int, crowded_first: int) -> tuple[grpc.Server, Any]:
    """Stop the fake server (its connections are lost) and start another on the same port,
    whose first ``crowded_first`` looks say crowded."""
    from ._fakes import start_fake

    server.stop(None).wait()
    server, servicer, _ = start_fake(port=port)
    servicer.knobs.crowded_first = crowded_first
    return server, servicer


def _until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_sync_client_places_a_lost_connection_again() -> None:
    """A server restart loses the client's connection; gRPC reconnects on its own, hashed to
    any front end. The client sees the loss (a connectivity watch) and, before its next
    compute call, places the new connection as at construction: here crowded once, so the
    call goes on a third connection, and the small rpcs follow lane 0."""
    from ._fakes import start_fake

    server, servicer, port = start_fake()
    try:
        with AttentionClient(f"localhost:{port}") as client:
            assert len(servicer.knobs.counted_peers) == 1  # placed, not crowded
            np.testing.assert_array_equal(client.attention(Q, Q, Q), Q)
            assert not client._lost.lost(0)
            server, servicer = _restart(server, port, crowded_first=1)
            _until(lambda: client._lost.lost(0))
            np.testing.assert_array_equal(client.attention(Q, Q, Q), Q)
            looks = servicer.knobs.counted_peers
            assert len(looks) == 2 and len(set(looks)) == 2  # the crowded one was replaced
            assert servicer.knobs.call_peers == [looks[1]]
            assert client.info()["device"] == "fake"
            np.testing.assert_array_equal(client.attention(Q, Q, Q), Q)
            assert len(servicer.knobs.counted_peers) == 2  # placed: no more looks
            assert servicer.knobs.call_peers == [looks[1]] * 2
    finally:
        server.stop(None)


def test_async_client_places_a_lost_connection_again() -> None:
    """The same for the asyncio client (a watch task per lane); calls that start while the
    lane is being placed wait for it and go on the new connection."""
    from ._fakes import start_fake

    server, servicer, port = start_fake()

    async def main() -> None:
        nonlocal server, servicer
        async with AsyncAttentionClient(f"localhost:{port}") as client:
            np.testing.assert_array_equal(await client.attention(Q, Q, Q), Q)
            assert len(servicer.knobs.counted_peers) == 1
            server, servicer = _restart(server, port, crowded_first=1)
            end = time.monotonic() + 10
            while not client._lost.lost(0):
                assert time.monotonic() < end, "the loss was not seen"
                await asyncio.sleep(0.01)
            outs = await asyncio.gather(*(client.attention(Q, Q, Q) for _ in range(3)))
            for out in outs:
                np.testing.assert_array_equal(out, Q)
            looks = servicer.knobs.counted_peers
            assert len(looks) == 2 and len(set(looks)) == 2
            assert servicer.knobs.call_peers == [looks[1]] * 3
            assert (await client.info())["device"] == "fake"

    try:
        asyncio.run(main())
    finally:
        server.stop(None)


@pytest.mark.parametrize("cls", [AttentionClient, AsyncAttentionClient])
def test_a_lost_connection_is_placed_once_the_server_is_back(cls) -> None:
    """A call while the server is down fails as before (UNAVAILABLE); the lane stays to be
    placed, and the first call once the server is back places it.

    "Back" is once the lane has reconnected: the failed call left its channel in gRPC's
    reconnect backoff (1 s, then 1.6 s, each +-20%), and a call made before that runs out
    fails fast after its retries (their backoffs are random, 0-1.5 s in all). Called right
    after the restart, this failed in CI once (2026-11-27) on that race alone."""
    from ._fakes import start_fake

    server, servicer, port = start_fake()

    async def call(client: Any) -> Any:
        out = client.attention(Q, Q, Q, timeout=5)
        return await out if cls is AsyncAttentionClient else out

    async def main() -> None:
        nonlocal server, servicer
        client = cls(f"localhost:{port}")
        try:
            await call(client)
            server.stop(None).wait()
            end = time.monotonic() + 10
            while not client._lost.lost(0):
                assert time.monotonic() < end, "the loss was not seen"
                await asyncio.sleep(0.01)
            with pytest.raises(AttentionError) as err:
                await call(client)
            assert err.value.code is grpc.StatusCode.UNAVAILABLE
            assert client._lost.lost(0)  # still to be placed
            server, servicer, _ = start_fake(port=port)
            servicer.knobs.crowded_first = 1
            end = time.monotonic() + 10
            while not client._lost._ready[0]:  # the watcher saw the lane READY again
                assert time.monotonic() < end, "the lane never reconnected"
                await asyncio.sleep(0.01)
            assert client._lost.lost(0)  # reconnected, not yet placed
            np.testing.assert_array_equal(await call(client), Q)
            looks = servicer.knobs.counted_peers
            assert len(looks) == 2 and servicer.knobs.call_peers == [looks[1]]
        finally:
            closed = client.close()
            if cls is AsyncAttentionClient:
                await closed

    try:
        asyncio.run(main())
    finally:
        server.stop(None)
