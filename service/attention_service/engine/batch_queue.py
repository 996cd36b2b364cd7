"""The waiting room of the batching executor, and its launch policy (no threads, no clock).

Policy, per call of ``next_batch(now, device_idle)``:

* the device is idle: launch at once whatever waits longest (with the jobs of its key that fit
  the budget) -- waiting while the GPU sits idle only adds latency;
* the device is busy: keep accumulating, and launch a second batch (so its copies overlap the
  running kernel) as soon as some key has a full token budget waiting, or the oldest waiter has
  waited ``max_delay_s``.

A batch takes waiters of one key in arrival order while their tokens fit ``max_batch_tokens``
and they number at most ``max_requests``; its first waiter always goes, so a job larger than
the budget runs alone. ``max_requests=1`` is batching off: every job is its own launch, and
any waiting job counts as a full batch (nothing waits for company).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from attention_service.engine.batch_plan import batch_key
from attention_service.engine.jobs import ExecStats, Job
from attention_service.errors import exhausted
from attention_service.params import BatchKey, Op

# Called exactly once per submitted job, with its stats or the exception that ended it.
Done = Callable[[ExecStats | BaseException], None]


class Waiter:
    """A queued job and where its result goes. (A slots class: one is made per request on
    the engine's hot path.)"""

    __slots__ = ("job", "done", "key", "tokens")

    def __init__(self, job: Job, done: Done) -> None:
        self.job = job
        self.done = done
        self.key: BatchKey = batch_key(job)
        self.tokens: int = job.budget_tokens  # weight against the token budget

    @property
    def submitted(self) -> float:
        return self.job.submitted_at


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
        self._queues: dict[BatchKey, deque[Waiter]] = {}
        self._tokens: dict[BatchKey, int] = {}
        self._depth: dict[Op, int] = dict.fromkeys(Op, 0)
        # Waiters found cancelled while still queued: the executor owes each one its
        # ``done(Cancelled())`` (``take_dropped``), so none is ever forgotten.
        self._dropped: list[Waiter] = []

    def __len__(self) -> int:
        return sum(self._depth.values())

    def depth(self, op: Op) -> int:
        return self._depth[op]

    def add(self, waiter: Waiter) -> None:
        if len(self) >= self.max_size:
            raise exhausted("queue", f"{self.max_size} requests already wait for the device "
                            "(--max-queue-size)")
        self._queues.setdefault(waiter.key, deque()).append(waiter)
        self._tokens[waiter.key] = self._tokens.get(waiter.key, 0) + waiter.tokens
        self._depth[waiter.job.params.op] += 1

    def remove(self, waiter: Waiter) -> bool:
        """Take a waiter out (its call went away); False if it already left the queue."""
        q = self._queues.get(waiter.key)
        if q is None or waiter not in q:
            return False
        q.remove(waiter)
        self._forget(waiter)
        return True

    def take_dropped(self) -> list[Waiter]:
        dropped, self._dropped = self._dropped, []
        return dropped

    def drain(self) -> list[Waiter]:
        left = [w for q in self._queues.values() for w in q]
        self._queues.clear()
        self._tokens.clear()
        self._depth = dict.fromkeys(self._depth, 0)
        return left

    def next_batch(self, now: float, device_idle: bool) -> tuple[list[Waiter], float | None]:
        """``(waiters, None)``: launch them now. ``([], t)``: ask again in ``t`` seconds (or
        when something changes). ``([], None)``: nothing waits."""
        while True:
            self._drop_cancelled_heads()
            if not self._queues:
                return [], None
            oldest = min(self._queues, key=lambda k: self._queues[k][0].submitted)
            full = [
                k for k in self._queues
                if self._tokens[k] >= self.max_batch_tokens
                or len(self._queues[k]) >= self.max_requests
            ]
            due = self._queues[oldest][0].submitted + self.max_delay_s
            if device_idle or now >= due:
                pick = oldest
            elif full:
                pick = min(full, key=lambda k: self._queues[k][0].submitted)
            else:
                return [], due - now
            batch = self._pop(pick)
            if batch:  # else every waiter of that key had gone: look again
                return batch, None

    def _forget(self, waiter: Waiter) -> None:
        self._tokens[waiter.key] -= waiter.tokens
        self._depth[waiter.job.params.op] -= 1
        q = self._queues.get(waiter.key)
        if q is not None and not q:
            del self._queues[waiter.key]
            del self._tokens[waiter.key]

    def _drop_cancelled_heads(self) -> None:
        for q in list(self._queues.values()):
            while q and q[0].job.cancel.is_set():
                self._dropped.append(self._forget_head(q))

    def _forget_head(self, q: deque[Waiter]) -> Waiter:
        w = q.popleft()
        self._forget(w)
        return w

    def _pop(self, key: BatchKey) -> list[Waiter]:
        q = self._queues[key]
        batch: list[Waiter] = []
        tokens = 0
        while q:
            w = q[0]
            if w.job.cancel.is_set():  # gone: never launched
                self._dropped.append(self._forget_head(q))
                continue
            if batch and (
                tokens + w.tokens > self.max_batch_tokens or len(batch) >= self.max_requests
            ):
                break
            batch.append(self._forget_head(q))
            tokens += w.tokens
        return batch
