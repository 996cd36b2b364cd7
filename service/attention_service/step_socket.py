"""The step socket: decode steps from a model host on this machine, straight into the engine.

A ``CacheDecodeSteps`` step through gRPC crosses three processes of Python (the client, a
front end, the engine) and four thread hand-offs; on an H200 host a B=1 step spent ~1 ms
there around a ~50 us kernel, and a B=64 step 2-3 ms around 130 us
(benchmarks/results/offload). With ``--step-socket PATH`` the engine process also listens on a
Unix socket at PATH, where a model host on the same machine sends the same step messages with
no gRPC and no front end: the socket's reader thread checks each step as a front end would
(``streams.start_upload``), submits it with ``issue_here`` (an idle GPU gets the launch from
this thread) and, inside the executor's ``deferring`` block, answers it from this thread too.

The protocol (``attention_wire.messages``: STEP_SOCKET_HELLO, frames of a 4-byte little-endian
length and the payload, both ways):

* the client's first frame is STEP_SOCKET_HELLO, the server instance it means
  (``ServerInfo.instance_id``, or nothing), a newline and its ``authorization`` value
  (``Bearer <token>``; nothing without auth); the server answers an AttentionResult, empty
  when it is accepted, else with ``error`` (FAILED_PRECONDITION: another server's socket;
  UNAUTHENTICATED) and closes;
* then each client frame is one whole CacheDecode step, exactly a ``CacheDecodeSteps``
  message, and each server frame that step's AttentionResult, in the order the steps came;
  a failed step's with ``error`` (it changed no cache), as a step stream with in-band errors.

The rules are the step stream's: up to STEPS_IN_FLIGHT steps unanswered (one more is
refused, RESOURCE_EXHAUSTED), steps naming one of an earlier unanswered step's caches start
after it, the same limits, region checks, cache ownership (the token's principal) and
metrics (counted as CacheDecode). A connection that closes cancels its steps (their caches
change as for a cancelled call: not at all, unless the launch had run). Access control is the
socket's: it is made readable and writable by the server's user only (mode 0600), and with
``--auth-token`` a client must also present a token.

A model host repeats a few messages with new tensor bytes (one per layer): a connection keeps
the form of each message it read the long way (``_StepForm``) and reads a message of a known
form without parsing or checking it again.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import select
import socket
import stat
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from attention_service.config import MAX_MESSAGE_BYTES, ServerConfig
from attention_service.engine.core import EngineCore
from attention_service.engine.executor import Hold
from attention_service.engine.jobs import ByteBase, ExecStats, Job
from attention_service.engine.local_link import LocalBuffers
from attention_service.errors import RequestError, StartupError, unavailable
from attention_service.frontend.auth import Principals
from attention_service.frontend.servicer import STEPS_IN_FLIGHT, call_log_level, logfmt
from attention_service.frontend.streams import (
    Upload,
    UploadBudget,
    error_answer,
    response_messages,
    start_upload,
    stats_message,
)
from attention_service.frontend.validation import INPUT_FIELDS, Limits, step_cache_ids
from attention_service.ipc.channel import Channel
from attention_service.metrics import Metrics
from attention_service.params import INPUTS, Op, Params, RegionSpan
from attention_wire.alloc import layout
from attention_wire.messages import (
    DATA_ALIGN,
    SOCKET_FRAME,
    STEP_SOCKET_BUFFER,
    STEP_SOCKET_HELLO,
    RawChunk,
    leading_header,
    message_frame,
    tail_step_timeout,
    widen_step_socket,
)
from attention_wire.pb import attention_pb2 as pb

log = logging.getLogger("attention_service")

OP = Op.CACHE_DECODE
_ACCEPTED = pb.AttentionResult().SerializeToString()  # the hello's answer: no error
_PEERCRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid
# Pinned blocks a connection keeps for its next steps: sizes, and bytes in all (a B=64 bf16
# step: its 770 KiB frame and 512 KiB of outputs; blocks of one size: up to the steps in flight).
_BLOCK_SIZES = 16  # a step takes two: its frame's and its outputs'
_FRAME_ROUND = 64 << 10  # frames are read into blocks of a multiple of this
_KEPT_BYTES = 32 << 20
# Answers left unsent for a client that does not read them, past which its steps are read no
# further (a client may leave its steps in flight unread: up to 8 answers of up to 4 MiB),
# and how often a reader held back so looks again.
_MAX_QUEUED_BYTES = (STEPS_IN_FLIGHT + 1) * MAX_MESSAGE_BYTES
_BACKLOG_POLL_S = 0.01
_MAX_FORMS = 512  # step forms a connection keeps (``_StepForm``: a model host's layers' steps)


@dataclass(frozen=True, slots=True, eq=False)
class _StepForm:
    """A step message's fixed bytes (``message_frame``'s: the header, then each tensor's chunk
    head, padded so its bytes start aligned) and what they were checked to mean. A later
    message of the connection with the same fixed bytes, and at most a ``step_timeout_ms``
    after them, is the same request with other tensor bytes, each whole and aligned where it
    lies: its step skips the parse, the header's checks and the chunks' (a B=64 step's read
    and start took 45 us in an H200 trace, where the check alone had taken ~95). Tensors in
    regions have no bytes here: a step of regions only is its header, read the long way
    in ~40 us of a B=64 step (dev box, sim_server), and the engine still looks its regions
    up (owner, bounds) every step."""

    header: bytes
    pieces: tuple[tuple[int, bytes], ...]  # (offset, bytes) of each fixed piece after the header
    end: int  # where the last tensor's bytes end
    inputs_at: dict[str, int]  # each input's offset in the message (every byte in place)
    params: Params
    regions: Mapping[str, RegionSpan]  # the tensors in regions, as the header named them
    ids: frozenset[str]
    sizes: dict[str, int]  # the step's buffers (outputs in its block)
    offsets: dict[str, int]
    block_bytes: int  # its block's bytes
    total: int  # its upload's

    @staticmethod
    def of(raw: memoryview, header: bytes, upload: Upload, sizes: dict[str, int],
           placed: dict[str, tuple[ByteBase, int]], offsets: dict[str, int], block_bytes: int,
           ids: frozenset[str]) -> _StepForm | None:
        """The form of ``raw``, a message just read the long way into ``upload``, when it is
        ``message_frame``'s with every input it sends in place; else None."""
        sent = [sizes.get(n, 0) for n in INPUTS]
        if any(n and name not in placed for name, n in zip(INPUTS, sent, strict=True)):
            return None
        frame, at = message_frame(header, sent), 0
        pieces, inputs_at = [], {}
        for name, piece, n in zip(INPUTS, frame, sent, strict=True):
            pieces.append((at, piece))
            at += len(piece)
            if n:
                if placed[name][1] != at:
                    return None
                inputs_at[name] = at
            at += n
        if at > len(raw) or any(raw[a : a + len(p)] != p for a, p in pieces):
            return None
        # The header's field is matched as the key (``_match``); the rest of its piece here.
        head_end = len(message_frame(header, (0, 0, 0))[0])
        fixed = ((head_end, frame[0][head_end:]), *pieces[1:])
        assert upload.params is not None
        return _StepForm(header, tuple((a, p) for a, p in fixed if p), at, inputs_at,
                         upload.params, upload.regions, ids, sizes, offsets, block_bytes,
                         upload.total)


