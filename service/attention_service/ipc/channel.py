"""Messages between a front-end process and the engine process: pickled objects over a
connected AF_UNIX stream socket, in both directions, with file descriptors riding along.

A frame is an 8-byte header (payload length, descriptor count) and the payload; descriptors
travel as SCM_RIGHTS with the frame's first bytes. The receiver reads exactly one frame at a
time (the kernel never hands out one frame's descriptors with another's bytes when each read
stops at a frame boundary). A reader thread hands every message to ``on_message(msg, fds)``
and calls ``on_close()`` once at end of stream or error; ``send`` queues for a writer thread,
so a slow or stopped peer never blocks the caller (the engine's completer thread sends here).

Both ends are our own processes (same code, same user), so pickle is safe here.
"""

from __future__ import annotations

import array
import contextlib
import logging
import os
import pickle
import queue
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("attention_service")

_HEADER = struct.Struct("<II")
MAX_FDS = 8  # per message; a request carries at most one overflow segment


class ChannelClosed(Exception):
    pass


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    """Exactly ``n`` bytes (descriptors that arrive meanwhile are appended to ``fds``)."""
    chunks, got = [], 0
    anc_size = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    while got < n:
        data, ancdata, _flags, _addr = sock.recvmsg(n - got, anc_size, socket.MSG_CMSG_CLOEXEC)
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(payload[: len(payload) - len(payload) % a.itemsize])
                fds.extend(a)
        if not data:
            raise ChannelClosed("peer closed the connection")
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


def recv_message(sock: socket.socket) -> tuple[Any, list[int]]:
    """One message (blocking): the object and the descriptors sent with it (now ours)."""
    fds: list[int] = []
    size, _nfds = _HEADER.unpack(_recv_exact(sock, _HEADER.size, fds))
    payload = _recv_exact(sock, size, fds)
    return pickle.loads(payload), fds


def send_message(sock: socket.socket, msg: Any, fds: Sequence[int] = ()) -> None:
    """One message (blocking)."""
    _send_payload(sock, pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), fds)


def _send_payload(sock: socket.socket, payload: bytes, fds: Sequence[int]) -> None:
    head = _HEADER.pack(len(payload), len(fds))
    if fds:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        sent = sock.sendmsg([head, payload], anc)
    else:
        sent = sock.sendmsg([head, payload])
    rest = (head + payload)[sent:]
    if rest:
        sock.sendall(rest)


class Channel:
    def __init__(
        self, sock: socket.socket, on_message: Callable[[Any, list[int]], None],
        on_close: Callable[[], None], name: str,
    ) -> None:
        sock.setblocking(True)
        self.sock = sock
        self.name = name
        self._on_message = on_message
        self._on_close = on_close
        self._outbox: queue.SimpleQueue[tuple[bytes, Sequence[int]] | None] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._threads = [
            threading.Thread(target=self._read_loop, name=f"{name}-reader", daemon=True),
            threading.Thread(target=self._write_loop, name=f"{name}-writer", daemon=True),
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def send(self, msg: Any, fds: Sequence[int] = ()) -> None:
        """Queue ``msg`` (pickled here, so a message that cannot travel fails its sender);
        the channel owns ``fds`` from here (closed once sent or dropped)."""
        try:
            payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        if self._closed.is_set():
            for fd in fds:
                os.close(fd)
            return
        self._outbox.put((payload, fds))

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._outbox.put(None)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def join(self, timeout: float | None = None) -> None:
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout)

    def _read_loop(self) -> None:
        try:
            while True:
                msg, fds = recv_message(self.sock)
                try:
                    self._on_message(msg, fds)
                except Exception:  # a handler bug must not end the connection silently
                    log.exception("%s: message handler failed", self.name)
                    for fd in fds:
                        with contextlib.suppress(OSError):
                            os.close(fd)
        except (ChannelClosed, OSError, EOFError, pickle.UnpicklingError) as exc:
            if not self._closed.is_set():
                log.debug("%s: closed (%s)", self.name, exc)
        finally:
            self.close()
            self._on_close()

    def _write_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                break
            payload, fds = item
            try:
                _send_payload(self.sock, payload, fds)
            except OSError as exc:
                log.debug("%s: send failed (%s)", self.name, exc)
                self.close()
            finally:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
        # Drop what is left (descriptors included).
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                for fd in item[1]:
                    with contextlib.suppress(OSError):
                        os.close(fd)
