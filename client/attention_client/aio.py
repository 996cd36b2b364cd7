"""asyncio client (grpc.aio): the same methods as AttentionClient, as coroutines.

Create it inside a running event loop (a grpc.aio channel belongs to the loop that first uses
it). Many calls may run concurrently on one client; they share one HTTP/2 connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from attention_client import _argnames as argnames
from attention_client._base import (
    SPREAD_TIMEOUT_S,
    ClientBase,
    LostLanes,
    crowded,
    lane_rpcs,
    spread_tries,
)
from attention_client._caches import AsyncKvCache
from attention_client._call_streams import AsyncCallStreams
from attention_client._channel import (
    CACHE_RPCS,
    DEFAULT,
    INFO_METHOD,
    REGION_RPCS,
    SERVICE,
    CallSettings,
)
from attention_client._errors import (
    AttentionError,
    AttentionInputError,
    AttentionNotFoundError,
    AttentionTimeoutError,
    from_rpc_error,
    make_error,
)
from attention_client._regions import SharedRegion
from attention_client._requests import KvLayout, PreparedRequest, kv_scales_of
from attention_client._responses import cache_info_dict, pool_info_dict, server_info_dict
from attention_client._score import ScoreMods
from attention_client._steps import AsyncDecodeSteps
from attention_client._stripes import join, lanes, merge_stats
from attention_wire import unary_method
from attention_wire.pb import attention_pb2 as pb
from attention_wire.requests import DEFAULT_CHUNK_BYTES, encode_messages
from attention_wire.responses import parse_result


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()


class AsyncAttentionClient(ClientBase):
    """See AttentionClient; ``interceptors`` are ``grpc.aio`` client interceptors here, and
    ``kv_cache`` returns an ``AsyncKvCache`` (awaited methods, ``async with``)."""

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        token: str | None = None,
        tls: Any = None,
        timeout: float | None = 60.0,
        interceptors: Sequence[Any] | None = None,
        max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        options: Sequence[tuple[str, Any]] | None = None,
        use_regions: bool = True,
        channels: int = 1,
        metadata: Any = None,
        wait_for_ready: bool | None = None,
        client_cert: Any = None,
        client_key: Any = None,
        unary: bool = True,
        call_streams: bool = True,
        stripes: int = 1,
        spread: bool = True,
        load_balancing: str | None = None,
    ) -> None:
        super().__init__(
            target, token=token, tls=tls, timeout=timeout, max_chunk_bytes=max_chunk_bytes,
            options=options, use_regions=use_regions, channels=channels, metadata=metadata,
            wait_for_ready=wait_for_ready, client_cert=client_cert, client_key=client_key,
            unary=unary, call_streams=call_streams, stripes=stripes, spread=spread,
            load_balancing=load_balancing,
        )
        self._interceptors = list(interceptors) if interceptors else None
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
        self._channel = channel
        self._info = channel.unary_unary(
            INFO_METHOD,
            request_serializer=pb.GetServerInfoRequest.SerializeToString,
            response_deserializer=pb.ServerInfo.FromString,
        )
        self._health = health_pb2_grpc.HealthStub(channel)
        self._unary_rpcs = {
            method: channel.unary_unary(
                f"/{SERVICE}/{method}", request_serializer=_serialize,
                response_deserializer=getattr(pb, reply).FromString,
            )
            for method, reply in (REGION_RPCS | CACHE_RPCS).items()
        }

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

    async def _placed_lane(self, lane_no: int, settings: CallSettings, method: str) -> None:
        """Before a call that uses lane ``lane_no``: if its connection was lost since it was
        placed, place the new one first (one task per lane, which calls that come meanwhile
        wait for, within their deadlines). A server that does not answer leaves the lane to
        be looked at by the next call."""
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

    async def attention(
        self,
        q: Any,
        k: Any,
        v: Any,
        cu_seqlens: Any = None,
        cu_seqlens_k: Any = None,
        *,
        causal: bool = False,
        softmax_scale: float | None = None,
        return_lse: bool = False,
        window_size: Any = (-1, -1),
        softcap: float = 0.0,
        alibi_slopes: Any = None,
        k_scale: Any = None,
        v_scale: Any = None,
        out: Any = None,
        use_regions: bool | None = None,
        timeout: Any = DEFAULT,
        metadata: Any = None,
        wait_for_ready: bool | None = None,
    ) -> Any:
        """See AttentionClient.attention."""
        settings = self._settings(timeout, metadata, wait_for_ready)
        score, kv_scales = ScoreMods.of(window_size, softcap, alibi_slopes), kv_scales_of(
            k_scale, v_scale)

        whole, parts = self._split_call(
            lambda q, k, v, score, kv_scales: self._prepare_attention(
                q, k, v, cu_seqlens, cu_seqlens_k, causal, softmax_scale, return_lse, out,
                use_regions, score, kv_scales,
            ), q, k, v, out, use_regions, score, kv_scales)
        names = self._attention_names
        if parts is None:
            return await self._run_placed(whole, settings, names)
        return await self._striped(parts, whole, settings, names, return_lse, -2)

    async def decode(
        self,
        q: Any,
        k: Any,
        v: Any,
        cu_seqlens_k: Any,
        *,
        softmax_scale: float | None = None,
        num_splits: int = 0,
        return_lse: bool = False,
        window_size: Any = (-1, -1),
        softcap: float = 0.0,
        alibi_slopes: Any = None,
        k_scale: Any = None,
        v_scale: Any = None,
        out: Any = None,
        use_regions: bool | None = None,
        timeout: Any = DEFAULT,
        metadata: Any = None,
        wait_for_ready: bool | None = None,
    ) -> Any:
        """See AttentionClient.decode."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.decode())
        score, kv_scales = ScoreMods.of(window_size, softcap, alibi_slopes), kv_scales_of(
            k_scale, v_scale)

        whole, parts = self._split_call(
            lambda q, k, v, score, kv_scales: self._prepare_decode(
                q, k, v, cu_seqlens_k, softmax_scale, num_splits, return_lse, out, use_regions,
                score, kv_scales,
            ), q, k, v, out, use_regions, score, kv_scales)
        if parts is None:
            return await self._run_placed(whole, settings)
        return await self._striped(parts, whole, settings, None, return_lse, -1)

    # ---- server-side KV caches -------------------------------------------------------------

    def kv_cache(
        self, num_kv_heads: int, head_dim: int, dtype: Any, *, kv_dtype: Any = None,
        k_scale: Any = None, v_scale: Any = None, session: str | None = None,
    ) -> AsyncKvCache:
        """See AttentionClient.kv_cache (not a coroutine: nothing is sent yet)."""
        return AsyncKvCache(self, KvLayout.of(num_kv_heads, head_dim, dtype, kv_dtype,
                                              k_scale, v_scale), session)

    async def decode_step(
        self,
        q: Any,
        cache_ids: Any,
        k_new: Any = None,
        v_new: Any = None,
        *,
        store: bool = True,
        softmax_scale: float | None = None,
        num_splits: int = 0,
        return_lse: bool = False,
        window_size: Any = (-1, -1),
        softcap: float = 0.0,
        alibi_slopes: Any = None,
        out: Any = None,
        use_regions: bool | None = None,
        timeout: Any = DEFAULT,
        metadata: Any = None,
        wait_for_ready: bool | None = None,
    ) -> Any:
        """See AttentionClient.decode_step."""
        settings = self._settings(
            timeout, metadata, wait_for_ready, argnames.cache_decode("cache_ids")
        )
        prep = await self._decode_step_request(
            settings, q, cache_ids, k_new, v_new, store, softmax_scale, num_splits, return_lse,
            ScoreMods.of(window_size, softcap, alibi_slopes), out, use_regions,
        )
        with self._layouts_checked(prep):
            return await self._run(prep, settings)

    async def _decode_step_request(
        self, settings: CallSettings, q: Any, cache_ids: Any, k_new: Any, v_new: Any,
        store: bool, softmax_scale: float | None, num_splits: int, return_lse: bool,
        score: ScoreMods, out: Any = None, use_regions: bool | None = None,
    ) -> PreparedRequest:
        """A decode step's request (``decode_step``, ``decode_steps``): the cheap checks, the
        layouts this client lacks (one ListCaches within ``settings``), then the request."""
        ids = self._decode_step_ids(q, cache_ids)
        missing = self._unknown_layouts(ids, k_new, v_new)
        if missing:
            with self._layout_lookup():
                await self._list_caches(missing, settings)
        try:
            return self._prepare_decode_step(
                q, ids, k_new, v_new, store, softmax_scale, num_splits, return_lse, score, out,
                use_regions,
            )
        except AttentionInputError:
            if not self._stale_layouts(ids, missing, k_new, v_new):
                raise
        # q did not fit a layout remembered from earlier: the cache may have been released
        # and made again with another layout elsewhere. Ask the server once.
        with self._layout_lookup():
            await self._list_caches(ids, settings)
        return self._prepare_decode_step(
            q, ids, k_new, v_new, store, softmax_scale, num_splits, return_lse, score, out,
            use_regions,
        )

    def decode_steps(
        self, *, timeout: Any = DEFAULT, metadata: Any = None,
        wait_for_ready: bool | None = None,
    ) -> AsyncDecodeSteps:
        """See AttentionClient.decode_steps (``async with``; ``await steps.step(...)``)."""
        return AsyncDecodeSteps(self, timeout, metadata, wait_for_ready)

    async def release_caches(
        self, ids: Any = None, *, all: bool = False, timeout: Any = DEFAULT,
        metadata: Any = None, wait_for_ready: bool | None = None,
    ) -> int:
        """See AttentionClient.release_caches."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.cache_ids())
        request, ids = self._release_request(ids, all)
        reply = await self._unary_rpc("ReleaseCaches", request, settings)
        self._forget_layouts(ids)
        return int(reply.released)

    async def list_caches(
        self, ids: Any = None, *, timeout: Any = DEFAULT, metadata: Any = None,
        wait_for_ready: bool | None = None,
    ) -> list[dict[str, Any]]:
        """See AttentionClient.list_caches."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.cache_ids())
        return [cache_info_dict(c) for c in (await self._list_caches(ids, settings)).caches]

    async def kv_pool_info(
        self, *, timeout: Any = DEFAULT, metadata: Any = None,
        wait_for_ready: bool | None = None,
    ) -> dict[str, Any]:
        """See AttentionClient.kv_pool_info."""
        settings = self._settings(timeout, metadata, wait_for_ready)
        return pool_info_dict((await self._list_caches(None, settings, pool_only=True)).pool)

    async def _list_caches(
        self, ids: Any, settings: CallSettings | None = None, pool_only: bool = False
    ) -> pb.ListCachesResponse:
        """See AttentionClient._list_caches."""
        request, listed = self._list_request(ids, pool_only), None
        while listed is None or request.page_token:
            page = await self._unary_rpc("ListCaches", request, settings)
            listed = self._list_page(request, listed, page)
        return listed

    # ---- same-host shared memory -----------------------------------------------------------

    async def register_shm(
        self, nbytes: int, *, name: str | None = None, timeout: Any = DEFAULT,
        metadata: Any = None, wait_for_ready: bool | None = None,
    ) -> SharedRegion:
        """See AttentionClient.register_shm; close it with ``await region.aclose()``."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.REGISTER)
        return await self._register("system", nbytes, name, None, settings)

    async def register_cuda(
        self, nbytes: int, *, device: Any = None, name: str | None = None,
        timeout: Any = DEFAULT, metadata: Any = None, wait_for_ready: bool | None = None,
    ) -> SharedRegion:
        """See AttentionClient.register_cuda."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.REGISTER)
        return await self._register("cuda", nbytes, name, device, settings)

    async def list_regions(
        self, *, timeout: Any = DEFAULT, metadata: Any = None,
        wait_for_ready: bool | None = None,
    ) -> list[dict[str, Any]]:
        """See AttentionClient.list_regions."""
        settings = self._settings(timeout, metadata, wait_for_ready)
        reply = await self._unary_rpc("ListRegions", pb.ListRegionsRequest(), settings)
        return [{f.name: getattr(r, f.name) for f in r.DESCRIPTOR.fields} for r in reply.regions]

    async def _register(
        self, kind: str, nbytes: int, name: str | None, device: Any, settings: CallSettings
    ) -> SharedRegion:
        region, request = self._new_region(kind, nbytes, name, device)
        try:
            await self._unary_rpc("RegisterRegion", request, settings)
        except BaseException:
            region._release()
            raise
        region._unregister, region._aunregister = None, self._unregister
        self.regions.add(region)
        return region

    async def _unregister(self, region: SharedRegion) -> None:
        self.regions.discard(region)
        # NOT_FOUND: the server no longer knows it (it restarted): nothing to unregister.
        with contextlib.suppress(AttentionNotFoundError):
            await self._unary_rpc(
                "UnregisterRegion", pb.UnregisterRegionRequest(name=region.name)
            )

    async def _run_placed(
        self, make: Callable[[], PreparedRequest], settings: CallSettings,
        names: Callable[[PreparedRequest], Any] | None = None,
    ) -> Any:
        """See AttentionClient._run_placed."""
        prep = make()
        try:
            return await self._run(prep, settings.named(names(prep)) if names else settings)
        except AttentionError as err:
            if not self._region_lost(prep, err) or not await self._reregister(settings):
                raise
        prep = make()
        return await self._run(prep, settings.named(names(prep)) if names else settings)

    async def _reregister(self, settings: CallSettings) -> bool:
        """See AttentionClient._reregister."""
        listing = await self._unary_rpc(
            "ListRegions", pb.ListRegionsRequest(), settings.named(None)
        )
        lost = self._forgotten(listing)
        for region in lost:
            await self._unary_rpc(
                "RegisterRegion", region._register_request, settings.named(None)
            )
        return bool(lost)

    async def _unary_rpc(
        self, method: str, request: Any, settings: CallSettings | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """See AttentionClient._unary_rpc."""
        settings = settings or self._settings()
        await self._placed_lane(0, settings, method)
        try:
            call = self._unary_rpcs[method](request, **settings.kwargs())
            reply = await call
            if headers is not None:
                headers.update(await call.initial_metadata() or ())
            return reply
        except grpc.RpcError as err:
            raise from_rpc_error(err, method, settings.names) from err

    async def info(
        self, *, timeout: Any = DEFAULT, metadata: Any = None,
        wait_for_ready: bool | None = None,
    ) -> dict[str, Any]:
        """See AttentionClient.info."""
        settings = self._settings(timeout, metadata, wait_for_ready)
        await self._placed_lane(0, settings, "GetServerInfo")
        try:
            reply = await self._info(pb.GetServerInfoRequest(), **settings.kwargs())
        except grpc.RpcError as err:
            raise from_rpc_error(err, "GetServerInfo") from err
        return server_info_dict(reply)

    async def health(
        self, service: str = "", *, timeout: Any = DEFAULT, metadata: Any = None,
        wait_for_ready: bool | None = None,
    ) -> str:
        """See AttentionClient.health."""
        settings = self._settings(timeout, metadata, wait_for_ready)
        await self._placed_lane(0, settings, "Health.Check")
        try:
            reply = await self._health.Check(
                health_pb2.HealthCheckRequest(service=service), **settings.kwargs()
            )
        except grpc.RpcError as err:
            raise from_rpc_error(err, "Health.Check") from err
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def close(self) -> None:
        """Unregister this client's regions (best effort) and close the channel."""
        for region in self.regions.all():
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
        settings: CallSettings, names: Callable[[PreparedRequest], Any] | None,
        return_lse: bool, lse_axis: int,
    ) -> Any:
        """See AttentionClient._striped: the parts as tasks on consecutive connections; the
        first failure cancels the others (and so does cancelling the call)."""
        connections = lanes(next(self._turn), len(makes), len(self._lanes))

        async def part(i: int) -> tuple[Any, dict[str, Any] | None]:
            prep = makes[i]()
            result = await self._run(prep, settings.named(names(prep)) if names else settings,
                                     lane=connections[i])
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

    async def _run(self, prep: PreparedRequest, settings: CallSettings | None = None,
                   lane: int | None = None) -> Any:
        """One call; ``lane``: its connection (default: the next in turn)."""
        settings = settings or self._settings()
        lane_no = self._lane_for(prep.method) if lane is None else lane
        try:
            await self._ensure_spread(settings, prep.method)
            if self._quarantined():  # a failed call's scratch: free again once the server is idle
                self._release_idle(await self._unary_rpc(
                    "ListRegions", pb.ListRegionsRequest(), settings.named(None)
                ))
            assembler = self._assembler(prep)
            await self._placed_lane(lane_no, settings, prep.method)
        except BaseException:
            if prep.placement is not None:
                prep.placement.finish(ok=True)  # nothing was sent
            raise
        lane = self._lanes[lane_no]
        message, streamed = self._call_message(prep, settings)
        if message is not None and streamed:
            try:
                raw = await self._streams.run(lane_no, lane, prep.method, message, settings)
            except BaseException:
                self._abandon(prep)
                raise
            if raw is not None:
                return self._assemble(prep, assembler, parse_result(raw))
        if message is not None:
            try:
                responses = await lane[unary_method(prep.method)](message, **settings.kwargs())
            except grpc.RpcError as err:
                self._unary_failed(prep, err, settings)  # returns: stream it instead
            except BaseException:  # cancelled: the unary call is cancelled with the task
                self._abandon(prep)
                raise
            else:
                return self._assemble(prep, assembler, responses)
        # A plain generator is fine for grpc.aio: producing a message is one memcpy.
        messages = encode_messages(prep.header, prep.tensors, self.max_chunk_bytes)
        call = lane[prep.method](messages, **settings.kwargs())
        try:
            async for response in call:
                assembler.add(response)
            return self._complete(prep, assembler)
        except grpc.RpcError as err:
            self._abandon(prep)
            raise _upload_error(err, prep.method, settings) from err
        except BaseException:  # broken stream or abandoned call: cancel (why: client.py)
            self._abandon(prep)
            call.cancel()
            raise


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