class _Step:
    """One step read from the socket: its message, caches, upload, job, and answer once done."""

    __slots__ = ("raw", "frame", "ids", "form", "timeout_ms", "after", "upload", "block", "job",
                 "answer", "t0")

    def __init__(self, raw: memoryview, frame: ByteBase, ids: frozenset[str],
                 form: _StepForm | None = None, timeout_ms: int = 0) -> None:
        # The message, in the block it was read into (its inputs may stay there: ``_start``).
        self.raw: memoryview | None = raw
        self.frame: ByteBase | None = frame
        self.ids = ids
        self.form, self.timeout_ms = form, timeout_ms  # a message of a checked form (``_match``)
        self.after: list[_Step] = []  # earlier unanswered steps that name one of its caches
        self.upload: Upload | None = None
        self.block: ByteBase | None = None  # its other buffers' pinned block (``_block``)
        self.job: Job | None = None
        # Its AttentionResult in pieces, set when it is done (finished); sent in order.
        self.answer: list[bytes | memoryview] | None = None
        self.t0 = time.perf_counter()


class StepSocket:
    """The listening socket at ``path`` and its connections (one reader thread each)."""

    def __init__(self, path: str, core: EngineCore, config: ServerConfig, metrics: Metrics,
                 principals: Principals) -> None:
        self.path, self.core, self.config, self.metrics = path, core, config, metrics
        self.principals = principals
        self.limits = Limits.of(config)
        self.budget = _SharedBudget(config.max_upload_bytes, config.max_upload_share)
        # Steps are refused (UNAVAILABLE) until the server serves, as gRPC's are: a warm-up
        # launches on the backend without the executor, one thread at a time.
        self.accepting = False
        self.refusal = "server is warming up"
        self._lock = threading.Lock()
        self._conns: set[_SocketConnection] = set()
        self._sock: socket.socket | None = None
        self._inode = 0  # the socket file this server made (``close`` removes only it)
        self._accepter: threading.Thread | None = None
        # Starts the steps that waited behind another (``_SocketConnection._done``): off the
        # executor's threads, whose ``done`` calls must be quick.
        self.starter = ThreadPoolExecutor(1, thread_name_prefix="attention-step-socket-start")

    def start(self) -> None:
        """Listen at ``path``: a stale socket file there is replaced; a live one (another
        server's) or anything else is not (OSError)."""
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.connect(self.path)
                except OSError:  # nobody listens there: stale
                    os.unlink(self.path)
                else:
                    raise OSError(errno.EADDRINUSE, "another server listens there")
                finally:
                    probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old = os.umask(0o177)  # created 0600: no window where others may connect
            try:
                sock.bind(self.path)
            finally:
                os.umask(old)
            sock.listen(64)
            self._inode = os.stat(self.path).st_ino
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._accepter = threading.Thread(target=self._accept_loop, daemon=True,
                                          name="attention-step-socket")
        self._accepter.start()
        widen_step_socket(sock)  # as each connection's: what the kernel grants, logged
        log.info("step socket listening at %s (send buffers of %d KiB, %d asked; the kernel "
                 "grants twice net.core.wmem_max at most)", self.path,
                 sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >> 10,
                 STEP_SOCKET_BUFFER >> 10)

    def _accept_loop(self) -> None:
        listening = self._sock
        assert listening is not None
        n = 0
        while True:
            try:
                sock, _ = listening.accept()
            except OSError as exc:
                if self._sock is None:
                    return  # closed
                # Out of descriptors or memory, or a peer gone before its accept: go on.
                log.warning("step socket: accept failed: %s", exc)
                time.sleep(0.05)
                continue
            n += 1
            conn = None
            try:
                widen_step_socket(sock)
                conn = _SocketConnection(self, sock, n)
                with self._lock:
                    if self._sock is None:
                        sock.close()
                        return
                    self._conns.add(conn)
                conn.start()
            except Exception:  # e.g. no thread to start: this connection only
                log.exception("step socket: a connection could not start")
                if conn is not None:
                    self.forget(conn)
                sock.close()

    def serve(self) -> None:
        """The server serves (its warm-up is done): steps run from now on."""
        self.accepting = True

    def forget(self, conn: _SocketConnection) -> None:
        with self._lock:
            self._conns.discard(conn)

    def drain(self) -> None:
        """Refuse new steps (UNAVAILABLE); those started are still answered."""
        self.refusal = "server is shutting down"
        self.accepting = False

    def close(self) -> None:
        """Stop listening, remove the socket file, close every connection."""
        self.accepting = False
        with self._lock:
            sock, self._sock = self._sock, None
            conns = list(self._conns)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            with contextlib.suppress(OSError):
                if os.lstat(self.path).st_ino == self._inode:  # not another server's since
                    os.unlink(self.path)
        for conn in conns:
            conn.close()
        self.starter.shutdown(wait=False)
        if self._accepter is not None:
            self._accepter.join(5)


