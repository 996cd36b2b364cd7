"""Whole calls as single messages on streams kept open between them (``<Op>Steps`` rpcs).

A unary call sets up and tears down an HTTP/2 stream per call; on an open stream a call is one
message each way. Measured on the 2-core dev box (grpcio 1.85, 12 KB up / 8 KB down, a bare
echo server, p50): sync client 551 -> 302 us per call, server CPU 404 -> 169 us; aio client
573 -> 251 us, server CPU 399 -> 155 us. A same-host CUDA IPC prefill (8192 x 16 x 128 bf16,
``out=`` in the region) on an H100 host, paired A/B against a unary call each: 2.63 vs 2.92 ms
p50 with one server process, -0.30 to -0.32 ms with 4 and 8 (``ab_call_streams.py``,
2026-11-24).

Two users: ``decode_steps()`` (one stream per handle, ``CacheDecodeSteps``), and the clients'
pools (``CallStreams`` / ``AsyncCallStreams``) that carry every single-message ``Prefill`` and
``Decode`` call, each call taking an idle stream of its lane (or opening one) and giving it
back once answered. Streams are keyed by what is fixed when one opens (metadata,
wait_for_ready); a call's deadline is its own (sync: a watchdog thread cancels the stream when
it passes; asyncio: ``wait_for``), and an expired, failed or abandoned call's stream is
cancelled, never reused. Pooled streams are idle between calls: the server's drain ends them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import queue
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np

from attention_client._channel import STEP_METHODS, CallSettings
from attention_client._errors import from_rpc_error
from attention_wire.messages import (
    SOCKET_FRAME,
    STEP_SOCKET_HELLO,
    call_error,
    widen_step_socket,
)

# Idle streams kept per key; more are closed when given back (a burst of concurrent calls
# leaves at most this many open per lane).
MAX_IDLE = 64
EXPIRED = "the call's timeout ran out (its stream was cancelled)"
_SOCKET_CONNECT_S = 10.0  # connecting to a step socket and its hello
# Reading an answer to make room for a step (a server that reads no more), or the answers
# left at ``close``: a step socket's server answers steps in milliseconds.
_SOCKET_READ_AHEAD_S = 60.0
STATUS = {s.value[0]: s for s in grpc.StatusCode}  # a CallError's code -> its status


class StreamError(grpc.RpcError):
    """A stream's failure that gRPC did not report itself: its call's timeout ran out (the
    stream was cancelled), or it ended with OK before the call was answered."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class NotSent(StreamError):
    """The call's message never went out (the stream had already ended: a server without
    the rpc, or one that closed it): the call may go another way."""

    def __init__(self, cause: BaseException) -> None:
        code = cause.code() if isinstance(cause, grpc.RpcError) else None
        super().__init__(code if isinstance(code, grpc.StatusCode)
                         else grpc.StatusCode.UNAVAILABLE, f"the stream had ended: {cause}")


def _send_failed(err: grpc.RpcError) -> bool:
    """gRPC could not send the message: the stream had ended before it (grpc.aio reports
    that as INTERNAL, "Internal error from Core", instead of the stream's own status)."""
    debug = getattr(err, "debug_error_string", None)
    return callable(debug) and "SendMessageOperation" in str(debug())


def _ended() -> StreamError:
    return StreamError(grpc.StatusCode.UNAVAILABLE,
                       "the stream ended before the call was answered")


def unimplemented(err: grpc.RpcError) -> bool:
    """The server has no such rpc (nothing ran)."""
    code = err.code() if callable(getattr(err, "code", None)) else None
    return code is grpc.StatusCode.UNIMPLEMENTED


def not_sent(err: grpc.RpcError, stream: Any) -> bool:
    """Whether a failed stream's call never ran: its message did not go out, or the server
    has no such rpc (UNIMPLEMENTED before any answer)."""
    return isinstance(err, NotSent) or (unimplemented(err) and not stream.answered)


