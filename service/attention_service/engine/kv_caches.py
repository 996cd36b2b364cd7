"""Server-side KV caches: named, owned, paged, expiring.

A cache is one sequence of one attention layer, named by its client and holding that
sequence's keys and values in ``KvPool`` pages. Rules (docs/service.md, "KV caches"):

* Ownership: ids live in the owner's namespace (the caller's token with auth on); another owner
  asking for the same id gets NOT_FOUND, never the data.
* One call at a time per cache: a second call while one runs gets ABORTED (a decode step must
  see the token its predecessor appended, so concurrent calls on one sequence are a client bug).
* A call reserves the pages its new tokens need when the engine accepts it, so a full pool
  answers RESOURCE_EXHAUSTED before anything is written; when the call ends, ``store`` keeps
  the tokens, anything else (no store, an error, a cancel) puts the cache back as it was.
* A decode step without store on a page boundary leaves each cache the page it took (its
  spare, for its next such step; given to any call that would otherwise find the pool or its
  quota full).
* Idle caches expire after the TTL; a cache in use never does. Releasing a cache in use
  removes its name at once and frees its pages when its call ends.

Thread-safe: one lock around the registry and the pool (callers: the engine's connection
threads for submit, the control-rpc threads, the executor's completer for ``finish``).
"""

from __future__ import annotations

import heapq
import logging
import operator
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from attention_service.engine.jobs import CacheWork
from attention_service.engine.kv_pool import KvPool, Layout
from attention_service.engine.sweeper import Sweeper
from attention_service.errors import RequestError, exhausted, invalid, not_found
from attention_service.params import (
    ELEMENT_BYTES,
    MAX_CACHE_ID_BYTES,
    QUERY_DTYPES,
    KvScales,
    Params,
    check_cache_id,
    check_cache_ids,
    check_kv_scales,
    kv_dtype_allowed,
    lengths,
    visible_pairs,
)
from attention_wire.pb import attention_pb2 as pb

log = logging.getLogger("attention_service")

MAX_HEADS = 1024
_NUMPY_SLOTS = 64  # new tokens per cache above which slots are computed with numpy
# Params.memo: the new tokens per cache when every cache gets the same 1 or 0 (a decode step,
# with or without k/v), else -1 (``begin``'s general way).
_STEP_TOKENS = "kv_caches.step_tokens"
METHODS = ("CreateCaches", "ReleaseCaches", "ForkCache", "ListCaches")
# ListCaches pages: caches per page by default and at most, and a reply's bytes (half gRPC's
# 4 MiB message limit): 100k caches in one reply passed the limit (issue 63).
LIST_PAGE = 1000
MAX_LIST_PAGE = 10000
LIST_REPLY_BYTES = 2 << 20


class _Page:
    """The caches of one ListCaches reply, ended before it passes LIST_REPLY_BYTES (the first
    always fits: an entry takes well under 4 KiB)."""

    def __init__(self) -> None:
        self.caches: list[pb.CacheInfo] = []
        self.nbytes = 0

    def add(self, info: pb.CacheInfo) -> bool:
        size = info.ByteSize() + 4  # with its tag and length
        if self.caches and self.nbytes + size > LIST_REPLY_BYTES:
            return False
        self.caches.append(info)
        self.nbytes += size
        return True


def _page_index(token: str, count: int) -> int:
    """Where a page of an id list starts: a token ``i<index>`` from the previous page."""
    if not token:
        return 0
    if token[0] == "i" and token[1:].isdigit() and 0 < int(token[1:]) < count:
        return int(token[1:])
    raise invalid("page_token", "not a token a previous page of these cache_ids gave")


def _page_after(token: str) -> str:
    """The id after which a page of all caches starts: a token ``a<id>``."""
    if not token:
        return ""
    if token[0] == "a" and 1 <= len(token[1:].encode()) <= MAX_CACHE_ID_BYTES:
        return token[1:]
    raise invalid("page_token", "not a token a previous page of this listing gave")


@dataclass(eq=False, slots=True)
class _Cache:
    owner: str
    cache_id: str
    layout: Layout
    kv_scales: KvScales | None  # FP8 layouts only
    page_tokens: int
    last_used: float
    length: int = 0
    pages: list[int] = field(default_factory=list)
    # The page its next token will start, held since a step without store took it on a page
    # boundary (-1: none; ``CacheRegistry._begin_step``).
    spare: int = -1
    # Bumped whenever its length, pages or spare change: a step memo over it is stale then.
    version: int = 0
    busy: bool = False
    released: bool = False  # released while busy: pages go when its call ends


