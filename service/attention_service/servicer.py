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
from attention_service.execution import Executor, Job
from attention_service.metrics import Metrics
from attention_service.streams import (
    Request,
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
        self, request_iterator: AsyncIterable[pb.PrefillRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.AttentionResponse]:
        async for msg in self._serve("Prefill", request_iterator, context):
            yield msg

    async def Decode(
        self, request_iterator: AsyncIterable[pb.DecodeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.AttentionResponse]:
        async for msg in self._serve("Decode", request_iterator, context):
            yield msg

    async def _serve(
        self, rpc: str, requests: AsyncIterable[Request], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.AttentionResponse]:
        t0 = time.perf_counter()
        code, details = "OK", ""
        bytes_in = bytes_out = tokens = flops = 0
        queue_seconds: float | None = None
        extra = ""
        self.tracker.enter()
        self._metrics.inflight.inc()
        try:
            if not self.tracker.accepting:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, self.tracker.refusal)
            plan, tensors = await receive_request(
                rpc, requests, self._config.max_request_bytes, self._alloc  # type: ignore[arg-type]
            )
            bytes_in = plan.bytes_in
            job = Job.from_plan(plan, tensors)
            del tensors
            run = self._executor.run_prefill if rpc == "Prefill" else self._executor.run_decode
            result = await run(job)
            queue_seconds = result.stats.queue_seconds
            for msg in response_messages(result, self._config.chunk_bytes):
                bytes_out += len(msg.chunk.data)
                yield msg
            yield stats_message(result, bytes_in, bytes_out)
            tokens, flops = plan.tokens, plan.flops
            s = result.stats
            extra = (
                f" tokens={tokens} queue_ms={s.queue_seconds * 1e3:.3f}"
                f" kernel_ms={s.kernel_seconds * 1e3:.3f} batch_requests={s.batch_requests}"
            )
        except RequestError as exc:
            code, details = exc.code.name, exc.details
            await context.abort(exc.code, exc.details)
        except torch.OutOfMemoryError as exc:
            code = "RESOURCE_EXHAUSTED"
            details = f"device out of memory: {str(exc).splitlines()[0] if str(exc) else ''}"
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, details)
        except (asyncio.CancelledError, GeneratorExit):
            code = _gone_code(context)
            raise
        except Cancelled:
            code = _gone_code(context)
            await context.abort(grpc.StatusCode[code], "call ended before its compute finished")
        except ValueError as exc:
            # A kernel refused what validation let through: still the caller's input.
            code, details = "INVALID_ARGUMENT", f"rejected by the kernel: {exc}"
            log.warning("validation gap: %s", exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, details)
        except Exception as exc:
            code, details = "INTERNAL", f"internal error: {type(exc).__name__}: {exc}"
            log.exception("rpc=%s internal error", rpc)
            await context.abort(grpc.StatusCode.INTERNAL, details)
        finally:
            seconds = time.perf_counter() - t0
            self.tracker.leave()
            self._metrics.inflight.dec()
            self._metrics.observe_request(
                rpc, code, seconds, bytes_in=bytes_in, bytes_out=bytes_out, tokens=tokens,
                flops=flops, queue_seconds=queue_seconds,
            )
            line = (
                f"rpc={rpc} code={code} duration_ms={seconds * 1e3:.3f} bytes_in={bytes_in} "
                f"bytes_out={bytes_out}{extra} peer={context.peer()}"
            )
            if details:
                line += f" details={details!r}"
            log.log(logging.ERROR if code == "INTERNAL" else logging.INFO, line)
