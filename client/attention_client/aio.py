"""asyncio client (grpc.aio): ``ClientCore``'s calls as coroutines, over ``grpc.aio``
channels (their placing, tasks for striped calls).

Create it inside a running event loop (a grpc.aio channel belongs to the loop that first uses
it). Many calls may run concurrently on one client; they share one HTTP/2 connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import grpc

from attention_client._caches import AsyncKvCache
from attention_client._call_streams import AsyncCallStreams
from attention_client._channel import (
    INFO_METHOD,
    SPREAD_TIMEOUT_S,
    CallSettings,
    LostLanes,
    crowded,
    lane_rpcs,
    small_rpcs,
    spread_tries,
)
from attention_client._core import ClientCore, Steps
from attention_client._errors import (
    AttentionError,
    AttentionInputError,
    AttentionTimeoutError,
    from_rpc_error,
    make_error,
)
from attention_client._regions import SharedRegion
from attention_client._requests import PreparedRequest
from attention_client._steps import AsyncDecodeSteps
from attention_client._stripes import join, lanes, merge_stats
from attention_wire.messages import encode_messages
from attention_wire.pb import attention_pb2 as pb


class AsyncAttentionClient(ClientCore):
    """``AttentionClient``'s calls as coroutines; ``kv_cache`` returns an ``AsyncKvCache``
    (awaited methods, ``async with``), ``decode_steps`` an ``AsyncDecodeSteps``."""

    _KvCache, _DecodeSteps = AsyncKvCache, AsyncDecodeSteps

    def _open(self) -> None:
        self._channels: list[grpc.aio.Channel] = []
        self._lanes: list[dict[str, Any]] = []
        self._streams = AsyncCallStreams()
        for i in range(self.channels):
            ch, lane = self._open_lane(i)
            self._channels.append(ch)
            self._lanes.append(lane)
        self._bind(self._channels[0])
        # ``spread`` waits for the first compute call or decode step (nothing can be awaited
        # here): see _ensure_spread.
        self._spread_pending = self.spread
        self._spread_task: asyncio.Task[None] | None = None
        self._closing = False
        self._retired: list[grpc.aio.Channel] = []  # replaced channels
        self._retiring: set[asyncio.Task[None]] = set()  # their closes, with a grace period
        # ``spread`` again for a lane whose connection was lost (LostLanes): a task per lane
        # watches its connectivity (on a server of several front ends), and one places it.
        self._lost = LostLanes(self.channels)
        self._several_frontends = False  # what spread's looks found
        self._watchers: list[asyncio.Task[None] | None] = [None] * self.channels
        self._placing: list[asyncio.Task[None] | None] = [None] * self.channels

    def _open_lane(self, lane_no: int) -> tuple[grpc.aio.Channel, dict[str, Any]]:
        """A new channel for lane ``lane_no`` (a connection of its own) and its compute rpcs."""
        icpts = self._interceptors
        target, options = self._lane_channel(lane_no)
        if self._credentials is None:
            ch = grpc.aio.insecure_channel(target, options=options, interceptors=icpts)
        else:
            ch = grpc.aio.secure_channel(
                target, self._credentials, options=options, interceptors=icpts
            )
        return ch, lane_rpcs(ch)

    def _bind(self, channel: grpc.aio.Channel) -> None:
        """The small rpcs (info, health, regions, caches) go over the first channel."""
        self._channel, self._unary_rpcs = channel, small_rpcs(channel)

    async def _drive(self, steps: Steps) -> Any:
        """Run a call's steps: await each rpc they yield, and send its reply (or throw its
        error, a cancellation included) back in."""
        try:
            pending = next(steps)
            while True:
                try:
                    reply = await pending
                except BaseException as exc:
                    pending = steps.throw(exc)
                else:
                    pending = steps.send(reply)
        except StopIteration as done:
            return done.value

    async def _ensure_spread(self, settings: CallSettings, method: str) -> None:
        """``spread``, once, before the first compute call or decode step uses a connection:
        see AttentionClient._spread_lanes. The looks run as a task of the client's, which
        every first call waits for (a call that is cancelled, or whose deadline passes
        meanwhile, leaves it running for the others); a failure leaves the channels as they
        are."""
        if not self._spread_pending or self._closing:
            return
        if self._spread_task is None:
            self._spread_task = asyncio.ensure_future(self._spread_lanes())
        await _wait_for_looks(self._spread_task, settings, method,
                              "its connections (spread=True; it does so once, before its "
                              "first call)")

    async def _spread_lanes(self) -> None:
        try:
            for i in range(len(self._lanes)):
                if not await self._place(i, self.timeout or 60.0) or self._closing:
                    return
            if self._several_frontends:  # else there is nowhere else to go
                for i in range(len(self._lanes)):
                    self._watch(i)
        finally:
            self._spread_pending = False

    async def _place(self, lane_no: int, grace: float) -> bool:
        """``spread`` for one lane (see AttentionClient._place); a replaced channel's calls
        get ``grace`` to finish."""
        settings = self._settings(min(self.timeout or SPREAD_TIMEOUT_S, SPREAD_TIMEOUT_S),
                                  wait_for_ready=False)
        tries = 0
        while True:
            try:
                info = await self._lanes[lane_no][INFO_METHOD](
                    pb.GetServerInfoRequest(connections=True), **settings.kwargs())
            except (grpc.RpcError, grpc.aio.UsageError):  # down, old, or closed
                return False
            tries += 1
            self._several_frontends = self._several_frontends or info.frontends > 1
            if self._closing or not crowded(info) or tries >= spread_tries(info):
                return True
            await self._replace(lane_no, grace)

    async def _replace(self, lane_no: int, grace: float) -> None:
        """A new channel for lane ``lane_no``; the old one closes once its calls end (at most
        ``grace``)."""
        old = self._channels[lane_no]
        watcher = self._watchers[lane_no]
        if watcher is not None:
            watcher.cancel()
        self._channels[lane_no], self._lanes[lane_no] = self._open_lane(lane_no)
        self._lost.placed(lane_no, new_channel=True)
        if watcher is not None:
            self._watch(lane_no)
        if lane_no == 0:
            self._bind(self._channels[0])
        # Small rpcs already sent on the old channel 0 finish first (close() cuts that
        # short); nothing new goes there. Its idle call streams close now.
        self._retired.append(old)
        for stream in self._streams.take_lane(lane_no):
            await stream.close()
        task = asyncio.ensure_future(old.close(grace=grace))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def _watch(self, lane_no: int) -> None:
        """A task that feeds lane ``lane_no``'s connectivity to ``_lost``."""
        async def watch(channel: grpc.aio.Channel) -> None:
            state = channel.get_state(try_to_connect=False)
            while state is not grpc.ChannelConnectivity.SHUTDOWN:
                self._lost.seen(lane_no, state)
                await channel.wait_for_state_change(state)
                state = channel.get_state(try_to_connect=False)

        self._watchers[lane_no] = asyncio.ensure_future(watch(self._channels[lane_no]))

    async def _ready_lane(self, lane_no: int, settings: CallSettings, method: str,
                          compute: bool = True) -> None:
        """Before a call that uses lane ``lane_no``: ``spread`` done (``compute``: before the
        first compute call or step only); if its connection was lost since it was
        placed, place the new one first (one task per lane, which calls that come meanwhile
        wait for, within their deadlines). A server that does not answer leaves the lane to
        be looked at by the next call."""
        if compute:
            await self._ensure_spread(settings, method)
        if not self._lost.lost(lane_no) or self._closing:
            return
        task = self._placing[lane_no]
        if task is None or task.done():
            async def place() -> None:
                if await self._place(lane_no, self.timeout or 60.0):
                    self._lost.placed(lane_no)

            task = self._placing[lane_no] = asyncio.ensure_future(place())
        await _wait_for_looks(task, settings, method,
                              "its new connection (spread=True; it does so after a "
                              "connection was lost)")

    async def _unary_rpc(
        self, method: str, request: Any, settings: CallSettings | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        settings = settings or self._settings()
        await self._ready_lane(0, settings, method, compute=False)
        try:
            call = self._unary_rpcs[method](request, **settings.kwargs())
            reply = await call
            if headers is not None:
                headers.update(await call.initial_metadata() or ())
            return reply
        except grpc.RpcError as err:
            raise from_rpc_error(err, method, settings.names) from err

    async def _stream_call(self, lane: dict[str, Any], prep: PreparedRequest,
                           settings: CallSettings) -> Any:
        # A plain generator is fine for grpc.aio: producing a message is one memcpy.
        call = lane[prep.method](encode_messages(prep.header, prep.tensors, self.max_chunk_bytes),
                                 **settings.kwargs())
        try:
            async for response in call:
                prep.add_reply(response)
            return self._complete(prep)
        except grpc.RpcError as err:
            self._abandon(prep)
            raise _upload_error(err, prep.method, settings) from err
        except BaseException:  # broken stream or abandoned call: cancel (why: client.py)
            self._abandon(prep)
            call.cancel()
            raise

    def _own(self, region: SharedRegion) -> None:
        region._unregister, region._aunregister = None, self._unregister

    async def close(self) -> None:
        """Unregister this client's regions (best effort) and close the channel."""
        for region in self._live_regions():
            with contextlib.suppress(AttentionError):
                await region.aclose()
        self._closing = True
        watchers = [w for w in self._watchers if w is not None]
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        looks = [t for t in (self._spread_task, *self._placing) if t is not None]
        if looks:  # their looks end within their 2 s, or at once
            await asyncio.wait(looks)
        await self._streams.close()
        for ch in self._channels:
            await ch.close()
        for task in list(self._retiring):  # a replaced channel's grace ends now
            task.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        for ch in self._retired:
            await ch.close()
        self.closed = True

    async def __aenter__(self) -> AsyncAttentionClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _striped(
        self, makes: list[Callable[[], PreparedRequest]], whole: Callable[[], PreparedRequest],
        settings: CallSettings, return_lse: bool, lse_axis: int, like: Any = None,
    ) -> Any:
        """See AttentionClient._striped: the parts as tasks on consecutive connections; the
        first failure cancels the others (and so does cancelling the call)."""
        connections = lanes(next(self._turn), len(makes), len(self._lanes))

        async def part(i: int) -> tuple[Any, dict[str, Any] | None]:
            prep = makes[i]()
            result = await self._run(prep, settings, connections[i])
            return result, prep.stats

        tasks = [asyncio.ensure_future(part(i)) for i in range(len(makes))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except BaseException:  # this call was cancelled: so are its parts
            for task in tasks:
                task.cancel()
            raise
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception()]
        if failed:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # every part has ended
            error = failed[0].exception()
            assert error is not None
            if isinstance(error, AttentionInputError):
                whole()  # the whole call's own message (raises)
            raise error
        outcomes = [t.result() for t in tasks]
        self.last_stats = merge_stats([stats for _, stats in outcomes])
        return join([result for result, _ in outcomes], return_lse, lse_axis)


async def _wait_for_looks(task: asyncio.Task[None], settings: CallSettings, method: str,
                          what: str) -> None:
    """Wait for ``spread``'s looks (``task``) within the call's deadline; a call that is
    cancelled, or whose deadline passes, leaves them running for the others."""
    timeout = None
    if settings.deadline is not None:
        timeout = max(settings.deadline - time.monotonic(), 0.0)
    try:
        await asyncio.wait_for(asyncio.shield(task), timeout)
    except asyncio.TimeoutError:
        raise make_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                         f"the call's deadline passed while the client was placing {what}",
                         method) from None


def _upload_error(err: grpc.RpcError, method: str, settings: CallSettings) -> AttentionError:
    """A streamed call's error. grpc.aio reports a request stream cut off mid-upload by the
    call's deadline as INTERNAL ("Internal error from Core"), not DEADLINE_EXCEEDED: a call
    whose deadline has passed is reported as timed out, as the sync client reports it."""
    expired = settings.deadline is not None and time.monotonic() >= settings.deadline
    if expired and err.code() is grpc.StatusCode.INTERNAL:
        return AttentionTimeoutError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "the call's timeout ran out while its request was being sent", method,
        )
    return from_rpc_error(err, method, settings.names)
