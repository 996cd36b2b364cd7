"""GetServerInfo's live parts: its connection counts (``frontend/connections.py``: what /proc
says, and how the servicer rations the counts) and the NIXL transports it asks the engine for."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from types import SimpleNamespace

import pytest

from attention_service.frontend import connections
from attention_service.frontend import servicer as servicer_mod

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@linux_only
def test_a_process_holds_the_established_connections_it_accepted() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        accepted = [listener.accept()[0] for _ in clients]
        try:
            mine = connections._socket_inodes(os.getpid()) & connections._established_inodes(port)
            assert len(mine) == 3  # the accepted ends; the listener and client ends are not
            accepted.pop().close()
            clients.pop().close()
            time.sleep(0.05)
            mine = connections._socket_inodes(os.getpid()) & connections._established_inodes(port)
            assert len(mine) == 2
        finally:
            for s in clients + accepted:
                s.close()


@linux_only
def test_children_forked_by_any_thread_are_found() -> None:
    """A child forked by a thread other than the main one is, while that thread lives, in
    the thread's ``children`` file only (the kernel moves it to the main thread's when the
    thread ends): a front end forked so must still count."""
    import subprocess
    import threading

    procs: list[subprocess.Popen[bytes]] = []
    spawned, checked = threading.Event(), threading.Event()

    def spawn() -> None:
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]))
        spawned.set()
        checked.wait(30)

    thread = threading.Thread(target=spawn)
    thread.start()
    try:
        assert spawned.wait(30)
        assert procs[0].pid in set(connections._children(os.getpid()))
    finally:
        checked.set()
        thread.join()
        procs[0].kill()
        procs[0].wait()


def test_a_process_outside_a_group_gets_no_counts() -> None:
    assert connections.spread(1) is None  # this test process is no front end


def test_counts_are_rationed_and_never_older_than_the_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    starts: list[float] = []

    def spread(port: int) -> tuple[int, int]:
        starts.append(time.monotonic())
        time.sleep(0.01)
        return len(starts), 0

    monkeypatch.setattr(connections, "spread", spread)
    fake = SimpleNamespace(_counted=None, _config=SimpleNamespace(port=1))
    count = servicer_mod.AttentionServicer._connection_counts

    async def main() -> tuple[object, float, float, list[object]]:
        fake._count_lock = asyncio.Lock()
        first = await count(fake)  # type: ignore[arg-type]
        first_started = fake._counted[0]  # when the servicer started that count
        asked = time.monotonic()
        many = await asyncio.gather(*(count(fake) for _ in range(20)))  # type: ignore[arg-type]
        return first, first_started, asked, many

    first, first_started, asked, many = asyncio.run(main())
    assert first == (1, 0)
    # Twenty askers at once shared one count, which started after they asked.
    assert len(starts) == 2 and starts[1] >= asked
    assert all(m == (2, 0) for m in many)
    # Spaced: the next count starts an interval after the last one started (as the servicer
    # saw it start: this fake's own clock runs later, by the thread hand-off).
    assert starts[1] >= first_started + servicer_mod._COUNT_INTERVAL_S


def test_a_failed_count_is_an_answer_without_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(port: int) -> tuple[int, int]:
        raise RuntimeError("boom")

    monkeypatch.setattr(connections, "spread", broken)
    fake = SimpleNamespace(_counted=None, _config=SimpleNamespace(port=1))

    async def main() -> object:
        fake._count_lock = asyncio.Lock()
        return await servicer_mod.AttentionServicer._connection_counts(fake)  # type: ignore[arg-type]

    assert asyncio.run(main()) is None


def test_server_info_asks_the_engine_for_nixl_transports_and_answers_without_them() -> None:
    """On a server with NIXL, GetServerInfo adds the transports the engine reports; an engine
    that cannot answer leaves them out, and the rest is still the answer."""
    import grpc

    from attention_service.errors import RequestError
    from attention_wire.pb import attention_pb2 as pb

    choice = pb.NixlTransport(peer="intra-node", op="read", local_memory="host",
                              remote_memory="host", transport="cma")
    asked: list[str] = []

    class Link:
        def __init__(self, fails: bool) -> None:
            self.fails = fails

        async def control_call(self, method: str, request: object, owner: str) -> pb.ServerInfo:
            asked.append(method)
            if self.fails:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "the engine is gone")
            return pb.ServerInfo(nixl_transports=[choice])

    context = SimpleNamespace(invocation_metadata=lambda: (), peer=lambda: "test")

    def info(nixl: bool, fails: bool, probe: bool = False) -> pb.ServerInfo:
        fake = SimpleNamespace(_info=pb.ServerInfo(device="d", frontends=1, nixl=nixl),
                               _link=Link(fails), record_control=lambda *a: None)
        return asyncio.run(servicer_mod.AttentionServicer.GetServerInfo(
            fake, pb.GetServerInfoRequest(connections=probe), context))  # type: ignore[arg-type]

    got = info(nixl=True, fails=False)
    assert got.device == "d" and list(got.nixl_transports) == [choice]
    got = info(nixl=True, fails=True)
    assert got.device == "d" and not got.nixl_transports
    assert asked == ["GetServerInfo", "GetServerInfo"]
    assert not info(nixl=False, fails=True).nixl_transports and len(asked) == 2  # not asked
    # A connections probe (a client's spread placing itself) does not ask the engine either.
    assert not info(nixl=True, fails=False, probe=True).nixl_transports and len(asked) == 2
