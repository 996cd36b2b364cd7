"""Request streams in, response streams out (protocol framing only, no policy)."""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
from collections.abc import AsyncIterable, AsyncIterator, Collection, Iterable, Iterator, Mapping
from types import MappingProxyType
from urllib.parse import unquote

import grpc
import numpy as np

from attention_service.config import MAX_MESSAGE_BYTES, MESSAGE_OVERHEAD_BYTES
from attention_service.errors import RequestError, StreamEnded, exhausted, invalid
from attention_service.frontend.validation import (
    INPUT_FIELDS,
    Limits,
    checked_header,
    parse_request,
)
from attention_service.link import Buffers, EngineLink, ExecStats
from attention_service.params import INPUTS, OUTPUTS, Op, Params, RegionSpan
from attention_wire import unary_method
from attention_wire.messages import RawChunk, RawRequest, chunk_head, output_chunk_parts
from attention_wire.pb import attention_pb2 as pb

log = logging.getLogger("attention_service")

# One response message as pieces to join (``attention_wire.messages.output_chunk_parts``).
MessageParts = tuple[bytes | memoryview, ...]
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Output bytes a unary compute rpc answers in its one message (gRPC's 4 MiB limit, less room
# for the slices' headers and the stats).
MAX_UNARY_OUTPUT_BYTES = MAX_MESSAGE_BYTES - MESSAGE_OVERHEAD_BYTES


# A lazy link's upload is charged in steps of this many bytes as its messages arrive: a
# header that declares 1 GiB and sends nothing holds 16 MiB, not 1.33 GiB (issue 63), and a
# call of up to 16 MiB (a 6 MiB prefill, every decode step) is charged once at its header.
UPLOAD_STEP_BYTES = 16 << 20


def upload_caller(principal: str, peer: str, forwarded: str = "",
                  proxies: tuple[IPNetwork, ...] = ()) -> str:
    """Whose share an upload counts against: the token's principal with auth, else the peer's
    host (``ipv4:10.0.0.7:51234`` -> ``ipv4:10.0.0.7``: a caller's connections are one
    caller). A peer in ``proxies`` (``--trusted-proxies``) that names the caller's host
    (``forwarded``: its x-attention-caller header) counts that host instead: behind Envoy
    every client's peer is Envoy."""
    if principal:
        return principal
    host = peer.rpartition(":")[0] if peer.startswith(("ipv4:", "ipv6:")) else peer
    if forwarded and proxies and _trusted(host, proxies):
        return f"{forwarded} via {host}"
    return host


@functools.lru_cache(maxsize=1024)
def _trusted(host: str, proxies: tuple[IPNetwork, ...]) -> bool:
    """Whether peer host ``host`` (``ipv4:10.0.0.7``) is in ``proxies``: parsed once per
    proxy address, not per call."""
    try:  # grpc writes IPv6 peers percent-encoded: ipv6:%5B::1%5D:34260
        address = ipaddress.ip_address(unquote(host.partition(":")[2]).strip("[]"))
    except ValueError:  # a unix socket or an odd peer: never a trusted proxy
        return False
    return any(address in net for net in proxies)


class UploadBudget:
    """Host bytes reserved by the uploads in flight in one front-end process, in all and per
    caller (``share`` of ``limit`` each), so that neither all callers' headers together nor
    one caller's can hold more. Event-loop only (no lock)."""

    def __init__(self, limit: int, share: float = 1.0) -> None:
        self.limit = limit
        self.share = share
        self.caller_limit = int(limit * share)
        self.used = 0
        self.by_caller: dict[str, int] = {}

    def reserve(self, nbytes: int, caller: str = "", field: str = "header") -> None:
        held = self.by_caller.get(caller, 0)
        if self.used + nbytes > self.limit:
            raise exhausted(
                field, f"this request needs {nbytes} more bytes of buffers and uploads in "
                f"flight hold {self.used} of the server's {self.limit} (--max-upload-bytes); "
                "retry later")
        if held + nbytes > self.caller_limit:
            raise exhausted(
                field, f"this request needs {nbytes} more bytes of buffers and your uploads in "
                f"flight hold {held} of the {self.caller_limit} one caller may hold "
                f"(--max-upload-share {self.share:g} of --max-upload-bytes); retry later")
        self.used += nbytes
        self.by_caller[caller] = held + nbytes

    def release(self, nbytes: int, caller: str = "") -> None:
        self.used -= nbytes
        left = self.by_caller.get(caller, 0) - nbytes
        if left > 0:
            self.by_caller[caller] = left
        else:
            self.by_caller.pop(caller, None)


class Upload:
    """One call's request, from its header until the call ends: its charge against an
    ``UploadBudget`` (``cover(n)`` makes it at least ``n`` bytes, in ``UPLOAD_STEP_BYTES``
    steps, at most ``total``), its q/k/v chunks written into its buffers with their offsets
    checked as they come (``add``; tensors in regions get no chunks), and, once complete
    (``check_complete``), what the engine runs: params, regions and buffers, held until
    ``release`` gives buffers and charge back."""

    def __init__(self, budget: UploadBudget, caller: str = "", total: int = 0) -> None:
        self.budget, self.charged = budget, 0
        self.buffers: Buffers | None = None
        self._inputs: dict[str, np.ndarray] = {}  # uint8 views of the inputs sent as chunks
        self._in_place: Collection[str] = ()
        self._received: dict[str, int] = {}
        self.start(caller, total, None)

    def start(
        self, caller: str, total: int, params: Params | None,
        regions: Mapping[str, RegionSpan] = MappingProxyType({}), step_timeout_ms: int = 0,
    ) -> None:
        """What the header said (``receive_request``: an upload is made before it arrives)."""
        self.caller, self.total = caller, total
        self.params = params
        self.regions = regions
        self.step_timeout_ms = step_timeout_ms  # the first message's (RawRequest's)

    def cover(self, nbytes: int, field: str = "header") -> None:
        if nbytes <= self.charged:
            return
        more = min(self.total, max(nbytes, self.charged + UPLOAD_STEP_BYTES)) - self.charged
        self.budget.reserve(more, self.caller, field)
        self.charged += more

    def fill(self, buffers: Buffers, in_place: Collection[str] = ()) -> None:
        """The buffers the chunks go into (and the outputs come back in); ``in_place``: the
        inputs whose buffers are their one chunk's own bytes (the step socket's), checked
        as any chunk and not copied."""
        self.buffers = buffers
        self._inputs = {n: a for n, a in buffers.arrays.items() if n in INPUTS}
        self._received = dict.fromkeys(self._inputs, 0)
        self._in_place = in_place

    def add(self, chunks: Iterable[RawChunk]) -> None:
        for field, offset, data in chunks:
            name = INPUT_FIELDS.get(field)
            if name is None:
                raise invalid("chunks.field", f"unknown input field {field} (use Q, K or V)")
            if name not in self._inputs:
                raise invalid(f"chunks[{name}]",
                              f"{name} lives in a region (header.regions.{name}): send no bytes")
            done, size = self._received[name], self._inputs[name].size
            if offset < done:
                raise invalid(
                    f"chunks[{name}].offset",
                    f"{offset} overlaps bytes already received (next offset is {done})",
                )
            if offset > done:
                raise invalid(
                    f"chunks[{name}].offset",
                    f"{offset} is out of order (next offset is {done})",
                )
            n = len(data)
            if offset + n > size:
                raise invalid(
                    f"chunks[{name}]",
                    f"bytes [{offset}, {offset + n}) run past the end of {name} "
                    f"({size} bytes for its shape and dtype)",
                )
            if name not in self._in_place:
                self._inputs[name][done : done + n] = np.frombuffer(data, dtype=np.uint8)
            self._received[name] = done + n

    def came_whole(self) -> None:
        """Every input is in place (``fill``'s ``in_place``), each whole: a step socket
        message of a form checked before (attention_service.step_socket)."""
        for name in self._in_place:
            self._received[name] = self._inputs[name].size

    def check_complete(self) -> None:
        """Every byte arrived?"""
        for name, arr in self._inputs.items():
            got = self._received[name]
            if got != arr.size:
                raise StreamEnded(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"chunks[{name}]: missing bytes at end of stream: received {got} of "
                    f"{arr.size} bytes for {name}'s shape and dtype",
                )

    def release(self) -> None:
        if self.buffers is not None:
            self.buffers.release()
        self.budget.release(self.charged, self.caller)
        self.charged = 0

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
    upload: Upload, op: Op, requests: AsyncIterable[bytes], limits: Limits, link: EngineLink,
    caller: str = "", unary: bool = False, proxied: bool = False,
) -> Upload:
    """``upload`` (a call's, made before its first message) filled from ``requests``: header
    first (validated before any byte is buffered), then chunks until end of stream.
    ``requests`` are raw PrefillRequest/DecodeRequest messages (``attention_wire.messages``).
    Buffers come from ``link`` for every tensor not in a region, outputs included, charged to
    ``caller``'s share of the upload's budget: in full at the header when the link pins them,
    else as the bytes arrive (``Upload``), the outputs with the last message. A stream slower than
    ``limits`` allow (``upload_idle_timeout``, ``min_upload_rate``) ends. On any failure buffers
    and charge are given back before this raises. ``unary``: the request is its one message, and
    the outputs must fit the one response message (MAX_UNARY_OUTPUT_BYTES). ``proxied``: the
    call came through a proxy, so its tensors may not name regions (registered with one replica
    directly)."""
    it = requests.__aiter__()
    idle_s = limits.upload_idle_timeout
    try:
        # The wait for the first message is an idle wait too: a stream that never sent one
        # held an in-flight slot, and a graceful stop's whole grace period, for ever.
        async with asyncio.timeout(idle_s or None):
            raw = await it.__anext__()
    except StopAsyncIteration:
        raise StreamEnded(grpc.StatusCode.INVALID_ARGUMENT,
                          "header: missing: the stream ended before any message") from None
    except TimeoutError:
        raise RequestError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"header: no message for {idle_s:g} s after the call started "
            "(--upload-idle-timeout)") from None
    first, sizes = start_upload(upload, op, raw, limits, caller, unary=unary, proxied=proxied,
                                lazy=link.lazy_buffers)
    try:
        upload.fill(await _allocate(link, sizes, upload.total))
        upload.add(first.chunks)
        if not unary:
            await _receive_rest(it, op, upload, len(raw), limits)
        upload.check_complete()
        upload.cover(upload.total)  # the outputs
    except BaseException:
        upload.release()
        raise
    return upload


