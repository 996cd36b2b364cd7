"""Messages between a front-end process and the engine process: pickled objects over a
connected AF_UNIX stream socket, in both directions, with file descriptors riding along.

A frame is an 8-byte header (payload length, descriptor count) and the payload; descriptors
travel as SCM_RIGHTS with the frame's first bytes. The kernel hands a frame's descriptors to
the read that takes its first byte and ends that read there, so a reader may take many frames
at once and give the descriptors out in frame order.

Sending never blocks the caller (the engine's completer thread sends here): a frame goes out
at once with MSG_DONTWAIT, and only what the socket cannot take right now waits for a writer
thread (which then also takes every later frame, to keep the order). Receiving happens on a
reader thread, or, given an event loop, on that loop (``loop.add_reader``): a front end's
replies then cost no thread hand-off.

A thread may cork its sends (``corked()``): the engine's completer answers a whole batch of
calls inside one, so each front end gets one frame write per launch instead of one per call
(64 decode steps a launch were 64 ``sendmsg`` calls on the engine's GIL).

Both ends are our own processes (same code, same user), so pickle is safe here.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import pickle
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from attention_service.config import ServerConfig
from attention_service.link import EngineInfo, ExecStats
from attention_service.params import Op, Params, RegionSpan
from attention_wire.messages import SOCKET_FRAME
from attention_wire.pb import attention_pb2 as pb

log = logging.getLogger("attention_service")

_HEADER = struct.Struct("<II")
MAX_FDS = 16  # per read; a request carries at most one overflow segment
_READ = 256 * 1024
_ANC = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)


class ChannelClosed(Exception):
    pass


class Spinner:
    """Reader threads poll their socket for up to ``seconds`` after each message before they
    block in ``recvmsg``, while ``allowed()`` holds: a thread blocked for a millisecond took
    ~25 us to wake on the hosts measured (git history:
    ``benchmarks/probe_wakeup.py``: 37 us a round trip after 1 ms asleep, 12 us with the reader
    polling), and it wakes on a cold core.

    A polling thread holds its process's GIL but for each ``recvmsg``, and takes it back
    before a woken thread can (CPython hands the GIL over only after a 5 ms switch interval),
    so it would delay every other thread of the process by up to the poll. Hence one thread
    polls at a time, and only while the other readers' sockets have been quiet for
    ``quiet`` seconds: one client at a time, the case polling is for. With clients on several
    front ends, polling engines ran 4-18% fewer steps/s at 8 clients on an H100 host."""

    def __init__(self, seconds: float, allowed: Callable[[], bool] = lambda: True,
                 quiet: float = 0.01) -> None:
        self.seconds = seconds
        self.allowed = allowed
        self.quiet = quiet
        self._turn = threading.Lock()
        self._last: dict[int, float] = {}  # reader (socket fd) -> its last message's time

    def seen(self, sock: socket.socket) -> None:
        """A message came in on ``sock`` (its reader calls this after each read)."""
        if self.seconds > 0:
            self._last[sock.fileno()] = time.perf_counter()

    def _others_quiet(self, key: int) -> bool:
        since = time.perf_counter() - self.quiet
        return all(t < since for k, t in list(self._last.items()) if k != key)

    def poll(self, sock: socket.socket, buf: list[memoryview]
             ) -> tuple[int, list[tuple[int, int, bytes]]] | None:
        """What ``sock`` brings within the spin (``recvmsg_into``'s n and ancdata), or None
        (nothing came, another thread spins, other readers are busy, or spinning is not
        allowed now)."""
        if self.seconds <= 0 or not self._others_quiet(sock.fileno()):
            return None
        if not self._turn.acquire(blocking=False):
            return None
        try:
            end = time.perf_counter() + self.seconds
            recv, flags = sock.recvmsg_into, socket.MSG_CMSG_CLOEXEC | socket.MSG_DONTWAIT
            while True:
                try:
                    n, anc, _, _ = recv(buf, _ANC, flags)
                    return n, anc
                except BlockingIOError:
                    pass
                if time.perf_counter() > end or not self.allowed():
                    return None
        finally:
            self._turn.release()


_corks = threading.local()  # .pending: {channel: [frames]} while this thread is corked


@contextlib.contextmanager
def corked() -> Iterator[None]:
    """Inside this block, this thread's sends without descriptors wait, and go out at its
    end in one write per channel, in order. Nested blocks join the outer one."""
    if getattr(_corks, "pending", None) is not None:
        yield
        return
    pending: dict[Channel, list[bytes]] = {}
    _corks.pending = pending
    try:
        yield
    finally:
        _corks.pending = None
        for channel, frames in pending.items():
            channel._send_data(b"".join(frames), ())


def _fds_of(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(payload[: len(payload) - len(payload) % a.itemsize])
            fds.extend(a)
    return fds


# Compact message types (``compact``): type -> (code, to plain tuple); code -> from plain.
_COMPACT: dict[type, tuple[int, Callable[[Any], tuple]]] = {}
_EXPAND: dict[int, Callable[[tuple], Any]] = {}
_KIND_SHIFT = 16  # a frame's compact code rides above its descriptor count in the header


def compact(cls: type, code: int, to_plain: Callable[[Any], tuple],
            from_plain: Callable[[tuple], Any]) -> None:
    """Send messages of type ``cls`` as the plain tuple ``to_plain(msg)`` and rebuild them
    with ``from_plain`` on arrival. For the per-call messages: pickle saves a class by
    reference and checks that reference on every ``dumps``, ~2.3 us a class (a decode
    step's answer, a NamedTuple inside a NamedTuple, was framed in 5.2 us and unframed in 3.7;
    as a plain tuple 1.3 and 1.3, rebuilding included). Both ends register the same codes
    (>= 1) at import."""
    if not 1 <= code < 1 << 15 or _EXPAND.get(code, from_plain) is not from_plain:
        raise ValueError(f"compact code {code} taken or out of range")
    _COMPACT[cls] = (code, to_plain)
    _EXPAND[code] = from_plain


def _frame(msg: Any, nfds: int) -> bytes:
    plain = _COMPACT.get(type(msg))
    if plain is not None:
        code, to_plain = plain
        payload = pickle.dumps(to_plain(msg), protocol=pickle.HIGHEST_PROTOCOL)
        return _HEADER.pack(len(payload), nfds | code << _KIND_SHIFT) + payload
    payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload), nfds) + payload


def _unframe(payload: bytes | bytearray, kind: int) -> Any:
    msg = pickle.loads(payload)
    if not kind:
        return msg
    expand = _EXPAND.get(kind)
    if expand is None:  # the peer runs other code: a broken channel, not a crashed reader
        raise pickle.UnpicklingError(f"unknown compact message code {kind}")
    return expand(msg)


def _unsent(parts: Sequence[bytes | memoryview], sent: int) -> list[bytes | memoryview]:
    """``parts`` past their first ``sent`` bytes: only those are copied for the writer thread
    (a B=64 answer, 512 KiB, over a send buffer of 416 KiB joined whole took ~50 us of the
    completer's GIL time a step, py-spy, H200 host)."""
    rest: list[bytes | memoryview] = []
    for part in parts:
        n = part.nbytes if isinstance(part, memoryview) else len(part)
        if sent >= n:
            sent -= n
            continue
        rest.append(memoryview(part).cast("B")[sent:] if sent else part)
        sent = 0
    return rest


def _anc(fds: Sequence[int]) -> list[tuple[int, int, bytes]]:
    if not fds:
        return []
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]


def recv_message(sock: socket.socket) -> tuple[Any, list[int]]:
    """One message (blocking), for the handshake: reads exactly one frame."""
    fds: list[int] = []
    buf = b""
    need = _HEADER.size
    while True:
        while len(buf) < need:
            data, anc, _, _ = sock.recvmsg(need - len(buf), _ANC, socket.MSG_CMSG_CLOEXEC)
            fds += _fds_of(anc)
            if not data:
                raise ChannelClosed("peer closed the connection")
            buf += data
        if need == _HEADER.size:
            size, _ = _HEADER.unpack(buf)
            need += size
            if size:
                continue
        return _unframe(buf[_HEADER.size:], _HEADER.unpack_from(buf)[1] >> _KIND_SHIFT), fds


class _Decoder:
    """Frames out of a byte stream; descriptors handed to frames in order."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.fds: collections.deque[int] = collections.deque()

    def frames(self) -> list[tuple[Any, list[int]]]:
        out = []
        buf = self.buf
        at = 0
        while len(buf) - at >= _HEADER.size:
            size, nfds = _HEADER.unpack_from(buf, at)
            end = at + _HEADER.size + size
            if end > len(buf):
                break
            msg = _unframe(buf[at + _HEADER.size : end], nfds >> _KIND_SHIFT)
            nfds &= (1 << _KIND_SHIFT) - 1
            fds = [self.fds.popleft() for _ in range(min(nfds, len(self.fds)))]
            out.append((msg, fds))
            at = end
        if at:
            del buf[:at]
        return out

    def close(self) -> None:
        while self.fds:
            with contextlib.suppress(OSError):
                os.close(self.fds.popleft())


class Channel:
    def __init__(
        self, sock: socket.socket, on_message: Callable[[Any, list[int]], None],
        on_close: Callable[[], None], name: str,
        batch_scope: Callable[[], contextlib.AbstractContextManager[object]] = (
            contextlib.nullcontext),
        spinner: Spinner | None = None,
    ) -> None:
        """``batch_scope``: entered around the messages of each read (the engine's readers
        finish their decode steps' launches at its end: ``Executor.deferring``).
        ``spinner``: the reader thread polls before it blocks (see ``Spinner``)."""
        sock.setblocking(True)
        self.sock = sock
        self.name = name
        self._on_message = on_message
        self._batch_scope = batch_scope
        self._on_close = on_close
        self._decoder = _Decoder()
        self._spinner = spinner
        # Received into one buffer: ``recvmsg(_READ)`` allocates _READ bytes per call and
        # shrinks them, 19-37 us for a 600-byte message against 3-5 us here (dev box).
        self._rbuf = memoryview(bytearray(_READ))
        self._send_lock = threading.Lock()
        self._backlog = False  # frames wait in the writer's queue: later ones must too
        self._queued = 0  # their bytes
        self._outbox: queue.SimpleQueue[tuple[bytes, Sequence[int]] | None] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._closed_reported = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writer = threading.Thread(target=self._write_loop, name=f"{name}-writer",
                                        daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name=f"{name}-reader",
                                        daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop | None = None, reader: bool = True) -> None:
        """Start receiving: on ``loop`` if given (called from its thread), else a thread;
        ``reader=False``: its owner reads the socket itself (sending only)."""
        self._writer.start()
        if not reader:
            return
        if loop is None:
            self._reader.start()
        else:
            self._loop = loop
            loop.add_reader(self.sock.fileno(), self._on_readable)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def queued_bytes(self) -> int:
        """Bytes waiting for the writer thread (the peer reads slower than this side sends)."""
        return self._queued

    # ---- sending ------------------------------------------------------------------------

    def send(self, msg: Any, fds: Sequence[int] = ()) -> None:
        """Send ``msg`` (pickled here, so a message that cannot travel fails its sender);
        the channel owns ``fds`` from here (closed once sent or dropped). Never blocks."""
        try:
            data = _frame(msg, len(fds))
        except BaseException:
            self._close_fds(fds)
            raise
        pending = getattr(_corks, "pending", None)
        if pending is not None and not fds:
            pending.setdefault(self, []).append(data)
            return
        self._send_data(data, fds)

    def send_raw(self, parts: Sequence[bytes | memoryview]) -> None:
        """Send ``parts`` joined as one raw frame (``SOCKET_FRAME``: the step socket's), not
        corked: from the parts themselves when the socket takes them all at once (else what
        is left is copied for the writer thread). Never blocks; the parts may change once
        this returns."""
        self._send_parts([SOCKET_FRAME.pack(sum(len(p) for p in parts)), *parts], ())

    def _send_data(self, data: bytes, fds: Sequence[int]) -> None:
        self._send_parts([data], fds)

    def _send_parts(self, parts: Sequence[bytes | memoryview], fds: Sequence[int]) -> None:
        """At once what the socket takes (``fds`` ride with the first bytes); the rest, and
        everything while earlier frames wait, to the writer thread, in order."""
        with self._send_lock:
            if self._closed.is_set():
                self._close_fds(fds)
                return
            sent = 0
            if not self._backlog:
                try:
                    sent = self.sock.sendmsg(parts, _anc(fds), socket.MSG_DONTWAIT)
                except BlockingIOError:
                    pass
                except OSError as exc:
                    log.debug("%s: send failed (%s)", self.name, exc)
                    self._close_fds(fds)
                    self._shutdown()
                    return
                if sent == sum(len(p) for p in parts):
                    self._close_fds(fds)
                    return
                if sent:  # the descriptors went with the first bytes
                    self._close_fds(fds)
                    fds = ()
                self._backlog = True
            data = parts[0] if len(parts) == 1 and not sent else b"".join(_unsent(parts, sent))
            self._queued += len(data)
            self._outbox.put((data, fds))

    def _write_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                break
            data, fds = item
            try:
                sent = self.sock.sendmsg([data], _anc(fds)) if fds else 0
                if sent < len(data):
                    self.sock.sendall(data[sent:])
            except OSError as exc:
                log.debug("%s: send failed (%s)", self.name, exc)
                self._shutdown()
            finally:
                self._close_fds(fds)
            with self._send_lock:
                self._queued -= len(data)
                if self._outbox.empty():
                    self._backlog = False
        while True:  # drop what is left (descriptors included)
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._close_fds(item[1])

    @staticmethod
    def _close_fds(fds: Sequence[int]) -> None:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    # ---- receiving ----------------------------------------------------------------------

    def _deliver(self, data: bytes | memoryview, anc: list[tuple[int, int, bytes]]) -> None:
        self._decoder.fds.extend(_fds_of(anc))
        self._decoder.buf += data
        with self._batch_scope():
            for msg, fds in self._decoder.frames():
                try:
                    self._on_message(msg, fds)
                except Exception:  # a handler bug must not end the connection silently
                    log.exception("%s: message handler failed", self.name)
                    self._close_fds(fds)

    def _read_loop(self) -> None:
        buf = [self._rbuf]
        try:
            while True:
                spinner = self._spinner
                got = spinner.poll(self.sock, buf) if spinner else None
                if got is None:
                    n, anc, _, _ = self.sock.recvmsg_into(buf, _ANC, socket.MSG_CMSG_CLOEXEC)
                else:
                    n, anc = got
                if not n:
                    break
                if spinner:
                    spinner.seen(self.sock)
                self._deliver(self._rbuf[:n], anc)
        except (OSError, EOFError, pickle.UnpicklingError) as exc:
            if not self._closed.is_set():
                log.debug("%s: closed (%s)", self.name, exc)
        finally:
            self._finish()

    def poll(self) -> None:
        """Deliver what has arrived, without waiting (a reader on an event loop)."""
        if not self._closed.is_set():
            self._on_readable()

    def _on_readable(self) -> None:
        try:
            while True:
                n, anc, _, _ = self.sock.recvmsg_into(
                    [self._rbuf], _ANC, socket.MSG_CMSG_CLOEXEC | socket.MSG_DONTWAIT
                )
                if not n:
                    break
                self._deliver(self._rbuf[:n], anc)
                if n < _READ:
                    return
        except BlockingIOError:
            return
        except (OSError, EOFError, pickle.UnpicklingError) as exc:
            if not self._closed.is_set():
                log.debug("%s: closed (%s)", self.name, exc)
        self._finish()

    def _finish(self) -> None:
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self.sock.fileno())
        self.close()
        self._decoder.close()
        if not self._closed_reported:
            self._closed_reported = True
            self._on_close()

    # ---- lifecycle ----------------------------------------------------------------------

    def _shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._outbox.put(None)
        self._shutdown()


# What front-end processes and the engine process say to each other (``channel.Channel``).
#
# Small on purpose: tensor bytes never travel here, only where they are. A tensor lives in the
# sender's arena (``ArenaSpan``), in a one-off segment whose descriptor rides with the message
# (``SegmentSpan``, for a request that does not fit the arena), or in a registered region
# (``params.RegionSpan``).
# A tensor in the sender's arena: (byte offset, byte count). A plain tuple, not a NamedTuple,
# because a call carries four or five of them: with interned params (ids; ``Submit.params`` once) a
# decode step's Submit unpickles in 1.8 us instead of 7.7 (NamedTuples unpickle through a
# class lookup and a Python-level ``__getnewargs__`` each).
ArenaSpan = tuple[int, int]


class SegmentSpan(NamedTuple):
    fd_index: int  # index into the descriptors sent with the message
    offset: int
    nbytes: int


Span = ArenaSpan | SegmentSpan | RegionSpan


# ---- engine -> front end ----------------------------------------------------------------

class Hello(NamedTuple):
    """First message to a new front end: what to serve and with what."""

    config: ServerConfig  # its port is the reserved one
    info: EngineInfo
    slot: int
    arena_bytes: int
    cpus: frozenset[int] | None = None  # where it runs (cpus.py); None: where it started


class Serving(NamedTuple):
    """The engine is warm: accept compute calls, answer health SERVING."""


class Done(NamedTuple):
    call_id: int
    stats: ExecStats


compact(Done, 1, lambda m: (m.call_id, tuple(m.stats)),
        lambda t: Done(t[0], ExecStats._make(t[1])))


class Failed(NamedTuple):
    call_id: int
    error: BaseException  # RequestError or Cancelled


class Reply(NamedTuple):
    call_id: int
    value: bytes  # a control rpc's serialized pb reply


# ---- front end -> engine ----------------------------------------------------------------

class Bound(NamedTuple):
    """The front end listens (its port), pid for the record."""

    slot: int
    port: int
    pid: int


class Submit(NamedTuple):
    """A call for the engine. Its ``params`` cross once per channel: a front end's calls
    repeat a few (a decode session's every step has the same), so a Submit names them by
    ``params_id`` and carries them only the first time (later ones: None)."""

    call_id: int
    params_id: int
    spans: dict[str, Span]  # q, k, v, out (and lse when asked for)
    owner: str
    params: Params | None = None


# Submit as a plain tuple (``compact``), new params as their field values: a stateless call of
# new lengths brings new Params, so the engine's reader unpickles one per request. Pickled as a
# frozen dataclass (its class, a state dict, an Op by value) they took ~15 us to unframe and ~14
# to frame; as field values, with the object made without the dataclass ``__init__``
# (``object.__setattr__`` per field, 7.5 us of it), ~4 and ~4 (dev box, 2026-11-28): GIL time
# every other engine thread waits behind. A NamedTuple pickled by class cost ~2.3 us more.
_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(Params))
assert _PARAM_FIELDS[0] == "op"
_OPS = {op.value: op for op in Op}


def _submit_plain(msg: Submit) -> tuple:
    p = msg.params
    if p is None:
        return msg[:4]
    return (*msg[:4], p.op.value, *[getattr(p, n) for n in _PARAM_FIELDS[1:]])


def _submit_from_plain(t: tuple) -> Submit:
    if len(t) == 4:
        return tuple.__new__(Submit, (*t, None))
    params = object.__new__(Params)
    state = dict(zip(_PARAM_FIELDS[1:], t[5:], strict=True))
    state["op"] = _OPS[t[4]]
    params.__dict__.update(state)  # the fields as __init__ leaves them (no __post_init__)
    return Submit(*t[:4], params)


compact(Submit, 2, _submit_plain, _submit_from_plain)


class ForgetParams(NamedTuple):
    """Drop every params a Submit brought so far (the front end's table was full; ids start
    over)."""


class Cancel(NamedTuple):
    call_id: int


class ControlCall(NamedTuple):
    call_id: int
    method: str
    request: bytes  # the serialized pb request
    owner: str


def rpc_types(method: str) -> tuple[Any, Any]:
    """(request class, reply class) of an AttentionService control rpc. Generated messages
    cross the channel serialized: they do not pickle (their module is not importable)."""
    desc = pb.DESCRIPTOR.services_by_name["AttentionService"].methods_by_name[method]
    return getattr(pb, desc.input_type.name), getattr(pb, desc.output_type.name)
