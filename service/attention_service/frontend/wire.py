"""The compute rpcs' requests in protobuf wire format, by hand, on the server's hot path, and
the handlers that take them (responses: ``attention_wire.responses``).

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

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import grpc
from google.protobuf.message import DecodeError

from attention_service.errors import invalid
from attention_service.params import Op
from attention_wire import unary_method
from attention_wire.codec import (
    LEN,
    VARINT,
    WireError,
    field_number,
    iter_fields,
)
from attention_wire.pb import attention_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AttentionService"].full_name
# PrefillRequest and DecodeRequest number their fields alike (a test checks it).
_HEADER = field_number(pb.PrefillRequest.DESCRIPTOR, "header")
_CHUNKS = field_number(pb.PrefillRequest.DESCRIPTOR, "chunks")
_STEP_TIMEOUT = field_number(pb.PrefillRequest.DESCRIPTOR, "step_timeout_ms")
_TC = pb.TensorChunk.DESCRIPTOR
_TC_FIELD, _TC_OFFSET, _TC_DATA = (field_number(_TC, n) for n in ("field", "offset", "data"))


class RawChunk(NamedTuple):
    """A TensorChunk whose ``data`` is a view into the received message (no copy)."""

    field: int  # pb.InputField value
    offset: int
    data: memoryview


class RawRequest(NamedTuple):
    """One PrefillRequest/DecodeRequest message: its header (if present) and chunks."""

    header: Any  # pb.PrefillHeader | pb.DecodeHeader | None
    chunks: list[RawChunk]
    header_bytes: bytes | None = None  # the header's wire bytes (its occurrences joined)
    step_timeout_ms: int = 0  # a step stream's call: how long its client waits (0: none)


# Fields per message and per chunk the parser reads before it refuses the message: a 4 MiB
# message of millions of empty fields must not hold the event loop for seconds. A real
# message has a header and a few chunks (attention_client: at most 3) of 3 fields each.
MAX_FIELDS_PER_MESSAGE = 1024
MAX_FIELDS_PER_CHUNK = 16


def _chunk(buf: memoryview) -> RawChunk:
    field = offset = 0
    data = memoryview(b"")
    for n, (number, wire_type, value) in enumerate(iter_fields(buf)):
        if n == MAX_FIELDS_PER_CHUNK:
            raise WireError(f"a chunk with more than {MAX_FIELDS_PER_CHUNK} fields")
        # Last occurrence wins and a mismatched wire type is an unknown field, as in protobuf.
        if number == _TC_FIELD and wire_type == VARINT:
            field = value
        elif number == _TC_OFFSET and wire_type == VARINT:
            offset = value
        elif number == _TC_DATA and wire_type == LEN:
            data = value
    return RawChunk(field, offset, data)


_HEADERS = {op: pb.DecodeHeader if op.decode_like else pb.PrefillHeader for op in Op}

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
    "RegisterRegion", "UnregisterRegion", "ListRegions",
    "CreateCaches", "ReleaseCaches", "ForkCache", "ListCaches",
)


def parse_request(message: bytes, op: Op) -> RawRequest:
    """``message`` as a PrefillRequest / DecodeRequest; INVALID_ARGUMENT if it is not valid
    protobuf."""
    header_parts: list[memoryview] = []
    chunks: list[RawChunk] = []
    step_timeout_ms = 0
    try:
        for n, (number, wire_type, value) in enumerate(iter_fields(memoryview(message))):
            if n == MAX_FIELDS_PER_MESSAGE:
                raise WireError(f"more than {MAX_FIELDS_PER_MESSAGE} fields in one message "
                                "(send fewer, larger chunks)")
            if wire_type != LEN:
                if number == _STEP_TIMEOUT and wire_type == VARINT:
                    step_timeout_ms = value & 0xFFFFFFFF  # uint32, as protobuf reads it
                continue  # else unknown
            if number == _HEADER:
                header_parts.append(value)  # repeated occurrences merge, as in protobuf
            elif number == _CHUNKS:
                chunks.append(_chunk(value))
        header_bytes = b"".join(header_parts) if header_parts else None
        header = _parse_header(op, header_bytes) if header_bytes is not None else None
    except (WireError, DecodeError) as exc:
        raise invalid("message", f"not a valid {op.rpc}Request: {exc}") from None
    return RawRequest(header, chunks, header_bytes, step_timeout_ms)


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


def _compute_steps(servicer: Any, op: Op) -> Any:
    """A stream of whole calls: each message served as the unary twin serves its one message,
    one after another; a failing call aborts the stream with its status (``serve`` does)."""
    call = _compute_unary(servicer, op, step=True)

    async def behavior(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async for raw in requests:
            yield await call(raw, context)

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
