"""Polling before sleeping (``--spin-us``): the engine's channel readers (``Spinner``) and a
front end waiting for the engine (``RemoteLink``), without processes; the whole group with
polling on is in test_process_group.py."""

from __future__ import annotations

import array
import asyncio
import os
import socket
import threading
import time
from typing import Any

import pytest

from attention_service.config import AUTO_SPIN_US, ServerConfig, auto_spin_us, load_config
from attention_service.ipc import arena as arenas
from attention_service.ipc.channel import Channel, Done, Spinner, Submit, _Decoder, _frame
from attention_service.ipc.remote_link import RemoteLink
from attention_service.link import ExecStats
from attention_service.params import Op, make_params
from attention_wire.pb import attention_pb2 as pb


def _buf() -> list[memoryview]:
    return [memoryview(bytearray(1024))]


@pytest.fixture
def pair():  # type: ignore[no-untyped-def]
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_a_message_within_the_spin_is_taken_without_blocking(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    a.setblocking(True)  # as a Channel's: only the spin's MSG_DONTWAIT keeps it from blocking
    threading.Timer(0.05, b.send, args=(b"xyz",)).start()
    t0 = time.perf_counter()
    got = Spinner(5.0).poll(a, buf := _buf())
    assert got is not None and got[0] == 3 and bytes(buf[0][:3]) == b"xyz"
    assert 0.04 < time.perf_counter() - t0 < 2.0


def test_the_spin_ends_after_its_time(pair) -> None:  # type: ignore[no-untyped-def]
    a, _ = pair
    t0 = time.perf_counter()
    assert Spinner(0.05).poll(a, _buf()) is None
    assert 0.05 <= time.perf_counter() - t0 < 2.0


@pytest.mark.parametrize("seconds", [0.0, 5.0])
def test_no_spin_when_off_or_not_allowed(pair, seconds: float) -> None:  # type: ignore[no-untyped-def]
    a, _ = pair
    t0 = time.perf_counter()
    assert Spinner(seconds, allowed=lambda: False).poll(a, _buf()) is None
    assert time.perf_counter() - t0 < 1.0


def test_the_spin_stops_once_it_is_no_longer_allowed(pair) -> None:  # type: ignore[no-untyped-def]
    a, _ = pair
    stop_at = time.perf_counter() + 0.1
    t0 = time.perf_counter()
    assert Spinner(10.0, allowed=lambda: time.perf_counter() < stop_at).poll(a, _buf()) is None
    assert 0.1 <= time.perf_counter() - t0 < 2.0


def test_one_thread_spins_at_a_time(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    spinner = Spinner(10.0)
    first: list[Any] = []
    t = threading.Thread(target=lambda: first.append(spinner.poll(a, _buf())))
    t.start()
    time.sleep(0.1)  # the thread is spinning now
    c, d = socket.socketpair()
    try:
        t0 = time.perf_counter()
        assert spinner.poll(c, _buf()) is None  # not its turn: back to a blocking read
        assert time.perf_counter() - t0 < 1.0
    finally:
        b.send(b"!")
        t.join(10)
        c.close()
        d.close()
    assert first and first[0] is not None and first[0][0] == 1


def test_no_spin_while_another_reader_has_traffic(pair) -> None:  # type: ignore[no-untyped-def]
    # A polling thread keeps the GIL from the other readers: it polls only while they are
    # quiet (one client at a time).
    a, b = pair
    c, d = socket.socketpair()
    try:
        spinner = Spinner(5.0, quiet=0.2)
        spinner.seen(a)  # its own traffic does not count
        spinner.seen(c)
        t0 = time.perf_counter()
        assert spinner.poll(a, _buf()) is None
        assert time.perf_counter() - t0 < 0.15
        time.sleep(0.25)  # c has been quiet for longer than ``quiet``: a spins again
        threading.Timer(0.1, b.send, args=(b"!",)).start()
        t0 = time.perf_counter()
        got = spinner.poll(a, _buf())
        assert got is not None and got[0] == 1 and time.perf_counter() - t0 >= 0.09
    finally:
        c.close()
        d.close()


def test_a_closed_peer_and_descriptors_come_through_the_spin(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    r, w = os.pipe()
    try:
        rights = array.array("i", [r]).tobytes()
        b.sendmsg([b"fd"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
        got = Spinner(5.0).poll(a, _buf())
        assert got is not None and got[0] == 2
        (level, kind, data), = got[1]
        assert (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
        os.close(array.array("i", data)[0])
        b.close()
        assert Spinner(5.0).poll(a, _buf()) == (0, [])  # end of stream, as recvmsg says it
    finally:
        os.close(r)
        os.close(w)


def test_a_channel_reader_that_spins_delivers_everything_in_order() -> None:
    # Frames that arrive while the reader spins (sent at once) and after it gave up and
    # blocked (sent 50 ms apart, a 10 ms spin) all arrive, in order.
    mine, theirs = socket.socketpair()
    got: list[int] = []
    done = threading.Event()

    def on_message(msg: Any, fds: list[int]) -> None:
        got.append(msg)
        if len(got) == 40:
            done.set()

    receiver = Channel(mine, on_message, lambda: None, "receiver", spinner=Spinner(0.01))
    receiver.start()
    try:
        for i in range(20):
            theirs.sendall(_frame(i, 0))
        for i in range(20, 40):
            time.sleep(0.05 if i % 5 == 0 else 0.0)
            theirs.sendall(_frame(i, 0))
        assert done.wait(10)
        assert got == list(range(40))
    finally:
        receiver.close()
        theirs.close()


# ---- a front end polling for the engine's answer -------------------------------------------


def _stats(batch: int) -> ExecStats:
    return ExecStats(0.0, 0.0, 0.001, 0.0, batch, batch)


class _Engine:
    """The engine's end of the socket: answers each Submit with Done(batch)."""

    def __init__(self, sock: socket.socket, batches: list[int]) -> None:
        self.sock, self.batches = sock, batches
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        decoder = _Decoder()
        batches = iter(self.batches)
        while True:
            data = self.sock.recv(1 << 16)
            if not data:
                return
            decoder.buf += data
            for msg, _ in decoder.frames():
                if isinstance(msg, Submit):
                    done = Done(msg.call_id, _stats(next(batches)))
                    self.sock.sendall(_frame(done, 0))


def test_a_lone_call_polls_for_its_answer_and_stops_after_batches() -> None:
    """The channel is never started (no reader, no ``add_reader``): an answer can only come in
    through the link's polling. After an answer from a launch of 4 requests the next call
    does not poll; the test reads that answer by hand."""
    params = make_params(Op.CACHE_DECODE, pb.BFLOAT16, (1, 4, 8), (1, 2, 8), [0, 1],
                         cache_ids=["a"], store=True)
    fd = arenas.create(1 << 16)
    arena = arenas.Mapped(fd, 1 << 16)
    os.close(fd)
    mine, theirs = socket.socketpair()
    loop = asyncio.new_event_loop()
    try:
        link = RemoteLink(None, arena, None, loop, spin_s=10.0)  # type: ignore[arg-type]
        link.channel = Channel(mine, link.on_message, link.on_close, "frontend")
        _Engine(theirs, [1, 4, 1])

        async def call() -> ExecStats:
            buffers = await link.allocate({"q": 64, "out": 64})
            try:
                return await link.run(params, buffers, {}, "")
            finally:
                buffers.release()

        async def scenario() -> list[int]:
            batches = [(await asyncio.wait_for(call(), 10)).batch_requests]
            assert not link._polling
            batches.append((await asyncio.wait_for(call(), 10)).batch_requests)  # polled
            task = asyncio.ensure_future(call())  # the last answer was a batch: no polling
            for _ in range(20):
                await asyncio.sleep(0.01)
                assert not link._polling and not task.done()
            assert link.channel is not None
            link.channel.poll()  # what a started channel's add_reader would do
            batches.append((await asyncio.wait_for(task, 10)).batch_requests)
            return batches

        assert loop.run_until_complete(scenario()) == [1, 4, 1]
    finally:
        loop.close()
        mine.close()
        theirs.close()
        arena.close()


# ---- the setting --------------------------------------------------------------------------


def test_auto_polls_with_enough_cores_only() -> None:
    assert auto_spin_us(16) == auto_spin_us(8) == AUTO_SPIN_US > 0
    assert auto_spin_us(2) == auto_spin_us(4) == 0
    assert ServerConfig().spin_us == -1  # auto
    assert ServerConfig(spin_us=0).spin_seconds == 0
    assert ServerConfig(spin_us=1500).spin_seconds == pytest.approx(0.0015)
    assert ServerConfig().spin_seconds == auto_spin_us() / 1e6


@pytest.mark.parametrize("bad", [-2.0, 1e6 + 1, float("nan"), float("inf")])
def test_bad_spin_is_refused_naming_the_flag(bad: float) -> None:
    with pytest.raises(ValueError, match="spin_us"):
        ServerConfig(spin_us=bad)


def test_spin_from_flag_and_env(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    assert load_config(["--spin-us", "500"]).spin_us == 500
    monkeypatch.setenv("ATTENTION_SPIN_US", "0")
    assert load_config([]).spin_us == 0


def test_the_control_pool_says_while_a_control_call_runs() -> None:
    # Cache and region rpcs run on these threads, outside the executor: the engine's readers
    # must not poll meanwhile (a polling reader would keep the GIL from them).
    from attention_service.ipc.group import _ControlPool

    pool = _ControlPool()
    gate = threading.Event()
    try:
        assert not pool.busy
        fut = pool.submit(gate.wait, 10)
        assert pool.busy
        gate.set()
        assert fut.result(10) is True
        assert not pool.busy  # counted down before the result is set
        failing = pool.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failing.result(10)
        assert not pool.busy
    finally:
        gate.set()
        pool.shutdown(wait=True)
