"""The executor: jobs in, launches out, every job answered exactly once.

One executor serves both modes: with batching on, concurrent jobs with the same batch key share
one packed kernel launch; with batching off, every job is a batch of one (same queue, same
launch path, same accounting). Two threads beside the callers:

* the dispatcher waits until ``BatchQueue.next_batch`` says launch (device idle, a full token
  budget, or the oldest job's delay is up), builds the ``BatchPlan`` and issues it with
  ``backend.launch``, which on the GPU returns once the work is queued on a stream;
* the completer waits for issued launches in order (``PendingLaunch.wait``) and calls each
  job's ``done`` with its stats (its outputs are already in its destination buffers).

At most ``backend.max_inflight`` launches are issued and not yet waited for (2 on cuda: the
next batch's copies and kernel issue overlap the running batch; 1 on cpu).

When the device is idle the policy launches a new job at once, so on a backend whose launch
only queues work (``backend.async_launch``, cuda) ``submit(issue_here=True)`` issues it
itself, on the caller's thread, instead of waking the dispatcher: one thread hand-off less
per request. Only callers whose thread may block for a launch say so (the engine's channel
readers); an event loop never does, since a launch may compile a kernel or capture a graph
first (seconds). On the H100 host of 2026-11-23 the hand-off was 0.3 ms of a 1-client decode
step's 3.4 ms (tools/engine/bench_engine_steps.py: 1-client steps/s 1.2-1.5x, the mean batch at
64 clients unchanged at 37-39). Launches never overlap: both paths issue under one lock.
A direct launch of an op in ``inline_ops`` (the cached decode steps: tens of microseconds of
GPU) made inside the submitting thread's ``deferring()`` block is also waited for and answered
by that thread, when the block ends, instead of by the completer: that saves the completer's
wake-up per step. A channel reader wraps each read's batch of messages in the block, so the
steps read together still queue behind the first one's launch and share the next; without
the block (or for longer launches) the completer finishes as before, so a reader is never held
for a prefill's time. On an H200 host (2026-11-25, three interleaved rounds of fresh servers,
git history: benchmarks/ab_env.sh, over bench_sessions.py) the 1-client step's p50 overhead over
the kernel
went 1.43 -> 1.29 ms (faster in every round); 64 clients stayed at ~5.8K steps/s. Answering
at once instead of at the block's end launched each of a read's steps alone: in
tools/engine/bench_engine_steps.py (one channel) the 8-client mean batch fell from 5 to 1.0.
Inside ``holding(hold)`` (a step socket's reader, for a host with steps in flight) a direct
launch of an inline op takes any free slot and goes to ``hold``: the completer only waits for
it, frees its slot and wakes the hold's pipe; the holding thread answers its launches in order
(``answer_held``) between its reads. On an H200 host (2026-12-01, four paired rounds) B=64 CUDA
IPC steps at 2 in flight went 2106 -> 2339 steps/s on the mean, inside the rounds' spread.

``submit``/``cancel`` are thread-safe and never block on the device; ``run`` wraps them for
asyncio callers. ``done`` runs on an executor thread: it must be quick (hand off, don't work).

Tried and dropped (H200, 64 clients of small prefills, fresh servers interleaved): a launch
gate that held channel readers (and the completer) while a batch was being issued, so that the
dispatcher got the GIL back at once after each torch call, cut the issue time (2.7-2.8 -> 2.2-2.6
ms) but not the rate (4090-4440 req/s against 4370-4640 without; results 2026-11-28g); and
driver calls that keep the GIL for the launch's events and tables (b853cd5) halved the GIL
hand-offs of a batch's launch (16 -> 7) but ran 7% slower over four paired rounds (same
folder). The GIL's wait moves between the engine's threads; it is not removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from attention_service.engine.jobs import (
    BatchPlan,
    Cancelled,
    Done,
    ExecStats,
    Job,
    LaunchTimes,
    PendingLaunch,
)
from attention_service.errors import exhausted, unavailable
from attention_service.params import BatchKey, Op

log = logging.getLogger("attention_service")

class Backend(Protocol):
    max_inflight: int  # launches the executor may hold issued and un-waited at once
    async_launch: bool  # launch only queues the work (may run on a request's thread)

    def launch(self, plan: BatchPlan) -> PendingLaunch: ...


class LaunchObserver(Protocol):
    """Per-launch accounting (metrics); called on the completer thread once per launch."""

    def observe_launch(
        self, op: Op, *, requests: int, tokens: int, flops: int, kv_bytes: int,
        h2d: float, kernel: float, d2h: float, issue: float | None = None,
    ) -> None: ...


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self._exc = exc

    def wait(self) -> LaunchTimes:
        raise self._exc


@dataclass
class _Issued:
    jobs: list[Job]
    plan: BatchPlan
    pending: PendingLaunch
    started: float  # perf_counter when the batch left the queue
    issued: float  # perf_counter when its launch had been issued
    hold: Hold | None = None  # answered by the thread that holds it (``Executor.holding``)
    outcome: LaunchTimes | BaseException | None = None  # its wait's, once the hold is woken


class Hold:
    """The launches one thread issued inside ``Executor.holding`` and answers itself, in
    order: the completer only waits for each (the GIL released), frees its launch slot and
    writes a byte to ``fd``; the holder, woken there (or by its own socket), answers those
    whose wait is over (``Executor.answer_held``). A step socket's reader holds its pipelined
    steps so: answered by the completer, each B=64 step's ~70 us of answering Python ran
    against the reader's next launch for the GIL, and the two threads' turns stretched both
    (a traced H200 run: a launch issued 430 us before the completer took it up)."""

    def __init__(self) -> None:
        self.items: deque[_Issued] = deque()  # issued, not yet answered, in launch order
        self.fd, self._wake_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._wake_fd, False)
        # The completer wakes a hold its holder may be closing: never a closed descriptor
        # (its number may be another connection's by then).
        self._lock = threading.Lock()
        self._closed = False

    def wake(self) -> None:
        with self._lock, contextlib.suppress(BlockingIOError):  # full: wake-ups to read
            if not self._closed:
                os.write(self._wake_fd, b"\0")

    def clear(self) -> None:
        """Read the wake-ups written so far (one a launch: a read takes them all)."""
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, 65536)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self.fd)
            os.close(self._wake_fd)


class _Holding:
    """``Executor.holding``'s block: the hold is this thread's while inside."""

    __slots__ = ("_local", "_hold")

    def __init__(self, local: threading.local, hold: Hold) -> None:
        self._local, self._hold = local, hold

    def __enter__(self) -> None:
        self._local.hold = self._hold

    def __exit__(self, *exc: object) -> None:
        self._local.hold = None


def _settle(fut: asyncio.Future[ExecStats], value: ExecStats | BaseException) -> None:
    if fut.done():  # the caller was cancelled meanwhile
        return
    if isinstance(value, BaseException):
        fut.set_exception(value)
    else:
        fut.set_result(value)


def future_done() -> tuple[asyncio.Future[ExecStats], Done]:
    """A future of the running loop and the thread-safe ``done`` that settles it."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[ExecStats] = loop.create_future()

    def done(value: ExecStats | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
            loop.call_soon_threadsafe(_settle, fut, value)

    return fut, done

# The waiting room of the batching executor, and its launch policy (no threads, no clock).
#
# Policy, per call of ``next_batch(now, device_idle)``:
#
# * the device is idle: launch at once whatever waits longest (with the jobs of its key that fit
#   the budget) -- waiting while the GPU sits idle only adds latency;
# * the device is busy: keep accumulating, and launch a second batch (so its copies overlap the
#   running kernel) as soon as some key has a full token budget waiting, or the oldest job has
#   waited ``max_delay_s``.
#
# A batch takes jobs of one key in arrival order while their tokens fit ``max_batch_tokens``
# and they number at most ``max_requests``; its first job always goes, so a job larger than
# the budget runs alone. ``max_requests=1`` is batching off: every job is its own launch, and
# any waiting job counts as a full batch (nothing waits for company).
class BatchQueue:
    """FIFO queues per batch key with a global size bound. Not thread-safe: the executor
    holds its lock around every call."""

    def __init__(
        self, max_batch_tokens: int, max_delay_s: float, max_size: int, max_requests: int = 0
    ) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.max_delay_s = max_delay_s
        self.max_size = max_size
        self.max_requests = max_requests or max_size  # 0: no bound but the queue's
        self._queues: dict[BatchKey, deque[Job]] = {}
        self._tokens: dict[BatchKey, int] = {}
        self._depth: dict[Op, int] = dict.fromkeys(Op, 0)
        # Jobs found cancelled while still queued: the executor owes each one its
        # ``done(Cancelled())`` (``take_dropped``), so none is ever forgotten.
        self._dropped: list[Job] = []

    def __len__(self) -> int:
        return sum(self._depth.values())

    def depth(self, op: Op) -> int:
        return self._depth[op]

    def add(self, job: Job) -> None:
        if len(self) >= self.max_size:
            raise exhausted("queue", f"{self.max_size} requests already wait for the device "
                            "(--max-queue-size)")
        self._queues.setdefault(job.key, deque()).append(job)
        self._tokens[job.key] = self._tokens.get(job.key, 0) + job.weight
        self._depth[job.params.op] += 1

    def remove(self, job: Job) -> bool:
        """Take a job out (its call went away); False if it already left the queue."""
        q = self._queues.get(job.key)
        if q is None or job not in q:
            return False
        q.remove(job)
        self._forget(job)
        return True

    def take_dropped(self) -> list[Job]:
        dropped, self._dropped = self._dropped, []
        return dropped

    def drain(self) -> list[Job]:
        left = [w for q in self._queues.values() for w in q]
        self._queues.clear()
        self._tokens.clear()
        self._depth = dict.fromkeys(self._depth, 0)
        return left

    def next_batch(self, now: float, device_idle: bool) -> tuple[list[Job], float | None]:
        """``(jobs, None)``: launch them now. ``([], t)``: ask again in ``t`` seconds (or
        when something changes). ``([], None)``: nothing waits."""
        while True:
            self._drop_cancelled_heads()
            if not self._queues:
                return [], None
            oldest = min(self._queues, key=lambda k: self._queues[k][0].submitted_at)
            full = [
                k for k in self._queues
                if self._tokens[k] >= self.max_batch_tokens
                or len(self._queues[k]) >= self.max_requests
            ]
            due = self._queues[oldest][0].submitted_at + self.max_delay_s
            if device_idle or now >= due:
                pick = oldest
            elif full:
                pick = min(full, key=lambda k: self._queues[k][0].submitted_at)
            else:
                return [], due - now
            batch = self._pop(pick)
            if batch:  # else every job of that key had gone: look again
                return batch, None

    def _forget(self, job: Job) -> None:
        self._tokens[job.key] -= job.weight
        self._depth[job.params.op] -= 1
        q = self._queues.get(job.key)
        if q is not None and not q:
            del self._queues[job.key]
            del self._tokens[job.key]

    def _drop_cancelled_heads(self) -> None:
        for q in list(self._queues.values()):
            while q and q[0].cancelled:
                self._dropped.append(self._forget_head(q))

    def _forget_head(self, q: deque[Job]) -> Job:
        w = q.popleft()
        self._forget(w)
        return w

    def _pop(self, key: BatchKey) -> list[Job]:
        q = self._queues[key]
        batch: list[Job] = []
        tokens = 0
        while q:
            w = q[0]
            if w.cancelled:  # gone: never launched
                self._dropped.append(self._forget_head(q))
                continue
            if batch and (
                tokens + w.weight > self.max_batch_tokens or len(batch) >= self.max_requests
            ):
                break
            batch.append(self._forget_head(q))
            tokens += w.weight
        return batch


class Executor:
    def __init__(
        self, backend: Backend, *, batching: bool = True, max_batch_tokens: int = 16384,
        max_queue_delay_s: float = 0.0005, max_queue_size: int = 1024,
        observer: LaunchObserver | None = None,
        delivery_scope: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
        inline_ops: frozenset[Op] = frozenset(),
    ) -> None:
        """``delivery_scope``: entered around each launch's answers on the completer thread
        (the process group corks its channels there: one write per front end per launch).
        ``inline_ops``: ops whose direct launches made inside the submitting thread's
        ``deferring()`` block are completed by that thread at the block's end."""
        self.backend = backend
        self._inline_ops = inline_ops
        self._deferred = threading.local()  # .issued: this thread's launches to finish
        self._delivery_scope = delivery_scope
        self.batching = batching
        self._observer = observer
        self._queue = BatchQueue(
            max_batch_tokens, max_queue_delay_s, max_queue_size,
            max_requests=0 if batching else 1,
        )
        self._max_inflight = max(1, int(getattr(backend, "max_inflight", 1)))
        self._direct = bool(getattr(backend, "async_launch", False))
        self._launch_lock = threading.Lock()  # one backend.launch at a time
        self._cond = threading.Condition()
        self._waiting: set[Job] = set()  # queued, not yet in a launch
        self._inflight = 0  # issued launches not yet waited for
        self._issuing = 0  # submits issuing a launch on their own thread right now
        self._dispatcher_waits = False  # in _cond.wait: a submit must wake it
        self._closed = False
        self._issued: queue.SimpleQueue[_Issued | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._dispatch_loop, name="attention-batcher", daemon=True),
            threading.Thread(target=self._complete_loop, name="attention-completer", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---- callers' side ------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """Nothing queued, in flight or being issued; read without the lock, so a hint (the
        engine's channel readers poll for requests only while it holds)."""
        return not self._waiting and self._inflight == 0 and self._issuing == 0

    def queue_depth(self, op: Op) -> int:
        with self._cond:
            return self._queue.depth(op)

    def submit(self, job: Job, done: Done, *, issue_here: bool = False) -> None:
        """Queue ``job``; ``done(stats | exception)`` is called exactly once, unless this
        raises (queue full: RESOURCE_EXHAUSTED; closed: UNAVAILABLE): on an executor thread,
        or on this one for a job dropped or refused while ``submit`` issues directly.
        ``issue_here``: this thread may take a launch's time (see the module doc)."""
        job.submitted_at = now = time.perf_counter()
        job.queued(done)
        with self._cond:
            if self._closed:
                raise unavailable("server is shutting down")
            if (issue_here and self._direct and self._dispatcher_waits and not self._waiting
                    and (self._inflight == 0 or (self._inflight < self._max_inflight
                                                 and not self._in_deferring()))
                    and self._queue.max_size > 0 and not job.cancelled):
                # Alone, with a launch slot free: it skips the queue (its adds, the pick and
                # the pops took ~6% of a B=64 socket step's engine GIL time in a py-spy
                # profile, H200). On an idle device the queue would hand it straight back. On
                # a busy one it would hold it until that launch ends or the queue delay is
                # up, and the second step of a host with two in flight (its other
                # micro-batch, which nothing queued can join) never overlapped the first's
                # launch; inside a ``deferring`` block the steps read with it join the next
                # launch instead, so there only an idle device takes it at once.
                jobs, dropped = [job], []
                self._inflight += 1
                alone = True
            else:
                self._queue.add(job)
                self._waiting.add(job)
                if not self._dispatcher_waits:  # it looks at the queue before it waits again
                    return
                if not (issue_here and self._direct and self._inflight == 0):
                    self._cond.notify_all()
                    return
                # The device is idle: the dispatcher would launch at once; do it here.
                jobs, dropped, _ = self._take(now, device_idle=True)
                alone = False  # a batch of the queue's (other callers' too): never held
            self._issuing += 1  # the completer must not stop before this launch is queued
        try:
            self._deliver(dropped, [Cancelled()] * len(dropped))
            if jobs:
                self._issue(jobs, here=True, holdable=alone)
        finally:
            with self._cond:
                self._issuing -= 1
                self._wake()

    def _wake(self) -> None:
        """Under the lock, after a launch slot or an issuing submit ended: wake the dispatcher
        when it has something to look at (queued jobs, or the close it waits to finish). A
        lone step's launch on an idle device woke it for nothing twice a step (its wake-ups
        held ~5% of a B=64 socket step's engine GIL time, py-spy, H200)."""
        if self._waiting or self._closed:
            self._cond.notify_all()

    def _in_deferring(self) -> bool:
        return getattr(self._deferred, "issued", None) is not None

    def _holding(self) -> Hold | None:
        return getattr(self._deferred, "hold", None)

    def holding(self, hold: Hold) -> AbstractContextManager[object]:
        """Inside: this thread's direct launches of ``inline_ops`` go to ``hold``: the
        completer waits for each and wakes the hold; this thread answers them
        (``answer_held``) before it next blocks on anything else. A direct launch here takes
        any free launch slot (a model host's second step in flight goes while its first
        runs). A plain object, made once and entered per step (a generator's context
        manager cost ~10 us of a step's GIL time, py-spy, H200)."""
        return _Holding(self._deferred, hold)

    def answer_held(self, hold: Hold) -> int:
        """Answer ``hold``'s launches whose wait is over, in order; how many are left."""
        items = hold.items
        while items and items[0].outcome is not None:
            issued = items.popleft()
            try:
                self._answer(issued, issued.outcome)  # type: ignore[arg-type]
            except Exception:  # never leave the executor's count behind
                log.exception("batch completion failed")
            finally:
                with self._cond:
                    self._issuing -= 1
                    self._wake()
        return len(items)

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """Inside: this thread's direct launches of ``inline_ops`` are left in flight, and
        waited for and answered here when the block ends (in order). Nested blocks join."""
        if self._in_deferring():
            yield
            return
        issued: list[_Issued] = []
        self._deferred.issued = issued
        try:
            yield
        finally:
            self._deferred.issued = None
            for item in issued:
                self._complete_here(item)
            if issued:
                with self._cond:
                    self._issuing -= len(issued)
                    self._wake()

    def _launch(self, plan: BatchPlan) -> PendingLaunch:
        with self._launch_lock:
            return self.backend.launch(plan)

    def cancel(self, job: Job) -> None:
        """The call went away: a queued job leaves now (``done(Cancelled())``); inside a
        running launch it completes for its batch mates and the caller drops the result."""
        with self._cond:
            job.cancelled = True
            removed = job in self._waiting and self._queue.remove(job)
            self._waiting.discard(job)
            if removed:
                self._cond.notify_all()
        if removed:
            self._deliver([job], [Cancelled()])

    async def run(self, job: Job) -> ExecStats:
        """``submit`` for asyncio callers; cancelling the await cancels the job."""
        fut, done = future_done()
        self.submit(job, done)
        try:
            return await fut
        except asyncio.CancelledError:
            self.cancel(job)
            raise

    def close(self, timeout: float = 10.0) -> None:
        """Refuse what still waits (UNAVAILABLE), let issued launches finish, stop threads."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            left = self._queue.drain()
            self._waiting.clear()
            self._cond.notify_all()
        gone = unavailable("server is shutting down")
        self._deliver(left, [gone] * len(left))
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))

    # ---- dispatcher thread --------------------------------------------------------------

    def _dispatch_loop(self) -> None:
        try:
            while True:
                with self._cond:
                    jobs, dropped = self._wait_for_batch()
                self._deliver(dropped, [Cancelled()] * len(dropped))
                if jobs is None:
                    return
                if jobs:
                    self._issue(jobs)
        finally:
            with self._cond:  # launches being issued by submitters go in before the end
                self._cond.wait_for(lambda: self._issuing == 0, timeout=60)
            self._issued.put(None)  # the completer finishes what was issued, then stops

    def _wait_for_batch(self) -> tuple[list[Job] | None, list[Job]]:
        """Under the lock: (the next batch, jobs dropped as cancelled); batch None once
        closed, [] when only dropped jobs are to be answered."""
        while not self._closed:
            timeout = None
            if self._inflight < self._max_inflight:
                batch, dropped, timeout = self._take(
                    time.perf_counter(), device_idle=self._inflight == 0
                )
                if batch or dropped:
                    return batch, dropped
            self._dispatcher_waits = True
            self._cond.wait(timeout)
            self._dispatcher_waits = False
        return None, []

    def _take(
        self, now: float, device_idle: bool
    ) -> tuple[list[Job], list[Job], float | None]:
        """Under the lock: the batch to launch now (its launch slot taken, ``[]`` when none
        is due), the jobs dropped as cancelled, and when to look again."""
        batch, timeout = self._queue.next_batch(now, device_idle=device_idle)
        dropped = self._queue.take_dropped()
        self._waiting.difference_update(dropped)
        if batch:
            self._inflight += 1
            self._waiting.difference_update(batch)
        return batch, dropped, timeout

    def _issue(self, jobs: list[Job], here: bool = False, holdable: bool = False) -> None:
        """Plan and launch ``jobs``; the completer finishes the launch, or this thread
        at the end of its ``deferring()`` block when ``here`` (a submitter's direct launch)
        and the op is one of ``inline_ops``, or its hold (``holding``) when ``holdable`` too
        (the submitter's own job alone: a thread answers only its own callers)."""
        started = time.perf_counter()
        try:
            plan = BatchPlan(jobs, jobs[0].key)
        except Exception as exc:  # a bug, not the callers' fault: fail them, keep serving
            log.exception("could not plan a batch of %d", len(jobs))
            self._release_slot()
            self._deliver(jobs, [exc] * len(jobs))
            return
        try:
            pending: PendingLaunch = self._launch(plan)
        except Exception as exc:
            if len(jobs) == 1 or isinstance(exc, Cancelled):
                pending = _Failed(exc)
            else:
                self._issue_alone(jobs, started, exc)
                return
        issued = _Issued(jobs, plan, pending, started, time.perf_counter())
        deferred = getattr(self._deferred, "issued", None) if here else None
        hold = self._holding() if here and holdable else None
        if deferred is not None and plan.op in self._inline_ops:
            with self._cond:  # close() waits for it as for a launch being issued
                self._issuing += 1
            deferred.append(issued)
        elif hold is not None and plan.op in self._inline_ops:
            with self._cond:  # close() waits for it until its holder answers it
                self._issuing += 1
            issued.hold = hold
            hold.items.append(issued)  # before the completer can see it
            self._issued.put(issued)
        else:
            self._issued.put(issued)

    def _issue_alone(self, jobs: list[Job], started: float, exc: Exception) -> None:
        """A merged launch failed to start (e.g. out of memory): retry each job on its own, so
        every caller gets its own answer rather than its batch mates' failure."""
        log.warning("batch of %d failed to launch (%s: %s); retrying each request alone",
                    len(jobs), type(exc).__name__, exc)
        with self._cond:
            self._inflight += len(jobs) - 1
        for job in jobs:
            plan = BatchPlan([job])
            try:
                pending: PendingLaunch = self._launch(plan)
            except Exception as single_exc:
                pending = _Failed(single_exc)
            self._issued.put(_Issued([job], plan, pending, started, time.perf_counter()))

    # ---- completer thread ---------------------------------------------------------------

    def _complete_loop(self) -> None:
        while True:
            issued = self._issued.get()
            if issued is None:
                return
            self._complete_here(issued)

    def _complete_here(self, issued: _Issued) -> None:
        """``_complete`` on this thread (the completer's, or a deferring submitter's); a
        held launch is only waited for here, then its holder is woken."""
        try:
            if issued.hold is not None:
                self._wait_held(issued)
            else:
                self._complete(issued)
        except Exception:  # never lose the thread: that would hang every later call
            log.exception("batch completion failed")

    def _wait_held(self, issued: _Issued) -> None:
        assert issued.hold is not None
        issued.outcome = self._wait(issued)
        issued.hold.wake()

    def _release_slot(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._wake()

    def _complete(self, issued: _Issued) -> None:
        self._answer(issued, self._wait(issued))

    def _wait(self, issued: _Issued) -> LaunchTimes | BaseException:
        """The launch's times, or why it failed, once the device is done with it; its launch
        slot is free then (the next batch may go)."""
        try:
            outcome: LaunchTimes | BaseException = issued.pending.wait()
        except Exception as exc:
            outcome = exc
        self._release_slot()
        return outcome

    def _answer(self, issued: _Issued, times: LaunchTimes | BaseException) -> None:
        """A waited launch's jobs answered: its failure, or their stats."""
        jobs, plan = issued.jobs, issued.plan
        if isinstance(times, BaseException):
            self._deliver(jobs, [times] * len(jobs))
            return
        if self._observer is not None:
            try:
                self._observer.observe_launch(
                    plan.op, requests=len(plan), tokens=plan.tokens, flops=plan.flops,
                    kv_bytes=plan.kv_bytes, h2d=times.h2d_seconds, kernel=times.kernel_seconds,
                    d2h=times.d2h_seconds, issue=issued.issued - issued.started,
                )
            except Exception:
                log.exception("launch accounting failed")
        # Positional (per request on the completer: keywords cost a NamedTuple ~2x more).
        started, h2d, kernel, d2h = (issued.started, times.h2d_seconds, times.kernel_seconds,
                                     times.d2h_seconds)
        n, tokens = len(plan), plan.tokens
        stats = [ExecStats(started - j.submitted_at, h2d, kernel, d2h, n, tokens, j.flops)
                 for j in jobs]
        with self._delivery_scope():
            self._deliver(jobs, stats)

    @staticmethod
    def _deliver(jobs: Sequence[Job], values: Sequence[ExecStats | BaseException]) -> None:
        for job, value in zip(jobs, values, strict=True):
            try:
                job.done(value)
            except Exception:  # a caller's callback must not take the executor down
                log.exception("result delivery failed")
