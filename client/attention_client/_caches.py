"""Handles of server-side KV caches: ``client.kv_cache(num_kv_heads, head_dim, dtype)``.

A handle stands for caches of one layout. It creates the caches its calls name the first time
(CreateCaches, then the call; an id it released is not created again: NOT_FOUND), checks every
tensor against its layout before anything is sent, and releases what it created on
``release()`` or when its ``with`` block ends. The cache calls (AppendKV, CachePrefill,
CacheDecode) place their tensors in the client's registered regions as stateless calls do
(``use_regions`` per call), and send their bytes otherwise.

``KvCache`` belongs to ``AttentionClient``, ``AsyncKvCache`` (the same methods, awaited) to
``AsyncAttentionClient``; both run the calls of ``_KvCacheBase``, written once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import operator
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import grpc

from attention_client import _argnames as argnames
from attention_client._channel import DEFAULT, CallSettings, merge_metadata
from attention_client._core import Steps, _io
from attention_client._decode import prepare_cache_decode
from attention_client._errors import (
    OUTCOME_UNKNOWN,
    AttentionError,
    AttentionInputError,
    CacheLostError,
)
from attention_client._layouts import CacheTarget, KvLayout, as_cache_ids
from attention_client._prefill import prepare_append_kv, prepare_cache_prefill
from attention_client._regions import Placement
from attention_client._requests import PreparedRequest, ScoreMods, as_flag
from attention_client._responses import cache_info_dict
from attention_client._tensors import dtype_name, is_4d
from attention_wire.pb import attention_pb2 as pb


# What a handle uses of its client, as a Protocol: the clients import this module to make
# handles, so it names neither of them (both have these through ``ClientCore`` and their face).
class CacheClient(Protocol):
    """Either client: call settings, region placement, the layouts of known caches, and the
    rpcs a handle's steps yield (a reply, or an awaitable of one), run by its ``_drive``."""

    _cache_layouts: dict[str, KvLayout]

    def _settings(
        self, timeout: Any = ..., metadata: Any = ..., wait_for_ready: bool | None = ...,
        names: Mapping[str, str] | None = ...,
    ) -> CallSettings: ...

    def _placed(self, use_regions: bool | None,
                prepare: Callable[[Placement | None], PreparedRequest]) -> PreparedRequest: ...

    def _drive(self, steps: Steps) -> Any: ...

    def _unary_rpc(self, method: str, request: Any, settings: CallSettings | None = ...,
                   headers: dict[str, str] | None = ...) -> Any: ...

    def _list_caches(self, ids: Any, settings: CallSettings | None = ...,
                     pool_only: bool = ...) -> Any: ...

    def _run(self, prep: PreparedRequest, settings: CallSettings | None = ...,
             lane: int | None = ...) -> Any: ...


