"""What a call is made of, for both clients: the settings, argument checks, request
preparation, reading replies, and the bookkeeping of registered shared-memory regions and of
server-side KV caches (the calls themselves: ``_core``; the rpcs: the faces)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2

from attention_client._call_streams import POOLED, STEP_METHODS
from attention_client._channel import (
    CACHE_RPCS,
    DEFAULT,
    INFO_METHOD,
    LOAD_BALANCING,
    REGION_RPCS,
    SERVICE,
    STREAM_RPCS,
    CallSettings,
    as_metadata,
    balanced_target,
    call_metadata,
    channel_options,
    check_chunk_bytes,
    check_targets,
    check_timeout,
    check_wait_for_ready,
    credentials,
    merge_metadata,
)
from attention_client._decode import prepare_cache_decode, prepare_decode
from attention_client._errors import (
    AttentionError,
    AttentionInputError,
    AttentionNotFoundError,
    from_rpc_error,
    make_error,
)
from attention_client._prefill import prepare_prefill
from attention_client._regions import (
    Placement,
    SharedRegion,
    create_cuda_region,
    create_nixl_region,
    create_system_region,
)
from attention_client._requests import (
    APPEND_KV,
    CACHE_DECODE,
    CACHE_PREFILL,
    CacheTarget,
    KvLayout,
    KvScales,
    PreparedRequest,
    ScoreMods,
    as_cache_ids,
    as_flag,
)
from attention_client._responses import ResponseAssembler
from attention_client._stripes import MAX_STRIPES, Part, part_inputs, plan
from attention_client._tensors import describe, storage_dtype
from attention_wire import shm, unary_method
from attention_wire.messages import (
    DEFAULT_CHUNK_BYTES,
    parse_response,
    parse_result,
    single_message,
    step_timeout,
)
from attention_wire.pb import attention_pb2 as pb

# ``spread``: connections looked at per channel, per front end of the server (the last one is
# kept whatever its front end). Placed one after another, the last of N clients over N front
# ends must find the one front end left free, a 1/N chance a try: 4 tries in all left all 8 of
# 8 front ends used in 23% of simulated starts (7 of 8 on average, as measured on the H200
# host), 4 per front end in 98% (tools/tuning/sim_spread.py). A try is a new connection and a
# count (5-20 ms), so it is capped; and all the looks of a client's placing take at most
# SPREAD_TIMEOUT_S together: a client made while its server is down waits at most this long.
SPREAD_TRIES_PER_FRONTEND = 4
SPREAD_MIN_TRIES = 4
SPREAD_MAX_TRIES = 64
SPREAD_TIMEOUT_S = 2.0
NEVER_IDLE_MS = 2**31 - 1  # grpc.client_idle_timeout_ms: INT_MAX turns the idle timer off


def crowded(info: pb.ServerInfo) -> bool:
    """Whether the connection that answered ``info`` (GetServerInfo with ``connections``) is
    on a front end that holds more than one connection more than the least-loaded one."""
    return info.frontends > 1 and (
        info.frontend_connections > info.fewest_frontend_connections + 1)


def spread_tries(info: pb.ServerInfo) -> int:
    """How many connections ``spread`` looks at per channel on the server that sent ``info``."""
    return max(SPREAD_MIN_TRIES,
               min(SPREAD_MAX_TRIES, SPREAD_TRIES_PER_FRONTEND * info.frontends))


# ListCaches' largest page: a listing of 100k caches takes 10 calls.
LIST_PAGE_SIZE = 10000


class LostLanes:
    """Which of a client's connections were lost since ``spread`` placed them. gRPC reconnects
    a lost connection on its own (a server or front end restarted, the network dropped it),
    and the kernel hashes the new one to any front end: after a server restart every client
    reconnects at once, as unevenly as if none had spread. The clients feed this each lane's
    connectivity (``seen``) and place a lost lane again before its next compute call."""

    def __init__(self, lanes: int) -> None:
        self._ready = [False] * lanes  # connected since (re)placed
        self._lost = [False] * lanes

    def seen(self, lane: int, state: grpc.ChannelConnectivity) -> None:
        """Lane ``lane``'s channel is in ``state`` now."""
        if state is grpc.ChannelConnectivity.READY:
            self._ready[lane] = True
        elif state is not grpc.ChannelConnectivity.SHUTDOWN and self._ready[lane]:
            self._ready[lane] = False  # it had a connection, and has none now
            self._lost[lane] = True

    def lost(self, lane: int) -> bool:
        return self._lost[lane]

    def placed(self, lane: int, new_channel: bool = False) -> None:
        """Lane ``lane`` was looked at (and on a new channel when ``new_channel``)."""
        self._lost[lane] = False
        if new_channel:
            self._ready[lane] = False


