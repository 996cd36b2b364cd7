"""Blocking client of the remote attention service: the transport under ``ClientCore``'s
calls (channels, their placing, threads for striped calls)."""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from attention_client._caches import KvCache
from attention_client._call_streams import CallStreams
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
from attention_client._errors import AttentionError, AttentionInputError, from_rpc_error
from attention_client._regions import SharedRegion
from attention_client._requests import PreparedRequest
from attention_client._steps import DecodeSteps
from attention_client._stripes import MAX_STRIPES, caller_stream, join, lanes, merge_stats
from attention_wire.messages import encode_messages
from attention_wire.pb import attention_pb2 as pb


def _await_pollers(channels: Sequence[grpc.Channel], limit_s: float = 0.5) -> None:
    """Wait until grpc's connectivity poller of each of ``channels`` (unsubscribed) has
    stopped: it wakes every 0.2 s, and one that finds its channel closed raises in its thread
    ("Cannot monitor channel state: Channel closed!"). Channels never watched, or a grpc
    without this attribute, do not wait."""
    end = time.monotonic() + limit_s
    for ch in channels:
        state = getattr(ch, "_connectivity_state", None)
        while getattr(state, "polling", False) and time.monotonic() < end:
            time.sleep(0.005)


class AttentionClient(ClientCore):
    """Remote varlen attention over gRPC, blocking: see ``ClientCore.__init__`` for the
    constructor and ``ClientCore`` for the calls (docs/client.md)."""

    _KvCache, _DecodeSteps = KvCache, DecodeSteps

    def _open(self) -> None:
        self._base_channels: list[grpc.Channel] = []
        self._lanes: list[dict[str, Any]] = []
        self._streams = CallStreams()
        self._stripe_pool: ThreadPoolExecutor | None = None  # made by the first striped call
        self._stripe_lock = threading.Lock()
        # ``spread`` again for a lane whose connection was lost (LostLanes): its watch (a
        # connectivity subscription) and one placing at a time.
        self._lost = LostLanes(self.channels)
        self._watches: list[Callable[[grpc.ChannelConnectivity], None] | None] = []
        self._place_locks = [threading.Lock() for _ in range(self.channels)]
        self._several_frontends = False  # what spread's looks found
        try:
            for i in range(self.channels):
                base, lane = self._open_lane(i)
                self._base_channels.append(base)
                self._lanes.append(lane)
                self._watches.append(None)
            if self.spread:
                self._spread_lanes()
        except BaseException:  # e.g. an interceptor that raised: no channel left open
            for base in self._base_channels:
                base.close()
            raise
        self._bind(self._base_channels[0])
        if self._several_frontends:  # else there is nowhere else to go
            for i in range(self.channels):
                self._watch(i)

    def _open_lane(self, lane_no: int) -> tuple[grpc.Channel, dict[str, Any]]:
        """A new channel for lane ``lane_no`` (a connection of its own) and its compute rpcs."""
        target, options = self._lane_channel(lane_no)
        if self._credentials is None:
            base = grpc.insecure_channel(target, options=options)
        else:
            base = grpc.secure_channel(target, self._credentials, options=options)
        icpts = self._interceptors
        return base, lane_rpcs(grpc.intercept_channel(base, *icpts) if icpts else base)

    def _bind(self, base: grpc.Channel) -> None:
        """The small rpcs (info, health, regions, caches) go over the first channel."""
        icpts = self._interceptors
        self._unary_rpcs = small_rpcs(grpc.intercept_channel(base, *icpts) if icpts else base)

    def _drive(self, steps: Steps) -> Any:
        """Run a call's steps: each rpc they yield was made as they evaluated it."""
        reply = None
        try:
            while True:
                reply = steps.send(reply)
        except StopIteration as done:
            return done.value

    def _unary_rpc(
        self, method: str, request: Any, settings: CallSettings | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        settings = settings or self._settings()
        self._ready_lane(0)
        rpc = self._unary_rpcs[method]
        try:
            if headers is None:
                return rpc(request, **settings.kwargs())
            reply, call = rpc.with_call(request, **settings.kwargs())
        except grpc.RpcError as err:
            raise from_rpc_error(err, method, settings.names) from err
        headers.update(call.initial_metadata() or ())
        return reply

    def _stream_call(self, lane: dict[str, Any], prep: PreparedRequest,
                     settings: CallSettings) -> Any:
        call = lane[prep.method](encode_messages(prep.header, prep.tensors, self.max_chunk_bytes),
                                 **settings.kwargs())
        try:
            for response in call:
                prep.add_reply(response)
            return self._complete(prep)
        except grpc.RpcError as err:
            self._abandon(prep)
            raise from_rpc_error(err, prep.method, settings.names) from err
        except BaseException:
            self._abandon(prep)
            # A broken stream (AttentionError), or the caller abandoned the call (a killed
            # greenlet, KeyboardInterrupt, task cancellation): cancel it, so the server stops its
            # work and sees CANCELLED. Otherwise gRPC may half-close the upload it was sending,
            # and the server answers a truncated request with INVALID_ARGUMENT (seen in Locust
            # runs, whose users are killed mid-call at the end).
            call.cancel()
            raise

    def _own(self, region: SharedRegion) -> None:
        region._unregister = self._unregister

    def close(self) -> None:
        """Unregister this client's regions (best effort) and close the channel."""
        for region in self._live_regions():
            # A server that is gone has nothing left to unregister.
            with contextlib.suppress(AttentionError):
                region.close()
        self._streams.close()
        with self._stripe_lock:
            self.closed = True  # no striped call starts parts any more
            if self._stripe_pool is not None:
                self._stripe_pool.shutdown(wait=False)
        for i in range(len(self._base_channels)):
            self._unwatch(i)
        _await_pollers(self._base_channels)
        for ch in self._base_channels:
            ch.close()
        self.closed = True

    def __enter__(self) -> AttentionClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spread_lanes(self) -> None:
        """``spread``: each connection that fell on a front end holding more connections than
        the least-loaded one (+1) is replaced by a new one, hashed afresh; at most
        ``spread_tries`` connections are looked at per channel (4 per front end), all within
        ``SPREAD_TIMEOUT_S`` (fail fast: a server that is not up, or cannot count, leaves the
        channels as they are)."""
        for i in range(len(self._lanes)):
            if not self._place(i):
                return

    def _place(self, lane_no: int) -> bool:
        """``spread`` for one lane; False when the server did not answer (down, or too old to
        count). A server of several front ends has its lanes watched for lost connections
        from then on."""
        settings = self._settings(min(self.timeout or SPREAD_TIMEOUT_S, SPREAD_TIMEOUT_S),
                                  wait_for_ready=False)
        tries = 0
        while True:
            try:
                info = self._lanes[lane_no][INFO_METHOD](
                    pb.GetServerInfoRequest(connections=True), **settings.kwargs())
            except grpc.RpcError:
                return False
            tries += 1
            self._several_frontends = self._several_frontends or info.frontends > 1
            if self.closed or not crowded(info) or tries >= spread_tries(info):
                return True
            self._replace(lane_no)

    def _replace(self, lane_no: int) -> None:
        """A new channel for lane ``lane_no``; the old one closes at once. It carries no call:
        at construction none was made; later every call that would use the lane (compute
        calls, decode steps, and the small rpcs on lane 0) waits for it to be placed first,
        and its idle call streams close here. (Kept open for a grace period, replaced
        connections still counted on their front end, and the other clients placing at the
        same time moved off it in turn: 20 connections for 8 clients in a test.)"""
        old = self._base_channels[lane_no]
        watched = self._watches[lane_no] is not None
        if watched:
            self._unwatch(lane_no)
        self._base_channels[lane_no], self._lanes[lane_no] = self._open_lane(lane_no)
        self._lost.placed(lane_no, new_channel=True)
        if watched:
            self._watch(lane_no)
        if lane_no == 0 and hasattr(self, "_unary_rpcs"):
            self._bind(self._base_channels[0])
        for stream in self._streams.take_lane(lane_no):  # idle, on the old connection
            stream.close()
        if watched:
            _await_pollers([old])
        old.close()

    def _watch(self, lane_no: int) -> None:
        """Feed lane ``lane_no``'s connectivity to ``_lost`` (grpc calls ``seen`` on a
        thread of its own, at once and at every change)."""
        channel = self._base_channels[lane_no]

        def seen(state: grpc.ChannelConnectivity) -> None:
            if self._base_channels[lane_no] is channel:  # not a channel replaced meanwhile
                self._lost.seen(lane_no, state)

        self._watches[lane_no] = seen
        channel.subscribe(seen, try_to_connect=False)

    def _unwatch(self, lane_no: int) -> None:
        seen = self._watches[lane_no]
        if seen is not None:
            self._watches[lane_no] = None
            self._base_channels[lane_no].unsubscribe(seen)

    def _ready_lane(self, lane_no: int, settings: Any = None, method: str = "") -> None:
        """Before a call that uses lane ``lane_no``: if its connection was lost since it was
        placed, place the new one (``spread``) first; calls that come meanwhile wait for it.
        A server that does not answer leaves the lane to be looked at by the next call."""
        if not self._lost.lost(lane_no):
            return
        with self._place_locks[lane_no]:
            if self._lost.lost(lane_no) and not self.closed and self._place(lane_no):
                self._lost.placed(lane_no)

    def _striped(
        self, makes: list[Callable[[], PreparedRequest]], whole: Callable[[], PreparedRequest],
        settings: CallSettings, return_lse: bool, lse_axis: int, like: Any,
    ) -> Any:
        """A striped call (``_stripes``): its parts, prepared by ``makes``, at once on
        consecutive connections (the first on this thread, the others on the client's stripe
        threads, each on this thread's CUDA stream and in a copy of its context), joined. A
        part's failure is raised once every part has ended, the first in part order; a bad
        argument as the whole call (``whole``) reports it. An interrupt while waiting is
        raised at once (the parts left finish within the call's timeout)."""
        with self._stripe_lock:
            if self.closed:
                raise AttentionError(grpc.StatusCode.FAILED_PRECONDITION,
                                     "the client is closed: make a new one")
            if self._stripe_pool is None:
                self._stripe_pool = ThreadPoolExecutor(
                    MAX_STRIPES, thread_name_prefix="attention-stripe")
            pool = self._stripe_pool
        on_stream = caller_stream(like)
        connections = lanes(next(self._turn), len(makes), len(self._lanes))

        def part(i: int) -> tuple[Any, dict[str, Any] | None]:
            with on_stream():
                prep = makes[i]()
                result = self._run(prep, settings, connections[i])
                return result, prep.stats

        rest = [pool.submit(contextvars.copy_context().run, part, i)
                for i in range(1, len(makes))]
        outcomes: list[tuple[Any, dict[str, Any] | None]] = []
        failures: list[Exception] = []
        try:
            outcomes.append(part(0))
        except Exception as exc:
            failures.append(exc)
        for fut in rest:
            try:
                outcomes.append(fut.result())
            except Exception as exc:
                failures.append(exc)
        if failures:
            if isinstance(failures[0], AttentionInputError):
                whole()  # the whole call's own message (raises)
            raise failures[0]
        self.last_stats = merge_stats([stats for _, stats in outcomes])
        return join([result for result, _ in outcomes], return_lse, lse_axis)
