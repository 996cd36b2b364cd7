"""Request streams in, response streams out (protocol framing only, no policy)."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterable, Iterator, Mapping
from dataclasses import dataclass

import grpc
import numpy as np

from attention_service.config import MAX_MESSAGE_BYTES, MESSAGE_OVERHEAD_BYTES
from attention_service.errors import StreamEnded, exhausted, invalid
from attention_service.frontend.validation import ChunkAssembler, Limits, checked_header
from attention_service.frontend.wire import chunk_head, output_chunk_parts, parse_request
from attention_service.link import Buffers, EngineLink, ExecStats
from attention_service.params import INPUTS, OUTPUTS, Op, Params, RegionSpan
from attention_wire import unary_method
from attention_wire.pb import attention_pb2 as pb

log = logging.getLogger("attention_service")

# One response message as pieces to join (wire.output_chunk_parts).
MessageParts = tuple[bytes | memoryview, ...]

# Output bytes a unary compute rpc answers in its one message (gRPC's 4 MiB limit, less room
# for the slices' headers and the stats).
MAX_UNARY_OUTPUT_BYTES = MAX_MESSAGE_BYTES - MESSAGE_OVERHEAD_BYTES


class UploadBudget:
    """Host bytes reserved by the uploads in flight in one front-end process: a request's
    buffers are reserved against it when its header is accepted (before any byte arrives),
    so headers that declare large tensors cannot together reserve more than ``limit``.
    Event-loop only (no lock)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def reserve(self, nbytes: int) -> None:
        if self.used + nbytes > self.limit:
            raise exhausted(
                "header", f"this request needs {nbytes} bytes of buffers and uploads in flight "
                f"hold {self.used} of the server's {self.limit} (--max-upload-bytes); retry "
                "later")
        self.used += nbytes

    def release(self, nbytes: int) -> None:
        self.used -= nbytes


@dataclass
class Received:
    """A fully received request: its params, the tensors in regions, the rest in buffers,
    whose ``reserved`` bytes count against ``budget`` until ``release``."""

    params: Params
    regions: Mapping[str, RegionSpan]
    buffers: Buffers
    budget: UploadBudget
    reserved: int
    step_timeout_ms: int = 0  # the first message's (RawRequest.step_timeout_ms)

    def release(self) -> None:
        self.buffers.release()
        self.budget.release(self.reserved)

    # Each read twice per call (its metrics, its stats message): summed once.
    @functools.cached_property
    def wire_bytes_in(self) -> int:
        return sum(self.params.nbytes(n) for n in INPUTS if n not in self.regions)

    @functools.cached_property
    def region_bytes_in(self) -> int:
        return sum(self.params.nbytes(n) for n in INPUTS if n in self.regions)

    @functools.cached_property
    def region_bytes_out(self) -> int:
        return sum(self.params.nbytes(n) for n in OUTPUTS if n in self.regions)


async def receive_request(
    op: Op, requests: AsyncIterable[bytes], limits: Limits, link: EngineLink,
    budget: UploadBudget, unary: bool = False,
) -> Received:
    """Header first (validated before any byte is buffered), then chunks until end of stream.
    ``requests`` are raw PrefillRequest/DecodeRequest messages (see wire.py). Buffers come
    from ``link`` for every tensor not in a region, outputs included, reserved against
    ``budget``; on any failure both are given back before this raises. ``unary``: the
    outputs must fit the one response message (MAX_UNARY_OUTPUT_BYTES)."""
    it = requests.__aiter__()
    try:
        first = parse_request(await it.__anext__(), op)
    except StopAsyncIteration:
        raise StreamEnded(grpc.StatusCode.INVALID_ARGUMENT,
                          "header: missing: the stream ended before any message") from None
    if first.header is None:
        raise invalid("header", "missing: the first message must carry the header")
    params, regions = checked_header(op, first.header, first.header_bytes, limits)
    sizes = {
        n: params.nbytes(n) for n in (*INPUTS, *OUTPUTS)
        if n not in regions and (n != "lse" or params.return_lse)
    }
    total = sum(sizes.values())
    if unary:
        outputs = sum(sizes.get(n, 0) for n in OUTPUTS)
        if outputs > MAX_UNARY_OUTPUT_BYTES:
            raise invalid(
                "header.q", f"the outputs take {outputs} bytes, over the {MAX_UNARY_OUTPUT_BYTES} "
                f"one response message of {unary_method(op.rpc)} can carry: use the stream rpc "
                f"{op.rpc}")
    budget.reserve(total)
    try:
        buffers = await _allocate(link, sizes, total)
        try:
            chunks = ChunkAssembler(
                params, {n: a for n, a in buffers.arrays.items() if n in INPUTS}
            )
            chunks.add(first.chunks)
            async for raw in it:
                msg = parse_request(raw, op)
                if msg.header is not None:
                    raise invalid("header", "repeated: only the first message may carry a "
                                  "header")
                chunks.add(msg.chunks)
            chunks.finish()
        except BaseException:
            buffers.release()
            raise
    except BaseException:
        budget.release(total)
        raise
    return Received(params, regions, buffers, budget, total, first.step_timeout_ms)


