"""Every call of the client, written once for both faces.

A call is a generator that builds its requests, yields each rpc its face makes, and reads
the replies; it does no I/O itself. The blocking face (``client.py``) makes an rpc as the
generator evaluates it and hands the reply straight back; the asyncio face (``aio.py``) gets
an awaitable, awaits it and sends the reply (or throws the error) back in. ``_io`` turns such
a generator into a method: a value on the blocking client, a coroutine on the async one
(nothing runs until it is awaited, as with any ``async def``).

The faces own the transport only: channels and their placing (``spread``), the rpc objects,
call streams, striped calls' threads or tasks, and closing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Generator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from attention_client import _argnames as argnames
from attention_client._base import ClientBase
from attention_client._channel import DEFAULT, CallSettings
from attention_client._errors import AttentionError, AttentionInputError, AttentionNotFoundError
from attention_client._regions import (
    SharedRegion,
    nixl_connect_request,
    with_full_nixl_metadata,
)
from attention_client._requests import KvLayout, PreparedRequest, ScoreMods, kv_scales_of
from attention_client._responses import cache_info_dict, pool_info_dict, server_info_dict
from attention_wire import unary_method
from attention_wire.messages import parse_result
from attention_wire.pb import attention_pb2 as pb

Steps = Generator[Any, Any, Any]  # yields a face's rpc (a reply, or an awaitable of one)


def _io(steps: Callable[..., Steps]) -> Callable[..., Any]:
    """A method made of a call's steps, run by the face's ``_drive``."""

    @functools.wraps(steps)
    def method(self: ClientCore, *args: Any, **kwargs: Any) -> Any:
        return self._drive(steps(self, *args, **kwargs))

    return method


class ClientCore(ClientBase):
    """The public calls of ``AttentionClient`` and ``AsyncAttentionClient``. On the async
    client each returns a coroutine (except ``kv_cache`` and ``decode_steps``, which send
    nothing yet)."""

    _KvCache: Any  # the face's handle classes
    _DecodeSteps: Any

    # ---- what a face provides -------------------------------------------------------------

    def _drive(self, steps: Steps) -> Any:
        raise NotImplementedError

    def _unary_rpc(self, method: str, request: Any, settings: CallSettings | None = None,
                   headers: dict[str, str] | None = None) -> Any:
        """One small rpc on lane 0 (``REGION_RPCS``, ``CACHE_RPCS``, GetServerInfo,
        Health.Check); ``headers`` is filled with the answer's initial metadata."""
        raise NotImplementedError

    def _ready_lane(self, lane_no: int, settings: CallSettings, method: str) -> Any:
        """Before a compute call or a step stream uses lane ``lane_no``: placed (``spread``)."""
        raise NotImplementedError

    def _stream_call(self, lane: dict[str, Any], prep: PreparedRequest, assembler: Any,
                     settings: CallSettings) -> Any:
        """A call streamed both ways (too large for one message, or unary off)."""
        raise NotImplementedError

    def _striped(self, makes: list[Callable[[], PreparedRequest]],
                 whole: Callable[[], PreparedRequest], settings: CallSettings,
                 return_lse: bool, lse_axis: int, like: Any) -> Any:
        raise NotImplementedError

    def _own(self, region: SharedRegion) -> None:
        """Hook ``region``'s close to this client's unregister."""
        raise NotImplementedError

    # ---- stateless compute ----------------------------------------------------------------

    @_io
    def attention(
        self, q: Any, k: Any, v: Any, cu_seqlens: Any = None, cu_seqlens_k: Any = None, *,
        causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False,
        window_size: Any = (-1, -1), softcap: float = 0.0, alibi_slopes: Any = None,
        k_scale: Any = None, v_scale: Any = None, q_scale: Any = None, out: Any = None,
        use_regions: bool | None = None, timeout: Any = DEFAULT, metadata: Any = None,
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
        ``attention_kernels.quantize_kv`` makes both), or ``[batch, H_kv]``: a row per
        sequence (``q_scale`` too): half the bytes on the wire. FP8
        queries too: q float8_e4m3fn beside FP8 k and v, with ``q_scale`` (one float per kv
        head, for the query heads that read it: ``attention_kernels.fp8.quantize_queries``,
        FlashAttention-3's ``q_descale``); the output is then bfloat16, and on a Hopper
        server both products run on FP8 tensor cores.
        ``timeout``, ``metadata``, ``wait_for_ready``: this call's (see the constructor).
        """
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.ATTENTION_4D
                                  if getattr(q, "ndim", 0) == 4 else argnames.ATTENTION)
        score, kv_scales = ScoreMods.of(window_size, softcap, alibi_slopes), kv_scales_of(
            k_scale, v_scale, q_scale)
        whole, parts = self._split_call(
            lambda q, k, v, score, kv_scales: self._prepare_attention(
                q, k, v, cu_seqlens, cu_seqlens_k, causal, softmax_scale, return_lse, out,
                use_regions, score, kv_scales,
            ), q, k, v, out, use_regions, score, kv_scales)
        if parts is None:
            return (yield from self._placed_call(whole, settings))
        return (yield self._striped(parts, whole, settings, return_lse, -2, q))

    @_io
    def decode(
        self, q: Any, k: Any, v: Any, cu_seqlens_k: Any, *,
        softmax_scale: float | None = None, num_splits: int = 0, return_lse: bool = False,
        window_size: Any = (-1, -1), softcap: float = 0.0, alibi_slopes: Any = None,
        k_scale: Any = None, v_scale: Any = None, out: Any = None,
        use_regions: bool | None = None, timeout: Any = DEFAULT, metadata: Any = None,
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
            return (yield from self._placed_call(whole, settings))
        return (yield self._striped(parts, whole, settings, return_lse, -1, q))

    def _placed_call(self, make: Callable[[], PreparedRequest], settings: CallSettings) -> Steps:
        """A call whose tensors may go into regions (``make`` prepares it). A server that no
        longer knows this client's regions (it restarted) gets them registered again, and the
        call is made once more."""
        prep = make()
        try:
            return (yield from self._call(prep, settings))
        except AttentionError as err:
            if not self._region_lost(prep, err) or not (yield from self._reregister(settings)):
                raise
        return (yield from self._call(make(), settings))

    def _reregister(self, settings: CallSettings) -> Steps:
        """Register again the regions the server does not know; whether there were any."""
        listing = yield self._unary_rpc("ListRegions", pb.ListRegionsRequest(),
                                        settings.named(None))
        lost = self._forgotten(listing)
        for region in lost:
            yield from self._register_rpc(region._register_request, settings.named(None))
        return bool(lost)

    def _register_rpc(self, request: pb.RegisterRegionRequest, settings: CallSettings) -> Steps:
        """RegisterRegion. A NIXL region's agent is introduced first (ConnectNixl), once per
        agent and server: again when the server says it does not know it (it restarted)."""
        nixl = request.WhichOneof("source") == "nixl"
        if (nixl and request.nixl.agent_name not in self._nixl_connected
                and not (yield from self._connect_nixl(settings))):
            # A server from before ConnectNixl: the agent's whole metadata introduces it.
            request = with_full_nixl_metadata(request)
        try:
            return (yield self._unary_rpc("RegisterRegion", request, settings))
        except AttentionError as err:
            if not (nixl and err.code == grpc.StatusCode.FAILED_PRECONDITION
                    and "ConnectNixl" in err.details):
                raise
        yield from self._connect_nixl(settings)
        return (yield self._unary_rpc("RegisterRegion", request, settings))

    def _connect_nixl(self, settings: CallSettings) -> Steps:
        """ConnectNixl for this process's agent; False when the server has no such rpc."""
        request = nixl_connect_request()
        try:
            yield self._unary_rpc("ConnectNixl", request, settings)
        except AttentionError as err:
            if err.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
            return False
        self._nixl_connected.add(request.agent_name)
        return True

    def _call(self, prep: PreparedRequest, settings: CallSettings | None = None,
              lane: int | None = None) -> Steps:
        """One compute call; ``lane``: its connection (default: the next in turn). It goes
        on a kept-open call stream, as a unary call, or streamed, in that order of
        preference (see ``_call_message``)."""
        settings = settings or self._settings()
        lane_no = self._lane_for(prep.method) if lane is None else lane
        try:
            if self._quarantined():  # a failed call's scratch: free again once the server is idle
                self._release_idle((yield self._unary_rpc(
                    "ListRegions", pb.ListRegionsRequest(), settings.named(None))))
            assembler = self._assembler(prep)
            yield self._ready_lane(lane_no, settings, prep.method)
        except BaseException:
            if prep.placement is not None:
                prep.placement.finish(ok=True)  # nothing was sent
            raise
        rpcs = self._lanes[lane_no]
        message, streamed = self._call_message(prep, settings)
        if message is not None and streamed:
            try:
                raw = yield self._streams.run(lane_no, rpcs, prep.method, message, settings)
            except BaseException:
                self._abandon(prep)
                raise
            if raw is not None:
                return self._assemble(prep, assembler, parse_result(raw))
        if message is not None:
            try:
                responses = yield rpcs[unary_method(prep.method)](message, **settings.kwargs())
            except grpc.RpcError as err:
                self._unary_failed(prep, err, settings)  # returns: stream it instead
            except BaseException:  # on asyncio: cancelled, and the unary call with the task
                self._abandon(prep)
                raise
            else:
                return self._assemble(prep, assembler, responses)
        return (yield self._stream_call(rpcs, prep, assembler, settings))

    _run = _io(_call)

    # ---- server-side KV caches ------------------------------------------------------------

    def kv_cache(
        self, num_kv_heads: int, head_dim: int, dtype: Any, *, kv_dtype: Any = None,
        k_scale: Any = None, v_scale: Any = None, session: str | None = None,
    ) -> Any:
        """A handle (``KvCache``, or ``AsyncKvCache`` with awaited methods) for server-side
        caches of one layout (``dtype``: the queries', a numpy or torch dtype, or "float16" /
        "bfloat16" / "float32"). Nothing is sent until it is used; ``with`` it to release
        its caches at the end.

        ``kv_dtype="float8_e4m3fn"`` (with float16/bfloat16 ``dtype``) stores keys and values
        in one byte each, quantized with ``k_scale`` / ``v_scale`` (one float per kv head, for
        every cache of the handle): half the pool and half the decode reads. New tokens may be
        given in ``dtype`` (the server quantizes them, saturating at 448 x scale) or already
        as float8_e4m3fn quantized with those scales.

        ``session``: the affinity key its calls carry (``x-attention-session``; default: one
        of its own), so that behind Envoy (docs/deploy.md) all of them reach the replica that
        holds its caches; handles given the same key share a replica."""
        return self._KvCache(self, KvLayout.of(num_kv_heads, head_dim, dtype, kv_dtype,
                                               k_scale, v_scale), session)

    @_io
    def decode_step(
        self, q: Any, cache_ids: Any, k_new: Any = None, v_new: Any = None, *,
        store: bool = True, softmax_scale: float | None = None, num_splits: int = 0,
        return_lse: bool = False, window_size: Any = (-1, -1), softcap: float = 0.0,
        alibi_slopes: Any = None, out: Any = None, use_regions: bool | None = None,
        timeout: Any = DEFAULT, metadata: Any = None, wait_for_ready: bool | None = None,
    ) -> Any:
        """``KvCache.decode`` on existing caches by id, without a handle. Without k_new/v_new
        the caches' num_kv_heads must be known: from this client's handles, else one
        ListCaches call (within the same ``timeout``). Registered regions carry q, the new
        tokens and the outputs as in ``decode`` (``out=`` a tensor in a region: written in
        place; ``use_regions`` per call)."""
        settings = self._settings(
            timeout, metadata, wait_for_ready, argnames.cache_decode("cache_ids")
        )
        prep = yield from self._step_request(
            settings, q, cache_ids, k_new, v_new, store, softmax_scale, num_splits, return_lse,
            ScoreMods.of(window_size, softcap, alibi_slopes), out, use_regions,
        )
        with self._layouts_checked(prep):
            return (yield from self._call(prep, settings))

    def _step_request(
        self, settings: CallSettings, q: Any, cache_ids: Any, k_new: Any, v_new: Any,
        store: bool, softmax_scale: float | None, num_splits: int, return_lse: bool,
        score: ScoreMods, out: Any = None, use_regions: bool | None = None,
    ) -> Steps:
        """A decode step's request (``decode_step``, ``decode_steps``): the cheap checks, the
        layouts this client lacks (one ListCaches within ``settings``), then the request."""
        ids = self._decode_step_ids(q, cache_ids)
        missing = self._unknown_layouts(ids, k_new, v_new)
        if missing:
            with self._layout_lookup():
                yield from self._listing(missing, settings)
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
            yield from self._listing(ids, settings)
        return self._prepare_decode_step(
            q, ids, k_new, v_new, store, softmax_scale, num_splits, return_lse, score, out,
            use_regions,
        )

    _decode_step_request = _io(_step_request)

    def decode_steps(self, *, timeout: Any = DEFAULT, metadata: Any = None,
                     wait_for_ready: bool | None = None) -> Any:
        """A decode loop on one stream: ``steps.step(q, cache_ids, k_new, v_new, ...)`` takes
        and returns what ``decode_step`` does, at about half its host time per step (no call
        set-up per step). ``timeout`` (default: the client's) applies to each step. Use it as
        a context manager (``async with`` on the async client), or ``close()`` it; one step
        at a time per handle."""
        return self._DecodeSteps(self, timeout, metadata, wait_for_ready)

    @_io
    def release_caches(self, ids: Any = None, *, all: bool = False, timeout: Any = DEFAULT,
                       metadata: Any = None, wait_for_ready: bool | None = None) -> Any:
        """Release caches by id, or every cache of this caller (``all=True``); returns how
        many were released (NOT_FOUND for an unknown id: then none is)."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.cache_ids())
        request, ids = self._release_request(ids, all)
        reply = yield self._unary_rpc("ReleaseCaches", request, settings)
        self._forget_layouts(ids)
        return int(reply.released)

    @_io
    def list_caches(self, ids: Any = None, *, timeout: Any = DEFAULT, metadata: Any = None,
                    wait_for_ready: bool | None = None) -> Any:
        """The caller's caches (None: all of them) as dicts, as ``KvCache.info`` gives them:
        cache_id, dtype, kv_dtype, num_kv_heads, head_dim, length, pages, ... ."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.cache_ids())
        return [cache_info_dict(c) for c in (yield from self._listing(ids, settings)).caches]

    @_io
    def kv_pool_info(self, *, timeout: Any = DEFAULT, metadata: Any = None,
                     wait_for_ready: bool | None = None) -> Any:
        """The server's cache pool: page_bytes, pages_total/used/free, caches_live,
        ttl_seconds, and the caller's share: caller_pages_used, caller_pages_limit (0: none),
        caller_caches. One call, however many caches there are."""
        settings = self._settings(timeout, metadata, wait_for_ready)
        return pool_info_dict((yield from self._listing(None, settings, pool_only=True)).pool)

    def _listing(self, ids: Any, settings: CallSettings | None = None,
                 pool_only: bool = False) -> Steps:
        """Every page of a listing, as one reply."""
        request, listed = self._list_request(ids, pool_only), None
        while listed is None or request.page_token:
            page = yield self._unary_rpc("ListCaches", request, settings)
            listed = self._list_page(request, listed, page)
        return listed

    _list_caches = _io(_listing)

    # ---- same-host shared memory ----------------------------------------------------------

    @_io
    def register_shm(self, nbytes: int, *, name: str | None = None, timeout: Any = DEFAULT,
                     metadata: Any = None, wait_for_ready: bool | None = None) -> Any:
        """Create a POSIX shared-memory region of ``nbytes`` and register it with the server
        (which must run on this host with registration on: ``info()["regions"]``). Close it
        with ``region.close()`` (``await region.aclose()`` on the async client)."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.REGISTER)
        return (yield from self._register("system", nbytes, name, None, settings))

    @_io
    def register_cuda(self, nbytes: int, *, device: Any = None, name: str | None = None,
                      timeout: Any = DEFAULT, metadata: Any = None,
                      wait_for_ready: bool | None = None) -> Any:
        """Allocate ``nbytes`` on a GPU (default: the current one; it must be the server's)
        and register it through CUDA IPC. Needs torch."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.REGISTER)
        return (yield from self._register("cuda", nbytes, name, device, settings))

    @_io
    def register_nixl(self, nbytes: int, *, device: Any = None, name: str | None = None,
                      timeout: Any = DEFAULT, metadata: Any = None,
                      wait_for_ready: bool | None = None) -> Any:
        """Allocate ``nbytes`` of host memory (or, with ``device``, of that GPU: "cuda",
        "cuda:N"; needs torch), register it with this process's NIXL agent and with the server
        (on any host that reaches this one; ``info()["nixl"]``), which then pulls inputs from
        it and pushes outputs into it over UCX instead of gRPC (GPU memory: GPU to GPU, into a
        mirror on the server's GPU). Needs ``attention-client[nixl]``. Close it with
        ``region.close()``."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.REGISTER)
        return (yield from self._register("nixl", nbytes, name, device, settings))

    @_io
    def list_regions(self, *, timeout: Any = DEFAULT, metadata: Any = None,
                     wait_for_ready: bool | None = None) -> Any:
        """The server's view of this caller's regions (name, kind, byte_size, inflight)."""
        settings = self._settings(timeout, metadata, wait_for_ready)
        reply = yield self._unary_rpc("ListRegions", pb.ListRegionsRequest(), settings)
        return [{f.name: getattr(r, f.name) for f in r.DESCRIPTOR.fields} for r in reply.regions]

    def _register(self, kind: str, nbytes: int, name: str | None, device: Any,
                  settings: CallSettings) -> Steps:
        region, request = self._new_region(kind, nbytes, name, device)
        try:
            yield from self._register_rpc(request, settings)
        except BaseException:
            region._release()
            raise
        self._own(region)
        self._add_region(region)
        return region

    @_io
    def _unregister(self, region: SharedRegion) -> Steps:
        self._discard_region(region)
        # NOT_FOUND: the server no longer knows it (it restarted): nothing to unregister.
        with contextlib.suppress(AttentionNotFoundError):
            yield self._unary_rpc("UnregisterRegion", pb.UnregisterRegionRequest(name=region.name))

    # ---- the server -----------------------------------------------------------------------

    @_io
    def info(self, *, timeout: Any = DEFAULT, metadata: Any = None,
             wait_for_ready: bool | None = None) -> Any:
        """GetServerInfo as a dict (device, backend, dtypes, head_dims, limits, versions)."""
        settings = self._settings(timeout, metadata, wait_for_ready)
        return server_info_dict((yield self._unary_rpc("GetServerInfo", pb.GetServerInfoRequest(),
                                                       settings)))

    @_io
    def health(self, service: str = "", *, timeout: Any = DEFAULT, metadata: Any = None,
               wait_for_ready: bool | None = None) -> Any:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", ... ("" = the whole server).
        ``wait_for_ready=True`` waits (within ``timeout``) for a server that is starting."""
        settings = self._settings(timeout, metadata, wait_for_ready)
        reply = yield self._unary_rpc("Health.Check",
                                      health_pb2.HealthCheckRequest(service=service), settings)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