class Watchdog:
    """Cancels a stream whose call's deadline passed. One thread per client, for all its
    streams, started with the first deadline; it sleeps until the earliest one armed, so in a
    steady loop it wakes about once per timeout, not once per call."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, Any]] = {}  # id(stream) -> (deadline, grpc call)
        self._sleeping_until: float | None = None
        self._thread: threading.Thread | None = None
        self.closed = False

    def arm(self, key: int, due: float, call: Any) -> None:
        with self._cond:
            self._armed[key] = (due, call)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="attention-stream-watchdog")
                self._thread.start()
            elif self._sleeping_until is None or due < self._sleeping_until:
                self._cond.notify()

    def disarm(self, key: int) -> bool:
        """Forget ``key``'s deadline; False if it had passed (the stream was cancelled)."""
        with self._cond:
            return self._armed.pop(key, None) is not None

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self.closed:
                now = time.monotonic()
                for key in [k for k, (due, _) in self._armed.items() if due <= now]:
                    self._armed.pop(key)[1].cancel()
                due = min((d for d, _ in self._armed.values()), default=None)
                self._sleeping_until = due
                self._cond.wait(None if due is None else due - now)
                self._sleeping_until = None


class StreamCall:
    """One open stream of whole calls (sync client): requests go through a queue that gRPC's
    sender thread reads, answers come back in order."""

    def __init__(self, rpc: Any, settings: CallSettings) -> None:
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        requests = self._queue

        def messages() -> Iterator[bytes]:
            while (msg := requests.get()) is not None:
                yield msg

        kwargs = settings.kwargs()
        self._call = rpc(messages(), metadata=kwargs["metadata"],
                         wait_for_ready=kwargs["wait_for_ready"])
        self.answered = False  # a call on it was ever answered
        self.failure: grpc.RpcError | None = None  # how it failed (decode_steps' record)

    def alive(self) -> bool:
        return not self._call.done()

    def exchange(self, message: bytes, deadline: float | None, watchdog: Watchdog) -> bytes:
        """Send one call, return its answer; grpc.RpcError if the stream failed: StreamError
        for an expired call or a stream that ended, NotSent if the message never went out.
        Drop the stream after any error."""
        self.send(message)
        return self.receive(deadline, watchdog)

    def send(self, message: bytes) -> None:
        """Send one call (gRPC's sender thread takes it); its answer comes in order."""
        self._queue.put(message)

    def receive(self, deadline: float | None, watchdog: Watchdog) -> bytes:
        """The next call's answer (see ``exchange``); ``deadline`` is that call's."""
        if deadline is not None:
            watchdog.arm(id(self), deadline, self._call)
        try:
            raw = next(self._call)
        except StopIteration:  # ended with OK but without this call's answer
            raise _ended() from None
        except grpc.RpcError as err:
            if deadline is not None and not watchdog.disarm(id(self)):
                raise StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, EXPIRED) from err
            if _send_failed(err):
                raise NotSent(err) from err
            raise
        finally:
            if deadline is not None:
                watchdog.disarm(id(self))
        self.answered = True
        return raw

    def drop(self) -> None:
        """Cancel the stream (ended, failed or in an unknown state)."""
        self._queue.put(None)
        self._call.cancel()

    def close(self) -> None:
        """Half-close: the server ends the stream with OK."""
        self._queue.put(None)


