"""The AttentionService handlers: receive, hand to the engine, stream back; account every call.

Thin: validation is in streams/validation, compute behind the ``EngineLink``, regions in the
engine's registry. Every call ends in exactly one metrics record and one log line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from attention_service.config import MAX_MESSAGE_BYTES, ServerConfig
from attention_service.errors import Cancelled, RequestError, StreamEnded
from attention_service.frontend import connections
from attention_service.frontend.auth import Principals
from attention_service.frontend.streams import (
    Upload,
    UploadBudget,
    error_answer,
    receive_request,
    response_messages,
    stats_message,
    upload_caller,
)
from attention_service.frontend.validation import Limits, step_cache_ids
from attention_service.link import EngineLink, ExecStats
from attention_service.metrics import Metrics
from attention_service.params import Op
from attention_wire import unary_method
from attention_wire.messages import IN_BAND, STEP_ERRORS_HEADER
from attention_wire.pb import attention_pb2 as pb

log = logging.getLogger("attention_service")


class CallTracker:
    """Whether new compute calls are accepted, and how many are in flight (for draining)."""

    def __init__(self) -> None:
        self.accepting = False  # False while warming up and once draining
        self.refusal = "server is warming up"
        self.cutting = False  # the drain's grace is over: calls left are being cancelled
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        if self.inflight == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


# GetServerInfo's connection counts start at most this often (about 5 ms each on a quiet host,
# more with many sockets): a flood of askers costs one count per interval, not one each.
_COUNT_INTERVAL_S = 0.02


# How long a request stream that ended early waits for a cancel or deadline to surface (the
# cancel arrives within a few milliseconds on loopback; an incomplete upload pays this once).
_CUT_OFF_WAIT_S = 0.05


# The client's deadline runs out a little before the server's copy of it (which starts when
# the call's headers arrive), so a call cut off by its deadline can reach the server with a few
# milliseconds still to go: seen in 14 of 462 such calls in the GPU soak, counted as CANCELLED.
_DEADLINE_SLACK_S = 0.05


# A logfmt value that needs no quotes; anything else is written as a JSON string.
_PLAIN = re.compile(r"[\w.:/@+\-\[\]]+")


def logfmt(value: str) -> str:
    return value if _PLAIN.fullmatch(value) else json.dumps(value)


def call_tags(context: grpc.aio.ServicerContext, caller: str = "") -> str:
    """The caller's principal (with auth on: a digest, never the token) and the client's
    ``x-request-id``, as log-line fields (empty when neither)."""
    tags = f" caller={caller}" if caller else ""
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id":
            text = value if isinstance(value, str) else bytes(value).decode("utf-8", "replace")
            tags += f" request_id={logfmt(text[:128])}"
            break
    return tags


def call_log_level(code: str, access_log: bool = True) -> int:
    """A call's log line level: INFO for OK and the client's own cancel (DEBUG without
    ``--access-log``), WARNING for every other failure (refused input, limits, deadlines, a
    drain), ERROR for INTERNAL. So a default server logs the failed calls, not the traffic."""
    if code in ("OK", "CANCELLED"):
        return logging.INFO if access_log else logging.DEBUG
    return logging.ERROR if code == "INTERNAL" else logging.WARNING


# Envoy (deploy/envoy/envoy.yaml) adds this to every request it forwards: a region is memory
# of the caller's host and GPU, registered with one replica, so a call that names one must
# not be balanced onto another (receive_request refuses it).
PROXIED_HEADER = "x-attention-proxied"
# And this, the address of the client it serves (its downstream), which a replica trusts
# from --trusted-proxies only: the caller whose upload share a call counts against.
CALLER_HEADER = "x-attention-caller"


def _proxy_headers(context: grpc.aio.ServicerContext) -> tuple[bool, str]:
    """(came through the proxy, the caller's host it names or "")."""
    proxied, caller = False, ""
    for key, value in context.invocation_metadata() or ():
        if key == PROXIED_HEADER:
            proxied = True
        elif key == CALLER_HEADER and isinstance(value, str):
            caller = value
    return proxied, caller


def _gone_code(context: grpc.aio.ServicerContext) -> str:
    """How a call the client ended counts: its deadline (due now or within the slack) or a
    cancel."""
    remaining = context.time_remaining()
    due = remaining is not None and remaining <= _DEADLINE_SLACK_S
    return "DEADLINE_EXCEEDED" if due else "CANCELLED"


class AttentionServicer:
    def __init__(
        self, *, config: ServerConfig, link: EngineLink, metrics: Metrics, info: pb.ServerInfo,
        tracker: CallTracker, principals: Principals,
    ) -> None:
        self._config = config
        self._limits = Limits.of(config)
        self._uploads = UploadBudget(config.max_upload_bytes, config.max_upload_share)
        self._proxies = config.proxy_networks
        self._link = link
        self._metrics = metrics
        self._info = info
        # None without auth: every caller is "" and nothing needs reading per call.
        self._principals = principals if principals.enabled else None
        self.tracker = tracker
        # GetServerInfo's connection counts: the last count (when it started, what it found).
        self._counted: tuple[float, tuple[int, int] | None] | None = None
        self._count_lock = asyncio.Lock()

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerInfo:
        # Timed like the control rpcs: from the handler's start (a unary call's request is
        # already parsed then) to its reply.
        t0 = time.perf_counter()
        reply = self._info
        counted = None
        # Not through a proxy: the caller's connection ends at the proxy, and the counts would
        # be of the proxy's upstream connections, which outlive the ones a spreading client
        # closes. Counted anyway, they herded every client behind Envoy onto the front end
        # with the fewest (one replica behind Envoy: busiest thread 0.92 of a core, the
        # replica at 1.8 cores, 0.85 GB/s of prefill uploads against 1.7-2.4 direct; 2 x H200).
        if request.connections and reply.frontends > 1 and not _proxy_headers(context)[0]:
            counted = await self._connection_counts()
        # NIXL's transports are the engine's to know, and change as peers transfer: asked
        # (an engine that cannot answer now leaves them out; the rest is still the answer),
        # but not by a connections probe (a client's ``spread`` placing itself reads counts).
        live = None
        if reply.nixl and not request.connections:
            try:
                live = await self._link.control_call("GetServerInfo", request, "")
            except RequestError as exc:
                log.debug("GetServerInfo without NIXL transports: %s", exc.details)
        if counted is not None or (live is not None and live.nixl_transports):
            reply = pb.ServerInfo()
            reply.CopyFrom(self._info)
            if counted is not None:
                reply.frontend_connections, reply.fewest_frontend_connections = counted
            if live is not None:
                reply.nixl_transports.extend(live.nixl_transports)
        self.record_control("GetServerInfo", "OK", t0, context)
        return reply

    def _caller(self, context: grpc.aio.ServicerContext) -> str:
        return self._principals.of(context) if self._principals is not None else ""

    async def control_rpc(
        self, method: str, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        """The unary control rpcs (CONTROL_METHODS): regions and caches, run by the engine."""
        t0 = time.perf_counter()
        try:
            reply = await self._link.control_call(method, request, self._caller(context))
        except RequestError as exc:
            self.record_control(method, exc.code.name, t0, context, exc.details)
            await context.abort(exc.code, exc.details)
        self.record_control(method, "OK", t0, context)
        return reply

    async def _connection_counts(self) -> tuple[int, int] | None:
        """``connections.spread`` of this front end's port, from a count that started after
        this request arrived (so it sees the asker's own connection), one count at a time and
        at most one per ``_COUNT_INTERVAL_S``: askers that queue behind a count share the next
        one. A count reads the host's whole TCP table, and the request that asks is cheap."""
        arrived = time.monotonic()
        async with self._count_lock:
            if self._counted is not None and self._counted[0] >= arrived:
                return self._counted[1]
            if self._counted is not None:
                # A loop: asyncio may wake a sleeper up to its clock resolution early.
                while (wait := self._counted[0] + _COUNT_INTERVAL_S - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
            started = time.monotonic()
            try:
                counted = await asyncio.to_thread(connections.spread, self._config.port)
            except Exception:  # a bug: answer without counts
                log.exception("counting the front ends' connections failed")
                counted = None
            self._counted = (started, counted)
            return counted

    def record_control(
        self, method: str, code: str, t0: float, context: grpc.aio.ServicerContext,
        details: str = "",
    ) -> None:
        seconds = time.perf_counter() - t0
        self._metrics.observe_request(method, code, seconds)
        level = call_log_level(code, self._config.access_log)
        if not log.isEnabledFor(level):
            return
        line = (f"rpc={method} code={code} duration_ms={seconds * 1e3:.3f} peer={context.peer()}"
                f"{call_tags(context)}")
        log.log(level, line + (f" details={logfmt(details)}" if details else ""))

    async def serve(
        self, op: Op, requests: AsyncIterable[bytes], context: grpc.aio.ServicerContext,
        unary: bool = False, step: bool = False,
    ) -> AsyncIterator[bytes | pb.AttentionResponse]:
        """A compute rpc (every ``Op``: ``add_to_server`` below registers one handler per op):
        receive, run on the engine, stream the outputs back, account the call. ``unary``: the
        rpc's unary twin (``requests`` is its one message, and so is the answer: every output
        as one slice and the stats, yielded joined); ``step`` with it: one call of a step
        stream (``CacheDecodeSteps``), whose refusal is raised (a ``RequestError``, once
        counted) for the stream's handler to answer, not sent as the stream's status. All
        count under the op's name in the metrics; the log line says which."""
        call = _CallRecord(op.rpc, context, self._uploads, unary, step)
        self.tracker.enter()
        self._metrics.inflight.inc()
        received: Upload | None = None
        refusal: tuple[grpc.StatusCode, str] | None = None
        try:
            if not self.tracker.accepting:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, self.tracker.refusal)
            call.principal = self._caller(context)
            proxied, forwarded = _proxy_headers(context)
            received = await receive_request(
                call, op, requests, self._limits, self._link,
                upload_caller(call.principal, call.peer, forwarded, self._proxies), unary=unary,
                proxied=proxied)
            if step and received.step_timeout_ms:
                call.due = call.t0 + received.step_timeout_ms / 1e3
            call.bytes_in = received.wire_bytes_in
            handed = time.perf_counter()
            stats = await self._link.run(
                received.params, received.buffers, received.regions, call.principal,
            )
            call.engine_seconds = time.perf_counter() - handed
            call.queue_seconds = stats.queue_seconds
            chunk_bytes = MAX_MESSAGE_BYTES if unary else self._config.chunk_bytes
            parts: list[bytes | memoryview] = []  # a unary answer's, joined once below
            for nbytes, msg_parts in response_messages(received, chunk_bytes):
                call.bytes_out += nbytes
                if unary:
                    parts += msg_parts
                else:
                    yield b"".join(msg_parts)  # the outputs' one copy (see add_to_server)
            # Accounted before the last message, so it is done when the client sees OK.
            call.ok(stats)
            self._finish(call)
            last = stats_message(stats, received, call.bytes_out)
            if unary:  # one message; joined here, while the call still holds its buffers
                parts.append(last.SerializeToString())
                yield b"".join(parts)
            else:
                yield last
            return
        except (asyncio.CancelledError, GeneratorExit):
            call.code = self._gone_code(call)
            self._finish(call)
            raise
        except StreamEnded as exc:
            refusal = (exc.code, exc.details)
            # A client's cancel or deadline cuts the request stream exactly like a short
            # upload; grpc reports the cancel a moment later. Wait for it, so the call is
            # counted as what it was, not as the client's INVALID_ARGUMENT. (A unary request
            # arrived whole: nothing to wait for.)
            try:
                if not unary:
                    await asyncio.sleep(_CUT_OFF_WAIT_S)
            except asyncio.CancelledError:
                call.code = self._gone_code(call)
                self._finish(call)
                raise
        except RequestError as exc:
            refusal = (exc.code, exc.details)
        except Cancelled:
            code = grpc.StatusCode[self._gone_code(call)]
            refusal = (code, "call ended before its compute finished")
        except Exception as exc:
            log.exception("rpc=%s internal error", op.rpc)
            internal = RequestError.internal(exc)
            refusal = (internal.code, internal.details)
        finally:
            if received is not None:
                received.release()
        # Accounted before the status goes out, so metrics and logs are final when it arrives.
        call.code, call.details = refusal[0].name, refusal[1]
        self._finish(call)
        if step:  # the stream's handler ends the stream with it, or answers it in-band
            raise RequestError(*refusal)
        await context.abort(*refusal)

    def _gone_code(self, call: _CallRecord) -> str:
        """How a call that ended early counts: UNAVAILABLE when the drain cut it (its client
        sees the server go), else the client's deadline or cancel: the call's own deadline
        on a step stream (``step_timeout_ms``), whose client cancels the stream at it, else
        the rpc's (``_gone_code``)."""
        if self.tracker.cutting:
            return "UNAVAILABLE"
        if call.due is not None and time.perf_counter() >= call.due - _DEADLINE_SLACK_S:
            return "DEADLINE_EXCEEDED"
        return _gone_code(call.context)

    def _finish(self, call: _CallRecord) -> None:
        """Exactly once per compute call: release it, record metrics, write its log line."""
        if call.finished:
            return
        call.finished = True
        seconds = time.perf_counter() - call.t0
        self.tracker.leave()
        self._metrics.inflight.dec()
        self._metrics.observe_request(
            call.rpc, call.code, seconds, bytes_in=call.bytes_in, bytes_out=call.bytes_out,
            region_in=call.region_in, region_out=call.region_out, tokens=call.tokens,
            flops=call.flops, queue_seconds=call.queue_seconds,
            engine_seconds=call.engine_seconds,
        )
        level = call_log_level(call.code, self._config.access_log)
        if not log.isEnabledFor(level):  # the line costs ~10 us to build; skip it unread
            return
        log.log(level, call.log_line(seconds))


class _CallRecord(Upload):
    """One compute call in a front end: its upload (from its header on: the request, its
    buffers and its charge) and what it did, for its metrics and log line."""

    def __init__(self, rpc: str, context: grpc.aio.ServicerContext, budget: UploadBudget,
                 unary: bool = False, step: bool = False) -> None:
        super().__init__(budget)
        self.rpc = rpc
        self.context = context  # its metadata read only for the log line
        self.principal = ""  # with auth on (``caller``: whose upload share it counts against)
        self.peer = context.peer()
        self.t0 = time.perf_counter()
        self.code, self.details = "OK", ""
        self.unary = unary
        self.step = step
        self.bytes_in = self.bytes_out = self.region_in = self.region_out = 0
        self.tokens = self.flops = 0
        self.queue_seconds: float | None = None
        self.engine_seconds: float | None = None  # handed to the engine -> its answer back
        self.due: float | None = None  # a step's own deadline (perf_counter), if it has one
        self.stats: ExecStats | None = None  # set by ``ok``
        self.finished = False

    def ok(self, stats: ExecStats) -> None:
        assert self.params is not None
        self.tokens, self.flops = self.params.tokens, stats.flops
        self.region_in, self.region_out = self.region_bytes_in, self.region_bytes_out
        self.stats = stats

    def log_line(self, seconds: float) -> str:
        line = (f"rpc={self.rpc} code={self.code} duration_ms={seconds * 1e3:.3f} "
                f"bytes_in={self.bytes_in} bytes_out={self.bytes_out}")
        if self.step:
            line += " step=1"
        elif self.unary:
            line += " unary=1"
        stats = self.stats
        if stats is not None:
            line += (
                f" tokens={self.tokens} queue_ms={stats.queue_seconds * 1e3:.3f}"
                f" kernel_ms={stats.kernel_seconds * 1e3:.3f}"
                f" batch_requests={stats.batch_requests}"
            )
            if self.regions:
                line += f" regions={','.join(sorted(self.regions))}"
        line += f" peer={self.peer}{call_tags(self.context, self.principal)}"
        if self.details:
            line += f" details={logfmt(self.details)}"
        return line


# The compute rpcs' handlers: raw bytes in and out (``add_to_server``), requests read and
# responses written by ``attention_wire.messages``, the headers parsed once (a memo,
# ``validation.parse_header``).
#
# Request and response messages carry up to ~1 MiB of tensor bytes each. Through upb's generated
# classes a request chunk costs a parse plus a copy on every ``data`` access, and a response
# chunk a ``tobytes``, a copy into the message and a serialization: measured here 0.2 ms per MiB
# in and 0.4-1.7 ms per MiB out, against 0.04 ms for the single copy this module leaves (into
# the pinned input buffer; into the response bytes). On an H100 host the event loop spent about
# 5 ms per 5 MB request, mostly on those copies.
#
# So the Prefill/Decode handlers are registered with raw bytes in and out (``add_to_server``):
# requests are read field by field (``attention_wire.messages``) with ``data`` as a memoryview into
# the received message, and responses are written with the tensor bytes joined once behind a
# prefix that protobuf itself serializes. The output is byte-for-byte what ``SerializeToString``
# gives, and valid messages parse as protobuf parses them, unknown fields included (tests check
# both). The parser is as strict as protobuf about field numbers, and stricter in corners a
# conforming sender never reaches, where it refuses rather than guesses (INVALID_ARGUMENT):
# groups (wire types 3/4, absent from proto3), and enum values above 32 bits (protobuf truncates
# them). Small messages (headers, stats, the region rpcs) still use the generated classes.
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AttentionService"].full_name


# The unary rpcs the engine answers (servicer.control_rpc), by method name.
CONTROL_METHODS = (
    "RegisterRegion", "UnregisterRegion", "ListRegions", "ConnectNixl",
    "CreateCaches", "ReleaseCaches", "ForkCache", "ListCaches",
)


def _serialize(message: bytes | Any) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def _unary(servicer: Any, method: str, behavior: Any) -> grpc.RpcMethodHandler:
    """A unary handler that parses its request itself: bytes that are not the rpc's message
    answer INVALID_ARGUMENT, counted and logged like any refusal (a deserializer that raises
    inside grpc answers UNKNOWN, logs a traceback and is never counted)."""
    desc = pb.DESCRIPTOR.services_by_name["AttentionService"].methods_by_name[method]
    request_cls = getattr(pb, desc.input_type.name)

    async def parsed(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        t0 = time.perf_counter()
        try:
            request = request_cls.FromString(raw)
        except DecodeError as exc:
            details = f"message: not a valid {request_cls.__name__}: {exc}"
            servicer.record_control(method, "INVALID_ARGUMENT", t0, context, details)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, details)
        return await behavior(request, context)

    return grpc.unary_unary_rpc_method_handler(
        parsed, request_deserializer=None, response_serializer=_serialize,
    )


def _compute(servicer: Any, op: Op) -> Any:
    # An async generator function, as grpc.aio requires of a streaming handler.
    async def behavior(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async for msg in servicer.serve(op, requests, context):
            yield msg

    return behavior


async def _one(message: bytes) -> Any:
    yield message


def _compute_unary(servicer: Any, op: Op, step: bool = False) -> Any:
    """The unary twin of a compute rpc: the stream handler fed one message, its response
    messages joined into one AttentionResult (whose field numbers are AttentionResponse's, so
    the concatenation is that message: a test checks it). ``step``: one call of a step
    stream."""

    async def behavior(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        parts = [_serialize(msg) async for msg in servicer.serve(op, _one(raw), context,
                                                                  unary=True, step=step)]
        return parts[0] if len(parts) == 1 else b"".join(parts)  # serve yields one

    return behavior


# Calls a step stream opened with in-band errors (STEP_ERRORS_HEADER) runs at once, the one
# being answered included (ServerInfo.steps_in_flight): a model host's two micro-batches per
# layer and a few layers ahead. Past it the stream's next message is not read, so the
# client's sends wait in HTTP/2 flow control.
STEPS_IN_FLIGHT = 8


def _in_band(context: grpc.aio.ServicerContext) -> bool:
    return any(key == STEP_ERRORS_HEADER and value == IN_BAND
               for key, value in context.invocation_metadata() or ())


async def _in_flight(servicer: Any, call: Any, op: Op, requests: Any,
                     context: grpc.aio.ServicerContext) -> Any:
    """A step stream with in-band errors: each call starts as it arrives (up to
    STEPS_IN_FLIGHT unanswered), after the earlier calls that name one of its caches; the
    answers go in order, a failed call's as its error. Once the server drains, no call is
    read: those read are answered, then the stream ends UNAVAILABLE."""
    room = asyncio.Semaphore(STEPS_IN_FLIGHT)
    answers: asyncio.Queue[Any] = asyncio.Queue()  # tasks in order, then None or an error
    # The calls not finished and their caches: at most STEPS_IN_FLIGHT, so a new call's
    # predecessors are a few set tests (a per-id table cost ~50 us a 64-id step, dev box).
    running: list[tuple[asyncio.Task[Any], frozenset[str]]] = []

    async def one(raw: bytes, after: list[asyncio.Task[Any]]) -> Any:
        if after:  # done or failed: a failed call changed nothing
            await asyncio.wait(after)
        return await call(raw, context)

    async def read() -> None:
        try:
            async for raw in requests:
                await room.acquire()
                if not servicer.tracker.accepting:
                    break
                ids = step_cache_ids(raw, op)
                running[:] = [(t, c) for t, c in running if not t.done()]
                after = [t for t, c in running if not ids.isdisjoint(c)] if ids else []
                task = asyncio.ensure_future(one(raw, after))
                if ids:
                    running.append((task, ids))
                answers.put_nowait(task)
            answers.put_nowait(None)
        except BaseException as exc:  # noqa: BLE001 (the stream's own end: handed on)
            answers.put_nowait(exc)

    reader = asyncio.ensure_future(read())
    item: Any = None
    try:
        while (item := await answers.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            try:
                answer = await item
            except RequestError as refusal:
                answer = error_answer(refusal)
            yield answer
            room.release()
        if not servicer.tracker.accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, servicer.tracker.refusal)
    finally:
        reader.cancel()
        if isinstance(item, asyncio.Task):  # the one being answered when the stream went
            item.cancel()
        while not answers.empty():  # read, not yet answered
            item = answers.get_nowait()
            if isinstance(item, asyncio.Task):
                item.cancel()


def _compute_steps(servicer: Any, op: Op) -> Any:
    """A stream of whole calls: each message served as the unary twin serves its one message.
    By default one after another, and a failing call ends the stream with its status; with
    in-band errors (STEP_ERRORS_HEADER), several at once (``_in_flight``)."""
    call = _compute_unary(servicer, op, step=True)

    async def behavior(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        if _in_band(context):
            async for answer in _in_flight(servicer, call, op, requests, context):
                yield answer
            return
        async for raw in requests:
            try:
                answer = await call(raw, context)
            except RequestError as refusal:
                await context.abort(refusal.code, refusal.details)
            yield answer

    return behavior


def _control(servicer: Any, method: str) -> Any:
    async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await servicer.control_rpc(method, request, context)

    return behavior


def add_to_server(servicer: Any, server: grpc.aio.Server) -> None:
    """Register AttentionService like the generated ``add_..._to_server``, except that the
    compute rpcs take raw request bytes and may yield pre-encoded response bytes."""
    handlers = {
        op.rpc: grpc.stream_stream_rpc_method_handler(
            _compute(servicer, op), request_deserializer=None, response_serializer=_serialize
        )
        for op in Op
    }
    for op in Op:
        handlers[unary_method(op.rpc)] = grpc.unary_unary_rpc_method_handler(
            _compute_unary(servicer, op), request_deserializer=None, response_serializer=None
        )
    for op in Op:
        if op.steps_rpc:
            handlers[op.steps_rpc] = grpc.stream_stream_rpc_method_handler(
                _compute_steps(servicer, op), request_deserializer=None,
                response_serializer=None)
    handlers["GetServerInfo"] = _unary(servicer, "GetServerInfo", servicer.GetServerInfo)
    for method in CONTROL_METHODS:
        handlers[method] = _unary(servicer, method, _control(servicer, method))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
