"""The waiting room of the batching executor, and its launch policy (no threads, no clock).

Policy, per call of ``next_batch(now, device_idle)``:

* the device is idle: launch at once whatever waits longest (with the jobs of its key that fit
  the budget) -- waiting while the GPU sits idle only adds latency;
* the device is busy: keep accumulating, and launch a second batch (so its copies overlap the
  running kernel) as soon as some key has a full token budget waiting, or the oldest job has
  waited ``max_delay_s``.

A batch takes jobs of one key in arrival order while their tokens fit ``max_batch_tokens``
and they number at most ``max_requests``; its first job always goes, so a job larger than
the budget runs alone. ``max_requests=1`` is batching off: every job is its own launch, and
any waiting job counts as a full batch (nothing waits for company).
"""

from __future__ import annotations

from collections import deque

from attention_service.engine.jobs import Job
from attention_service.errors import exhausted
from attention_service.params import BatchKey, Op


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