class SocketStream:
    """``decode_steps()`` over the server's step socket (ServerInfo.step_socket): a Unix
    socket to the engine process, carrying what a ``CacheDecodeSteps`` stream with in-band
    errors carries, without gRPC or a front end (sync client; the interface of
    ``StreamCall``). Up to ``limit`` steps are sent before an answer is read; sending one
    more first reads the oldest answer into a queue (``receive`` takes from it first)."""

    def __init__(self, path: str, settings: CallSettings, limit: int, instance: str = "",
                 spin_s: float = 0.0) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        widen_step_socket(sock)
        self._sock: socket.socket | None = sock
        self._limit = max(1, limit)
        self._unread = 0
        self._early: collections.deque[bytes] = collections.deque()
        # Reads and their counts: a handle's steps are sent under one lock and read under
        # another, so a ``submit`` (which may read ahead) and a ``result()`` may overlap.
        self._reading = threading.Lock()
        self.answered = False
        self.failure: grpc.RpcError | None = None
        self._spin_s = 0.0  # ``decode_steps(spin_us=)``: each answer polled for this long
        try:
            sock.settimeout(_SOCKET_CONNECT_S)
            sock.connect(path)
            sock.sendall(_hello(settings, instance))
            answer = self._read()
            sock.settimeout(None)
        except (OSError, StreamError) as exc:
            self.drop()
            raise _unreachable(path, exc) from None
        _check_hello(path, answer, self.drop)
        if spin_s:  # from here on: the hello is read blocking
            self._spin_s, self._poller = spin_s, select.poll()
            self._poller.register(sock, select.POLLIN)

    def alive(self) -> bool:
        return self._sock is not None

    def send(self, message: bytes | tuple[Any, ...]) -> None:
        """Send one call, its message whole or in pieces (no join: ``_Compiled.parts``); its
        answer comes in order."""
        sock = self._sock
        if sock is None:
            raise NotSent(_ended())
        with self._reading:
            if self._unread - len(self._early) >= self._limit:  # the server reads no more
                self._early.append(self._read(time.monotonic() + _SOCKET_READ_AHEAD_S))
            self._unread += 1  # before the send: a concurrent read may take its answer
        frame, nbytes = _framed(message)
        try:
            sent = sock.sendmsg(frame)  # blocking: all of it, but for a signal
            if sent < nbytes:
                sock.sendall(b"".join(frame)[sent:])
        except OSError as exc:
            self.drop()
            raise StreamError(grpc.StatusCode.UNAVAILABLE,
                              f"the step socket closed while a step was sent: {exc}") from None

    def receive(self, deadline: float | None, watchdog: Watchdog) -> bytes:
        """The next call's answer; StreamError if the socket closed or ``deadline`` passed
        (the socket is then closed, and the server cancels the steps it has not answered)."""
        with self._reading:
            raw = self._early.popleft() if self._early else self._read(deadline)
            self._unread -= 1
        self.answered = True
        return raw

    def _read(self, deadline: float | None = None) -> bytes:
        """One frame's payload (a uint8 array: the answer readers take any bytes-like, and
        a compiled step's OUT is used where it lies), by ``deadline`` (``time.monotonic()``;
        StreamError DEADLINE_EXCEEDED after it, the socket dropped)."""
        sock = self._sock
        if sock is None:
            raise _ended()
        if deadline is not None:
            sock.settimeout(max(deadline - time.monotonic(), 1e-6))
        if self._spin_s:
            # The caller's CPU polls instead of sleeping: where an idle CPU halts (VMs), the
            # wake-up that ends a blocking recv cost a B=1 step 0.07-0.15 ms of its 0.39-0.44
            # (H200 host; benchmarks/results/offload, "Host settings").
            end = time.perf_counter() + self._spin_s
            while not self._poller.poll(0) and time.perf_counter() < end:
                pass
        try:
            head = self._exactly(sock, SOCKET_FRAME.size)
            (size,) = SOCKET_FRAME.unpack(head)
            return self._exactly(sock, size) if size else b""  # type: ignore[return-value]
        except TimeoutError:
            self.drop()
            raise StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, EXPIRED) from None
        finally:
            if deadline is not None and self._sock is not None:
                sock.settimeout(None)

    def _exactly(self, sock: socket.socket, n: int) -> np.ndarray:
        # Not a bytearray: it zeroes what recv_into then overwrites (a B=64 answer's 512 KiB:
        # 11.6 us against 0.7, dev box).
        buf = np.empty(n, dtype=np.uint8)
        view, got = memoryview(buf), 0
        while got < n:
            try:
                k = sock.recv_into(view[got:])
            except TimeoutError:
                raise
            except OSError as exc:  # closed under it by ``drop``, or by the server
                self.drop()
                raise StreamError(grpc.StatusCode.UNAVAILABLE,
                                  f"the step socket closed: {exc}") from None
            if not k:
                self.drop()
                raise _ended()
            got += k
        return buf

    def drop(self) -> None:
        """Close the socket: the server cancels the steps it has not answered."""
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def close(self) -> None:
        """The answers not read yet are read first (``receive`` still gives them; within
        ``_SOCKET_READ_AHEAD_S`` in all), then the socket closes."""
        deadline = time.monotonic() + _SOCKET_READ_AHEAD_S
        with self._reading:
            while self._sock is not None and self._unread > len(self._early):
                try:
                    self._early.append(self._read(deadline))
                except StreamError:
                    break
        self.drop()


