"""Dynamic batching: concurrent jobs with the same batch key share one packed kernel launch.

Two threads beside the event loop:

* the dispatcher waits until ``BatchQueue.next_batch`` says launch (device idle, a full token
  budget, or the oldest waiter's delay is up), builds the ``BatchPlan`` and issues it with
  ``backend.launch_batch``, which on the GPU returns once the work is queued on a stream;
* the completer waits for issued launches in order (``PendingLaunch.wait``), splits each
  output into its callers' rows and hands the results to the event loop.

At most ``backend.max_inflight`` launches are issued and not yet waited for (2 on cuda: the
next batch's copies and kernel issue overlap the running batch; 1 on cpu).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from attention_service.backends import Backend, Cancelled, LaunchOutput, PendingLaunch
from attention_service.batch_plan import BatchPlan
from attention_service.batch_queue import BatchQueue, Waiter
from attention_service.errors import RequestError
from attention_service.execution import ExecStats, Job, LaunchObserver, Result

if TYPE_CHECKING:
    from attention_service.config import ServerConfig

log = logging.getLogger("attention_service")


class _AllCancelled:
    """A batch's cancel flag: compute may stop only once every member has gone."""

    def __init__(self, jobs: Sequence[Job]) -> None:
        self._jobs = jobs

    def is_set(self) -> bool:
        return all(j.cancel.is_set() for j in self._jobs)


class _Failed:
    def __init__(self, exc: Exception) -> None:
        self._exc = exc

    def wait(self) -> LaunchOutput:
        raise self._exc


@dataclass
class _Issued:
    waiters: list[Waiter]
    plan: BatchPlan
    pending: PendingLaunch
    started: float  # perf_counter when the batch left the queue


def _resolve(items: list[tuple[asyncio.Future[Result], Result | BaseException]]) -> None:
    """On the event loop: complete the futures whose callers are still waiting."""
    for fut, value in items:
        if fut.done():  # the call was cancelled meanwhile
            continue
        if isinstance(value, BaseException):
            fut.set_exception(value)
        else:
            fut.set_result(value)


class _NullObserver:
    def observe_launch(self, rpc: str, **_: object) -> None:
        pass


