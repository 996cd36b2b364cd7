"""Request streams in, response streams out (protocol framing only, no policy)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Iterator

import torch
from attention_client.pb import attention_pb2 as pb

from attention_service.codec import HostAllocator, output_messages
from attention_service.errors import invalid
from attention_service.execution import Result
from attention_service.validation import (
    InputAssembler,
    Plan,
    validate_decode_header,
    validate_prefill_header,
)
from attention_service.wire import parse_request


async def receive_request(
    rpc: str, requests: AsyncIterable[bytes], max_request_bytes: int, alloc: HostAllocator
) -> tuple[Plan, dict[str, torch.Tensor]]:
    """Header first (validated before any byte is buffered), then chunks until end of stream.
    ``requests`` are raw PrefillRequest/DecodeRequest messages (see wire.py)."""
    it = requests.__aiter__()
    try:
        first = parse_request(await it.__anext__(), rpc)
    except StopAsyncIteration:
        raise invalid("header", "missing: the stream ended before any message") from None
    if first.header is None:
        raise invalid("header", "missing: the first message must carry the header")
    if rpc == "Prefill":
        plan = validate_prefill_header(first.header, max_request_bytes)
    else:
        plan = validate_decode_header(first.header, max_request_bytes)
    # Off the event loop: pinning a large host buffer can take a while.
    assembler = await asyncio.to_thread(InputAssembler, plan, alloc)
    assembler.add(first.chunks)
    async for raw in it:
        msg = parse_request(raw, rpc)
        if msg.header is not None:
            raise invalid("header", "repeated: only the first message may carry a header")
        assembler.add(msg.chunks)
    return plan, assembler.finish()


def response_messages(result: Result, chunk_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(data bytes, encoded AttentionResponse) for the OUT row slices, then the LSE row slices
    (when present); the caller appends the stats."""
    yield from output_messages(pb.OUT, result.out, chunk_bytes)
    if result.lse is not None:
        yield from output_messages(pb.LSE, result.lse, chunk_bytes)


def stats_message(result: Result, bytes_in: int, bytes_out: int) -> pb.AttentionResponse:
    s = result.stats
    return pb.AttentionResponse(
        stats=pb.RequestStats(
            queue_seconds=s.queue_seconds, h2d_seconds=s.h2d_seconds,
            kernel_seconds=s.kernel_seconds, d2h_seconds=s.d2h_seconds, bytes_in=bytes_in,
            bytes_out=bytes_out, flops=float(s.flops), batch_requests=s.batch_requests,
            batch_tokens=s.batch_tokens,
        )
    )