def _framed(message: bytes | tuple[Any, ...]) -> tuple[list[Any], int]:
    """One step's frame in pieces (its length, then the message, whole or in its pieces)
    and its bytes in all."""
    parts = message if isinstance(message, tuple) else (message,)
    size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
    return [SOCKET_FRAME.pack(size), *parts], SOCKET_FRAME.size + size


def _hello(settings: CallSettings, instance: str) -> bytes:
    """A step socket's first frame: the hello, the server instance meant (the server refuses
    the socket if it is another one) and the call's ``authorization`` value."""
    value = next((v for k, v in settings.metadata if k == "authorization"), "")
    hello = (STEP_SOCKET_HELLO + instance.encode() + b"\n"
             + (value.encode() if isinstance(value, str) else bytes(value)))
    return SOCKET_FRAME.pack(len(hello)) + hello


def _unreachable(path: str, exc: BaseException) -> NotSent:
    return NotSent(StreamError(grpc.StatusCode.UNAVAILABLE, f"step socket {path!r}: {exc}"))


def _check_hello(path: str, answer: bytes, drop: Any) -> None:
    """The hello's answer: nothing, or the error the server refused the socket with."""
    error = call_error(answer)
    if error is not None:
        drop()
        code = STATUS.get(error.code, grpc.StatusCode.UNKNOWN)
        raise StreamError(code, f"step socket {path!r}: {error.details}")


class _Frames(asyncio.BufferedProtocol):
    """The asyncio client's step socket: each answer frame read by the transport straight
    into a uint8 array of its size (no stream buffer, no bytes object: a compiled step's
    OUT is used where it lies), and write flow control for ``AsyncSocketStream.send``."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.frames: collections.deque[Any] = collections.deque()
        self.lost: str | None = None  # why the connection ended, once it has
        self._head = bytearray(SOCKET_FRAME.size)
        self._payload: np.ndarray | None = None  # the frame being read, after its head
        self._target, self._got = memoryview(self._head), 0
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._drained: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._target[self._got :]

    def buffer_updated(self, nbytes: int) -> None:
        self._got += nbytes
        if self._got < len(self._target):
            return
        if self._payload is None:  # a head: the payload comes next (an empty one is done)
            (size,) = SOCKET_FRAME.unpack(self._head)
            if size:
                self._payload = np.empty(size, dtype=np.uint8)
                self._target, self._got = memoryview(self._payload), 0
                return
            self._deliver(b"")
        else:
            self._deliver(self._payload)
        self._payload, self._target, self._got = None, memoryview(self._head), 0

    def _deliver(self, frame: Any) -> None:
        self.frames.append(frame)
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = str(exc) if exc is not None else "it was closed"
        self._wake()
        self.resume_writing()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    async def drain(self) -> None:
        """Until the transport's buffer is under its mark (or the connection is gone)."""
        while self._paused and self.lost is None:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    async def next_frame(self) -> Any:
        while not self.frames:
            if self.lost is not None:
                raise StreamError(grpc.StatusCode.UNAVAILABLE,
                                  f"the step socket closed: {self.lost}")
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self.frames.popleft()


