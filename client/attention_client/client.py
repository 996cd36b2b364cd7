"""Blocking client of the remote attention service."""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
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
from attention_client._caches import KvCache
from attention_client._call_streams import CallStreams
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
    from_rpc_error,
)
from attention_client._regions import SharedRegion
from attention_client._requests import KvLayout, PreparedRequest, kv_scales_of
from attention_client._responses import cache_info_dict, pool_info_dict, server_info_dict
from attention_client._score import ScoreMods
from attention_client._steps import DecodeSteps
from attention_client._stripes import MAX_STRIPES, caller_stream, join, lanes, merge_stats
from attention_wire import unary_method
from attention_wire.pb import attention_pb2 as pb
from attention_wire.requests import DEFAULT_CHUNK_BYTES, encode_messages
from attention_wire.responses import parse_result


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()


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


class AttentionClient(ClientBase):
    """Remote varlen attention over gRPC.

    ``q, k, v`` are numpy arrays (float16, float32, ml_dtypes.bfloat16) or torch tensors on any
    device; results come back in the same flavour, dtype and device as ``q``. Failures raise
    ``AttentionError`` (``.code``, ``.details``), or one of its subclasses; bad arguments raise
    ``AttentionInputError``, which is also a ``ValueError`` (see ``attention_client._errors``).

    ``tls``: None (plaintext), True (system roots), or a root certificate as PEM bytes or a
    file path; ``client_cert`` and ``client_key`` (PEM bytes or file paths) add a client
    certificate (mutual TLS). ``token`` goes as ``authorization: Bearer <token>``;
    ``metadata`` (a mapping or (key, value) pairs) goes with every call too. ``timeout`` is
    each call's deadline in seconds (None: none). ``wait_for_ready``: True makes a call wait
    (within its timeout) for the server to become reachable instead of failing with
    UNAVAILABLE; None leaves gRPC's default (fail fast, after gRPC's retries).
    ``options`` are extra gRPC channel options. ``channels``: compute calls go round-robin over
    this many connections (for concurrent calls from many threads against a server with several
    front ends). ``unary`` (default True): a call whose request fits one message of
    ``max_chunk_bytes`` and whose outputs do too (a decode step, a short prefill) goes through
    the rpc's unary twin (``CacheDecodeUnary``, ...), about half the host time of a stream;
    False streams every call. ``stripes`` (default 1): ``attention`` and ``decode`` calls of
    4 MiB or more split into up to this many kv-head groups, sent at once over as many
    connections (``channels`` is raised to ``stripes``) and joined: one large call then uses
    several of the server's front-end processes instead of one (a Python gRPC stream moves
    about 1 GB/s). The result is the same as the whole call's; calls with ``out=`` or whose
    tensors may go through registered regions go whole. ``spread`` (default True): a server
    with several front-end processes gets each connection from the kernel, which may put
    several clients' connections on one front end while others idle; each connection found on
    a front end holding more than one connection more than the least-loaded one is replaced by
    a new one (here at construction, in the async client before its first compute call; at
    most 4 looks per front end for each connection, up to 64 (``spread_tries``), and
    ``SPREAD_TIMEOUT_S`` in all; a server that is down, or too old to count, leaves the
    connections as they are). With it, the client's connections are its own, not shared with
    other clients of this process, and do not idle out (grpc's idle timer is off). False:
    gRPC's connection as it comes. See docs/client.md.

    Several replicas without a proxy: ``target`` a list of ``HOST:PORT`` (resolved once, here),
    or ``"dns:///NAME:PORT"`` with ``load_balancing="round_robin"`` (re-resolved by gRPC).
    Stateless compute calls then go round-robin over every replica, a replica that is down is
    skipped, and ``spread``/``call_streams`` are off; caches, regions and the other small
    calls go to the first target (a cache lives on the replica that made it). Behind Envoy,
    give its one address instead (deploy/envoy).

    Every call also takes ``timeout=`` (None: no deadline), ``metadata=`` (merged over the
    client's: a key it names replaces the client's) and ``wait_for_ready=`` for itself.

    Same host: ``register_shm`` / ``register_cuda`` register a shared-memory region; calls then
    pass tensors that live in (or fit into) it by reference instead of bytes (see
    ``SharedRegion``). ``use_regions=False`` turns that off for the client or for one call.

    Server-side KV caches: ``kv_cache(num_kv_heads, head_dim, dtype)`` returns a ``KvCache``
    handle (append, prefill, decode, fork, release, info); ``decode_step``, ``release_caches``,
    ``list_caches`` and ``kv_pool_info`` work on caches by id without one.
    """

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
        self._base_channel = base
        icpts = self._interceptors
        channel = self._channel = grpc.intercept_channel(base, *icpts) if icpts else base
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

    def attention(
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
        """Prefill attention; returns ``out`` or ``(out, lse)``.

        Without ``cu_seqlens``: q ``[N, H, D]`` is one sequence (lse ``[H, N]``) and
        ``[B, N, H, D]`` a batch of equal-length ones (lse ``[B, H, N]``). With ``cu_seqlens``
        (int32 ``[B + 1]``; ``cu_seqlens_k`` defaults to it) q, k, v are packed
        ``[total, H, D]`` and lse is ``[H, total_q]``. out always has q's shape.
        ``out``: a tensor inside a registered region that the server writes in place (and
        that is returned). ``use_regions``: None follows the client's setting.
        ``window_size`` ``(left, right)`` (-1: unbounded; a query at key position ``p``
        sees keys ``p - left .. p + right``, bottom-right aligned), ``softcap`` (> 0: logits
        ``softcap * tanh(logit / softcap)``) and ``alibi_slopes`` (float32 ``[H]`` or
        ``[B, H]``: ``-slope * |p - j|`` added) are flash_attn's, with its semantics.
        FP8 keys and values: k and v float8_e4m3fn (beside float16/bfloat16 q) with
        ``k_scale`` / ``v_scale``, one float per kv head (k stands for ``k * k_scale[h]``;
        ``attention_kernels.quantize_kv`` makes both): half the bytes on the wire.
        ``timeout``, ``metadata``, ``wait_for_ready``: this call's (see the class).
        """
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
            return self._run_placed(whole, settings, names)
        return self._striped(parts, whole, settings, names, return_lse, -2, q)

    def decode(
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
        """One query token per sequence: q ``[B, H, D]``, packed k/v; lse ``[B, H]``.
        ``k_scale``/``v_scale`` (FP8 k/v), ``out``, ``use_regions``, ``timeout``,
        ``metadata``, ``wait_for_ready`` as in ``attention``."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.decode())
        score, kv_scales = ScoreMods.of(window_size, softcap, alibi_slopes), kv_scales_of(
            k_scale, v_scale)

        whole, parts = self._split_call(
            lambda q, k, v, score, kv_scales: self._prepare_decode(
                q, k, v, cu_seqlens_k, softmax_scale, num_splits, return_lse, out, use_regions,
                score, kv_scales,
            ), q, k, v, out, use_regions, score, kv_scales)
        if parts is None:
            return self._run_placed(whole, settings)
        return self._striped(parts, whole, settings, None, return_lse, -1, q)

    # ---- server-side KV caches -------------------------------------------------------------

    def kv_cache(
        self, num_kv_heads: int, head_dim: int, dtype: Any, *, kv_dtype: Any = None,
        k_scale: Any = None, v_scale: Any = None, session: str | None = None,
    ) -> KvCache:
        """A handle for server-side caches of one layout (``dtype``: the queries', a numpy or
        torch dtype, or "float16" / "bfloat16" / "float32"). Nothing is sent until it is used;
        ``with`` it to release its caches at the end.

        ``kv_dtype="float8_e4m3fn"`` (with float16/bfloat16 ``dtype``) stores keys and values
        in one byte each, quantized with ``k_scale`` / ``v_scale`` (one float per kv head, for
        every cache of the handle): half the pool and half the decode reads. New tokens may be
        given in ``dtype`` (the server quantizes them, saturating at 448 x scale) or already
        as float8_e4m3fn quantized with those scales.

        ``session``: the affinity key its calls carry (``x-attention-session``; default: one
        of its own), so that behind Envoy (docs/deploy.md) all of them reach the replica that
        holds its caches; handles given the same key share a replica."""
        return KvCache(self, KvLayout.of(num_kv_heads, head_dim, dtype, kv_dtype, k_scale,
                                         v_scale), session)

    def decode_step(
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
        """``KvCache.decode`` on existing caches by id, without a handle. Without k_new/v_new
        the caches' num_kv_heads must be known: from this client's handles, else one
        ListCaches call (within the same ``timeout``). Registered regions carry q, the new
        tokens and the outputs as in ``decode`` (``out=`` a tensor in a region: written in
        place; ``use_regions`` per call)."""
        settings = self._settings(
            timeout, metadata, wait_for_ready, argnames.cache_decode("cache_ids")
        )
        prep = self._decode_step_request(
            settings, q, cache_ids, k_new, v_new, store, softmax_scale, num_splits, return_lse,
            ScoreMods.of(window_size, softcap, alibi_slopes), out, use_regions,
        )
        with self._layouts_checked(prep):
            return self._run(prep, settings)

    def _decode_step_request(
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
                self._list_caches(missing, settings)
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
            self._list_caches(ids, settings)
        return self._prepare_decode_step(
            q, ids, k_new, v_new, store, softmax_scale, num_splits, return_lse, score, out,
            use_regions,
        )

    def decode_steps(
        self, *, timeout: Any = DEFAULT, metadata: Any = None,
        wait_for_ready: bool | None = None,
    ) -> DecodeSteps:
        """A decode loop on one stream: ``steps.step(q, cache_ids, k_new, v_new, ...)`` takes
        and returns what ``decode_step`` does, at about half its host time per step (no call
        set-up per step). ``timeout`` (default: the client's) applies to each step. Use it as
        a context manager, or ``close()`` it; one step at a time per handle."""
        return DecodeSteps(self, timeout, metadata, wait_for_ready)

    def release_caches(
        self, ids: Any = None, *, all: bool = False, timeout: Any = DEFAULT,
        metadata: Any = None, wait_for_ready: bool | None = None,
    ) -> int:
        """Release caches by id, or every cache of this caller (``all=True``); returns how
        many were released (NOT_FOUND for an unknown id: then none is)."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.cache_ids())
        request, ids = self._release_request(ids, all)
        reply = self._unary_rpc("ReleaseCaches", request, settings)
        self._forget_layouts(ids)
        return int(reply.released)

    def list_caches(
        self, ids: Any = None, *, timeout: Any = DEFAULT, metadata: Any = None,
        wait_for_ready: bool | None = None,
    ) -> list[dict[str, Any]]:
        """The caller's caches (None: all of them) as dicts, as ``KvCache.info`` gives them:
        cache_id, dtype, kv_dtype, num_kv_heads, head_dim, length, pages, ... ."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.cache_ids())
        return [cache_info_dict(c) for c in self._list_caches(ids, settings).caches]

    def kv_pool_info(
        self, *, timeout: Any = DEFAULT, metadata: Any = None,
        wait_for_ready: bool | None = None,
    ) -> dict[str, Any]:
        """The server's cache pool: page_bytes, pages_total/used/free, caches_live,
        ttl_seconds, and the caller's share: caller_pages_used, caller_pages_limit (0: none),
        caller_caches. One call, however many caches there are."""
        settings = self._settings(timeout, metadata, wait_for_ready)
        return pool_info_dict(self._list_caches(None, settings, pool_only=True).pool)

    def _list_caches(self, ids: Any, settings: CallSettings | None = None,
                     pool_only: bool = False) -> pb.ListCachesResponse:
        """Every page of a listing, as one reply."""
        request, listed = self._list_request(ids, pool_only), None
        while listed is None or request.page_token:
            page = self._unary_rpc("ListCaches", request, settings)
            listed = self._list_page(request, listed, page)
        return listed

    # ---- same-host shared memory ----------------------------------------------------------

    def register_shm(
        self, nbytes: int, *, name: str | None = None, timeout: Any = DEFAULT,
        metadata: Any = None, wait_for_ready: bool | None = None,
    ) -> SharedRegion:
        """Create a POSIX shared-memory region of ``nbytes`` and register it with the server
        (which must run on this host with registration on: ``info()["regions"]``)."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.REGISTER)
        return self._register("system", nbytes, name, None, settings)

    def register_cuda(
        self, nbytes: int, *, device: Any = None, name: str | None = None,
        timeout: Any = DEFAULT, metadata: Any = None, wait_for_ready: bool | None = None,
    ) -> SharedRegion:
        """Allocate ``nbytes`` on a GPU (default: the current one; it must be the server's)
        and register it through CUDA IPC. Needs torch."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.REGISTER)
        return self._register("cuda", nbytes, name, device, settings)

    def list_regions(
        self, *, timeout: Any = DEFAULT, metadata: Any = None,
        wait_for_ready: bool | None = None,
    ) -> list[dict[str, Any]]:
        """The server's view of this caller's regions (name, kind, byte_size, inflight)."""
        settings = self._settings(timeout, metadata, wait_for_ready)
        reply = self._unary_rpc("ListRegions", pb.ListRegionsRequest(), settings)
        return [{f.name: getattr(r, f.name) for f in r.DESCRIPTOR.fields} for r in reply.regions]

    def _register(
        self, kind: str, nbytes: int, name: str | None, device: Any, settings: CallSettings
    ) -> SharedRegion:
        region, request = self._new_region(kind, nbytes, name, device)
        try:
            self._unary_rpc("RegisterRegion", request, settings)
        except BaseException:
            region._release()
            raise
        region._unregister = self._unregister
        self.regions.add(region)
        return region

    def _unregister(self, region: SharedRegion) -> None:
        self.regions.discard(region)
        # NOT_FOUND: the server no longer knows it (it restarted): nothing to unregister.
        with contextlib.suppress(AttentionNotFoundError):
            self._unary_rpc("UnregisterRegion", pb.UnregisterRegionRequest(name=region.name))

    def _run_placed(
        self, make: Callable[[], PreparedRequest], settings: CallSettings,
        names: Callable[[PreparedRequest], Any] | None = None,
    ) -> Any:
        """``_run`` of a call whose tensors may go into regions (``make`` prepares it; ``names``
        gives its argument names for errors). A server that no longer knows this client's
        regions (it restarted) gets them registered again, and the call is made once more."""
        prep = make()
        try:
            return self._run(prep, settings.named(names(prep)) if names else settings)
        except AttentionError as err:
            if not self._region_lost(prep, err) or not self._reregister(settings):
                raise
        prep = make()
        return self._run(prep, settings.named(names(prep)) if names else settings)

    def _reregister(self, settings: CallSettings) -> bool:
        """Register again the regions the server does not know; whether there were any."""
        listing = self._unary_rpc("ListRegions", pb.ListRegionsRequest(), settings.named(None))
        lost = self._forgotten(listing)
        for region in lost:
            self._unary_rpc("RegisterRegion", region._register_request, settings.named(None))
        return bool(lost)

    def _unary_rpc(
        self, method: str, request: Any, settings: CallSettings | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """One unary rpc; ``settings`` None: the client's (a region's close, a handle's exit).
        ``headers``: filled with the answer's initial metadata (a proxy's session pin)."""
        settings = settings or self._settings()
        self._placed_lane(0)
        rpc = self._unary_rpcs[method]
        try:
            if headers is None:
                return rpc(request, **settings.kwargs())
            reply, call = rpc.with_call(request, **settings.kwargs())
        except grpc.RpcError as err:
            raise from_rpc_error(err, method, settings.names) from err
        headers.update(call.initial_metadata() or ())
        return reply

    def info(
        self, *, timeout: Any = DEFAULT, metadata: Any = None,
        wait_for_ready: bool | None = None,
    ) -> dict[str, Any]:
        """GetServerInfo as a dict (device, backend, dtypes, head_dims, limits, versions)."""
        settings = self._settings(timeout, metadata, wait_for_ready)
        self._placed_lane(0)
        try:
            reply = self._info(pb.GetServerInfoRequest(), **settings.kwargs())
        except grpc.RpcError as err:
            raise from_rpc_error(err, "GetServerInfo") from err
        return server_info_dict(reply)

    def health(
        self, service: str = "", *, timeout: Any = DEFAULT, metadata: Any = None,
        wait_for_ready: bool | None = None,
    ) -> str:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", ... ("" = the whole server).
        ``wait_for_ready=True`` waits (within ``timeout``) for a server that is starting."""
        settings = self._settings(timeout, metadata, wait_for_ready)
        self._placed_lane(0)
        try:
            reply = self._health.Check(
                health_pb2.HealthCheckRequest(service=service), **settings.kwargs()
            )
        except grpc.RpcError as err:
            raise from_rpc_error(err, "Health.Check") from err
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        """Unregister this client's regions (best effort) and close the channel."""
        for region in self.regions.all():
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
        if lane_no == 0 and hasattr(self, "_channel"):
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

    def _placed_lane(self, lane_no: int) -> None:
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
        settings: CallSettings, names: Callable[[PreparedRequest], Any] | None,
        return_lse: bool, lse_axis: int, like: Any,
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
                result = self._run(prep, settings.named(names(prep)) if names else settings,
                                   lane=connections[i])
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

    def _run(self, prep: PreparedRequest, settings: CallSettings | None = None,
             lane: int | None = None) -> Any:
        """One call; ``lane``: its connection (default: the next in turn)."""
        settings = settings or self._settings()
        try:
            if self._quarantined():  # a failed call's scratch: free again once the server is idle
                self._release_idle(
                    self._unary_rpc("ListRegions", pb.ListRegionsRequest(), settings.named(None))
                )
            assembler = self._assembler(prep)
        except BaseException:
            if prep.placement is not None:
                prep.placement.finish(ok=True)  # nothing was sent
            raise
        lane_no = self._lane_for(prep.method) if lane is None else lane
        self._placed_lane(lane_no)
        lane = self._lanes[lane_no]
        message, streamed = self._call_message(prep, settings)
        if message is not None and streamed:
            try:
                raw = self._streams.run(lane_no, lane, prep.method, message, settings)
            except BaseException:
                self._abandon(prep)
                raise
            if raw is not None:
                return self._assemble(prep, assembler, parse_result(raw))
        if message is not None:
            try:
                responses = lane[unary_method(prep.method)](message, **settings.kwargs())
            except grpc.RpcError as err:
                self._unary_failed(prep, err, settings)  # returns: stream it instead
            except BaseException:
                self._abandon(prep)
                raise
            else:
                return self._assemble(prep, assembler, responses)
        messages = encode_messages(prep.header, prep.tensors, self.max_chunk_bytes)
        call = lane[prep.method](messages, **settings.kwargs())
        try:
            for response in call:
                assembler.add(response)
            return self._complete(prep, assembler)
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

