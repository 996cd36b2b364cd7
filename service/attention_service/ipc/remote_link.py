"""``EngineLink`` of a front-end process: buffers in its shared arena, calls over a Channel.

Runs on the front end's event loop, and so does the channel's reading (``Channel.start(loop)``),
so everything here is single-threaded. A call's buffers are freed only once both the
call is done with them (``release``) and the engine is (its Done/Failed arrived): the engine
may still be copying into them when a client cancels.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from attention_service.errors import unavailable
from attention_service.ipc import arena as arenas
from attention_service.ipc.channel import (
    ArenaSpan,
    Cancel,
    Channel,
    ControlCall,
    Done,
    Failed,
    ForgetParams,
    Reply,
    SegmentSpan,
    Serving,
    Span,
    Submit,
    rpc_types,
)
from attention_service.link import EngineInfo, ExecStats
from attention_service.params import Params, RegionSpan

log = logging.getLogger("attention_service")

# Distinct Params a front end keeps defined on its channel before it starts over: far more
# than the shapes x caches of a busy server's concurrent sessions, small for the engine.
MAX_DEFINED_PARAMS = 4096


class RemoteBuffers:
    """One call's tensors: a block of the arena, or a one-off segment when it did not fit."""

    def __init__(
        self, link: RemoteLink, sizes: Mapping[str, int], block: int | None,
        segment: arenas.Mapped | None, segment_fd: int | None, total: int,
    ) -> None:
        self._link = link
        self._block, self._total = block, total
        self._segment, self.segment_fd = segment, segment_fd
        offsets, _ = arenas.layout(sizes)
        base = block if block is not None else 0
        memory = link.arena.array if segment is None else segment.array
        self.spans: dict[str, ArenaSpan | SegmentSpan] = {}
        self.arrays: dict[str, np.ndarray] = {}
        for name, n in sizes.items():
            at = base + offsets[name]
            self.arrays[name] = memory[at : at + n]
            self.spans[name] = (at, n) if segment is None else SegmentSpan(0, at, n)
        self._holders = 1  # the call; +1 while the engine has it
        self._released = False

    def hold_for_engine(self) -> None:
        self._holders += 1

    def engine_done(self) -> None:
        self._drop()

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._drop()

    def _drop(self) -> None:
        self._holders -= 1
        if self._holders:
            return
        self.arrays = {}
        if self._block is not None:
            self._link.free_list.free(self._block, self._total)
        if self._segment is not None:
            self._segment.close()
        if self.segment_fd is not None:  # never sent (the channel closes what it sends)
            os.close(self.segment_fd)
            self.segment_fd = None