def lane_rpcs(channel: Any) -> dict[str, Any]:
    """A connection's compute rpcs (a ``grpc`` or ``grpc.aio`` channel: the same calls make
    both), by method name: the stream and unary twin of each, the step streams, and
    GetServerInfo (``spread`` asks each connection). Requests are pre-serialized bytes
    (``attention_wire.messages``); responses are parsed lazily (``attention_wire.messages``)."""
    return {
        method: channel.stream_stream(
            f"/{SERVICE}/{method}", response_deserializer=parse_response
        )
        for method in STREAM_RPCS
    } | {
        unary_method(method): channel.unary_unary(
            f"/{SERVICE}/{unary_method(method)}", response_deserializer=parse_result
        )
        for method in STREAM_RPCS
    } | {
        method: channel.stream_stream(f"/{SERVICE}/{method}")
        for method in STEP_METHODS.values()
    } | {
        INFO_METHOD: channel.unary_unary(
            INFO_METHOD, request_serializer=pb.GetServerInfoRequest.SerializeToString,
            response_deserializer=pb.ServerInfo.FromString,
        ),
    }


def small_rpcs(channel: Any) -> dict[str, Any]:
    """The small rpcs, which go over lane 0's channel (``ClientCore._unary_rpc``): regions,
    caches, GetServerInfo and the health check, by name."""
    rpcs = {
        method: channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=_serialize,
                                    response_deserializer=getattr(pb, reply).FromString)
        for method, reply in (REGION_RPCS | CACHE_RPCS).items()
    }
    rpcs["GetServerInfo"] = channel.unary_unary(
        INFO_METHOD, request_serializer=_serialize, response_deserializer=pb.ServerInfo.FromString)
    rpcs["Health.Check"] = channel.unary_unary(
        "/grpc.health.v1.Health/Check", request_serializer=_serialize,
        response_deserializer=health_pb2.HealthCheckResponse.FromString)
    return rpcs


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()


# The compute rpcs on a cache: they go where the cache lives (``ClientBase._cache_lane``).
CACHE_METHODS = (APPEND_KV, CACHE_PREFILL, CACHE_DECODE)