class AsyncSocketStream:
    """``SocketStream`` for the asyncio client (``await AsyncSocketStream.open(...)``; the
    interface of ``AsyncStreamCall``)."""

    def __init__(self, frames: _Frames, limit: int) -> None:
        self._frames = frames
        self._open = True
        self._limit = max(1, limit)
        self._unread = 0
        self._early: collections.deque[bytes] = collections.deque()
        self._reading = asyncio.Lock()  # see SocketStream
        self.answered = False
        self.failure: grpc.RpcError | None = None

    @classmethod
    async def open(cls, path: str, settings: CallSettings, limit: int, instance: str = ""
                   ) -> AsyncSocketStream:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stream = None
        try:
            async with asyncio.timeout(_SOCKET_CONNECT_S):
                sock.setblocking(False)
                widen_step_socket(sock)
                loop = asyncio.get_running_loop()
                await loop.sock_connect(sock, path)
                transport, frames = await loop.create_unix_connection(_Frames, sock=sock)
                stream = cls(frames, limit)
                transport.write(_hello(settings, instance))  # a whole frame already
                answer = await stream._read()
        except BaseException as exc:  # nothing left open: a failed hello closes its socket
            if stream is not None:
                stream.drop()
            else:
                sock.close()
            if isinstance(exc, (OSError, StreamError)):
                raise _unreachable(path, exc) from None
            raise
        _check_hello(path, answer, stream.drop)
        return stream

    def alive(self) -> bool:
        return self._open

    async def send(self, message: bytes | tuple[Any, ...]) -> None:
        """See ``SocketStream.send``."""
        if not self._open:
            raise NotSent(_ended())
        async with self._reading:
            if self._unread - len(self._early) >= self._limit:
                self._early.append(await asyncio.wait_for(self._read(), _SOCKET_READ_AHEAD_S))
            self._unread += 1
        try:
            await self._write(message)
        except OSError as exc:
            self.drop()
            raise StreamError(grpc.StatusCode.UNAVAILABLE,
                              f"the step socket closed while a step was sent: {exc}") from None

    async def _write(self, message: bytes | tuple[Any, ...]) -> None:
        """One frame: ``message`` joined once with its length in front (the caller's tensors
        may change once this returns, and asyncio's transports count a buffer's len(), not
        its bytes: Python 3.12's sendmsg path failed on numpy views)."""
        frames = self._frames
        if frames.lost is not None or frames.transport is None:
            raise ConnectionResetError(frames.lost or "not connected")
        frames.transport.write(b"".join(_framed(message)[0]))
        await frames.drain()

    async def receive(self, deadline: float | None) -> bytes:
        """See ``SocketStream.receive``."""
        async with self._reading:
            if self._early:
                raw = self._early.popleft()
            else:
                if not self._open:
                    raise _ended()
                try:
                    if deadline is None:
                        raw = await self._read()
                    else:
                        raw = await asyncio.wait_for(self._read(),
                                                     max(deadline - time.monotonic(), 0.0))
                except asyncio.TimeoutError:
                    self.drop()
                    raise StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, EXPIRED) from None
            self._unread -= 1
        self.answered = True
        return raw

    async def _read(self) -> Any:
        try:
            return await self._frames.next_frame()
        except StreamError:
            self.drop()
            raise

    def drop(self) -> None:
        self._open = False
        if self._frames.transport is not None:
            self._frames.transport.close()

    async def close(self) -> None:
        """See ``SocketStream.close``."""
        async with self._reading:
            try:
                async with asyncio.timeout(_SOCKET_READ_AHEAD_S):
                    while self._open and self._unread > len(self._early):
                        self._early.append(await self._read())
            except (StreamError, TimeoutError):
                pass
        self.drop()


class AsyncStreamCall:
    """``StreamCall`` for grpc.aio."""

    def __init__(self, rpc: Any, settings: CallSettings) -> None:
        kwargs = settings.kwargs()
        self._call = rpc(metadata=kwargs["metadata"], wait_for_ready=kwargs["wait_for_ready"])
        self.answered = False
        self.failure: grpc.RpcError | None = None

    def alive(self) -> bool:
        return not self._call.done()

    async def exchange(self, message: bytes, deadline: float | None) -> bytes:
        """See StreamCall.exchange."""
        await self.send(message)
        return await self.receive(deadline)

    async def send(self, message: bytes) -> None:
        """Send one call; NotSent if the stream had ended (one write at a time: a read may
        wait meanwhile)."""
        try:
            await self._call.write(message)
        except asyncio.InvalidStateError as err:  # it had ended before the write
            raise NotSent(err) from err
        except grpc.RpcError as err:
            if _send_failed(err):
                raise NotSent(err) from err
            raise

    async def receive(self, deadline: float | None) -> bytes:
        """The next call's answer (see StreamCall.exchange)."""
        try:
            read = self._call.read()
            if deadline is None:
                raw = await read
            else:
                raw = await asyncio.wait_for(read, max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            raise StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, EXPIRED) from None
        except grpc.RpcError as err:
            if _send_failed(err):
                raise NotSent(err) from err
            raise
        if raw is grpc.aio.EOF:
            raise _ended()
        self.answered = True
        return raw

    def drop(self) -> None:
        self._call.cancel()

    async def close(self) -> None:
        if not self._call.done():
            with contextlib.suppress(grpc.RpcError):
                await self._call.done_writing()