def start_upload(
    upload: Upload, op: Op, raw: bytes, limits: Limits, caller: str, *, unary: bool = True,
    proxied: bool = False, lazy: bool = False,
) -> tuple[RawRequest, dict[str, int]]:
    """A call's first message read into ``upload`` (``receive_request``; a step socket's
    whole call): its header checked, the upload started and charged (``lazy``: only for the
    bytes received so far), and the buffers it needs by name. Fills nothing: on failure
    nothing is held."""
    first = parse_request(raw, op)
    if first.header is None:
        raise invalid("header", "missing: the first message must carry the header")
    params, regions = checked_header(op, first.header, first.header_bytes, limits)
    if regions and proxied:
        raise RequestError(
            grpc.StatusCode.FAILED_PRECONDITION,
            "header.regions: this call came through a proxy (x-attention-proxied), and "
            "regions are registered with one replica directly: send calls that use them to "
            "that replica's own address")
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
    upload.start(caller, total, params, regions, first.step_timeout_ms)
    # A unary request is here whole; a lazy link's buffers fill as the bytes arrive.
    upload.cover(len(raw) if lazy and not unary else total)
    return first, sizes


async def _receive_rest(
    it: AsyncIterator[bytes], op: Op, upload: Upload, received: int, limits: Limits,
) -> None:
    """The messages after the header's, until the client ends the stream, no slower than
    ``limits`` allow: no wait for a message longer than ``upload_idle_timeout``, and
    ``min_upload_rate`` bytes/s on average once that long has passed."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    idle_s, min_rate = limits.upload_idle_timeout, limits.min_upload_rate
    try:
        async with asyncio.timeout_at(start + idle_s if idle_s else None) as timer:
            async for raw in it:
                received += len(raw)
                now = loop.time()
                if idle_s:
                    timer.reschedule(now + idle_s)
                late = now - start - idle_s
                if min_rate and late > 0 and received < min_rate * late:
                    raise exhausted(
                        "chunks", f"{received} bytes in {now - start:.1f} s, under the "
                        f"server's minimum upload rate of {min_rate} bytes/s "
                        "(--min-upload-rate)")
                msg = parse_request(raw, op)
                if msg.header is not None:
                    raise invalid("header", "repeated: only the first message may carry a "
                                  "header")
                upload.cover(received, "chunks")
                upload.add(msg.chunks)
    except TimeoutError:
        raise RequestError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"chunks: no message for {idle_s:g} s while the upload was incomplete "
            f"({received} bytes received; --upload-idle-timeout)") from None


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
    (data bytes, AttentionResponse in pieces) pairs (``output_chunk_parts``: the pieces
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
    received: Upload, chunk_bytes: int
) -> Iterator[tuple[int, MessageParts]]:
    """(data bytes, AttentionResponse in pieces) for the OUT row slices, then the LSE row slices
    (when asked for), of the outputs not written into regions; the caller appends the stats."""
    p, arrays = received.params, received.buffers.arrays
    if not p.op.queries:
        return  # AppendKV: no outputs: the stats (cache lengths) are the answer
    if "out" not in received.regions:
        yield from output_messages(pb.OUT, p.wire_dtype("out"), p.q_shape, arrays["out"],
                                   chunk_bytes)
    lse_shape = p.lse_shape
    if lse_shape is not None and "lse" not in received.regions:
        yield from output_messages(pb.LSE, pb.FLOAT32, lse_shape, arrays["lse"], chunk_bytes)


def stats_message(
    stats: ExecStats, received: Upload, bytes_out: int
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


def error_answer(refusal: RequestError) -> bytes:
    """A failed call's in-band answer: an AttentionResult with only ``error`` set."""
    error = pb.CallError(code=refusal.code.value[0], details=refusal.details)
    return pb.AttentionResult(error=error).SerializeToString()