class ClientBase:
    """Holds the settings; ``ClientCore`` makes the calls, the faces own the channels."""

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
        """Remote varlen attention over gRPC, blocking (``AttentionClient``) or asyncio
        (``AsyncAttentionClient``: the same methods as coroutines; create it inside a running event
        loop, whose ``grpc.aio`` channels it uses; ``interceptors`` are ``grpc.aio`` client
        interceptors there).

        ``q, k, v`` are numpy arrays (float16, float32, ml_dtypes.bfloat16) or torch tensors on any
        device; results come back in the same flavour, dtype and device as ``q``. Failures raise
        ``AttentionError`` (``.code``, ``.details``), or one of its subclasses; bad arguments raise
        ``AttentionInputError``, which is also a ``ValueError`` (see ``attention_client._errors``).

        ``tls``: None (plaintext), True (system roots), or a root certificate as PEM bytes or a file
        path; ``client_cert`` and ``client_key`` (PEM bytes or file paths) add a client certificate
        (mutual TLS). ``token`` goes as ``authorization: Bearer <token>``; ``metadata`` (a mapping
        or (key, value) pairs) goes with every call too. ``timeout`` is each call's deadline in
        seconds (None: none). ``wait_for_ready``: True makes a call wait (within its timeout) for
        the server to become reachable instead of failing with UNAVAILABLE; None leaves gRPC's
        default (fail fast, after gRPC's retries). ``options`` are extra gRPC channel options.
        ``channels``: compute calls go round-robin over this many connections (for concurrent calls
        from many threads against a server with several front ends). ``unary`` (default True): a
        call whose request fits one message of ``max_chunk_bytes`` and whose outputs do too (a
        decode step, a short prefill) goes through the rpc's unary twin (``CacheDecodeUnary``, ...),
        about half the host time of a stream; False streams every call. ``stripes`` (default 1):
        ``attention`` and ``decode`` calls of 4 MiB or more split into up to this many kv-head
        groups, sent at once over as many connections (``channels`` is raised to ``stripes``) and
        joined: one large call then uses several of the server's front-end processes instead of one
        (a Python gRPC stream moves about 1 GB/s). The result is the same as the whole call's; calls
        with ``out=`` or whose tensors may go through registered regions go whole. ``spread``
        (default True): a server with several front-end processes gets each connection from the
        kernel, which may put several clients' connections on one front end while others idle; each
        connection found on a front end holding more than one connection more than the least-loaded
        one is replaced by a new one (here at construction, in the async client before its first
        compute call; at most 4 looks per front end for each connection, up to 64
        (``spread_tries``), and ``SPREAD_TIMEOUT_S`` in all; a server that is down, or too old to
        count, leaves the connections as they are). With it, the client's connections are its own,
        not shared with other clients of this process, and do not idle out (grpc's idle timer is
        off). False: gRPC's connection as it comes. See docs/client.md.

        Several replicas without a proxy: ``target`` a list of ``HOST:PORT`` (resolved once, here),
        or ``"dns:///NAME:PORT"`` with ``load_balancing="round_robin"`` (re-resolved by gRPC).
        Stateless compute calls then go round-robin over every replica, a replica that is down is
        skipped, and ``spread``/``call_streams`` are off; caches, regions and the other small calls
        go to the first target (a cache lives on the replica that made it). Behind Envoy, give its
        one address instead (deploy/envoy).

        Every call also takes ``timeout=`` (None: no deadline), ``metadata=`` (merged over the
        client's: a key it names replaces the client's) and ``wait_for_ready=`` for itself.

        Same host: ``register_shm`` / ``register_cuda`` register a shared-memory region; calls then
        pass tensors that live in (or fit into) it by reference instead of bytes (see
        ``SharedRegion``). ``use_regions=False`` turns that off for the client or for one call.

        Server-side KV caches: ``kv_cache(num_kv_heads, head_dim, dtype)`` returns a ``KvCache``
        handle (append, prefill, decode, fork, release, info); ``decode_step``, ``release_caches``,
        ``list_caches`` and ``kv_pool_info`` work on caches by id without one.
        """
        # Several replicas without a proxy (issue 64): ``target`` a list of them, or a
        # ``dns:`` name with load_balancing="round_robin". Stateless compute calls then go
        # round-robin over every replica on lanes 1.. (gRPC's round_robin: a replica that is
        # down is skipped, and UNAVAILABLE retried on another); caches, regions and the small
        # rpcs stay on lane 0, a connection to the first target (pick_first): a cache lives
        # on the replica that made it.
        self.targets = check_targets(target)
        self.target = self.targets[0]
        if load_balancing is None:
            load_balancing = "round_robin" if len(self.targets) > 1 else "pick_first"
        if load_balancing not in LOAD_BALANCING:
            raise AttentionInputError(
                f"load_balancing must be one of {LOAD_BALANCING}, got {load_balancing!r}")
        if load_balancing == "pick_first" and len(self.targets) > 1:
            raise AttentionInputError("a list of targets is balanced round_robin: give "
                                      "load_balancing='round_robin' or leave it out")
        self.balanced = load_balancing == "round_robin"
        self._balanced_target = balanced_target(self.targets) if self.balanced else ""
        if self.balanced:
            # A kept-open stream stays on one replica, and ``spread`` counts one replica's
            # front ends: per-call balancing needs neither.
            spread, call_streams = False, False
        # Move each connection off a crowded front end (AttentionClient._spread_lanes: at
        # construction; AsyncAttentionClient._ensure_spread: before the first compute call).
        # Every channel then has a connection of its own.
        self.spread = bool(spread)
        # Large stateless calls split into this many kv-head groups, sent at once over as many
        # connections (see _stripes.py); 1: every call goes whole.
        self.stripes = int(stripes)
        if not 1 <= self.stripes <= MAX_STRIPES:
            raise AttentionInputError(f"stripes must be in [1, {MAX_STRIPES}], got {stripes!r}")
        # Compute calls go round-robin over this many channels, each with a connection of its
        # own: a server with several front ends (SO_REUSEPORT) spreads connections, not calls.
        self.channels = int(channels)
        if not 1 <= self.channels <= 64:
            raise AttentionInputError(f"channels must be in [1, 64], got {channels!r}")
        self.channels = max(self.channels, self.stripes)  # a connection per stripe at least
        if self.balanced:
            self.channels += 1  # lane 0: the first target's own connection
        self._turn = itertools.count()
        self.timeout = check_timeout(timeout)
        self.wait_for_ready = check_wait_for_ready(wait_for_ready)
        self.max_chunk_bytes = check_chunk_bytes(max_chunk_bytes)
        # Sent with every call: the token (authorization), then ``metadata``.
        self._metadata = call_metadata(token, metadata)
        self._credentials = credentials(tls, client_cert, client_key)
        # ``spread`` placed each connection: one that idles past grpc's client idle timeout
        # (30 minutes by default) would be closed and, at the next call, hashed afresh to any
        # front end. So a spread client keeps its connections (``options`` may still set it).
        kept = [("grpc.client_idle_timeout_ms", NEVER_IDLE_MS)] if self.spread else []
        self._options = channel_options([*kept, *(options or ())])
        if self.channels > 1 or self.spread:  # else grpc shares a connection among equal ones
            self._options.append(("grpc.use_local_subchannel_pool", 1))
        self._balanced_options = [*self._options, ("grpc.lb_policy_name", "round_robin")]
        if self.balanced and self._credentials is not None and len(self.targets) > 1:
            # Dialled by address: TLS checks the certificates against the first target's
            # name (replicas listed by name share one in their certificates' names).
            host = self.target.rpartition(":")[0].strip("[]")
            self._balanced_options.append(("grpc.ssl_target_name_override", host))
        # Calls use registered regions when their tensors live there or fit (see _regions.py).
        self.use_regions = bool(use_regions)
        # Calls that fit one message each way go through the unary twin rpcs (see
        # _single_message); turned off for good if the server has no such rpc.
        self.unary = bool(unary)
        # Of those, Prefill and Decode calls go as messages on streams kept open between
        # calls (_call_streams); per op turned off for good if the server has no such rpc.
        self.call_streams = bool(call_streams)
        # The regions this client registered (``_live_regions``: the open ones).
        self._regions: list[SharedRegion] = []
        self._regions_lock = threading.Lock()
        self._nixl_connected: set[str] = set()  # NIXL agents this server knows (ConnectNixl)
        # RequestStats of the last call that completed (a dict), for benchmarks. With
        # concurrent calls on one client it is whichever finished last.
        self.last_stats: dict[str, Any] | None = None
        # Layouts of the caches this client created or forked (decode_step without new tokens
        # needs their num_kv_heads); others are looked up with ListCaches once.
        self._cache_layouts: dict[str, KvLayout] = {}
        self.closed = False  # set by close(): every later call raises AttentionError
        self._interceptors = list(interceptors) if interceptors else None
        self._open()

    def _open(self) -> None:
        """The face's channels (one per lane) and its transport state."""
        raise NotImplementedError

    def _lane_channel(self, lane_no: int) -> tuple[str, list[tuple[str, Any]]]:
        """The target and options of lane ``lane_no``'s channel."""
        if self.balanced and lane_no:
            return self._balanced_target, self._balanced_options
        return self.target, self._options

    def _compute_lane(self) -> int:
        """The next lane in turn for a stateless compute call."""
        if self.balanced:
            return 1 + next(self._turn) % (self.channels - 1)
        return next(self._turn) % self.channels

    def _cache_lane(self) -> int:
        """The lane of a cache's compute call or step stream: any (in turn) on one server,
        the first target's when balanced (where its caches are)."""
        return 0 if self.balanced else next(self._turn) % self.channels

    def _lane_for(self, method: str) -> int:
        return self._cache_lane() if method in CACHE_METHODS else self._compute_lane()

    def _settings(
        self, timeout: Any = DEFAULT, metadata: Any = None, wait_for_ready: bool | None = None,
        names: Mapping[str, str] | None = None,
    ) -> CallSettings:
        """One public call's settings: ``timeout`` (DEFAULT: the client's; None: no deadline)
        runs from now over every rpc of the call; ``metadata`` is merged over the client's
        (a key it names replaces the client's); ``wait_for_ready`` None: the client's."""
        if self.closed:  # else grpc's ValueError / UsageError, which reads as a bad argument
            raise AttentionError(grpc.StatusCode.FAILED_PRECONDITION,
                                 "the client is closed: make a new one")
        seconds = self.timeout if timeout is DEFAULT else check_timeout(timeout)
        return CallSettings(
            deadline=None if seconds is None else time.monotonic() + seconds,
            metadata=merge_metadata(self._metadata, as_metadata(metadata)),
            wait_for_ready=(self.wait_for_ready if wait_for_ready is None
                            else check_wait_for_ready(wait_for_ready)),
            names=names,
        )

    def _regions_wanted(self, use_regions: bool | None) -> bool:
        """Whether a call's tensors may go through registered regions."""
        wanted = self.use_regions if use_regions is None else use_regions
        return bool(wanted and self._live_regions())

    def _placement(self, use_regions: bool | None) -> Placement | None:
        if not self._regions_wanted(use_regions):
            return None
        return Placement(self._live_regions(), stage=True)

    def _live_regions(self) -> list[SharedRegion]:
        """The regions this client registered and has not closed."""
        with self._regions_lock:
            return [r for r in self._regions if not r.closed]

    def _add_region(self, region: SharedRegion) -> None:
        with self._regions_lock:
            self._regions.append(region)

    def _discard_region(self, region: SharedRegion) -> None:
        with self._regions_lock:
            if region in self._regions:
                self._regions.remove(region)

    def _split_call(
        self, prepare: Callable[[Any, Any, Any, Any, Any], PreparedRequest], q: Any, k: Any,
        v: Any, out: Any, use_regions: bool | None, score: ScoreMods | None,
        kv_scales: KvScales | None,
    ) -> tuple[Callable[[], PreparedRequest], list[Callable[[], PreparedRequest]] | None]:
        """A stateless call's preparation as a whole (``prepare(q, k, v, score, kv_scales)``),
        and each part's when it is striped (None: it goes whole)."""
        whole = functools.partial(prepare, q, k, v, score, kv_scales)
        parts = self._stripe_plan(q, k, v, out, use_regions, score, kv_scales)
        if parts is None:
            return whole, None
        return whole, [functools.partial(prepare, *part_inputs(p, q, k, v, score, kv_scales))
                       for p in parts]

    def _stripe_plan(
        self, q: Any, k: Any, v: Any, out: Any, use_regions: bool | None,
        score: ScoreMods | None, kv_scales: KvScales | None,
    ) -> list[Part] | None:
        """The parts a stateless call is split into (``stripes``), or None: it goes whole (one
        stripe, a small call, ``out=``, or tensors that may go through registered regions)."""
        if self.stripes < 2 or out is not None or self._placement(use_regions) is not None:
            return None
        return plan(q, k, v, self.stripes, score, kv_scales)

    def _prepare_attention(
        self, q: Any, k: Any, v: Any, cu_seqlens: Any, cu_seqlens_k: Any, causal: bool,
        softmax_scale: float | None, return_lse: bool, out: Any = None,
        use_regions: bool | None = None, score: ScoreMods | None = None,
        kv_scales: KvScales | None = None,
    ) -> PreparedRequest:
        placement = self._placement(use_regions)
        try:
            return prepare_prefill(
                q, k, v, cu_seqlens, cu_seqlens_k, causal=causal, softmax_scale=softmax_scale,
                return_lse=return_lse, placement=placement, out=out, score=score,
                kv_scales=kv_scales,
            )
        except BaseException:
            if placement is not None:
                placement.finish(ok=True)  # nothing was sent
            raise

    def _prepare_decode(
        self, q: Any, k: Any, v: Any, cu_seqlens_k: Any, softmax_scale: float | None,
        num_splits: int, return_lse: bool, out: Any = None, use_regions: bool | None = None,
        score: ScoreMods | None = None, kv_scales: KvScales | None = None,
    ) -> PreparedRequest:
        placement = self._placement(use_regions)
        try:
            return prepare_decode(
                q, k, v, cu_seqlens_k, softmax_scale=softmax_scale, num_splits=num_splits,
                return_lse=return_lse, placement=placement, out=out, score=score,
                kv_scales=kv_scales,
            )
        except BaseException:
            if placement is not None:
                placement.finish(ok=True)
            raise

    def _single_message(self, prep: PreparedRequest, tail: bytes = b"") -> bytes | None:
        """The request as one message when the call goes through its unary twin: unary on,
        the request fits one message of ``max_chunk_bytes`` and the outputs that come back
        fit that too (the server allows up to 4 MiB; this leaves the client's receive limit
        alone). None: stream it. ``tail``: fields to end it with (``step_timeout``)."""
        return self._one_message(prep, tail) if self.unary else None

    def _call_message(self, prep: PreparedRequest,
                      settings: CallSettings) -> tuple[bytes | None, bool]:
        """A call's one message (None: stream it) and whether it goes on a kept-open stream,
        where the call's deadline goes along in the message (``step_timeout_ms``)."""
        streamed = self._streamed(prep)
        tail = step_timeout(settings.deadline) if streamed else b""
        return self._single_message(prep, tail), streamed

    def _streamed(self, prep: PreparedRequest) -> bool:
        """Whether a single-message call goes on a kept-open stream (``_call_streams``)."""
        return (self.call_streams and prep.method in POOLED
                and prep.method not in self._streams.unsupported)

    def _one_message(self, prep: PreparedRequest, tail: bytes = b"") -> bytes | None:
        """The request as one message if it and its outputs fit ``max_chunk_bytes``."""
        out_bytes = 0
        if prep.streamed_out_shape is not None:
            out_bytes += math.prod(prep.streamed_out_shape) * storage_dtype(prep.out_dtype).itemsize
        if prep.streamed_lse_shape is not None:
            out_bytes += math.prod(prep.streamed_lse_shape) * 4  # float32
        if out_bytes > self.max_chunk_bytes:
            return None
        return single_message(prep.header, prep.tensors, self.max_chunk_bytes, tail)

    def _unary_failed(self, prep: PreparedRequest, err: grpc.RpcError,
                      settings: CallSettings) -> None:
        """A unary call's error, raised as AttentionError; except from a server without the
        unary twins (UNIMPLEMENTED: nothing ran), where this returns and the client streams
        from now on."""
        if err.code() is grpc.StatusCode.UNIMPLEMENTED:  # type: ignore[attr-defined]
            self.unary = False
            return
        self._abandon(prep)
        raise from_rpc_error(err, prep.method, settings.names) from err

    def _assemble(self, prep: PreparedRequest, assembler: ResponseAssembler,
                  responses: Any) -> Any:
        """The result from a unary call's parsed responses (``responses.parse_result``)."""
        try:
            for response in responses:
                assembler.add(response)
            return self._complete(prep, assembler)
        except BaseException:
            self._abandon(prep)
            raise

    @staticmethod
    def _assembler(prep: PreparedRequest) -> ResponseAssembler:
        if prep.placement is not None:
            prep.placement.synchronize()  # the GPU work that fills the tensors is done
        return ResponseAssembler(
            prep.method, prep.streamed_out_shape, prep.out_dtype, prep.streamed_lse_shape
        )

    def _complete(self, prep: PreparedRequest, assembler: ResponseAssembler) -> Any:
        out, lse, stats = assembler.finish()
        self.last_stats = stats
        prep.take_stats(stats)
        result = prep.result(out, lse)
        if prep.placement is not None:
            prep.placement.finish(ok=True)
        return result

    @staticmethod
    def _abandon(prep: PreparedRequest) -> None:
        """The call failed or went away: its scratch waits until the region is idle."""
        if prep.placement is not None:
            prep.placement.finish(ok=False)

    # ---- KV caches ---------------------------------------------------------------------------

    @staticmethod
    def _decode_step_ids(q: Any, cache_ids: Any) -> tuple[str, ...]:
        """decode_step's cheap checks, made before any lookup goes to the server."""
        ids = as_cache_ids(cache_ids, "cache_ids")
        shape, _, _ = describe(q, "q")
        if len(shape) != 3:
            raise AttentionInputError(f"q must be 3-D [B, H, D], got shape {shape}")
        if shape[0] != len(ids):
            raise AttentionInputError(
                f"cache_ids names {len(ids)} caches, but q has batch {shape[0]}: name one "
                "cache per sequence"
            )
        return ids

    def _unknown_layouts(self, ids: tuple[str, ...], k_new: Any, v_new: Any) -> list[str]:
        """Caches whose layout decode_step needs (no new tokens) but this client lacks."""
        if k_new is not None or v_new is not None:
            return []
        return [i for i in ids if i not in self._cache_layouts]

    def _prepare_decode_step(
        self, q: Any, ids: tuple[str, ...], k_new: Any, v_new: Any, store: bool,
        softmax_scale: float | None, num_splits: int, return_lse: bool,
        score: ScoreMods | None = None, out: Any = None, use_regions: bool | None = None,
    ) -> PreparedRequest:
        placement = self._placement(use_regions)
        try:
            return self._cache_decode_request(q, ids, k_new, v_new, store, softmax_scale,
                                              num_splits, return_lse, score, placement, out)
        except BaseException:
            if placement is not None:
                placement.finish(ok=True)  # nothing was sent
            raise

    def _cache_decode_request(
        self, q: Any, ids: tuple[str, ...], k_new: Any, v_new: Any, store: bool,
        softmax_scale: float | None, num_splits: int, return_lse: bool,
        score: ScoreMods | None, placement: Placement | None, out: Any,
    ) -> PreparedRequest:
        layout = None
        if k_new is None and v_new is None:  # empty k/v: their shape is the caches' layout
            layouts = {self._cache_layouts[i] for i in ids}
            if len(layouts) != 1:
                raise AttentionInputError(
                    "cache_ids name caches of different layouts: one call takes one"
                )
            layout = layouts.pop()
        return prepare_cache_decode(
            q, k_new, v_new, CacheTarget(ids, as_flag(store, "store"), layout),
            softmax_scale=softmax_scale, num_splits=num_splits, return_lse=return_lse,
            score=score, placement=placement, out=out,
        )

    def _stale_layouts(self, ids: tuple[str, ...], listed: list[str], k_new: Any,
                       v_new: Any) -> bool:
        """A decode step without new tokens took some of its caches' layouts from memory
        (not from the ListCaches just made for ``listed``): forget them, and say so."""
        if k_new is not None or v_new is not None or set(ids) <= set(listed):
            return False
        self._forget_layouts(ids)
        return True

    @staticmethod
    @contextlib.contextmanager
    def _layout_lookup() -> Iterator[None]:
        """Around the ListCaches a decode step makes for its caches' layouts: a failure
        reads as the step's (CacheDecode), saying what it was doing."""
        try:
            yield
        except AttentionError as err:
            raise make_error(err.code, f"looking up the caches' layout (no k_new/v_new): "
                             f"{err.details}", CACHE_DECODE, err.server_details) from err

    @contextlib.contextmanager
    def _layouts_checked(self, prep: PreparedRequest) -> Iterator[None]:
        """Around a decode step without new tokens, whose empty k/v took the layout this
        client remembered for its caches: when the server refuses it (INVALID_ARGUMENT: the
        cache was released and made again with another layout elsewhere; NOT_FOUND: gone),
        forget those layouts, so the next step asks the server again."""
        try:
            yield
        except AttentionError as exc:
            remembered = prep.cache is not None and prep.cache.layout is not None
            if remembered and exc.code in (grpc.StatusCode.INVALID_ARGUMENT,
                                           grpc.StatusCode.NOT_FOUND):
                self._forget_layouts(prep.cache.ids)  # type: ignore[union-attr]
            raise

    def _note_layouts(self, infos: Any) -> None:
        """Remember the layouts in CacheInfo messages."""
        for info in infos:
            self._cache_layouts[info.cache_id] = KvLayout.from_message(info.layout)

    def _forget_layouts(self, ids: Any = None) -> None:
        if ids is None:
            self._cache_layouts.clear()
        for i in ids or ():
            self._cache_layouts.pop(i, None)

    @staticmethod
    def _list_request(ids: Any, pool_only: bool = False) -> pb.ListCachesRequest:
        """ListCaches' first page (the largest the server gives), or the pool alone."""
        return pb.ListCachesRequest(cache_ids=() if ids is None else as_cache_ids(ids),
                                    page_size=LIST_PAGE_SIZE, pool_only=pool_only)

    def _list_page(self, request: pb.ListCachesRequest, listed: pb.ListCachesResponse | None,
                   page: pb.ListCachesResponse) -> pb.ListCachesResponse:
        """``page`` added to the pages ``listed`` before (its layouts remembered); the request
        asks for the next one (``page.next_page_token``: "" when it was the last)."""
        self._note_layouts(page.caches)
        request.page_token = page.next_page_token
        if listed is None:
            return page
        listed.caches.extend(page.caches)
        listed.pool.CopyFrom(page.pool)
        return listed

    @staticmethod
    def _release_request(ids: Any, all: bool) -> tuple[pb.ReleaseCachesRequest, Any]:
        if all:
            if ids is not None:
                raise AttentionInputError("release_caches: pass ids or all=True, not both")
            return pb.ReleaseCachesRequest(all=True), None
        if ids is None:
            raise AttentionInputError(
                "release_caches: pass ids, or all=True to release every cache"
            )
        ids = as_cache_ids(ids)
        return pb.ReleaseCachesRequest(cache_ids=ids), ids

    # ---- regions ------------------------------------------------------------------------

    @staticmethod
    def _new_region(
        kind: str, nbytes: int, name: str | None, device: Any
    ) -> tuple[SharedRegion, pb.RegisterRegionRequest]:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int | np.integer):
            raise AttentionInputError(f"nbytes must be an int, got {type(nbytes).__name__}")
        if name is not None:
            try:
                shm.check_name(name)
            except (TypeError, ValueError) as exc:
                raise AttentionInputError(f"name: {exc}") from None
        if kind == "system":
            region, key = create_system_region(nbytes, name)
            source = {"system": pb.SystemRegion(key=key)}
        elif kind == "nixl":
            region, nixl = create_nixl_region(nbytes, name, device)
            source = {"nixl": nixl}
        else:
            region, cuda = create_cuda_region(nbytes, device, name)
            source = {"cuda": cuda}
        request = pb.RegisterRegionRequest(name=region.name, byte_size=region.nbytes, **source)
        region._register_request = request
        return region, request

    def _forgotten(self, listing: pb.ListRegionsResponse) -> list[SharedRegion]:
        """This client's regions the server does not know: it restarted (regions do not
        survive a restart) or dropped them. Re-registering them (``_register_request``: the same
        memory, same name) lets calls go on."""
        known = {r.name for r in listing.regions}
        return [r for r in self._live_regions() if r.name not in known and not r.closed]

    @staticmethod
    def _region_lost(prep: PreparedRequest, err: AttentionError) -> bool:
        """Whether a compute call failed because the server does not know a region it used
        (NOT_FOUND on a call that placed tensors in regions)."""
        return isinstance(err, AttentionNotFoundError) and prep.placement is not None

    def _quarantined(self) -> list[SharedRegion]:
        return [r for r in self._live_regions() if r.has_quarantine]

    def _release_idle(self, listing: pb.ListRegionsResponse) -> None:
        idle = {r.name for r in listing.regions if r.inflight == 0}
        for region in self._quarantined():
            if region.name in idle:
                region.release_quarantine()