class _Pool:
    """Idle streams by key, and the ops whose stream rpc the server lacks."""

    def __init__(self) -> None:
        self._idle: dict[tuple[Any, ...], list[Any]] = {}
        self._lock = threading.Lock()
        self.unsupported: set[str] = set()
        self.closed = False

    @staticmethod
    def key(lane_no: int, method: str, settings: CallSettings) -> tuple[Any, ...]:
        return (lane_no, method, settings.metadata, settings.wait_for_ready)

    def take(self, key: tuple[Any, ...]) -> Any:
        with self._lock:
            idle = self._idle.get(key)
            while idle:
                stream = idle.pop()
                if stream.alive():
                    return stream
                stream.drop()  # ended while idle (a server restart, a drain): its sender too
        return None

    def give_back(self, key: tuple[Any, ...], stream: Any) -> bool:
        """Keep ``stream`` for the next call; False: close it (pool closed or full)."""
        with self._lock:
            if self.closed:
                return False
            idle = self._idle.setdefault(key, [])
            if len(idle) >= MAX_IDLE:
                return False
            idle.append(stream)
            return True

    def take_lane(self, lane_no: int) -> list[Any]:
        """Remove and return the idle streams of connection ``lane_no`` (being replaced)."""
        with self._lock:
            keys = [key for key in self._idle if key[0] == lane_no]
            return [s for key in keys for s in self._idle.pop(key)]

    def take_all(self) -> list[Any]:
        with self._lock:
            self.closed = True
            streams = [s for idle in self._idle.values() for s in idle]
            self._idle.clear()
        return streams

    def failed(self, method: str, stream: Any, err: grpc.RpcError,
               settings: CallSettings) -> None:
        """A call's stream failed: drop the stream, then return if the call may go another
        way (unary), else raise its error. It may when nothing ran (from now on if the server
        has no such rpc), and after UNAVAILABLE: the pools carry stateless calls only, so
        sending one again is safe, and the unary rpc has gRPC's retries within the call's
        deadline, which the step rpcs leave out (``_channel``)."""
        stream.drop()
        if not_sent(err, stream):
            if unimplemented(err):
                self.unsupported.add(method)
            return
        if err.code() is grpc.StatusCode.UNAVAILABLE:
            return
        raise from_rpc_error(err, method, settings.names) from err


class CallStreams(_Pool):
    """The sync client's pool (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.watchdog = Watchdog()

    def run(self, lane_no: int, lane: dict[str, Any], method: str, message: bytes,
            settings: CallSettings) -> bytes | None:
        """One call's answer; None when it did not run (the server has no stream rpc for
        it, or the stream had ended): send it unary. AttentionError if it failed."""
        key = self.key(lane_no, method, settings)
        stream = self.take(key) or StreamCall(lane[STEP_METHODS[method]], settings)
        try:
            raw = stream.exchange(message, settings.deadline, self.watchdog)
        except grpc.RpcError as err:
            self.failed(method, stream, err, settings)
            return None
        except BaseException:
            stream.drop()  # the caller went away mid-call: the stream's state is unknown
            raise
        if not self.give_back(key, stream):
            stream.close()
        return raw

    def close(self) -> None:
        for stream in self.take_all():
            stream.close()
        self.watchdog.close()


class AsyncCallStreams(_Pool):
    """The asyncio client's pool."""

    async def run(self, lane_no: int, lane: dict[str, Any], method: str, message: bytes,
                  settings: CallSettings) -> bytes | None:
        """See CallStreams.run."""
        key = self.key(lane_no, method, settings)
        stream = self.take(key) or AsyncStreamCall(lane[STEP_METHODS[method]], settings)
        try:
            raw = await stream.exchange(message, settings.deadline)
        except grpc.RpcError as err:
            self.failed(method, stream, err, settings)
            return None
        except BaseException:
            stream.drop()
            raise
        if not self.give_back(key, stream):
            await stream.close()
        return raw

    async def close(self) -> None:
        for stream in self.take_all():
            await stream.close()