@dataclass(slots=True)
class _StepMemo:
    """A decode step's ``begin`` that reserved nothing, kept for the next step over the same
    caches with the same ``params`` object (a model host's layer sends one form). While no
    cache's ``version`` moved (a step without store, or one that failed), the next step is
    this one again (one comprehension, where working it out again took ~12% of a B=64 step's
    engine GIL time, py-spy, H200). When this step stored its one token per cache and nothing
    else changed (each version one up: ``after``), the next is this one a token on, on the
    same pages while no token crosses into a new page. Its lists go to each such step's
    CacheWork: nothing changes them in place."""

    params: Params
    caches: list[_Cache]
    versions: list[int]
    lens: list[int]
    seq_lens: list[int]
    table: list[list[int]]
    slot_pages: list[int]
    slot_offsets: list[int]
    added: list[int] | None
    width: int
    work: tuple[int, int, int]  # flops, kv bytes, keys
    stores: bool  # the step stores one token per cache
    # Its caches' versions right after it stored them (set by its ``finish`` when it kept its
    # tokens; None until then, and for good when it failed or stores nothing).
    after: list[int] | None = None


# Resolved id lists kept (a step stream per layer of each model host names one): lists of up
# to _MAX_KEPT_LIST ids, _MAX_KEPT_IDS ids in all (then they are all forgotten), kept once a
# call naming them is accepted, so refused calls cannot fill the memo.
_MAX_KEPT_LIST = 1024
_MAX_KEPT_IDS = 1 << 16


def _aborted(field_name: str, message: str) -> RequestError:
    return RequestError(grpc.StatusCode.ABORTED, f"{field_name}: {message}")


