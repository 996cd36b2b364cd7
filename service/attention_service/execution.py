"""How validated jobs reach a backend: the Executor interface and the DirectExecutor.

The servicer only knows ``Executor``: ``await run_prefill(job)`` / ``await run_decode(job)``.
DirectExecutor runs each job as its own launch on one compute thread (one launch at a time per
device keeps the GPU uncontended and makes queue wait visible). A dynamic-batching executor
(``attention_service.batching.BatchingExecutor``) can merge jobs into launches behind the same
interface; ``make_executor`` picks it when batching is on and the module exists.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from attention_service.backends import Backend, Cancelled, LaunchOutput
from attention_service.errors import exhausted

if TYPE_CHECKING:
    from attention_service.config import ServerConfig
    from attention_service.validation import Plan

log = logging.getLogger("attention_service")


@dataclass
class Job:
    """One request's validated host tensors and parameters."""

    rpc: str  # "Prefill" | "Decode"
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: list[int] | None  # None for decode
    cu_seqlens_k: list[int]
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    softmax_scale: float | None
    return_lse: bool
    num_splits: int
    flops: int
    tokens: int
    # Set when the call is cancelled or its deadline passes: compute stops where it can.
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = 0.0  # perf_counter when fully received and handed to the executor

    @classmethod
    def from_plan(cls, plan: Plan, tensors: dict[str, torch.Tensor]) -> Job:
        return cls(
            rpc=plan.rpc, q=tensors["q"], k=tensors["k"], v=tensors["v"],
            cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_k=plan.cu_seqlens_k,
            max_seqlen_q=plan.max_seqlen_q, max_seqlen_k=plan.max_seqlen_k, causal=plan.causal,
            softmax_scale=plan.softmax_scale, return_lse=plan.return_lse,
            num_splits=plan.num_splits, flops=plan.flops, tokens=plan.tokens,
        )


@dataclass
class ExecStats:
    queue_seconds: float
    h2d_seconds: float
    kernel_seconds: float
    d2h_seconds: float
    flops: int  # this request's own flops
    batch_requests: int  # requests in the launch that served it
    batch_tokens: int  # tokens in that launch


@dataclass
class Result:
    out: torch.Tensor  # host
    lse: torch.Tensor | None  # host, float32
    stats: ExecStats


class LaunchObserver(Protocol):
    """Per-launch accounting (metrics); called on the compute thread once per launch."""

    def observe_launch(
        self, rpc: str, *, requests: int, tokens: int, flops: int, kv_bytes: int,
        h2d: float, kernel: float, d2h: float,
    ) -> None: ...


class Executor(Protocol):
    batching: bool  # whether concurrent requests are merged into one launch

    async def run_prefill(self, job: Job) -> Result: ...
    async def run_decode(self, job: Job) -> Result: ...
    def queue_depth(self, rpc: str) -> int: ...
    async def close(self) -> None: ...


class _NullObserver:
    def observe_launch(self, rpc: str, **_: object) -> None:
        pass


class DirectExecutor:
    """One job per launch, in arrival order, on a single compute thread."""

    batching = False

    def __init__(
        self, backend: Backend, observer: LaunchObserver | None = None,
        max_queue_size: int = 1024,
    ) -> None:
        self.backend = backend
        self.max_queue_size = max_queue_size
        self._observer = observer or _NullObserver()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attention-compute")
        self._lock = threading.Lock()
        self._queued = {"Prefill": 0, "Decode": 0}

    def queue_depth(self, rpc: str) -> int:
        return self._queued.get(rpc, 0)

    async def run_prefill(self, job: Job) -> Result:
        return await self._submit(job, self.backend.prefill)

    async def run_decode(self, job: Job) -> Result:
        return await self._submit(job, self.backend.decode)

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _dequeue(self, job: Job, ticket: list[bool]) -> None:
        with self._lock:
            if not ticket[0]:
                ticket[0] = True
                self._queued[job.rpc] -= 1

    async def _submit(self, job: Job, fn: Callable[..., LaunchOutput]) -> Result:
        job.submitted_at = time.perf_counter()
        ticket = [False]  # dequeued yet?
        with self._lock:
            if sum(self._queued.values()) >= self.max_queue_size:
                raise exhausted(
                    "queue", f"{self.max_queue_size} requests already wait for the device"
                )
            self._queued[job.rpc] += 1
        loop = asyncio.get_running_loop()
        try:
            # Cancelling this await also cancels the pool future if the job has not started.
            return await loop.run_in_executor(self._pool, self._launch, job, fn, ticket)
        except asyncio.CancelledError:
            job.cancel.set()
            raise
        finally:
            self._dequeue(job, ticket)

    def _launch(self, job: Job, fn: Callable[..., LaunchOutput], ticket: list[bool]) -> Result:
        self._dequeue(job, ticket)
        started = time.perf_counter()
        if job.cancel.is_set():
            raise Cancelled()
        res = fn(job, job.cancel)
        queue_seconds = started - job.submitted_at
        self._observer.observe_launch(
            job.rpc, requests=1, tokens=job.tokens, flops=job.flops,
            kv_bytes=job.k.nbytes + job.v.nbytes,
            h2d=res.h2d_seconds, kernel=res.kernel_seconds, d2h=res.d2h_seconds,
        )
        stats = ExecStats(
            queue_seconds=queue_seconds, h2d_seconds=res.h2d_seconds,
            kernel_seconds=res.kernel_seconds, d2h_seconds=res.d2h_seconds, flops=job.flops,
            batch_requests=1, batch_tokens=job.tokens,
        )
        return Result(out=res.out, lse=res.lse, stats=stats)


def make_executor(
    config: ServerConfig, backend: Backend, observer: LaunchObserver | None = None
) -> Executor:
    if config.batching:
        try:
            from attention_service.batching import BatchingExecutor  # type: ignore[import-not-found]
        except ModuleNotFoundError as exc:
            if exc.name != "attention_service.batching":
                raise
            log.warning("batching requested but attention_service.batching is not available; "
                        "serving one request per launch")
        else:
            if hasattr(backend, "launch_batch"):
                return BatchingExecutor(backend, config, observer)  # type: ignore[no-any-return]
            log.warning("backend %s cannot run merged launches; serving one request per launch",
                        getattr(backend, "name", type(backend).__name__))
    return DirectExecutor(backend, observer, max_queue_size=config.max_queue_size)
