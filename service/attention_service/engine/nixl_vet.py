"""NIXL metadata read first in a throwaway process, so bytes that crash NIXL's parser cannot
take the engine down (issue 66).

NIXL 1.5.1 parses a peer's metadata blob in C++ with little checking: with 4 random bytes
changed near the end of a blob it segfaulted in about 1 in 60 tries (dev box, 2026-11-29).
The engine hands every blob a caller sends (ConnectNixl, a NIXL region's registration) to
``MetadataVetter.check`` before its own agent sees it. A helper process, started on first use
and kept, loads the blob into an agent of its own and drops it again. If the helper dies or
does not answer within ``timeout``, the blob is refused and the helper is started afresh for
the next one; if NIXL raises there, it raises the same way in the engine, which reports it as
before. A blob of a region's memory (no connection info) is loaded after its agent's
connection blob, as the engine's agent would read it.

The helper speaks over its stdin/stdout: each request is ``n`` (4 bytes little-endian) then
``n`` blobs, each a 4-byte length and its bytes; each answer a 4-byte length and ``ok`` or
the name of the exception NIXL raised (NIXL's own log lines, which it prints to stdout, go to
/dev/null).
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

# A load of one blob takes milliseconds (dev box: ~1 ms for an agent's metadata over UCX
# on loopback); the first after the helper starts also imports NIXL and makes its agent
# (~1 s on the dev box).
TIMEOUT_S = 20.0
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


class MetadataVetter:
    """Loads blobs in the helper process first; thread-safe (one check at a time)."""

    def __init__(self, command: Sequence[str] = tuple(_HELPER), timeout: float = TIMEOUT_S
                 ) -> None:
        self._command = list(command)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    def check(self, blobs: Sequence[bytes]) -> str | None:
        """None when NIXL read ``blobs`` in turn without crashing or hanging (it may have
        raised: the engine's own agent then raises the same); else why not, in words."""
        request = len(blobs).to_bytes(4, "little") + b"".join(_frame(b) for b in blobs)
        with self._lock:
            proc = self._started()
            try:
                assert proc.stdin is not None
                proc.stdin.write(request)
                proc.stdin.flush()
                answer = self._read_answer(proc)
            except (OSError, ValueError):  # its end closed before it read the request
                answer = b""
            if answer:
                return None
            return self._stop(proc, ended=answer is not None)

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._stop(self._proc, ended=False)

    def _started(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True)
        return self._proc

    def _read_answer(self, proc: subprocess.Popen[bytes]) -> bytes | None:
        """The helper's answer; ``b""`` if it closed its end, None if the time ran out."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        end = time.monotonic() + self.timeout
        data = b""
        need = 4
        while len(data) < need:
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, need - len(data))
            if not chunk:
                return b""
            data += chunk
            if need == 4 and len(data) == 4:
                need += int.from_bytes(data, "little")
        return data[4:]

    def _stop(self, proc: subprocess.Popen[bytes], ended: bool = True) -> str:
        """Ends the helper; says how it went: it crashed (``ended``: it closed its end, and
        exits), or it did not answer in time."""
        try:
            code = proc.wait(2.0) if ended else None
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            proc.kill()
            proc.wait()
        if ended:
            why = f"NIXL's parser crashed on it (exit {code if code is not None else '?'})"
        else:
            why = f"NIXL did not finish reading it within {self.timeout:g} s"
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        if self._proc is proc:
            self._proc = None
        return why


def _read_exact(n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _serve() -> None:
    """The helper: one agent of its own; each request's blobs loaded in turn, then dropped."""
    # Answers go to the stdout it was given; NIXL logs to stdout (INFO lines), so fd 1 itself
    # goes to /dev/null first.
    answers = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    nixl = __import__(NIXL_MODULE)
    config = nixl.nixl_agent_config(enable_prog_thread=False, backends=[BACKEND])
    agent = nixl.nixl_agent(f"attention-vet-{os.getpid()}", config)
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
                    agent.add_remote_agent(blob)
                except Exception as exc:
                    # New connection info under a name loaded just before: the engine drops
                    # the old agent and reads the blob again; so does this.
                    if type(exc).__name__ != "nixlNotAllowedError" or name not in loaded:
                        raise
                    agent.remove_remote_agent(name)
                    loaded.discard(name)
                    agent.add_remote_agent(blob)
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