class BatchingExecutor:
    batching = True

    def __init__(
        self, backend: Backend, config: ServerConfig, observer: LaunchObserver | None = None
    ) -> None:
        self.backend = backend
        self._observer = observer or _NullObserver()
        self._queue = BatchQueue(
            config.max_batch_tokens, config.max_queue_delay_ms / 1e3, config.max_queue_size
        )
        self._max_inflight = max(1, int(getattr(backend, "max_inflight", 1)))
        self._cond = threading.Condition()
        self._inflight = 0  # issued launches not yet waited for
        self._closed = False
        self._issued: queue.SimpleQueue[_Issued | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._dispatch_loop, name="attention-batcher", daemon=True),
            threading.Thread(target=self._complete_loop, name="attention-completer", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---- event loop side ------------------------------------------------------------------

    def queue_depth(self, rpc: str) -> int:
        with self._cond:
            return self._queue.depth(rpc)

    async def run_prefill(self, job: Job) -> Result:
        return await self._submit(job)

    async def run_decode(self, job: Job) -> Result:
        return await self._submit(job)

    async def _submit(self, job: Job) -> Result:
        loop = asyncio.get_running_loop()
        job.submitted_at = time.perf_counter()
        waiter = Waiter(job, loop, loop.create_future())
        with self._cond:
            if self._closed:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
            self._queue.add(waiter)  # RESOURCE_EXHAUSTED when full
            self._cond.notify_all()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            # Leave the queue now (never launched later); inside a running launch the batch
            # goes on for its mates and this result is dropped.
            job.cancel.set()
            with self._cond:
                if self._queue.remove(waiter):
                    self._cond.notify_all()
            raise

    async def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            left = self._queue.drain()
            self._cond.notify_all()
        gone = RequestError(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        self._deliver(left, [gone] * len(left))
        await asyncio.to_thread(self._join, 10.0)

    def _join(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))

    # ---- dispatcher thread -----------------------------------------------------------------

    def _dispatch_loop(self) -> None:
        try:
            while True:
                with self._cond:
                    waiters = self._wait_for_batch()
                    if waiters is None:
                        return
                    self._inflight += 1
                self._issue(waiters)
        finally:
            self._issued.put(None)  # the completer finishes what was issued, then stops

    def _wait_for_batch(self) -> list[Waiter] | None:
        """Under the lock: the next batch to launch, or None once closed."""
        while not self._closed:
            timeout = None
            if self._inflight < self._max_inflight:
                batch, timeout = self._queue.next_batch(
                    time.perf_counter(), device_idle=self._inflight == 0
                )
                if batch:
                    return batch
            self._cond.wait(timeout)
        return None

    def _issue(self, waiters: list[Waiter]) -> None:
        started = time.perf_counter()
        try:
            plan = BatchPlan([w.job for w in waiters])
        except Exception as exc:  # a bug, not the callers' fault: fail them, keep serving
            log.exception("could not plan a batch of %d", len(waiters))
            self._release_slot()
            self._deliver(waiters, [exc] * len(waiters))
            return
        try:
            pending: PendingLaunch = self.backend.launch_batch(plan, _AllCancelled(plan.jobs))
        except Exception as exc:
            if len(waiters) == 1 or isinstance(exc, Cancelled):
                pending = _Failed(exc)
            else:
                self._issue_alone(waiters, started, exc)
                return
        self._issued.put(_Issued(waiters, plan, pending, started))

    def _issue_alone(self, waiters: list[Waiter], started: float, exc: Exception) -> None:
        """A merged launch failed to start (e.g. out of memory): retry each job on its own, so
        every caller gets its own answer rather than its batch mates' failure."""
        log.warning("batch of %d failed to launch (%s: %s); retrying each request alone",
                    len(waiters), type(exc).__name__, exc)
        with self._cond:
            self._inflight += len(waiters) - 1
        for w in waiters:
            plan = BatchPlan([w.job])
            try:
                pending: PendingLaunch = self.backend.launch_batch(plan, w.job.cancel)
            except Exception as single_exc:
                pending = _Failed(single_exc)
            self._issued.put(_Issued([w], plan, pending, started))

    # ---- completer thread ------------------------------------------------------------------

    def _complete_loop(self) -> None:
        while True:
            issued = self._issued.get()
            if issued is None:
                return
            try:
                self._complete(issued)
            except Exception:  # never lose the thread: that would hang every later call
                log.exception("batch completion failed")

    def _release_slot(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    def _complete(self, issued: _Issued) -> None:
        waiters, plan = issued.waiters, issued.plan
        try:
            output = issued.pending.wait()
        except Exception as exc:
            self._release_slot()
            self._deliver(waiters, [exc] * len(waiters))
            return
        self._release_slot()  # the device is done with it: the next batch may go
        try:
            parts = plan.split(output.out, output.lse)
            self._observer.observe_launch(
                plan.rpc, requests=len(plan), tokens=plan.tokens, flops=plan.flops,
                kv_bytes=plan.kv_bytes, h2d=output.h2d_seconds, kernel=output.kernel_seconds,
                d2h=output.d2h_seconds,
            )
        except Exception as exc:
            self._deliver(waiters, [exc] * len(waiters))
            return
        results: list[Result | BaseException] = []
        for w, (out, lse) in zip(waiters, parts, strict=True):
            stats = ExecStats(
                queue_seconds=issued.started - w.submitted, h2d_seconds=output.h2d_seconds,
                kernel_seconds=output.kernel_seconds, d2h_seconds=output.d2h_seconds,
                flops=w.job.flops, batch_requests=len(plan), batch_tokens=plan.tokens,
            )
            results.append(Result(out=out, lse=lse, stats=stats))
        self._deliver(waiters, results)

    @staticmethod
    def _deliver(waiters: list[Waiter], values: Sequence[Result | BaseException]) -> None:
        """One wake-up per event loop for the whole batch."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Result], Any]]] = {}
        for w, value in zip(waiters, values, strict=True):
            by_loop.setdefault(w.loop, []).append((w.future, value))
        for loop, items in by_loop.items():
            # A closed loop raises RuntimeError: nobody waits there any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, items)
