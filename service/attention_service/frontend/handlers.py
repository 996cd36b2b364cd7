"""The compute rpcs' handlers: raw bytes in and out (``add_to_server``), requests read by
``attention_wire.requests`` with their headers parsed once (a memo), responses written by
``attention_wire.responses``.

Request and response messages carry up to ~1 MiB of tensor bytes each. Through upb's generated
classes a request chunk costs a parse plus a copy on every ``data`` access, and a response
chunk a ``tobytes``, a copy into the message and a serialization: measured here 0.2 ms per MiB
in and 0.4-1.7 ms per MiB out, against 0.04 ms for the single copy this module leaves (into
the pinned input buffer; into the response bytes). On an H100 host the event loop spent about
5 ms per 5 MB request, mostly on those copies.

So the Prefill/Decode handlers are registered with raw bytes in and out (``add_to_server``):
requests are read field by field (``attention_wire.codec``) with ``data`` as a memoryview into
the received message, and responses are written with the tensor bytes joined once behind a
prefix that protobuf itself serializes. The output is byte-for-byte what ``SerializeToString``
gives, and valid messages parse as protobuf parses them, unknown fields included (tests check
both). The parser is as strict as protobuf about field numbers, and stricter in corners a
conforming sender never reaches, where it refuses rather than guesses (INVALID_ARGUMENT):
groups (wire types 3/4, absent from proto3), and enum values above 32 bits (protobuf truncates
them). Small messages (headers, stats, the region rpcs) still use the generated classes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from attention_service.errors import RequestError, invalid
from attention_service.params import Op
from attention_wire import unary_method
from attention_wire.codec import WireError
from attention_wire.pb import attention_pb2 as pb
from attention_wire.requests import (
    IN_BAND,
    STEP_ERRORS_HEADER,
    RawRequest,
    read_request,
    request_header,
)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AttentionService"].full_name


_HEADERS = {op: op.header for op in Op}

# Parsed headers by (op, wire bytes), for headers up to MEMO_HEADER_BYTES: a KV-cache
# session's decode steps repeat one header (same shapes, same caches) call after call; plain
# Decode headers change every step (k grows) and only pass through. Shared messages are only
# read. Bounded: at most MEMO_ENTRIES headers and MEMO_BYTES of their wire bytes; a full memo
# starts over. A step of 64 caches has a ~1 KB header (its ids): parsing and checking it again
# each step took ~290 us of a front end's CPU (2-core dev box), the memo ~1 us.
MEMO_HEADER_BYTES = 16 << 10
MEMO_ENTRIES = 1024
MEMO_BYTES = 4 << 20


class Memo(dict):  # type: ignore[type-arg]
    """A dict that ``memoized`` keeps under MEMO_ENTRIES entries and MEMO_BYTES of keys."""

    nbytes = 0


_PARSED: Memo = Memo()


def memoized(memo: dict[Any, Any], key: Any, make: Callable[[], Any], size: int = 0) -> Any:
    """``memo[key]``, made by ``make()`` (and kept) when missing; ``make``'s exceptions
    propagate and leave nothing behind. ``size``: the key's bytes (a ``Memo`` counts them).
    At MEMO_ENTRIES entries, or MEMO_BYTES of keys, the memo starts over."""
    got = memo.get(key)
    if got is None:
        got = make()
        counted = isinstance(memo, Memo)
        if len(memo) >= MEMO_ENTRIES or (counted and memo.nbytes + size > MEMO_BYTES):
            memo.clear()
            if counted:
                memo.nbytes = 0
        memo[key] = got
        if counted:
            memo.nbytes += size
    return got


def _parse_header(op: Op, raw: bytes) -> Any:
    if len(raw) > MEMO_HEADER_BYTES:
        return _HEADERS[op].FromString(raw)
    return memoized(_PARSED, (op, raw), lambda: _HEADERS[op].FromString(raw), len(raw))
# The unary rpcs the engine answers (servicer.control_rpc), by method name.
CONTROL_METHODS = (
    "RegisterRegion", "UnregisterRegion", "ListRegions", "ConnectNixl",
    "CreateCaches", "ReleaseCaches", "ForkCache", "ListCaches",
)


def parse_request(message: bytes, op: Op) -> RawRequest:
    """``message`` as a PrefillRequest / DecodeRequest (``attention_wire.requests``), its
    header parsed once per distinct header (the memo above); INVALID_ARGUMENT if it is not
    valid protobuf."""
    try:
        return read_request(message, lambda raw: _parse_header(op, raw))
    except (WireError, DecodeError) as exc:
        raise invalid("message", f"not a valid {op.rpc}Request: {exc}") from None


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


# The compute rpcs with a step stream (each request message one whole call, each response
# message its AttentionResult), by op: the rpc's name.
STEP_STREAMS = {
    Op.CACHE_DECODE: "CacheDecodeSteps", Op.PREFILL: "PrefillSteps", Op.DECODE: "DecodeSteps",
}


# Calls a step stream opened with in-band errors (STEP_ERRORS_HEADER) runs at once, the one
# being answered included (ServerInfo.steps_in_flight): a model host's two micro-batches per
# layer and a few layers ahead. Past it the stream's next message is not read, so the
# client's sends wait in HTTP/2 flow control.
STEPS_IN_FLIGHT = 8


def _in_band(context: grpc.aio.ServicerContext) -> bool:
    return any(key == STEP_ERRORS_HEADER and value == IN_BAND
               for key, value in context.invocation_metadata() or ())


# The caches a step header names, by the header's wire bytes: a model host's steps repeat a
# few headers (one per layer), and a 64-id header's ids read once, not each step.
_STEP_CACHES: Memo = Memo()
_NO_CACHES: frozenset[str] = frozenset()


def _cache_ids(raw: bytes, op: Op) -> frozenset[str]:
    """The caches a call names; none for a stateless op, and for a message ``serve`` will
    refuse."""
    if not op.cached:
        return _NO_CACHES
    try:
        header_bytes = request_header(raw)
    except WireError:
        return _NO_CACHES
    if header_bytes is None:
        return _NO_CACHES

    def read() -> frozenset[str]:
        try:
            return frozenset(_parse_header(op, header_bytes).cache.cache_ids)
        except DecodeError:
            return _NO_CACHES

    return memoized(_STEP_CACHES, header_bytes, read, len(header_bytes))  # type: ignore[no-any-return]


def _error_answer(refusal: RequestError) -> bytes:
    """A failed call's in-band answer: an AttentionResult with only ``error`` set."""
    error = pb.CallError(code=refusal.code.value[0], details=refusal.details)
    return pb.AttentionResult(error=error).SerializeToString()


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
                ids = _cache_ids(raw, op)
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
                answer = _error_answer(refusal)
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


# A compute rpc's unary twin and step stream -> the rpc (``PrefillSteps`` -> ``Prefill``): the
# op their handlers (add_to_server) serve, hence the ``rpc`` label their calls count under.
_OP_RPC = {unary_method(op.rpc): op.rpc for op in Op} | {
    method: op.rpc for op, method in STEP_STREAMS.items()}


def metric_rpc(method: str) -> str:
    """The ``rpc`` label of a method's calls: its op's rpc, or the method's own name."""
    return _OP_RPC.get(method, method)


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
    for op, method in STEP_STREAMS.items():
        handlers[method] = grpc.stream_stream_rpc_method_handler(
            _compute_steps(servicer, op), request_deserializer=None, response_serializer=None
        )
    handlers["GetServerInfo"] = _unary(servicer, "GetServerInfo", servicer.GetServerInfo)
    for method in CONTROL_METHODS:
        handlers[method] = _unary(servicer, method, _control(servicer, method))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
