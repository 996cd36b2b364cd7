"""The engine's side of one front-end process: its channel, its arena, its calls.

Requests arrive on the channel's reader thread and go straight to the engine core (no event
loop in the engine's request path; when the device is idle the reader issues the launch
itself); answers go back from the executor's completer thread, one corked write per launch
(the channel's writer thread takes over only what the socket cannot take at once). Params
arrive once each, with the first Submit that names them by id. The connection tracks its calls
so that when its front end dies they are cancelled and the arena is not handed to a new front
end before the last copy into it has finished.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor as ThreadPool
from typing import Any

import torch

from attention_service.engine.core import EngineCore, Source
from attention_service.engine.jobs import ByteBase, ExecStats, Job
from attention_service.errors import RequestError
from attention_service.ipc.channel import (
    Bound,
    Cancel,
    Channel,
    ControlCall,
    Done,
    Failed,
    ForgetParams,
    Reply,
    SegmentSpan,
    Submit,
    rpc_types,
)
from attention_service.params import Params, RegionSpan

log = logging.getLogger("attention_service")


class FrontendConnection:
    def __init__(
        self, slot: int, core: EngineCore, arena: torch.Tensor, control_pool: ThreadPool,
        on_bound: Callable[[Bound], None],
    ) -> None:
        self.slot = slot
        self.core = core
        self.arena = ByteBase(arena)  # the front end's arena (page-locked on cuda)
        self._control_pool = control_pool
        self._on_bound = on_bound
        self._lock = threading.Condition()
        self._calls: dict[int, Job | None] = {}  # in the engine; None: being submitted
        self._params: dict[int, Params] = {}  # what Submits brought, by id (reader only)
        self.channel: Channel | None = None

    def attach(self, channel: Channel) -> None:
        self.channel = channel

    def send(self, msg: Any) -> None:
        assert self.channel is not None
        self.channel.send(msg)

    # ---- reader thread ------------------------------------------------------------------

    def on_message(self, msg: Any, fds: list[int]) -> None:
        if isinstance(msg, Submit):
            self._submit(msg, fds)
        elif isinstance(msg, ForgetParams):
            self._params.clear()
        elif isinstance(msg, Cancel):
            with self._lock:
                job = self._calls.get(msg.call_id)
            if job is not None:
                self.core.cancel(job)
        elif isinstance(msg, ControlCall):
            self._control_pool.submit(self._control_call, msg)
        elif isinstance(msg, Bound):
            self._on_bound(msg)
        else:
            log.error("front end %d sent an unknown message %s", self.slot, type(msg).__name__)
        for fd in fds:  # segments were mapped (a mapping outlives its descriptor)
            with contextlib.suppress(OSError):
                os.close(fd)

    def on_channel_close(self) -> None:
        """Nothing to do here: the supervisor acts on the process's exit (``Group._watch``);
        the channel closes when that process goes (or when the supervisor closes it)."""

    def _sources(self, msg: Submit, fds: list[int]) -> dict[str, Source]:
        segments: dict[int, ByteBase] = {}
        sources: dict[str, Source] = {}
        for name, span in msg.spans.items():
            if type(span) is tuple:  # ArenaSpan
                sources[name] = (self.arena, span[0])
            elif isinstance(span, SegmentSpan):
                if span.fd_index not in segments:
                    # Unmapped when the last tensor viewing it goes (after the call's done).
                    fd = fds[span.fd_index]
                    mm = mmap.mmap(fd, os.fstat(fd).st_size)
                    segments[span.fd_index] = ByteBase(torch.frombuffer(mm, dtype=torch.uint8))
                sources[name] = (segments[span.fd_index], span.offset)
            elif isinstance(span, RegionSpan):
                sources[name] = span
            else:
                raise TypeError(f"unknown span {span!r}")
        return sources

    def _submit(self, msg: Submit, fds: list[int]) -> None:
        with self._lock:
            self._calls[msg.call_id] = None
        try:
            params = msg.params
            if params is None:
                params = self._params[msg.params_id]  # a bug when unknown: answered below
            else:
                self._params[msg.params_id] = params
            job = self.core.submit(
                params, self._sources(msg, fds), msg.owner,
                lambda value, call_id=msg.call_id: self._done(call_id, value),
                issue_here=True,  # the channel's reader thread: no event loop to stall
            )
        except RequestError as exc:
            self._done(msg.call_id, exc)
            return
        except Exception as exc:  # a bug: answer the call, keep the connection
            log.exception("front end %d: submit failed", self.slot)
            self._done(msg.call_id, RequestError.internal(exc))
            return
        with self._lock:
            if msg.call_id in self._calls:  # not already answered
                self._calls[msg.call_id] = job

    def _done(self, call_id: int, value: ExecStats | BaseException) -> None:
        """Exactly once per Submit (executor thread, or the reader for a refusal)."""
        with self._lock:
            self._calls.pop(call_id, None)
            if not self._calls:  # what wait_idle waits for
                self._lock.notify_all()
        if isinstance(value, BaseException):
            self.send(Failed(call_id, value))
        else:
            self.send(Done(call_id, value))

    def _control_call(self, msg: ControlCall) -> None:
        try:
            request = rpc_types(msg.method)[0].FromString(msg.request)
            reply = self.core.control_call(msg.method, request, msg.owner).SerializeToString()
        except RequestError as exc:
            self.send(Failed(msg.call_id, exc))
        except Exception as exc:
            log.exception("front end %d: %s failed", self.slot, msg.method)
            self.send(Failed(msg.call_id, RequestError.internal(exc)))
        else:
            self.send(Reply(msg.call_id, reply))

    # ---- supervisor ---------------------------------------------------------------------

    @property
    def inflight(self) -> int:
        with self._lock:
            return len(self._calls)

    def cancel_all(self) -> None:
        """Its front end is gone: nobody will read these results."""
        with self._lock:
            jobs = [j for j in self._calls.values() if j is not None]
        for job in jobs:
            self.core.cancel(job)

    def wait_idle(self, timeout: float) -> bool:
        """Until no call of this connection is in the engine (its arena is quiet)."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._calls, timeout)