async def _allocate(link: EngineLink, sizes: dict[str, int], total: int) -> Buffers:
    try:
        return await link.allocate(sizes)
    except (MemoryError, OSError, RuntimeError) as exc:
        # Host memory, shared memory or pinning failed: the caller's status, not ours.
        log.warning("could not reserve %d bytes for a request: %s: %s", total,
                    type(exc).__name__, exc)
        raise exhausted(
            "header", f"the server could not reserve {total} bytes of host memory for this "
            "request's tensors; retry later or send less"
        ) from None


def output_messages(
    field: int, dtype: int, shape: tuple[int, ...], data: np.ndarray, chunk_bytes: int
) -> Iterator[tuple[int, MessageParts]]:
    """Row slices of a tensor (its bytes in ``data``) of at most ``chunk_bytes`` data each, as
    (data bytes, AttentionResponse in pieces) pairs (``wire.output_chunk_parts``: the pieces
    view ``data``, so they are joined while the call holds its buffers).

    A single row larger than ``chunk_bytes`` still goes out whole (one row per message):
    validation keeps every row under the 4 MiB message limit.
    """
    rows = shape[0]
    row_bytes = data.size // rows if rows else 0
    per_msg = max(1, chunk_bytes // row_bytes) if row_bytes else max(rows, 1)
    raw = memoryview(data)
    start = 0
    while True:
        count = min(per_msg, rows - start)
        piece = raw[start * row_bytes : (start + count) * row_bytes]
        yield len(piece), output_chunk_parts(chunk_head(field, dtype, shape, start, count),
                                             piece)
        start += count
        if start >= rows:
            return


def response_messages(
    received: Received, chunk_bytes: int
) -> Iterator[tuple[int, MessageParts]]:
    """(data bytes, AttentionResponse in pieces) for the OUT row slices, then the LSE row slices
    (when asked for), of the outputs not written into regions; the caller appends the stats."""
    p, arrays = received.params, received.buffers.arrays
    if p.op is Op.APPEND_KV:
        return  # no outputs: the stats (cache lengths) are the answer
    if "out" not in received.regions:
        yield from output_messages(pb.OUT, p.dtype, p.q_shape, arrays["out"], chunk_bytes)
    lse_shape = p.lse_shape
    if lse_shape is not None and "lse" not in received.regions:
        yield from output_messages(pb.LSE, pb.FLOAT32, lse_shape, arrays["lse"], chunk_bytes)


def stats_message(
    stats: ExecStats, received: Received, bytes_out: int
) -> pb.AttentionResponse:
    return pb.AttentionResponse(
        stats=pb.RequestStats(
            queue_seconds=stats.queue_seconds, h2d_seconds=stats.h2d_seconds,
            kernel_seconds=stats.kernel_seconds, d2h_seconds=stats.d2h_seconds,
            bytes_in=received.wire_bytes_in, bytes_out=bytes_out,
            flops=float(stats.flops), batch_requests=stats.batch_requests,
            batch_tokens=stats.batch_tokens, region_bytes_in=received.region_bytes_in,
            region_bytes_out=received.region_bytes_out, cache_lengths=stats.cache_lengths,
        )
    )
