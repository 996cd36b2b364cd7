"""Every call of the client, written once for both faces.

A call is a generator that builds its requests, yields each rpc its face makes, and reads
the replies; it does no I/O itself. The blocking face (``client.py``) makes an rpc as the
generator evaluates it and hands the reply straight back; the asyncio face (``aio.py``) gets
an awaitable, awaits it and sends the reply (or throws the error) back in. ``_io`` turns such
a generator into a method: a value on the blocking client, a coroutine on the async one
(nothing runs until it is awaited, as with any ``async def``).

``ClientCore`` also holds the client's settings (its constructor), the lanes, each call's
parts (preparing, one message or streamed, assembling the reply), and the bookkeeping of
registered regions and of the caches' layouts. The faces own the transport only: channels and
their placing (``spread``), the rpc objects, call streams, striped calls' threads or tasks,
and closing.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from attention_client import _argnames as argnames
from attention_client._channel import (
    DEFAULT,
    LOAD_BALANCING,
    NEVER_IDLE_MS,
    POOLED,
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
from attention_client._layouts import CacheTarget, KvLayout, as_cache_ids
from attention_client._prefill import prepare_prefill
from attention_client._regions import (
    Placement,
    SharedRegion,
    forgotten,
    new_region,
    nixl_connect_request,
    release_idle,
    with_full_nixl_metadata,
)
from attention_client._requests import (
    APPEND_KV,
    CACHE_DECODE,
    CACHE_PREFILL,
    KvScales,
    PreparedRequest,
    ScoreMods,
    as_flag,
    kv_scales_of,
)
from attention_client._responses import cache_info_dict, pool_info_dict, server_info_dict
from attention_client._stripes import MAX_STRIPES, Part, part_inputs, plan
from attention_client._tensors import describe, is_4d, storage_dtype
from attention_wire import unary_method
from attention_wire.messages import (
    DEFAULT_CHUNK_BYTES,
    parse_result,
    single_message,
    step_timeout,
)
from attention_wire.pb import attention_pb2 as pb

# ListCaches' largest page: a listing of 100k caches takes 10 calls.
LIST_PAGE_SIZE = 10000
# The compute rpcs on a cache: they go where the cache lives (``ClientCore._cache_lane``).
CACHE_METHODS = (APPEND_KV, CACHE_PREFILL, CACHE_DECODE)
Steps = Generator[Any, Any, Any]  # yields a face's rpc (a reply, or an awaitable of one)


def _io(steps: Callable[..., Steps]) -> Callable[..., Any]:
    """A method made of a call's steps, run by the face's ``_drive``."""

    @functools.wraps(steps)
    def method(self: ClientCore, *args: Any, **kwargs: Any) -> Any:
        return self._drive(steps(self, *args, **kwargs))

    return method


class ClientCore:
    """The public calls of ``AttentionClient`` and ``AsyncAttentionClient``. On the async
    client each returns a coroutine (except ``kv_cache`` and ``decode_steps``, which send
    nothing yet). It holds the settings and makes the calls; the faces own the channels."""

    _KvCache: Any  # the face's handle classes
    _DecodeSteps: Any

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
        # _call_message); turned off for good if the server has no such rpc.
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
        wanted = self.use_regions if use_regions is None else use_regions
        regions = self._live_regions() if wanted else None
        return Placement(regions, stage=True) if regions else None

    def _placed(self, use_regions: bool | None,
                prepare: Callable[[Placement | None], PreparedRequest]) -> PreparedRequest:
        """``prepare(placement)``, the call's tensors placed in registered regions as
        ``use_regions`` (per call; None: the client's setting) says; a request that fails
        to prepare gives its scratch back (nothing was sent)."""
        placement = self._placement(use_regions)
        try:
            return prepare(placement)
        except BaseException:
            if placement is not None:
                placement.finish(ok=True)
            raise

    def _live_regions(self) -> list[SharedRegion]:
        """The regions this client registered and has not closed."""
        if not self._regions:  # the usual case, checked on every call: no lock, no copy
            return []
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
        if self.stripes < 2 or out is not None or self._regions_wanted(use_regions):
            return None
        return plan(q, k, v, self.stripes, score, kv_scales)

    def _prepare_attention(
        self, q: Any, k: Any, v: Any, cu_seqlens: Any, cu_seqlens_k: Any, causal: bool,
        softmax_scale: float | None, return_lse: bool, out: Any = None,
        use_regions: bool | None = None, score: ScoreMods | None = None,
        kv_scales: KvScales | None = None,
    ) -> PreparedRequest:
        return self._placed(use_regions, lambda placement: prepare_prefill(
            q, k, v, cu_seqlens, cu_seqlens_k, causal=causal, softmax_scale=softmax_scale,
            return_lse=return_lse, placement=placement, out=out, score=score,
            kv_scales=kv_scales,
        ))

    def _prepare_decode(
        self, q: Any, k: Any, v: Any, cu_seqlens_k: Any, softmax_scale: float | None,
        num_splits: int, return_lse: bool, out: Any = None, use_regions: bool | None = None,
        score: ScoreMods | None = None, kv_scales: KvScales | None = None,
    ) -> PreparedRequest:
        return self._placed(use_regions, lambda placement: prepare_decode(
            q, k, v, cu_seqlens_k, softmax_scale=softmax_scale, num_splits=num_splits,
            return_lse=return_lse, placement=placement, out=out, score=score,
            kv_scales=kv_scales,
        ))

    def _call_message(self, prep: PreparedRequest,
                      settings: CallSettings) -> tuple[bytes | None, bool]:
        """A call's one message (None: stream it) and whether it goes on a kept-open stream,
        where the call's deadline goes along in the message (``step_timeout_ms``).

        The request goes as one message, through its unary twin, when unary is on, the
        request fits one message of ``max_chunk_bytes`` and the outputs that come back fit
        that too (the server allows up to 4 MiB; this leaves the client's receive limit
        alone)."""
        streamed = self._streamed(prep)
        tail = step_timeout(settings.deadline) if streamed else b""
        return (self._one_message(prep, tail) if self.unary else None), streamed

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

    def _assemble(self, prep: PreparedRequest, responses: Any) -> Any:
        """The result from a unary call's parsed responses
        (``attention_wire.messages.parse_result``)."""
        try:
            for response in responses:
                prep.add_reply(response)
            return self._complete(prep)
        except BaseException:
            self._abandon(prep)
            raise

    @staticmethod
    def _expect_reply(prep: PreparedRequest) -> None:
        """Before ``prep`` goes: the GPU work that fills its region tensors done, its reply's
        arrays made."""
        if prep.placement is not None:
            prep.placement.synchronize()
        prep.expect_reply()

    def _complete(self, prep: PreparedRequest) -> Any:
        out, lse, stats = prep.reply()
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

    def _stream_call(self, lane: dict[str, Any], prep: PreparedRequest,
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
        settings = self._settings(timeout, metadata, wait_for_ready, (
            argnames.ATTENTION_4D if is_4d(q) else argnames.ATTENTION))
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
        k_scale: Any = None, v_scale: Any = None, q_scale: Any = None, out: Any = None,
        use_regions: bool | None = None, timeout: Any = DEFAULT, metadata: Any = None,
        wait_for_ready: bool | None = None,
    ) -> Any:
        """One query token per sequence: q ``[B, H, D]``, packed k/v; lse ``[B, H]``.
        ``k_scale``/``v_scale`` (FP8 k/v), ``q_scale`` (FP8 q: a bfloat16 output), ``out``,
        ``use_regions``, ``timeout``, ``metadata``, ``wait_for_ready`` as in ``attention``."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.DECODE)
        score, kv_scales = ScoreMods.of(window_size, softcap, alibi_slopes), kv_scales_of(
            k_scale, v_scale, q_scale)
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
        lost = forgotten(self._live_regions(), listing)
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
                listing = yield self._unary_rpc(
                    "ListRegions", pb.ListRegionsRequest(), settings.named(None))
                release_idle(self._live_regions(), listing)
            self._expect_reply(prep)
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
                return self._assemble(prep, parse_result(raw))
        if message is not None:
            try:
                responses = yield rpcs[unary_method(prep.method)](message, **settings.kwargs())
            except grpc.RpcError as err:
                self._unary_failed(prep, err, settings)  # returns: stream it instead
            except BaseException:  # on asyncio: cancelled, and the unary call with the task
                self._abandon(prep)
                raise
            else:
                return self._assemble(prep, responses)
        return (yield self._stream_call(rpcs, prep, settings))

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
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.DECODE_STEP)
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
                     wait_for_ready: bool | None = None,
                     step_socket: str | bool | None = None, spin_us: float = 0) -> Any:
        """A decode loop on one stream: ``steps.step(q, cache_ids, k_new, v_new, ...)`` takes
        and returns what ``decode_step`` does, at about half its host time per step (no call
        set-up per step). ``timeout`` (default: the client's) applies to each step. Use it as
        a context manager (``async with`` on the async client), or ``close()`` it; one step
        at a time per handle. ``step_socket`` (a model host on the server's machine):
        send the steps through the server's step socket (True: the path it advertises,
        ``info()["step_socket"]``; or a path) instead of gRPC. ``spin_us`` (sync client, step
        socket): wait for each answer by polling up to this many microseconds before blocking,
        which spends the caller's CPU (and holds its GIL) to skip a wake-up."""
        return self._DecodeSteps(self, timeout, metadata, wait_for_ready, step_socket, spin_us)

    @_io
    def release_caches(self, ids: Any = None, *, all: bool = False, timeout: Any = DEFAULT,
                       metadata: Any = None, wait_for_ready: bool | None = None) -> Any:
        """Release caches by id, or every cache of this caller (``all=True``); returns how
        many were released (NOT_FOUND for an unknown id: then none is)."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.CACHE_IDS)
        request, ids = self._release_request(ids, all)
        reply = yield self._unary_rpc("ReleaseCaches", request, settings)
        self._forget_layouts(ids)
        return int(reply.released)

    @_io
    def list_caches(self, ids: Any = None, *, timeout: Any = DEFAULT, metadata: Any = None,
                    wait_for_ready: bool | None = None) -> Any:
        """The caller's caches (None: all of them) as dicts, as ``KvCache.info`` gives them:
        cache_id, dtype, kv_dtype, num_kv_heads, head_dim, length, pages, ... ."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.CACHE_IDS)
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
        region, request = new_region(kind, nbytes, name, device)
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

    # ---- KV caches: requests, layouts, listings ---------------------------------------------

    @staticmethod
    def _decode_step_ids(q: Any, cache_ids: Any) -> tuple[str, ...]:
        """decode_step's cheap checks, made before any lookup goes to the server."""
        ids = as_cache_ids(cache_ids, "cache_ids")
        shape, _ = describe(q, "q")
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
        return self._placed(use_regions, lambda placement: self._cache_decode_request(
            q, ids, k_new, v_new, store, softmax_scale, num_splits, return_lse, score,
            placement, out))

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

    # ---- regions: after a failed call -------------------------------------------------------

    @staticmethod
    def _region_lost(prep: PreparedRequest, err: AttentionError) -> bool:
        """Whether a compute call failed because the server does not know a region it used
        (NOT_FOUND on a call that placed tensors in regions)."""
        return isinstance(err, AttentionNotFoundError) and prep.placement is not None

    def _quarantined(self) -> list[SharedRegion]:
        return [r for r in self._live_regions() if r.has_quarantine]