class CacheRegistry:
    def __init__(
        self, pool: KvPool | None, *, ttl_seconds: float = 600.0, max_caches: int = 1 << 20,
        max_request_flops: float = float("inf"), clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``pool`` None: caches are off (every call answers FAILED_PRECONDITION).
        ``max_request_flops``: the front end checks a cached call's new tokens only; here,
        where the cached lengths are known, the whole call (cached keys included) is held to
        the same --max-request-flops."""
        self.pool = pool
        self.max_request_flops = max_request_flops
        self.ttl = ttl_seconds
        self.max_caches = max_caches
        self._clock = clock
        self._lock = threading.Lock()
        self._caches: dict[tuple[str, str], _Cache] = {}
        # Id lists resolved to their caches, layouts checked equal (a step stream names the
        # same caches every step): emptied whenever a cache goes, so never stale.
        self._resolved: dict[tuple[str, tuple[str, ...]], list[_Cache]] = {}
        self._resolved_ids = 0  # ids in the kept lists
        self._memos: dict[tuple[str, tuple[str, ...]], _StepMemo] = {}  # as ``_resolved``
        self._per_owner: dict[str, int] = {}
        # Caches holding a spare page (``_Cache.spare``), for ``_alloc`` to take back (in the
        # order they took them: which pages come back, and in what order, is deterministic).
        self._spares: dict[_Cache, None] = {}
        self.expired_total = 0  # caches released by the TTL (a metric)
        self._sweeper = (Sweeper("kv-cache-ttl", ttl_seconds, self.expire)
                         if pool is not None and ttl_seconds > 0 else None)

    # ---- accounting (metrics, ServerInfo) -----------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.pool is not None

    def gauges(self) -> tuple[int, int, int, int]:
        """(pages used, pages total, caches live, caches expired so far)."""
        if self.pool is None:
            return 0, 0, 0, 0
        with self._lock:
            return (self.pool.pages_used, self.pool.pages_total, len(self._caches),
                    self.expired_total)

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.stop()

    # ---- the data ops -------------------------------------------------------------------

    def begin(self, params: Params, owner: str) -> CacheWork:
        """Accept a cached op: check its caches, reserve pages for its new tokens, mark the
        caches busy. Raises RequestError (nothing reserved) on any refusal."""
        pool = self._pool()
        ids = params.cache_ids
        if not ids:  # validation names one cache per sequence, and a request has one or more
            raise invalid("header.cache.cache_ids", "empty")
        new = params.new_keys
        name = "q" if params.op.queries else "k"
        with self._lock:
            kept = self._resolved.get((owner, ids))
            caches = kept or self._resolve(owner, ids, params, name)
            self._check_layout(caches[0], params, name)
            busy = [c.busy for c in caches]
            if True in busy:
                i = busy.index(True)
                raise _aborted(f"header.cache.cache_ids[{i}]",
                               f"cache {caches[i].cache_id!r} is in use by another call; calls "
                               "on one cache must be sequential (a call cancelled or past its "
                               "deadline holds its caches until its launch ends: retry)")
            step = params.memo.get(_STEP_TOKENS)
            if step is None:
                step = params.memo[_STEP_TOKENS] = next(
                    (k for k in (1, 0) if new.count(k) == len(new)), -1)
            if step >= 0:
                return self._begin_step(params, owner, caches, kept is None, pool, step)
            seq_lens = [c.length + n for c, n in zip(caches, new, strict=True)]
            flops, kv_bytes, keys = self._checked_work(params, seq_lens, caches[0].layout)
            pt = caches[0].page_tokens  # one layout, one page size
            need = [-(-n // pt) - len(c.pages) for c, n in zip(caches, seq_lens, strict=True)]
            fresh = self._alloc(sum(need), "header.k", owner)
            if kept is None:  # accepted: its caches are worth keeping resolved
                self._keep(owner, ids, caches)
            view = pool.view(caches[0].layout)  # all checked equal to the request's layout
            now = self._clock()
            table, slot_pages, slot_offsets = [], [], []
            at = 0
            for c, n, k in zip(caches, new, need, strict=True):
                c.busy, c.last_used = True, now
                pages = c.pages + fresh[at : at + k]
                at += k
                table.append(pages)
                if n > _NUMPY_SLOTS:
                    pos = np.arange(c.length, c.length + n)
                    slot_pages += np.asarray(pages, dtype=np.int64)[pos // c.page_tokens].tolist()
                    slot_offsets += (pos % c.page_tokens).tolist()
                else:  # a decode step's token or few: plain ints are ~10x cheaper
                    pt = c.page_tokens
                    for pos in range(c.length, c.length + n):
                        slot_pages.append(pages[pos // pt])
                        slot_offsets.append(pos % pt)
        return self._work_of(params, caches, table, seq_lens, slot_pages, slot_offsets, flops,
                             kv_bytes, keys, max(map(len, table)), view, fresh)

    def _begin_step(self, params: Params, owner: str, caches: list[_Cache], new_ids: bool,
                    pool: KvPool, tokens: int) -> CacheWork:
        """Under the lock, ``begin`` of a call with ``tokens`` (1 or 0) new tokens per cache (a
        decode step, stored or not, with or without k/v): each token lands on its cache's last
        page, or starts the one fresh page its cache gets (``CacheWork.new_pages``; the rows
        are the caches' own page lists, never copied). A comprehension or two per quantity and
        no per-cache call: 64 caches, begin + finish, 47 -> 37 us without store on a page
        boundary, 38 -> 26 with (dev box). The same step again over unchanged caches takes
        its memo, or follows from it (``_StepMemo``)."""
        key = (owner, params.cache_ids)
        memo = self._memos.get(key)
        versions = [c.version for c in caches]
        if memo is not None and memo.params is params and memo.caches is caches:
            if memo.versions == versions:  # nothing changed: the same step again
                for c in caches:
                    c.busy = True
                return self._work_of(params, caches, memo.table, memo.seq_lens,
                                     memo.slot_pages, memo.slot_offsets, *memo.work,
                                     memo.width, pool.view(caches[0].layout), [], memo.added,
                                     memo.lens)
            if (memo.after == versions and memo.added is None
                    and caches[0].page_tokens - 1 not in memo.slot_offsets):
                # Its tokens stored, none of them a page's last: each cache's next token goes
                # one row on, on the same page (64 caches, begin + finish 46 -> 36 us, dev box).
                seq_lens = [n + 1 for n in memo.seq_lens]
                return self._step_work(
                    params, key, caches, versions, memo.seq_lens, seq_lens, memo.table,
                    memo.slot_pages, [o + 1 for o in memo.slot_offsets], None, memo.width,
                    self._checked_work(params, seq_lens, caches[0].layout), [], pool, tokens)
        lens = [c.length for c in caches]
        seq_lens = [n + 1 for n in lens] if tokens else lens
        flops, kv_bytes, keys = self._checked_work(params, seq_lens, caches[0].layout)
        pt = caches[0].page_tokens  # one layout, one page size
        table = [c.pages for c in caches]
        slot_offsets = [n % pt for n in lens] if tokens else []
        # A token past its cache's pages starts a fresh one (pages are never fewer than the
        # tokens need, so this is the only page a step adds); only a token at a page's start
        # can be (a stored step's 63 of 64).
        past = ([o == 0 and n >= len(row) * pt
                 for o, n, row in zip(slot_offsets, lens, table, strict=True)]
                if 0 in slot_offsets else None)
        fresh: list[int] = []
        added: list[int] | None = None
        every = False  # every token starts a page, each its cache's spare
        if past is not None and True in past:
            # A cache's spare page first (a step without store on a page boundary left it),
            # fresh pages for the others: steps without store then take the same pages step
            # after step, none from the pool, and a staging finds its table as it left it
            # (64 caches on a boundary, begin + finish: 80 -> 44 us, dev box).
            added = [c.spare for c in caches]
            every = -1 not in added and False not in past
            if not every:
                short = [p and s < 0 for p, s in zip(past, added, strict=True)]
                # Not from these caches' spares: ``added`` names them.
                fresh = self._alloc(short.count(True), "header.k", owner, caches)
                handed = iter(fresh)
                added = [(next(handed) if n else s) if p else -1
                         for p, n, s in zip(past, short, added, strict=True)]
        if new_ids:  # accepted: its caches are worth keeping resolved
            self._keep(owner, params.cache_ids, caches)
        if every:  # the table's width (``CacheWork.width``): its longest row with its page
            width = max(map(len, table)) + 1
            slot_pages = added  # type: ignore[assignment]
        elif added is not None:
            width = max(map(operator.add, map(len, table), past))  # type: ignore[arg-type]
            slot_pages = [p if p >= 0 else row[n // pt]
                          for p, row, n in zip(added, table, lens, strict=True)]
        else:  # each token on its cache's last page; no slots without new tokens
            width = max(map(len, table))
            slot_pages = ([row[n // pt] for row, n in zip(table, lens, strict=True)]
                          if tokens else [])
        return self._step_work(params, key, caches, versions, lens, seq_lens, table,
                               slot_pages, slot_offsets, added, width, (flops, kv_bytes, keys),
                               fresh, pool, tokens)

    def _step_work(
        self, params: Params, key: tuple[str, tuple[str, ...]], caches: list[_Cache],
        versions: list[int], lens: list[int], seq_lens: list[int], table: list[list[int]],
        slot_pages: list[int], slot_offsets: list[int], added: list[int] | None, width: int,
        work: tuple[int, int, int], fresh: list[int], pool: KvPool, tokens: int,
    ) -> CacheWork:
        """Under the lock, ``_begin_step``'s end: its caches busy, its memo kept when it
        reserved nothing and its ids (``key``, as ``_resolved``'s) are kept resolved, its
        CacheWork."""
        for c in caches:  # ``last_used`` is set when the call ends (none expires while busy)
            c.busy = True
        made = None
        if not fresh and key in self._resolved:
            made = self._memos[key] = _StepMemo(
                params, caches, versions, lens, seq_lens, table, slot_pages, slot_offsets,
                added, width, work, params.store and tokens == 1)
        return self._work_of(params, caches, table, seq_lens, slot_pages, slot_offsets, *work,
                             width, pool.view(caches[0].layout), fresh, added, lens, made)

    def _checked_work(self, params: Params, seq_lens: list[int], layout: Layout
                      ) -> tuple[int, int, int]:
        """(FLOPs, K/V bytes, keys) of the call over ``seq_lens``; RESOURCE_EXHAUSTED over
        the server's FLOPs limit."""
        flops, kv_bytes, keys = _work(params, seq_lens, layout)
        if flops > self.max_request_flops:
            raise exhausted("header", f"attention FLOPs over the cached keys: {flops:.3g}, "
                            f"over the server's limit of {self.max_request_flops:.3g} "
                            "(--max-request-flops)")
        return flops, kv_bytes, keys

    def _resolve(self, owner: str, ids: tuple[str, ...], params: Params, name: str
                 ) -> list[_Cache]:
        """Under the lock: ``owner``'s caches ``ids``, checked to exist and to share one
        layout, remembered for the next call naming the same ids. Field names are made only
        for a refusal: 64 f-strings and layout checks per step took ~120 us of a 64-sequence
        step's ~250 in ``begin`` (2-core dev box)."""
        get = self._caches.get
        found = [get((owner, cid)) for cid in ids]
        if None in found:
            i = found.index(None)
            self._lookup(owner, ids[i], f"header.cache.cache_ids[{i}]")  # raises
        caches: list[_Cache] = found  # type: ignore[assignment]
        first = caches[0].layout
        for i, c in enumerate(caches):
            if c.layout is not first and c.layout != first:
                self._check_layout(caches[0], params, name)
                self._check_layout(c, params, name)
                if any(b.busy for b in caches[:i]):  # the first fault in id order, as ever
                    return caches
                raise invalid(f"header.cache.cache_ids[{i}]",
                              f"cache {c.cache_id!r} differs from {caches[0].cache_id!r} "
                              "in layout (an FP8 cache and a 16-bit one): one request "
                              "runs caches of one layout")
        return caches

    def _keep(self, owner: str, ids: tuple[str, ...], caches: list[_Cache]) -> None:
        """Under the lock: remember ``ids`` resolved, within the memo's bounds."""
        if len(ids) > _MAX_KEPT_LIST:
            return
        if self._resolved_ids + len(ids) > _MAX_KEPT_IDS:
            self._resolved.clear()
            self._memos.clear()
            self._resolved_ids = 0
        self._resolved[(owner, ids)] = caches
        self._resolved_ids += len(ids)

    def _work_of(
        self, params: Params, caches: list[_Cache], table: list[list[int]], seq_lens: list[int],
        slot_pages: list[int], slot_offsets: list[int], flops: int, kv_bytes: int, keys: int,
        width: int, view: Any, fresh: list[int], added: list[int] | None = None,
        lens: list[int] | None = None, memo: _StepMemo | None = None,
    ) -> CacheWork:
        """The accepted call's CacheWork; its ``finish`` keeps or rolls back its tokens
        (``fresh``: the pages ``begin`` reserved for them, in the caches' order; ``added``:
        ``CacheWork.new_pages``; ``lens``: the caches' lengths before, when known; ``memo``:
        the step's, told when it stored its tokens)."""
        if lens is None:
            lens = [c.length for c in caches]

        def finish(ok: bool) -> tuple[int, ...]:
            keep = ok and params.store  # kept: the grown rows become the caches' page lists
            return self._finish(caches, work.rows() if keep else table,
                                seq_lens if keep else lens, fresh, keep, ok, added, memo)

        work = CacheWork(
            k_pages=view.k_pages, v_pages=view.v_pages, block_table=table, seq_lens=seq_lens,
            slot_pages=slot_pages, slot_offsets=slot_offsets, flops=flops, kv_bytes=kv_bytes,
            finish=finish, keys=keys, width=width,
            seq_scales=[c.kv_scales for c in caches] if caches[0].kv_scales else None,  # type: ignore[misc]
            new_pages=added,
        )
        return work

    def _finish(
        self, caches: list[_Cache], table: list[list[int]], lengths: list[int],
        fresh: list[int], keep: bool, ok: bool = False, added: list[int] | None = None,
        memo: _StepMemo | None = None,
    ) -> tuple[int, ...]:
        """The call's end: its rows and ``lengths`` kept (``keep``), else its ``fresh`` pages
        given back; its caches free for the next call. A decode step's new pages (``added``)
        not kept are its caches' spares: those it took from the pool stay when it succeeded
        without store, and go back when it failed (it changes nothing). Returns
        ``lengths``."""
        with self._lock:
            now = self._clock()
            if keep:
                for c, pages, total in zip(caches, table, lengths, strict=True):
                    c.pages, c.length = pages, total
                    c.version += 1
                if added is not None:  # a spare a row took is its cache's own page now
                    for c, p in zip(caches, added, strict=True):
                        if p >= 0 and c.spare >= 0:
                            c.spare = -1
                            self._spares.pop(c, None)
                if memo is not None and memo.stores:  # the next step follows from it
                    memo.after = [c.version for c in caches]
            elif fresh:
                if ok and added is not None:  # without store: the next step's pages
                    for c, p in zip(caches, added, strict=True):
                        if p >= 0 and c.spare < 0:
                            c.spare = p
                            c.version += 1
                            self._spares[c] = None
                else:  # the reserved pages go back in one call; the caches are intact
                    self._pool().free(fresh)
            for c in caches:
                c.busy, c.last_used = False, now
                if c.released:  # released during the call: its pages go now
                    self._free_all(c)
            return tuple(lengths)

    def _alloc(self, count: int, field_name: str, owner: str,
               using: list[_Cache] | None = None) -> list[int]:
        """Under the lock: ``KvPool.alloc``, which on a full pool or quota first takes back
        the spare pages of caches in no call and not in ``using`` (the caches whose spares
        the caller is about to use; for a quota, only the caller's own) and tries again."""
        pool = self._pool()
        try:
            return pool.alloc(count, field_name, owner)
        except RequestError:
            mine = set(using or ())
            idle = [c for c in self._spares if not c.busy and c not in mine]
            if pool.over_quota(owner, count):
                idle = [c for c in idle if c.owner == owner]  # the quota: the caller's own
            if not idle:
                raise
            pool.free([c.spare for c in idle])
            for c in idle:
                c.spare = -1
                c.version += 1
                del self._spares[c]
            return pool.alloc(count, field_name, owner)

    def _free_all(self, c: _Cache) -> None:
        """Under the lock: a cache that went gives back its pages and its spare."""
        self._pool().free(c.pages if c.spare < 0 else [*c.pages, c.spare])
        c.pages, c.spare = [], -1
        c.version += 1
        self._spares.pop(c, None)

    # ---- the control rpcs ---------------------------------------------------------------

    def call(self, method: str, request: Any, owner: str) -> Any:
        self._pool()
        if method == "CreateCaches":
            return self._create(request, owner)
        if method == "ReleaseCaches":
            return self._release(request, owner)
        if method == "ForkCache":
            return self._fork(request, owner)
        if method == "ListCaches":
            return self._list(request, owner)
        raise ValueError(f"unknown cache method {method}")

    def _create(self, req: pb.CreateCachesRequest, owner: str) -> pb.CreateCachesResponse:
        pool = self._pool()
        ids = check_cache_ids(req.cache_ids, "cache_ids")
        if not ids:
            raise invalid("cache_ids", "empty: name at least one cache")
        layout, kv_scales = _check_layout_msg(req, pool)
        page_tokens = pool.page_tokens(layout)
        with self._lock:
            for i, cid in enumerate(ids):
                if (owner, cid) in self._caches:
                    raise RequestError(grpc.StatusCode.ALREADY_EXISTS,
                                       f"cache_ids[{i}]: cache {cid!r} exists")
            held = self._per_owner.get(owner, 0)
            if held + len(ids) > self.max_caches:
                raise exhausted("cache_ids", f"{held} caches held, {len(ids)} more would pass "
                                f"the per-caller limit of {self.max_caches}")
            now = self._clock()
            for cid in ids:
                self._caches[(owner, cid)] = _Cache(owner, cid, layout, kv_scales,
                                                    page_tokens, now)
            self._per_owner[owner] = held + len(ids)
        return pb.CreateCachesResponse(created=len(ids))

    def _release(self, req: pb.ReleaseCachesRequest, owner: str) -> pb.ReleaseCachesResponse:
        with self._lock:
            if req.all:
                if req.cache_ids:
                    raise invalid("all", "set together with cache_ids: use one or the other")
                caches = [c for c in self._caches.values() if c.owner == owner]
            else:
                ids = check_cache_ids(req.cache_ids, "cache_ids")
                caches = [self._lookup(owner, cid, f"cache_ids[{i}]")
                          for i, cid in enumerate(ids)]
            for c in caches:
                self._drop(c)
        return pb.ReleaseCachesResponse(released=len(caches))

    def _fork(self, req: pb.ForkCacheRequest, owner: str) -> pb.CacheInfo:
        pool = self._pool()
        target = check_cache_id(req.target_id, "target_id")
        with self._lock:
            src = self._lookup(owner, req.source_id, "source_id")
            if src.busy:
                raise _aborted("source_id", f"cache {src.cache_id!r} is in use by another call")
            if (owner, target) in self._caches:
                raise RequestError(grpc.StatusCode.ALREADY_EXISTS,
                                   f"target_id: cache {target!r} exists")
            length = req.length if req.HasField("length") else src.length
            if length > src.length:
                raise invalid("length", f"{length} tokens, but the source holds {src.length}")
            held = self._per_owner.get(owner, 0)
            if held + 1 > self.max_caches:
                raise exhausted("target_id", f"the per-caller limit of {self.max_caches} "
                                "caches is reached")
            full, part = divmod(length, src.page_tokens)
            shared = src.pages[:full]
            copied = self._alloc(1, "target_id", owner) if part else []
            if copied:
                pool.copy_page(src.pages[full], copied[0])
            pool.share(shared)
            c = _Cache(owner, target, src.layout, src.kv_scales, src.page_tokens,
                       self._clock(), length, shared + copied)
            self._caches[(owner, target)] = c
            self._per_owner[owner] = held + 1
            src.last_used = c.last_used
            return self._info(c)

    def _list(self, req: pb.ListCachesRequest, owner: str) -> pb.ListCachesResponse:
        """One page (``LIST_PAGE``, ``LIST_REPLY_BYTES``): of ``cache_ids`` in their order, or
        of all the owner's caches by id, never holding the lock for a sort."""
        pool = self._pool()
        size = min(req.page_size or LIST_PAGE, MAX_LIST_PAGE)
        page, token = _Page(), ""
        if req.cache_ids and not req.pool_only:
            start = _page_index(req.page_token, len(req.cache_ids))
            with self._lock:
                for i in range(start, min(start + size, len(req.cache_ids))):
                    c = self._lookup(owner, req.cache_ids[i], f"cache_ids[{i}]")
                    if not page.add(self._info(c)):
                        break
            end = start + len(page.caches)
            token = f"i{end}" if end < len(req.cache_ids) else ""
        elif not req.pool_only:
            after = _page_after(req.page_token)
            with self._lock:
                ids = [cid for o, cid in self._caches if o == owner and cid > after]
            first = heapq.nsmallest(size, ids)
            last, more = "", len(ids) > len(first)
            with self._lock:
                for cid in first:
                    c = self._caches.get((owner, cid))  # released meanwhile: not listed
                    if c is not None and not page.add(self._info(c)):
                        more = True
                        break
                    last = cid
            token = "a" + last if more else ""
        with self._lock:
            return pb.ListCachesResponse(
                caches=page.caches, next_page_token=token,
                pool=pb.KvPoolInfo(
                    page_bytes=pool.page_bytes, pages_total=pool.pages_total,
                    pages_used=pool.pages_used, pages_free=pool.pages_free,
                    caches_live=len(self._caches), ttl_seconds=self.ttl,
                    caller_pages_used=pool.held(owner), caller_pages_limit=pool.caller_pages,
                    caller_caches=self._per_owner.get(owner, 0),
                ),
            )

    # ---- helpers (under the lock) -------------------------------------------------------

    def _pool(self) -> KvPool:
        if self.pool is None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               "server-side KV caches are off on this server (--kv-cache-bytes)")
        return self.pool

    def _lookup(self, owner: str, cache_id: str, field_name: str) -> _Cache:
        c = self._caches.get((owner, cache_id))
        if c is None:
            raise not_found(field_name, f"no cache {cache_id!r} (never created, released, "
                            "expired, or the server restarted)")
        return c

    def _drop(self, c: _Cache) -> None:
        """Remove ``c``'s name; its pages go now, or when its call ends."""
        del self._caches[(c.owner, c.cache_id)]
        self._resolved.clear()  # none may name a cache that went
        self._memos.clear()
        self._resolved_ids = 0
        self._per_owner[c.owner] -= 1
        if not self._per_owner[c.owner]:
            del self._per_owner[c.owner]
        c.released = True
        if not c.busy:
            self._free_all(c)

    def _info(self, c: _Cache) -> pb.CacheInfo:
        pool = self._pool()
        return pb.CacheInfo(
            cache_id=c.cache_id, layout=_layout_msg(c),
            length=c.length, pages=len(c.pages),
            shared_pages=sum(1 for p in c.pages if pool.refs(p) > 1),
            idle_seconds=0.0 if c.busy else max(0.0, self._clock() - c.last_used), busy=c.busy,
        )

    @staticmethod
    def _check_layout(c: _Cache, params: Params, q_or_k: str) -> None:
        lay = c.layout
        name = pb.DType.Name
        if q_or_k == "q" and params.dtype != lay.dtype:
            raise invalid("header.q.dtype", f"{name(params.dtype)}, but cache {c.cache_id!r} "
                          f"takes {name(lay.dtype)} queries")
        if params.kv_dtype not in (lay.dtype, lay.stored_dtype):
            stored = "" if lay.stored_dtype == lay.dtype else f" (stored {name(lay.kv_dtype)})"
            raise invalid("header.k.dtype",
                          f"{name(params.kv_dtype)}, but cache {c.cache_id!r} holds "
                          f"{name(lay.dtype)}{stored} keys and values")
        if params.num_kv_heads != lay.num_kv_heads:
            raise invalid("header.k.shape[1]",
                          f"num_kv_heads {params.num_kv_heads}, but cache {c.cache_id!r} has "
                          f"{lay.num_kv_heads}")
        if params.head_dim != lay.head_dim:
            raise invalid(f"header.{q_or_k}.shape[2]",
                          f"head_dim {params.head_dim}, but cache {c.cache_id!r} has "
                          f"{lay.head_dim}")

    # ---- TTL ----------------------------------------------------------------------------

    def expire(self) -> int:
        """Release every idle cache past the TTL; returns how many."""
        if self.ttl <= 0:
            return 0
        with self._lock:
            cutoff = self._clock() - self.ttl
            old = [c for c in self._caches.values() if not c.busy and c.last_used < cutoff]
            for c in old:
                self._drop(c)
            self.expired_total += len(old)
        for c in old:
            log.info("kv cache %r of %s expired after %.0f s idle", c.cache_id,
                     "a caller" if c.owner else "anonymous", self.ttl)
        return len(old)


def _layout_msg(c: _Cache) -> pb.CacheLayout:
    lay = c.layout
    msg = pb.CacheLayout(dtype=lay.dtype, num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim,
                         kv_dtype=lay.kv_dtype)
    if c.kv_scales is not None:
        msg.kv_scales.k.extend(c.kv_scales[0])
        msg.kv_scales.v.extend(c.kv_scales[1])
    return msg


def _check_layout_msg(req: pb.CreateCachesRequest, pool: KvPool
                      ) -> tuple[Layout, KvScales | None]:
    from attention_kernels import supported_head_dim

    if not req.HasField("layout"):
        raise invalid("layout", "missing")
    lay = req.layout
    if lay.dtype not in QUERY_DTYPES:
        raise invalid("layout.dtype", "unknown or unsupported; use FLOAT16, BFLOAT16 or FLOAT32")
    kv_dtype = 0 if lay.kv_dtype in (pb.DTYPE_UNSPECIFIED, lay.dtype) else int(lay.kv_dtype)
    if kv_dtype and not kv_dtype_allowed(lay.dtype, kv_dtype):
        given = pb.DType.Name(lay.kv_dtype) if lay.kv_dtype in ELEMENT_BYTES else lay.kv_dtype
        raise invalid("layout.kv_dtype", f"{given} with dtype {pb.DType.Name(lay.dtype)}: "
                      "leave it unset (dtype), or FLOAT8_E4M3 with FLOAT16 or BFLOAT16")
    if not 1 <= lay.num_kv_heads <= MAX_HEADS:
        raise invalid("layout.num_kv_heads", f"must be in [1, {MAX_HEADS}], got "
                      f"{lay.num_kv_heads}")
    if not supported_head_dim(lay.head_dim):
        raise invalid("layout.head_dim", f"{lay.head_dim} unsupported: must be in [1, 256]")
    scales = None
    if kv_dtype:
        if not lay.HasField("kv_scales"):
            raise invalid("layout.kv_scales", "missing: FLOAT8_E4M3 caches need per-kv-head "
                          "scales")
        scales = check_kv_scales(lay.kv_scales, lay.num_kv_heads, "layout.kv_scales")
    elif lay.HasField("kv_scales"):
        raise invalid("layout.kv_scales", "set, but kv_dtype is not FLOAT8_E4M3")
    layout = Layout(int(lay.dtype), int(lay.num_kv_heads), int(lay.head_dim), kv_dtype)
    if pool.page_tokens(layout) < 1:
        raise invalid("layout", f"one token's keys and values take {layout.token_bytes} "
                      f"bytes, more than a {pool.page_bytes}-byte page (--kv-page-bytes)")
    return layout, scales


def _work(params: Params, seq_lens: list[int], layout: Layout) -> tuple[int, int, int]:
    """(FLOPs, K/V bytes read, keys) of a cached op over its sequences' full key ranges."""
    keys = sum(seq_lens)
    if not params.op.queries:  # AppendKV stores, computes nothing
        return 0, 0, keys
    h, d = params.num_heads, params.head_dim
    if params.op.decode_like and params.window[0] < 0:
        pairs = keys  # one query at the end of each sequence sees every key (a decode step)
    else:
        if params.op.decode_like:
            len_q = [1] * len(seq_lens)
        else:
            assert params.cu_seqlens_q is not None
            len_q = lengths(params.cu_seqlens_q)
        pairs = visible_pairs(len_q, seq_lens, params.causal, params.window)
    kv = 2 * keys * params.num_kv_heads * d * ELEMENT_BYTES[layout.stored_dtype]
    return 4 * pairs * h * d, kv, keys