class RemoteLink:
    def __init__(
        self, channel: Channel | None, arena: arenas.Mapped, info: EngineInfo,
        loop: asyncio.AbstractEventLoop, spin_s: float = 0.0,
    ) -> None:
        """``spin_s``: while its only call waits for the engine, the loop polls the channel
        for up to this long (a callback that reschedules itself keeps the loop from
        sleeping) instead of waking from epoll when the answer comes (see ``Spinner``)."""
        self.channel = channel  # set by the caller once the channel exists (it needs us)
        self.arena = arena
        self.free_list = arenas.FreeList(arena.size)
        self.info = info
        self.lazy_buffers = True  # the arena is pinned once; segments fill as written
        self.on_overflow: Callable[[], None] | None = None  # a call took a one-off segment
        self._loop = loop
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future[Any], RemoteBuffers | None]] = {}
        self._params_ids: dict[Params, int] = {}  # sent on the channel (Submit.params)
        self.serving = asyncio.Event()
        self.gone = asyncio.Event()
        self._spin_s = spin_s
        self._polling = False
        # The engine's last answer came from a launch of one request: it is not batching, so
        # a poll here waits on one launch; with batches, the engine and front ends are busy
        # and polling front ends took cores from them (8 clients on 16 vCPUs: p99 4.2 -> 7 ms).
        self._engine_alone = True

    # ---- called by the channel, on the event loop -----------------------------------------

    def on_message(self, msg: Any, fds: list[int]) -> None:
        for fd in fds:  # the engine sends none
            os.close(fd)
        self._dispatch(msg)

    def on_close(self) -> None:
        self._engine_gone()

    # ---- event loop ---------------------------------------------------------------------

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, Serving):
            self.serving.set()
            return
        entry = self._pending.pop(msg.call_id, None)
        if entry is None:
            return
        fut, buffers = entry
        if buffers is not None:
            buffers.engine_done()
        if isinstance(msg, Done):
            self._engine_alone = msg.stats.batch_requests <= 1
        if fut.done():  # the caller went away meanwhile
            return
        if isinstance(msg, Failed):
            fut.set_exception(msg.error)
        elif isinstance(msg, Done):
            fut.set_result(msg.stats)
        elif isinstance(msg, Reply):
            fut.set_result(msg.value)

    def _engine_gone(self) -> None:
        if self.gone.is_set():
            return
        self.gone.set()
        pending, self._pending = self._pending, {}
        for fut, buffers in pending.values():
            if buffers is not None:
                buffers.engine_done()
            if not fut.done():
                fut.set_exception(unavailable("the engine process exited"))

    def _send(self, msg: Any, fds: list[int] | None = None) -> None:
        if self.gone.is_set() or self.channel is None:
            raise unavailable("the engine process exited")
        self.channel.send(msg, fds or [])

    async def allocate(self, sizes: Mapping[str, int]) -> RemoteBuffers:
        _, total = arenas.layout(sizes)
        block = self.free_list.alloc(total)
        if block is not None:
            return RemoteBuffers(self, sizes, block, None, None, total)
        # Does not fit now (or ever): a segment of its own, sent along with the request.
        fd = arenas.create(total, "attention-segment")
        try:
            segment = arenas.Mapped(fd, total)
        except BaseException:
            os.close(fd)
            raise
        if self.on_overflow is not None:
            self.on_overflow()
        return RemoteBuffers(self, sizes, None, segment, fd, total)

    async def run(
        self, params: Params, buffers: RemoteBuffers,  # type: ignore[override]
        regions: Mapping[str, RegionSpan], owner: str,
    ) -> ExecStats:
        call_id = next(self._ids)
        spans: dict[str, Span] = {**buffers.spans, **regions}
        fds = []
        if buffers.segment_fd is not None:
            fds, buffers.segment_fd = [buffers.segment_fd], None  # the channel owns it now
        fut: asyncio.Future[ExecStats] = self._loop.create_future()
        msg = self._submission(call_id, params, spans, owner)
        try:
            self._send(msg, fds)
        except BaseException:
            if msg.params is not None:  # never reached the engine: send them again next time
                self._params_ids.pop(params, None)
            raise
        buffers.hold_for_engine()
        self._pending[call_id] = (fut, buffers)
        if (self._spin_s and self._engine_alone and len(self._pending) == 1
                and not self._polling):
            self._polling = True
            self._loop.call_soon(self._poll, time.perf_counter() + self._spin_s)
        try:
            return await fut
        except asyncio.CancelledError:
            if call_id in self._pending and not self.gone.is_set():
                self._send(Cancel(call_id))  # the buffers stay held until the engine answers
            raise

    def _poll(self, end: float) -> None:
        """Read the channel without waiting; again on the loop's next turn while one call
        waits and the spin lasts. More calls at once: the loop is busy anyway."""
        channel = self.channel
        if channel is not None and len(self._pending) == 1:
            channel.poll()
            if len(self._pending) == 1 and time.perf_counter() < end:
                self._loop.call_soon(self._poll, end)
                return
        self._polling = False

    def _submission(self, call_id: int, params: Params, spans: dict[str, Span],
                    owner: str) -> Submit:
        """The Submit of a call: ``params`` named by their id on the channel, and carried
        too the first time (a new id, after a ForgetParams when the table is full)."""
        pid = self._params_ids.get(params)
        if pid is not None:
            return Submit(call_id, pid, spans, owner)
        if len(self._params_ids) >= MAX_DEFINED_PARAMS:
            self._send(ForgetParams())
            self._params_ids.clear()
        pid = self._params_ids[params] = len(self._params_ids)
        return Submit(call_id, pid, spans, owner, params)

    async def control_call(self, method: str, request: Any, owner: str) -> Any:
        call_id = next(self._ids)
        fut: asyncio.Future[bytes] = self._loop.create_future()
        self._send(ControlCall(call_id, method, request.SerializeToString(), owner))
        self._pending[call_id] = (fut, None)
        return rpc_types(method)[1].FromString(await fut)
