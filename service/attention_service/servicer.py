"""The AttentionService handlers: receive, execute, stream back; account every call."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator

import grpc
import torch
from attention_client.pb import attention_pb2 as pb
from attention_client.pb import attention_pb2_grpc as pb_grpc

from attention_service.backends import Cancelled
from attention_service.config import ServerConfig
from attention_service.errors import RequestError
from attention_service.execution import ExecStats, Executor, Job
from attention_service.metrics import Metrics
from attention_service.streams import (
    receive_request,
    response_messages,
    stats_message,
)

log = logging.getLogger("attention_service")


class CallTracker:
    """Whether new compute calls are accepted, and how many are in flight (for draining)."""

    def __init__(self) -> None:
        self.accepting = False  # False while warming up and once draining
        self.refusal = "server is warming up"
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


def _gone_code(context: grpc.aio.ServicerContext) -> str:
    remaining = context.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"


class AttentionServicer(pb_grpc.AttentionServiceServicer):
    def __init__(
        self, *, config: ServerConfig, executor: Executor, alloc: object, metrics: Metrics,
        info: pb.ServerInfo, tracker: CallTracker,
    ) -> None:
        self._config = config
        self._executor = executor
        self._alloc = alloc
        self._metrics = metrics
        self._info = info
        self.tracker = tracker

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerInfo:
        self._metrics.observe_request("GetServerInfo", "OK", 0.0)
        log.info("rpc=GetServerInfo code=OK duration_ms=0 peer=%s", context.peer())
        return self._info

    async def Prefill(
        self, request_iterator: AsyncIterable[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes | pb.AttentionResponse]:
        async for msg in self._serve("Prefill", request_iterator, context):
            yield msg

    async def Decode(
        self, request_iterator: AsyncIterable[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes | pb.AttentionResponse]:
        async for msg in self._serve("Decode", request_iterator, context):
            yield msg

    async def _serve(
        self, rpc: str, requests: AsyncIterable[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes | pb.AttentionResponse]:
        call = _CallRecord(rpc, context)
        self.tracker.enter()
        self._metrics.inflight.inc()
        refusal: tuple[grpc.StatusCode, str] | None = None
        try:
            if not self.tracker.accepting:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, self.tracker.refusal)
            plan, tensors = await receive_request(
                rpc, requests, self._config.max_request_bytes, self._alloc  # type: ignore[arg-type]
            )
            call.bytes_in = plan.bytes_in
            job = Job.from_plan(plan, tensors)
            del tensors
            run = self._executor.run_prefill if rpc == "Prefill" else self._executor.run_decode
            result = await run(job)
            call.queue_seconds = result.stats.queue_seconds
            for nbytes, msg in response_messages(result, self._config.chunk_bytes):
                call.bytes_out += nbytes
                yield msg  # pre-encoded (wire.py)
            # Accounted before the last message, so it is done when the client sees OK.
            call.ok(plan.tokens, plan.flops, result.stats)
            self._finish(call)
            yield stats_message(result, call.bytes_in, call.bytes_out)
            return
        except (asyncio.CancelledError, GeneratorExit):
            call.code = _gone_code(context)
            self._finish(call)
            raise
        except RequestError as exc:
            refusal = (exc.code, exc.details)
        except torch.OutOfMemoryError as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            refusal = (grpc.StatusCode.RESOURCE_EXHAUSTED, f"device out of memory: {first}")
        except Cancelled:
            code = grpc.StatusCode[_gone_code(context)]
            refusal = (code, "call ended before its compute finished")
        except ValueError as exc:
            # A kernel refused what validation let through: still the caller's input.
            log.warning("validation gap: %s", exc)
            refusal = (grpc.StatusCode.INVALID_ARGUMENT, f"rejected by the kernel: {exc}")
        except Exception as exc:
            log.exception("rpc=%s internal error", rpc)
            refusal = (grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
        # Accounted before the status goes out, so metrics and logs are final when it arrives.
        call.code, call.details = refusal[0].name, refusal[1]
        self._finish(call)
        await context.abort(*refusal)

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
            tokens=call.tokens, flops=call.flops, queue_seconds=call.queue_seconds,
        )
        line = (
            f"rpc={call.rpc} code={call.code} duration_ms={seconds * 1e3:.3f} "
            f"bytes_in={call.bytes_in} bytes_out={call.bytes_out}{call.extra} "
            f"peer={call.peer}"
        )
        if call.details:
            line += f" details={call.details!r}"
        log.log(logging.ERROR if call.code == "INTERNAL" else logging.INFO, line)


class _CallRecord:
    """What one compute call did, for its metrics and log line."""

    def __init__(self, rpc: str, context: grpc.aio.ServicerContext) -> None:
        self.rpc = rpc
        self.peer = context.peer()
        self.t0 = time.perf_counter()
        self.code, self.details, self.extra = "OK", "", ""
        self.bytes_in = self.bytes_out = self.tokens = self.flops = 0
        self.queue_seconds: float | None = None
        self.finished = False

    def ok(self, tokens: int, flops: int, stats: ExecStats) -> None:
        self.tokens, self.flops = tokens, flops
        self.extra = (
            f" tokens={tokens} queue_ms={stats.queue_seconds * 1e3:.3f}"
            f" kernel_ms={stats.kernel_seconds * 1e3:.3f} batch_requests={stats.batch_requests}"
        )