class _KvCacheBase:
    """Both handles' calls, written once as steps their client drives (see ``_core``): a
    value on ``AttentionClient``, a coroutine on ``AsyncAttentionClient``. ``lock``: one
    CreateCaches at a time per handle (a ``threading.Lock`` or an ``asyncio.Lock``: each
    acquire is a step too)."""

    def __init__(self, client: CacheClient, layout: KvLayout, session: str | None,
                 lock: Any) -> None:
        self.client = client
        self._lock = lock
        self.layout = layout
        # Behind Envoy (deploy/envoy/envoy.yaml) every call of the handle carries its session
        # key, hashed to a replica, and, once an answer named it, that replica's pin: exact
        # even while other replicas join or leave. A server reached directly ignores both.
        self.session = uuid.uuid4().hex if session is None else _checked_session(session)
        self.replica: str | None = None  # the proxy's x-attention-replica, once answered
        self._created: dict[str, None] = {}  # insertion-ordered set
        # Every id this handle created: one released (or expired) is not created again by a
        # call that names it (NOT_FOUND, rather than attending to a fresh empty cache).
        self._seen: set[str] = set()
        self._lengths: dict[str, int] = {}
        # Ids of a CreateCaches or ForkCache whose answer never came (a deadline, a cancel, a
        # lost connection): the server may hold them. ``release()`` tries them too, and a
        # later create of one takes ALREADY_EXISTS as its own earlier create having happened.
        self._unsure: dict[str, None] = {}

    def _drive(self, steps: Steps) -> Any:
        return self.client._drive(steps)

    @property
    def dtype(self) -> str:
        """The caches' dtype as the wire names it ("FLOAT16", "BFLOAT16", "FLOAT32")."""
        return dtype_name(self.layout.dtype)

    @property
    def kv_dtype(self) -> str:
        """What the caches store keys and values in: ``dtype``, or "FLOAT8_E4M3"."""
        return dtype_name(self.layout.stored_dtype)

    @property
    def num_kv_heads(self) -> int:
        return self.layout.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.layout.head_dim

    @property
    def ids(self) -> list[str]:
        """The caches this handle created (or forked) and has not released. The server may
        drop one on its own (idle TTL, a restart): ``info()`` then takes it off this list."""
        return list(self._created)

    @property
    def lengths(self) -> dict[str, int]:
        """Each cache's token count as the server last reported it to this handle."""
        return dict(self._lengths)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, caches={len(self._created)})"
        )

    def _missing(self, ids: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(i for i in ids if i not in self._seen)

    def _create_request(self, ids: tuple[str, ...]) -> pb.CreateCachesRequest:
        return pb.CreateCachesRequest(cache_ids=ids, layout=self.layout.message())

    def _mark_created(self, ids: tuple[str, ...], layouts: dict[str, KvLayout]) -> None:
        for i in ids:
            self._unsure.pop(i, None)
            self._created[i] = None
            self._seen.add(i)
            self._lengths[i] = 0
            layouts[i] = self.layout

    def _mark_released(self, ids: tuple[str, ...], layouts: dict[str, KvLayout]) -> None:
        for i in ids:
            self._unsure.pop(i, None)
            self._created.pop(i, None)
            self._lengths.pop(i, None)
            layouts.pop(i, None)

    def _note_unsure(self, ids: tuple[str, ...], exc: BaseException) -> None:
        """A create (or fork) of ``ids`` raised ``exc``: remember them if it may still have
        happened (no answer came), not when the server refused it."""
        if not isinstance(exc, AttentionError) or exc.code in OUTCOME_UNKNOWN:
            self._unsure.update(dict.fromkeys(ids))

    def _split_unsure(self, ids: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``ids`` as (those an earlier create may have made, the rest)."""
        return (tuple(i for i in ids if i in self._unsure),
                tuple(i for i in ids if i not in self._unsure))

    def _release_all_ids(self) -> tuple[str, ...]:
        """What ``release()`` releases: the created ids, then the unsure ones."""
        return (*self._created, *(i for i in self._unsure if i not in self._created))

    def _note(self, prep: PreparedRequest) -> None:
        if prep.cache is not None and prep.cache_lengths is not None:
            self._lengths.update(zip(prep.cache.ids, prep.cache_lengths, strict=True))

    def _own_gone(
        self, asked: tuple[str, ...], infos: Any, layouts: dict[str, KvLayout]
    ) -> list[Any]:
        """Of all the caller's caches (``infos``, listed after ``asked`` was taken from
        ``ids``), those of ``asked``; the ones the server no longer has (expired, released
        elsewhere, a restart) leave ``ids``. Ids created meanwhile are not judged."""
        live = {c.cache_id: c for c in infos}
        self._mark_released(tuple(i for i in asked if i not in live), layouts)
        return [live[i] for i in asked if i in live]

    def _note_infos(self, infos: Any) -> list[dict[str, Any]]:
        out = [cache_info_dict(c) for c in infos]
        for c in out:
            if c["cache_id"] in self._created:
                self._lengths[c["cache_id"]] = c["length"]
        return out

    def _prep_append(self, ids: Any, k: Any, v: Any, cu_seqlens: Any,
                     use_regions: bool | None = None) -> PreparedRequest:
        target = CacheTarget(as_cache_ids(ids), True, self.layout)
        return self.client._placed(use_regions, lambda placement: prepare_append_kv(
            k, v, cu_seqlens, target, placement))

    def _prep_prefill(
        self, q: Any, ids: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
        causal: bool, store: bool, softmax_scale: float | None, return_lse: bool,
        score: ScoreMods | None = None, out: Any = None, use_regions: bool | None = None,
    ) -> PreparedRequest:
        target = CacheTarget(as_cache_ids(ids), as_flag(store, "store"), self.layout)
        return self.client._placed(use_regions, lambda placement: prepare_cache_prefill(
            q, k, v, cu_seqlens_q, cu_seqlens_k, target, causal=causal,
            softmax_scale=softmax_scale, return_lse=return_lse, score=score,
            placement=placement, out=out,
        ))

    def _prep_decode(
        self, q: Any, ids: Any, k_new: Any, v_new: Any, store: bool,
        softmax_scale: float | None, num_splits: int, return_lse: bool,
        score: ScoreMods | None = None, out: Any = None, use_regions: bool | None = None,
    ) -> PreparedRequest:
        target = CacheTarget(as_cache_ids(ids), as_flag(store, "store"), self.layout)
        return self.client._placed(use_regions, lambda placement: prepare_cache_decode(
            q, k_new, v_new, target, softmax_scale=softmax_scale, num_splits=num_splits,
            return_lse=return_lse, score=score, placement=placement, out=out,
        ))

    @staticmethod
    def _fork_request(source_id: str, target_id: str, length: int | None) -> pb.ForkCacheRequest:
        (source,) = as_cache_ids([source_id], "source_id")
        (target,) = as_cache_ids([target_id], "target_id")
        request = pb.ForkCacheRequest(source_id=source, target_id=target)
        if length is not None:
            try:  # numpy and torch integers too (operator.index), not bools or floats
                n = operator.index(length) if not isinstance(length, bool) else -1
            except TypeError:
                n = -1
            if n < 0:
                raise AttentionInputError(
                    f"length must be a non-negative int or None, got {length!r}"
                )
            request.length = n
        return request

    def _own_ids(self, ids: Any) -> tuple[str, ...]:
        return as_cache_ids(ids) if ids is not None else tuple(self._created)

    @property
    def session_metadata(self) -> tuple[tuple[str, str], ...]:
        """The headers that keep a call on this handle's replica behind a proxy: pass them
        to calls made without the handle (``client.decode_steps(metadata=...)``)."""
        pin = ((REPLICA_HEADER, self.replica),) if self.replica else ()
        return ((SESSION_HEADER, self.session), *pin)

    def _settings(
        self, timeout: Any, metadata: Any, wait_for_ready: bool | None, names: Any = None
    ) -> CallSettings:
        return self._sessioned(self.client._settings(timeout, metadata, wait_for_ready, names))

    def _sessioned(self, settings: CallSettings) -> CallSettings:
        """``settings`` with the session headers under the caller's own metadata."""
        return dataclasses.replace(
            settings, metadata=merge_metadata(self.session_metadata, settings.metadata))

    def _note_replica(self, headers: dict[str, str]) -> None:
        self.replica = headers.get(REPLICA_HEADER) or self.replica

    def _lost(self, err: AttentionError, ids: tuple[str, ...]) -> AttentionError:
        """NOT_FOUND for one of ``ids`` this handle made and still holds: CacheLostError."""
        if err.code != grpc.StatusCode.NOT_FOUND:
            return err
        gone = [i for i in ids if i in self._created and repr(i) in err.details]
        if not gone:
            return err
        for i in gone:  # nothing left to release
            self._created.pop(i, None)
            self._lengths.pop(i, None)
        return CacheLostError(
            err.code, f"{err.details}: cache {gone[0]!r} was lost (this handle made it; the "
            "server, or behind a proxy the replica that held it, no longer has it: a restart, "
            "a replica gone, or its TTL): create it again", err.method, err.server_details)

    @_io
    def create(
        self, ids: Any, *, timeout: Any = DEFAULT, metadata: Any = None,
        wait_for_ready: bool | None = None,
    ) -> None:
        """Create empty caches (ALREADY_EXISTS if one exists, then none is created)."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.CACHE_IDS)
        ids = as_cache_ids(ids)
        yield self._lock.acquire()  # one CreateCaches at a time per handle
        try:
            yield from self._create(ids, settings)
        finally:
            self._lock.release()

    @_io
    def append(
        self, ids: Any, k: Any, v: Any, cu_seqlens: Any = None, *,
        use_regions: bool | None = None, timeout: Any = DEFAULT, metadata: Any = None,
        wait_for_ready: bool | None = None,
    ) -> list[int]:
        """Append k, v ``[total, H_kv, D]`` (split over ``ids`` by ``cu_seqlens``, which may be
        None for a single id); returns each cache's length after. With registered regions,
        k and v go through them (by reference, or staged); ``use_regions`` per call."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.CACHE_APPEND)
        return (yield from self._call(
            self._prep_append(ids, k, v, cu_seqlens, use_regions), settings))

    @_io
    def prefill(
        self, q: Any, ids: Any, k: Any, v: Any, cu_seqlens_q: Any = None,
        cu_seqlens_k: Any = None, *, causal: bool = True, store: bool = True,
        softmax_scale: float | None = None, return_lse: bool = False,
        window_size: Any = (-1, -1), softcap: float = 0.0, alibi_slopes: Any = None,
        out: Any = None, use_regions: bool | None = None, timeout: Any = DEFAULT,
        metadata: Any = None, wait_for_ready: bool | None = None,
    ) -> Any:
        """Each sequence's queries attend to its cache followed by its new k, v (bottom-right
        causal); ``store`` keeps the new tokens. Forms as ``client.attention`` (packed with
        ``cu_seqlens_q``; ``cu_seqlens_k`` defaults to it, or to no new keys when k has no
        rows); k, v None: no new tokens. Returns ``out`` or ``(out, lse)``. With registered
        regions, q, the new tokens and the outputs go through them as in
        ``client.attention`` (``out=`` a tensor in a region: written in place);
        ``use_regions`` per call."""
        settings = self._settings(timeout, metadata, wait_for_ready, (
            argnames.CACHE_PREFILL_4D if is_4d(q) else argnames.CACHE_PREFILL))
        prep = self._prep_prefill(
            q, ids, k, v, cu_seqlens_q, cu_seqlens_k, causal, store, softmax_scale, return_lse,
            ScoreMods.of(window_size, softcap, alibi_slopes), out, use_regions,
        )
        return (yield from self._call(prep, settings))

    @_io
    def decode(
        self, q: Any, ids: Any, k_new: Any = None, v_new: Any = None, *, store: bool = True,
        softmax_scale: float | None = None, num_splits: int = 0, return_lse: bool = False,
        window_size: Any = (-1, -1), softcap: float = 0.0, alibi_slopes: Any = None,
        out: Any = None, use_regions: bool | None = None,
        timeout: Any = DEFAULT, metadata: Any = None, wait_for_ready: bool | None = None,
    ) -> Any:
        """One decode step: q ``[B, H, D]``, k_new/v_new ``[B, H_kv, D]`` (each sequence's new
        token, appended first, kept if ``store``) or None. Returns out ``[B, H, D]`` or
        ``(out, lse [B, H])``. With registered regions, q, the new tokens and the outputs go
        through them as in a stateless decode (``out=`` a tensor in a region: written in
        place); ``use_regions`` per call."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.CACHE_DECODE)
        return (yield from self._call(self._prep_decode(
            q, ids, k_new, v_new, store, softmax_scale, num_splits, return_lse,
            ScoreMods.of(window_size, softcap, alibi_slopes), out, use_regions,
        ), settings))

    @_io
    def fork(
        self, source_id: str, target_id: str, length: int | None = None, *,
        timeout: Any = DEFAULT, metadata: Any = None, wait_for_ready: bool | None = None,
    ) -> dict[str, Any]:
        """Copy the first ``length`` tokens (default: all) of a cache into a new one, which
        this handle then owns; returns the new cache's info."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.FORK)
        request = self._fork_request(source_id, target_id, length)
        try:
            info = yield self.client._unary_rpc("ForkCache", request, settings)
        except BaseException as exc:
            self._note_unsure((request.target_id,), exc)
            raise
        self._mark_created((info.cache_id,), self.client._cache_layouts)
        return self._note_infos([info])[0]

    @_io
    def release(
        self, ids: Any = None, *, timeout: Any = DEFAULT, metadata: Any = None,
        wait_for_ready: bool | None = None,
    ) -> int:
        """Release caches; None: every cache this handle created, skipping those already gone
        (expired, or released elsewhere). Returns how many were released."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.CACHE_IDS)
        if ids is not None:
            return (yield from self._release(as_cache_ids(ids), settings))
        ids = self._release_all_ids()
        if not ids:
            return 0
        try:
            return (yield from self._release(ids, settings))
        except AttentionError as err:  # nothing was released: one by one, skipping the gone
            if not _not_found(err):
                raise
        released = 0
        for i in ids:
            try:
                released += yield from self._release((i,), settings)
            except AttentionError as e:
                if not _not_found(e):
                    raise
                self._mark_released((i,), self.client._cache_layouts)
        return released

    @_io
    def info(
        self, ids: Any = None, *, timeout: Any = DEFAULT, metadata: Any = None,
        wait_for_ready: bool | None = None,
    ) -> list[dict[str, Any]]:
        """The server's view of caches (None: this handle's): cache_id, dtype, kv_dtype,
        num_kv_heads, head_dim, length, pages, shared_pages, idle_seconds, busy (and k_scale,
        v_scale for FP8 caches). With None, caches of this handle the server no longer has
        (expired, a restart) are left out and leave ``ids``; named ids must all exist."""
        settings = self._settings(timeout, metadata, wait_for_ready, argnames.CACHE_IDS)
        own = ids is None
        ids = self._own_ids(ids)
        if not ids:
            return []
        try:
            return self._note_infos((yield self.client._list_caches(ids, settings)).caches)
        except AttentionError as err:
            if not (own and _not_found(err)):
                raise
        every = (yield self.client._list_caches(None, settings)).caches
        return self._note_infos(self._own_gone(ids, every, self.client._cache_layouts))

    def _create(self, ids: tuple[str, ...], settings: CallSettings) -> Steps:
        """CreateCaches of ``ids``; those an earlier create may have made (``_unsure``) one
        by one first, ALREADY_EXISTS counting as that create."""
        unsure, rest = self._split_unsure(ids)
        for i in unsure:  # one by one: a create of several makes none if one exists
            try:
                yield self.client._unary_rpc("CreateCaches", self._create_request((i,)), settings)
            except AttentionError as err:
                if err.code != grpc.StatusCode.ALREADY_EXISTS:
                    raise
            self._mark_created((i,), self.client._cache_layouts)
        if not rest:
            return
        headers: dict[str, str] = {}
        try:
            yield self.client._unary_rpc("CreateCaches", self._create_request(rest), settings,
                                         headers)
        except BaseException as exc:
            self._note_unsure(rest, exc)
            raise
        self._note_replica(headers)
        self._mark_created(rest, self.client._cache_layouts)

    def _release(self, ids: tuple[str, ...], settings: CallSettings) -> Steps:
        reply = yield self.client._unary_rpc(
            "ReleaseCaches", pb.ReleaseCachesRequest(cache_ids=ids), settings
        )
        self._mark_released(ids, self.client._cache_layouts)
        return int(reply.released)

    def _call(self, prep: PreparedRequest, settings: CallSettings) -> Steps:
        assert prep.cache is not None
        if self._missing(prep.cache.ids):
            try:
                yield self._lock.acquire()
            except BaseException:
                _abandon(prep)
                raise
            try:
                missing = self._missing(prep.cache.ids)
                if missing:
                    try:
                        yield from self._create(missing, settings)
                    except BaseException:
                        _abandon(prep)
                        raise
                    settings = self._sessioned(settings)  # the replica the create reached
            finally:
                self._lock.release()
        try:
            result = yield self.client._run(prep, settings)
        except AttentionError as err:
            lost = self._lost(err, prep.cache.ids)
            if lost is err:
                raise
            raise lost from err
        self._note(prep)
        return result


def _abandon(prep: PreparedRequest) -> None:
    """A call that failed before it was sent: its region scratch waits until the region is
    idle, as a failed call's does (the client's ``_abandon``)."""
    if prep.placement is not None:
        prep.placement.finish(ok=False)


SESSION_HEADER = "x-attention-session"
REPLICA_HEADER = "x-attention-replica"


def _checked_session(session: Any) -> str:
    if not (isinstance(session, str) and 0 < len(session) <= 256 and session.isascii()
            and session.isprintable()):
        raise AttentionInputError(f"session must be 1-256 printable ASCII characters (a "
                                  f"header value), got {session!r}")
    return session


def _not_found(err: AttentionError) -> bool:
    return err.code == grpc.StatusCode.NOT_FOUND


class KvCache(_KvCacheBase):
    """Server-side KV caches of one layout (see the module doc); from ``client.kv_cache``.

    ``ids`` arguments are a str or a sequence of str, one cache per sequence. Tensors are numpy
    arrays or torch tensors of the handle's dtype; results come back like ``q``. Mistakes the
    client can see raise AttentionInputError (a ValueError) before anything is sent; the
    server's refusals raise AttentionError subclasses (NOT_FOUND, ALREADY_EXISTS,
    INVALID_ARGUMENT, RESOURCE_EXHAUSTED when the pool is full, ABORTED while another call uses
    one of the caches, FAILED_PRECONDITION when the server has caches off).

    Every method takes ``timeout=``, ``metadata=`` and ``wait_for_ready=`` as the client's
    calls do; a call that creates caches first spends one ``timeout`` on both rpcs.
    """

    def __init__(self, client: CacheClient, layout: KvLayout,
                 session: str | None = None) -> None:
        super().__init__(client, layout, session, threading.Lock())

    def __enter__(self) -> KvCache:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.release()
        else:  # do not hide the error in flight
            with contextlib.suppress(AttentionError):
                self.release()


class AsyncKvCache(_KvCacheBase):
    """KvCache for AsyncAttentionClient: the same methods as coroutines; ``async with``."""

    def __init__(self, client: CacheClient, layout: KvLayout,
                 session: str | None = None) -> None:
        super().__init__(client, layout, session, asyncio.Lock())

    async def __aenter__(self) -> AsyncKvCache:
        return self

    async def __aexit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            await self.release()
        else:
            with contextlib.suppress(AttentionError):
                await self.release()
