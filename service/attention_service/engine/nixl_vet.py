"""NIXL metadata read first in a helper process, so bytes that crash NIXL's parser cannot
take the engine down (issue 66).

NIXL 1.5.1 parses a peer's metadata blob in C++ with little checking: with 4 random bytes
changed near the end of a blob it segfaulted in about 1 in 60 tries in one session's runs
(dev box, 2026-11-29; another run of 150 whole blobs only raised). The engine hands every
blob a caller sends (ConnectNixl, a NIXL region's registration) to ``MetadataVetter.check``
before its own agent sees it. A helper process, started on first use and kept, loads the blob
into an agent of its own and drops it again:

* it read the blob: the engine's agent reads it next (which may still refuse it: the engine's
  agent also holds the peer's earlier regions, which the helper does not);
* NIXL raised there: the engine refuses the blob the same way without reading it;
* the helper died on it (a crash signal: ``Unread``, crashed), or did not answer within
  ``timeout``, could not start or ended otherwise (``Unread``, not crashed: try again); a new
  helper starts for the next blob.

A blob of a region's memory (no connection info) is loaded after its agent's connection blob.

The helper speaks over its stdin/stdout: first it sends ``ready``; each request is ``n``
(4 bytes little-endian) then ``n`` blobs, each a 4-byte length and its bytes; each answer a
4-byte length and ``ok`` or the name of the exception NIXL raised. NIXL's own log lines,
which it prints to stdout, go to /dev/null; its stderr, up to ``ready``, to a file the engine
logs the end of when the helper fails to start, and to /dev/null after it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("attention_service")

# A load of one blob takes milliseconds (dev box: 1-6 ms for an agent's metadata over UCX on
# loopback); the helper's start, NIXL's import and its agent, ~0.6-0.7 s on the dev box.
TIMEOUT_S = 20.0
_MAX_ANSWER = 256  # bytes: "ok" or an exception's class name
# How a helper that closed its end ended, for it to count as NIXL crashing on the blob (any
# other end, e.g. the out-of-memory killer's SIGKILL, is the server's trouble, not the blob's).
_CRASHES = frozenset({"SIGSEGV", "SIGABRT", "SIGBUS", "SIGILL", "SIGFPE"})
NIXL_MODULE = "nixl_cu13"
BACKEND = "UCX"  # the NIXL backend that moves the bytes
_HELPER = [sys.executable, "-m", "attention_service.engine.nixl_vet"]


def metadata_agent(metadata: bytes) -> str | None:
    """The agent a NIXL metadata blob is of (its serialized header: ``nixlSerDes|Agent``, an
    8-byte little-endian length, the name, ``|``), or None when it has none."""
    head = b"nixlSerDes|Agent"
    if not metadata.startswith(head) or len(metadata) < len(head) + 8:
        return None
    size = int.from_bytes(metadata[len(head):len(head) + 8], "little")
    start = len(head) + 8
    if size > 1024 or metadata[start + size:start + size + 1] != b"|":
        return None
    try:
        return metadata[start:start + size].decode()
    except UnicodeDecodeError:
        return None


def _frame(blob: bytes) -> bytes:
    return len(blob).to_bytes(4, "little") + blob


class Unread(Exception):
    """NIXL did not read the blob in the helper: ``crashed`` it died on it; otherwise it did
    not finish in time or the helper could not start (worth trying again)."""

    def __init__(self, why: str, crashed: bool) -> None:
        super().__init__(why)
        self.why, self.crashed = why, crashed


class MetadataVetter:
    """Loads blobs in the helper process first; thread-safe (one check at a time)."""

    def __init__(self, command: Sequence[str] = tuple(_HELPER), timeout: float = TIMEOUT_S
                 ) -> None:
        self._command = list(command)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: Any = None  # the helper's stderr (a temporary file)

    def check(self, blobs: Sequence[bytes]) -> str:
        """``ok`` when NIXL read ``blobs`` in turn in the helper, else the name of the
        exception it raised. Raises ``Unread``."""
        request = len(blobs).to_bytes(4, "little") + b"".join(_frame(b) for b in blobs)
        end = time.monotonic() + self.timeout
        if not self._lock.acquire(timeout=self.timeout):
            raise Unread(f"the server's NIXL metadata helper was busy for {self.timeout:g} s",
                         crashed=False)
        try:
            proc = self._started(end)
            try:
                self._write(proc, request, end)
                answer = self._read(proc, end)
            except _Late:
                answer = None
            except OSError:  # its end closed (it died) before it took the whole request
                answer = b""
            if answer:
                return answer.decode(errors="replace")
            if answer is None:
                self._stop(proc)
                raise Unread(f"NIXL did not finish reading it within {self.timeout:g} s",
                             crashed=False)
            how = self._stop(proc, ended=True)
            if how in _CRASHES:
                raise Unread(f"NIXL's parser crashed on it ({how})", crashed=True)
            raise Unread(f"the server's NIXL metadata helper ended ({how})", crashed=False)
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._stop(self._proc)
            if self._stderr is not None:
                self._stderr.close()
                self._stderr = None

    def _started(self, end: float) -> subprocess.Popen[bytes]:
        """The helper, started (and its ``ready`` read) if it is not running."""
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self._proc is not None:
            self._stop(self._proc)
        if self._stderr is not None:
            self._stderr.close()
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (kept for the helper's life)
        try:
            proc = self._proc = subprocess.Popen(
                self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=self._stderr, close_fds=True, start_new_session=True)
        except OSError as exc:
            log.error("the NIXL metadata helper could not be started: %s", exc)
            raise Unread(f"this server's NIXL metadata helper could not start ({exc})",
                         crashed=False) from None
        assert proc.stdin is not None
        os.set_blocking(proc.stdin.fileno(), False)  # writes wait in ``_write``, timed
        if self._read(proc, end) == b"ready":
            return proc
        how = self._stop(proc, ended=proc.poll() is not None)
        log.error("the NIXL metadata helper did not start (%s): %s", how, self._stderr_tail())
        raise Unread(f"this server's NIXL metadata helper could not start ({how})",
                     crashed=False)

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read()[-2000:].decode(errors="replace").strip()

    @staticmethod
    def _write(proc: subprocess.Popen[bytes], data: bytes, end: float) -> None:
        """All of ``data`` to the helper by ``end`` (a helper that stops reading must not
        hold the caller: the pipe holds 64 KiB, a blob up to the message limit)."""
        assert proc.stdin is not None
        fd, view = proc.stdin.fileno(), memoryview(data)
        while view:
            left = end - time.monotonic()
            if left <= 0 or not select.select([], [fd], [], left)[1]:
                raise _Late
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                continue

    @staticmethod
    def _read(proc: subprocess.Popen[bytes], end: float) -> bytes | None:
        """The helper's next answer; ``b""`` if it closed its end (or sent what is not an
        answer), None if ``end`` passed first."""
        assert proc.stdout is not None
        fd, data, need = proc.stdout.fileno(), b"", 4
        while len(data) < need:
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, need - len(data))
            if not chunk:
                return b""
            data += chunk
            if need == 4 and len(data) == 4:
                size = int.from_bytes(data, "little")
                if not 0 < size <= _MAX_ANSWER:  # not this protocol's: treat as gone
                    return b""
                need += size
        return data[4:]

    def _stop(self, proc: subprocess.Popen[bytes], ended: bool = False) -> str:
        """Ends the helper (``ended``: it closed its end and exits by itself); says how it
        ended (its exit code, or the signal that killed it)."""
        try:
            code = proc.wait(2.0) if ended else None
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        if self._proc is proc:
            self._proc = None
        if code is None:
            return "stopped"
        if code < 0:
            with contextlib.suppress(ValueError):
                return signal.Signals(-code).name
        return f"exit {code}"


class _Late(Exception):
    """The helper did not take the request in time."""


def _read_exact(n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


# Waits before loading a blob again when its connection failed (nixlBackendError): a blob
# NIXL read but whose peer UCX did not reach at once. On a loaded 2-core CI box the helper's
# first ConnectNixl of a client failed so through all of gRPC's retries (~0.3-0.8 s of
# backoff), twice in one session's replicas; not in 3 runs of the NIXL tests beside 3 busy
# processes.
_BACKEND_RETRY_S = (0.1, 0.3, 0.6)


def _load(agent: Any, blob: bytes) -> None:
    """``agent.add_remote_agent(blob)``, tried again after each of _BACKEND_RETRY_S when the
    backend could not connect to the peer it names."""
    for wait in (*_BACKEND_RETRY_S, None):
        try:
            agent.add_remote_agent(blob)
            return
        except Exception as exc:
            if type(exc).__name__ != "nixlBackendError" or wait is None:
                raise
        time.sleep(wait)


def _serve() -> None:
    """The helper: one agent of its own; each request's blobs loaded in turn, then dropped."""
    # Answers go to the stdout it was given; NIXL logs to stdout (INFO lines), so fd 1 itself
    # goes to /dev/null first.
    answers = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    nixl = __import__(NIXL_MODULE)
    config = nixl.nixl_agent_config(enable_prog_thread=False, backends=[BACKEND])
    agent = nixl.nixl_agent(f"attention-vet-{os.getpid()}", config)
    os.write(answers, _frame(b"ready"))
    # From here NIXL logs a line or two per blob it refuses: not kept (a start failure's
    # output, before this, is what the engine logs).
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    while True:
        try:
            count = int.from_bytes(_read_exact(4), "little")
            blobs = [_read_exact(int.from_bytes(_read_exact(4), "little"))
                     for _ in range(count)]
        except EOFError:
            return
        answer = b"ok"
        loaded: set[str] = set()
        for blob in blobs:
            name = metadata_agent(blob)
            try:
                try:
                    _load(agent, blob)
                except Exception as exc:
                    # New connection info under a name loaded just before: the engine drops
                    # the old agent and reads the blob again; so does this.
                    if type(exc).__name__ != "nixlNotAllowedError" or name not in loaded:
                        raise
                    agent.remove_remote_agent(name)
                    loaded.discard(name)
                    _load(agent, blob)
                if name:
                    loaded.add(name)
            except Exception as exc:  # NIXL refused it: the engine's agent will too
                answer = type(exc).__name__.encode()
                break
        for name in loaded:
            with contextlib.suppress(Exception):
                agent.remove_remote_agent(name)
        os.write(answers, _frame(answer))


if __name__ == "__main__":
    _serve()