class _SocketConnection:
    def __init__(self, owner: StepSocket, sock: socket.socket, n: int) -> None:
        self.owner, self.core = owner, owner.core
        try:
            pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except OSError:
            pid = uid = -1
        self.peer = f"unix:{owner.path} pid={pid} uid={uid}"
        self.principal: str | None = None  # set by the hello
        self.caller = ""  # whose upload share its steps count against
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # room to read (``_room``)
        self._order: deque[_Step] = deque()  # read, answer not sent yet, in order
        self._running: list[_Step] = []  # submitted, not finished
        self._waiting: list[_Step] = []  # behind an earlier step on one of its caches
        # Whether the client sends steps before the last one is answered (see ``_scope``).
        self._pipelined = False
        # Its pipelined steps' launches, answered by its reader: made by the reader (its
        # pipe is closed on the reader's way out, whatever ends it).
        self._hold: Hold | None = None
        self._holding: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        self._free: dict[int, list[ByteBase]] = {}  # pinned blocks by size (``_block``)
        self._forms: dict[bytes, _StepForm] = {}  # by header bytes (``_match``)
        self._kept = 0  # their bytes
        self._closed = False  # its client went (``on_close``): nothing more starts
        # Sends only (never blocking the engine's threads): ``_read_loop`` reads.
        self.channel = Channel(sock, _no_message, lambda: None, f"step-socket-{n}")
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"attention-step-socket-{n}")

    def start(self) -> None:
        self.channel.start(reader=False)
        self._reader.start()

    def _scope(self) -> contextlib.AbstractContextManager[object]:
        """Around each read's step. One step at a time: the executor's ``deferring``, so
        that this thread, which issued the launch on an idle GPU, also waits for it and
        answers (no completer wake-up). But then it reads nothing meanwhile, and a client
        with a second step in flight (a ping-pong of micro-batches) would wait for every
        launch to end before its next step is even read. So a read does not defer when the
        last deferred one saw the next step arrive while it waited (``_deferring``'s peek),
        nor when this step came while earlier ones were unanswered: then its launch is held
        (``Executor.holding``), and this thread answers it once the completer has seen it end,
        reading the next step meanwhile (``_answer_held``)."""
        with self._lock:
            ahead = bool(self._order)
        if self._pipelined or ahead:
            self._pipelined = ahead  # the peek counts once; then what the client does
            return self._holding
        return self._deferring()

    @contextlib.contextmanager
    def _deferring(self) -> Iterator[None]:
        with self.core.executor.deferring():
            yield
        self._pipelined = bool(_peek(self.channel.sock))  # did the next step come meanwhile?

    # ---- reader thread ------------------------------------------------------------------

    def _read_loop(self) -> None:
        """Frames straight from the socket into pinned blocks (``_block``): the kernel copies
        a step's bytes there without the GIL, and its tensors, when they arrive aligned (the
        client's ``message_frame``), stay there for the launch to read (a B=64 bf16 step's
        770 KiB took ~180 us of the engine's GIL to pass through a generic frame decoder, and
        ~70-90 us to copy into its buffers, H200)."""
        sock = self.channel.sock
        head = memoryview(bytearray(SOCKET_FRAME.size))
        try:
            self._hold = Hold()
            self._holding = self.core.executor.holding(self._hold)
            # What ``_answer_held`` waits on: the hold's wake-ups, and the socket's next frame.
            self._watch_held = select.poll()
            self._watch_held.register(self._hold.fd, select.POLLIN)
            self._watch_frame = select.poll()
            self._watch_frame.register(self._hold.fd, select.POLLIN)
            self._watch_frame.register(sock, select.POLLIN)
            while True:
                self._answer_held(until_frame=True)
                if not (self._room() and _fill(sock, head)):
                    break
                (size,) = SOCKET_FRAME.unpack(head)
                if size > MAX_MESSAGE_BYTES:
                    log.info("step socket: %s sent a frame of %d bytes, over the %d allowed; "
                             "closing", self.peer, size, MAX_MESSAGE_BYTES)
                    break
                frame = self._frame_block(size)
                payload = memoryview(frame.np)[:size]  # type: ignore[index]
                if not _fill(sock, payload):
                    break
                with self._scope():
                    self.on_message(payload, frame)
        except OSError as exc:
            log.debug("step socket: %s: %s", self.peer, exc)
        finally:
            self.channel.close()
            # Its running steps cancelled first (a held launch still running then changes
            # no cache, as any of its steps' launches), then the held ones answered (into
            # the closed socket): their slots, caches and the executor's count come back.
            self.on_close()
            if self._hold is not None:
                try:
                    self._answer_held(until_frame=False)
                finally:
                    self._hold.close()

    def _answer_held(self, until_frame: bool) -> None:
        """Answer this connection's held launches as the completer sees each end: all of
        them, or (``until_frame``) until the client's next frame can be read (it is read and
        launched first; the GPU has the held ones meanwhile). ``poll``, not ``select``: a
        server with over 1024 descriptors open (connections, regions) is no exception."""
        hold, executor = self._hold, self.core.executor
        if hold is None or not hold.items:
            return
        watch = self._watch_frame if until_frame else self._watch_held
        while executor.answer_held(hold):
            ready = watch.poll()
            if any(fd == hold.fd for fd, _ in ready):
                hold.clear()
            elif until_frame:
                return

    def _room(self) -> bool:
        """Wait, reading nothing, while STEPS_IN_FLIGHT steps are unanswered, or while more
        answers wait in the channel than a client that reads them can leave there (as a gRPC
        step stream stops reading: memory stays bounded); held launches are answered here
        meanwhile. False once the connection is closed. (Holding back for any unsent answer
        would deadlock a client that sends a large step while its earlier answers wait: it
        reads only once the send is done.)"""
        while True:
            with self._cond:
                if self._closed:
                    return False
                backlog = self.channel.queued_bytes > _MAX_QUEUED_BYTES
                if len(self._order) < STEPS_IN_FLIGHT and not backlog:
                    return True
                if self._hold is None or not self._hold.items:
                    if not backlog:
                        self._cond.wait()  # an answer (``_done``) or the close notifies
                        continue
                    self._cond.wait(_BACKLOG_POLL_S)
                    if _peek(self.channel.sock) == b"":  # the peer went while answers waited
                        return False
                    continue
            self._answer_held(until_frame=False)

    def on_message(self, payload: memoryview, frame: ByteBase) -> None:
        if self.principal is None:
            self._hello(bytes(payload))  # its block is not kept: one hello a connection
        else:
            self._read(payload, frame)

    def _hello(self, payload: bytes) -> None:
        if not payload.startswith(STEP_SOCKET_HELLO):
            log.info("step socket: %s sent no hello; closing", self.peer)
            self.channel.close()
            return
        expected, _, presented = payload[len(STEP_SOCKET_HELLO):].partition(b"\n")
        instance = self.core.info.instance
        meant = expected[:64].decode(errors="replace")
        if expected and meant != instance:
            self._refuse(grpc.StatusCode.FAILED_PRECONDITION,
                         f"hello: this step socket is server {instance}'s, not {meant}'s "
                         "(another server listens at the path the one you called advertises)")
            return
        principals = self.owner.principals
        principal = principals.match(presented or None) if principals.enabled else ""
        if principal is None:
            self._refuse(grpc.StatusCode.UNAUTHENTICATED,
                         f"authorization: {'invalid' if presented else 'missing'} bearer token "
                         "(send 'Bearer <token>' after the hello)")
            return
        self.principal = principal
        self.caller = principal or self.peer.partition(" ")[2]
        self.channel.send_raw([_ACCEPTED])

    def _refuse(self, code: grpc.StatusCode, details: str) -> None:
        """The hello refused: its answer, a log line, the connection closed."""
        log.info("step socket: %s refused: %s", self.peer, details)
        self.channel.send_raw([error_answer(RequestError(code, details))])
        self.channel.close()

    def _read(self, raw: memoryview, frame: ByteBase) -> None:
        form, timeout_ms = self._match(raw)
        ids = form.ids if form is not None else step_cache_ids(raw, OP)  # type: ignore[arg-type]
        step = _Step(raw, frame, ids, form, timeout_ms)
        refusal = None
        with self._lock:
            if not self.owner.accepting:
                refusal = unavailable(self.owner.refusal)
            self._order.append(step)
            if refusal is None:
                ids = step.ids
                if ids:
                    step.after = [s for s in (*self._running, *self._waiting)
                                  if not ids.isdisjoint(s.ids)]
                if step.after:  # started later, from another thread
                    self._waiting.append(step)
                    return
                self._running.append(step)
        if refusal is not None:
            self._done(step, refusal)
            return
        self._start(step, issue_here=True)

    def _start(self, step: _Step, issue_here: bool) -> None:
        """Check, buffer and submit one step (its answer comes to ``_done``)."""
        upload = step.upload = Upload(self.owner.budget)
        try:
            form = step.form
            if form is not None:  # as its form's first message was read and checked
                upload.start(self.caller, form.total, form.params, form.regions,
                             step.timeout_ms)
                upload.cover(form.total)
                step.block = self._block(form.block_bytes)
                placed = {n: (step.frame, at) for n, at in form.inputs_at.items()}
                upload.fill(LocalBuffers(step.block, form.offsets, form.sizes, placed),  # type: ignore[arg-type]
                            placed.keys())
                upload.came_whole()
            else:
                self._read_long_way(step, upload)
            assert upload.params is not None and upload.buffers is not None
            step.raw = None  # read once, here
            job = self.core.submit(
                upload.params, {**upload.buffers.spans, **upload.regions},
                self.principal or "", lambda value: self._done(step, value),
                issue_here=issue_here)
            with self._lock:
                step.job = job
                gone = self._closed
            if gone:  # a waiting step started as its client went: nobody reads it
                self.core.cancel(job)
        except RequestError as exc:
            self._done(step, exc)
        except (MemoryError, OSError, RuntimeError) as exc:
            log.warning("step socket: could not buffer a step: %s: %s", type(exc).__name__, exc)
            self._done(step, RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "header: the server could not reserve host memory for this step's tensors; "
                "retry later"))
        except Exception as exc:  # a bug: answer the step, keep the connection
            log.exception("step socket: a step failed")
            self._done(step, RequestError.internal(exc))

    def _read_long_way(self, step: _Step, upload: Upload) -> None:
        """``step``'s message parsed and checked into ``upload`` as a front end does, its
        buffers made (its inputs left where they lie when they came whole and aligned); its
        form kept when it has one, for the next message like it (``_match``)."""
        raw = step.raw
        assert raw is not None and step.frame is not None
        first, sizes = start_upload(upload, OP, raw, self.owner.limits, self.caller)  # type: ignore[arg-type]
        placed = _in_place(first.chunks, step.frame, sizes)
        offsets, total = layout({n: b for n, b in sizes.items() if n not in placed})
        step.block = self._block(total)
        upload.fill(LocalBuffers(step.block, offsets, sizes, placed), placed.keys())
        upload.add(first.chunks)  # checks every chunk, copies those not in place
        upload.check_complete()
        if first.header_bytes is None:
            return
        form = _StepForm.of(raw, first.header_bytes, upload, sizes, placed, offsets, total,
                            step.ids)
        if form is not None:
            with self._lock:  # read by this connection's reader, written by it or a starter
                if len(self._forms) >= _MAX_FORMS:
                    self._forms.clear()
                self._forms[form.header] = form

    def _match(self, raw: memoryview) -> tuple[_StepForm | None, int]:
        """The form ``raw`` has (one kept by ``_read_long_way``) and its ``step_timeout_ms``;
        (None, 0) when it has none: it is read the long way."""
        header = leading_header(raw)
        if header is None:
            return None, 0
        with self._lock:
            form = self._forms.get(bytes(header))
        if form is None or len(raw) < form.end:
            return None, 0
        for at, piece in form.pieces:
            if raw[at : at + len(piece)] != piece:
                return None, 0
        timeout_ms = tail_step_timeout(raw[form.end :])
        return (None, 0) if timeout_ms is None else (form, timeout_ms)

    # ---- any engine thread: a step's end -------------------------------------------------

    def _done(self, step: _Step, value: ExecStats | BaseException) -> None:
        """Exactly once per step: its answer made and sent in order (from its buffers when it
        is next, else copied to wait), its buffers freed, the steps that waited for it
        started."""
        upload, step.upload = step.upload, None
        try:
            try:
                answer, code, details, bytes_out = self._answer(upload, value)
            except Exception as exc:  # a bug: the step still gets an answer, the rest go on
                log.exception("step socket: a step's answer failed")
                value = RequestError.internal(exc)
                answer, code, details, bytes_out = self._answer(None, value)
            with self._lock:
                step.answer = answer
                if step in self._running:
                    self._running.remove(step)
                ready = [w for w in self._waiting
                         if all(a.answer is not None for a in w.after)]
                for w in ready:
                    self._waiting.remove(w)
                    self._running.append(w)
                order = self._order
                while order and order[0].answer is not None:
                    self.channel.send_raw(order.popleft().answer)  # type: ignore[arg-type]
                if order and step in order:  # an earlier step is not done: it waits
                    step.answer = [b"".join(answer)]
                self._cond.notify_all()  # room to read
        finally:
            if upload is not None:
                upload.release()
            for block in (step.block, step.frame):
                if block is not None:
                    self._give_back(block)
            step.block = step.frame = None
        for w in ready:  # off this thread (an executor's: its ``done`` must be quick)
            with contextlib.suppress(RuntimeError):  # the server has closed the socket
                self.owner.starter.submit(self._start, w, False)
        self._account(step, upload, value, code, details, bytes_out)

    def _block(self, nbytes: int) -> ByteBase:
        """A pinned block of ``nbytes`` for one step's buffers: one a finished step of the
        same size gave back, else a new one (a model host's steps repeat a few sizes; a new
        block and its views took ~13 us of a B=1 step's ~136 us of engine GIL, H200)."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._kept -= nbytes
                block = free.pop()
                if not free:  # its size slot goes back too
                    del self._free[nbytes]
                return block
        u8 = self.core.backend.alloc_host(nbytes)
        return ByteBase(u8, pinned=u8.is_pinned())

    def _frame_block(self, size: int) -> ByteBase:
        """A block to read a frame of ``size`` bytes into: ``_block``'s, rounded up to
        _FRAME_ROUND so a host's frames of near sizes share blocks; pageable when no pinned
        memory is left (a step then still runs, its inputs copied unpinned)."""
        rounded = -(-max(size, 1) // _FRAME_ROUND) * _FRAME_ROUND
        try:
            return self._block(rounded)
        except (MemoryError, RuntimeError) as exc:
            log.warning("step socket: no pinned block of %d bytes for a frame (%s); reading "
                        "it into pageable memory", rounded, exc)
            return ByteBase(torch.empty(rounded, dtype=torch.uint8))

    def _give_back(self, block: ByteBase) -> None:
        """``block``'s step is done with it (its launch ended, its answer is sent or copied);
        kept for the next step of its size within ``_KEPT_BYTES`` a connection."""
        with self._lock:
            if self._kept + block.nbytes > _KEPT_BYTES:
                return
            free = self._free.get(block.nbytes)
            if free is None and len(self._free) < _BLOCK_SIZES:
                free = self._free[block.nbytes] = []
            if free is not None and len(free) < STEPS_IN_FLIGHT:
                free.append(block)
                self._kept += block.nbytes

    @staticmethod
    def _answer(upload: Upload | None, value: ExecStats | BaseException
                ) -> tuple[list[bytes | memoryview], str, str, int]:
        """The step's AttentionResult in pieces (its outputs viewed in its buffers), its code,
        details and output bytes."""
        if isinstance(value, BaseException):  # a RequestError, or Cancelled (its client went)
            if not isinstance(value, RequestError):
                value = RequestError(grpc.StatusCode.CANCELLED, "the step was cancelled")
            return [error_answer(value)], value.code.name, value.details, 0
        assert upload is not None
        parts: list[bytes | memoryview] = []
        bytes_out = 0
        for nbytes, msg_parts in response_messages(upload, MAX_MESSAGE_BYTES):
            bytes_out += nbytes
            parts += msg_parts
        parts.append(stats_message(value, upload, bytes_out).SerializeToString())
        return parts, "OK", "", bytes_out

    def _account(self, step: _Step, upload: Upload | None, value: ExecStats | BaseException,
                 code: str, details: str, bytes_out: int) -> None:
        seconds = time.perf_counter() - step.t0
        metrics = self.owner.metrics
        if isinstance(value, BaseException) or upload is None or upload.params is None:
            metrics.observe_request(OP.rpc, code, seconds)
        else:
            metrics.observe_request(
                OP.rpc, code, seconds, bytes_in=upload.wire_bytes_in, bytes_out=bytes_out,
                region_in=upload.region_bytes_in, region_out=upload.region_bytes_out,
                tokens=upload.params.tokens, flops=value.flops,
                queue_seconds=value.queue_seconds)
        level = call_log_level(code, self.owner.config.access_log)
        if log.isEnabledFor(level):
            line = (f"rpc={OP.rpc} code={code} duration_ms={seconds * 1e3:.3f} step_socket=1 "
                    f"bytes_out={bytes_out} peer={logfmt(self.peer)}")
            if details:
                line += f" details={logfmt(details)}"
            log.log(level, line)

    def close(self) -> None:
        """The server closes it: its reader ends (and calls ``on_close``)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.channel.close()

    def on_close(self) -> None:
        """The model host went (or the server closed the socket): its steps are cancelled,
        those waiting dropped; nobody reads their answers."""
        with self._lock:
            self._closed = True
            running = [s.job for s in self._running if s.job is not None]
            self._waiting.clear()
        for job in running:
            self.core.cancel(job)
        self.owner.forget(self)


class _SharedBudget(UploadBudget):
    """An ``UploadBudget`` under a lock: the socket's connections' reader threads and the
    engine's threads reserve and release it (a front end's is its event loop's alone)."""

    def __init__(self, limit: int, share: float) -> None:
        super().__init__(limit, share)
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, caller: str = "", field: str = "header") -> None:
        with self._lock:
            super().reserve(nbytes, caller, field)

    def release(self, nbytes: int, caller: str = "") -> None:
        with self._lock:
            super().release(nbytes, caller)


def start_step_socket(config: ServerConfig, core: EngineCore, metrics: Metrics) -> StepSocket:
    """The socket at ``config.step_socket``, listening (StartupError when it cannot)."""
    sock = StepSocket(config.step_socket, core, config, metrics, Principals(config.tokens))
    try:
        sock.start()
    except OSError as exc:
        raise StartupError(
            f"--step-socket: cannot listen at {config.step_socket!r}: {exc}") from None
    return sock


def _in_place(chunks: list[RawChunk], frame: ByteBase, sizes: dict[str, int]
              ) -> dict[str, tuple[ByteBase, int]]:
    """The inputs whose bytes came whole in one chunk of ``frame`` at a DATA_ALIGN offset, by
    name: (frame, offset), their buffers where they lie. (Anything else, e.g. a tensor in
    several chunks, is copied into the step's block; ``Upload.add`` checks every chunk.)"""
    whole = [(name, data) for field, offset, data in chunks
             if (name := INPUT_FIELDS.get(field)) and data and offset == 0
             and len(data) == sizes.get(name)]
    placed: dict[str, tuple[ByteBase, int]] = {}
    for name, data in whole:
        # The chunk's address in the frame (``data`` views it): ctypes takes ~0.4 us where
        # numpy's ``ctypes.data`` took ~1.6.
        at = ctypes.addressof(ctypes.c_char.from_buffer(data)) - frame.ptr
        if at % DATA_ALIGN == 0:
            placed[name] = (frame, at)
    return placed


def _fill(sock: socket.socket, view: memoryview) -> bool:
    """``view`` filled from ``sock`` (blocking); False if the peer closed first."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            return False
        got += k
    return True


def _no_message(_msg: Any, _fds: list[int]) -> None:  # the channel reads nothing
    raise AssertionError("a step socket's channel has no reader")


def _peek(sock: socket.socket) -> bytes | None:
    """The socket's next byte, left in it; b"" once the peer closed (or the socket failed),
    None while nothing has come."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return None
    except OSError:
        return b""
