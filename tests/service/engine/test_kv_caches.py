"""Server-side KV caches at the wire level (raw stubs, cpu backend): the pool and registry as
units, then create / append / prefill against a cache / decode steps / fork / release / TTL /
pool full / cross-token isolation / concurrency end to end, every result against the float64
reference on the concatenated keys and values."""

from __future__ import annotations

import collections
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch

from attention_service.engine.kv_caches import CacheRegistry
from attention_service.engine.kv_pool import KvPool, Layout
from attention_service.errors import RequestError
from attention_service.params import Op, make_params
from attention_wire.pb import attention_pb2 as pb

from ..kv_helpers import (
    Model,
    append_messages,
    cache_decode_messages,
    cache_prefill_messages,
    decode_step,
    layout,
    rand,
    session,
)
from ..svc_helpers import (
    GatedBackend,
    ServerHandle,
    collect,
    make_config,
    prefill_oracle,
    sample,
    wait_until,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_tracebacks")]
PAGE = 4096  # 16 tokens of the 2 x 16 float32 layout below: lengths cross pages often
F32 = Layout(pb.FLOAT32, 2, 16)


def _code(fn: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


@pytest.fixture(scope="module")
def srv() -> Any:
    handle = ServerHandle(make_config(kv_cache_bytes=64 * PAGE, kv_page_bytes=PAGE))
    yield handle
    handle.close()


# ---- units: the pool and the registry ----------------------------------------------------


def test_pool_pages_any_layout_and_counts_exactly() -> None:
    pool = KvPool(torch.zeros(10 * PAGE, dtype=torch.uint8), PAGE)
    assert (pool.pages_total, pool.pages_free) == (10, 10)
    # A head dim that is not a multiple of 16 takes rows padded to one (24 -> 32 elements):
    # 4096 / (2 * 32 * 2) tokens, and the kernels see 16-divisible strides.
    odd = Layout(pb.BFLOAT16, 1, 24)
    assert pool.page_tokens(F32) == 16 and pool.page_tokens(odd) == 32
    assert pool.view(odd).k_pages.shape[-1] == 24 and pool.view(odd).k_pages.stride()[1:] == (
        32, 32, 1)
    a = pool.alloc(4, "x")
    b = pool.alloc(6, "x")
    assert sorted(a + b) == list(range(10)) and pool.pages_free == 0
    with pytest.raises(RequestError) as info:
        pool.alloc(1, "header.k")
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details.startswith("header.k: the KV-cache pool is full")
    pool.share(a[:2])
    pool.free(a)
    assert pool.pages_free == 2  # the shared two stay until their second owner lets go
    pool.free(a[:2])
    assert pool.pages_free == 4
    # K and V of a page are disjoint views of the same bytes; pages do not overlap.
    view = pool.view(F32)
    view.k_pages[3].fill_(1.0)
    view.v_pages[3].fill_(2.0)
    assert view.k_pages[3].sum() == 16 * 2 * 16 and view.v_pages[3].sum() == 2 * 16 * 2 * 16
    assert view.k_pages[2].abs().sum() == 0 and view.k_pages[4].abs().sum() == 0


def test_pool_holds_each_caller_to_its_quota() -> None:
    pool = KvPool(torch.zeros(10 * PAGE, dtype=torch.uint8), PAGE, caller_pages=4)
    a = pool.alloc(3, "x", "alice")
    with pytest.raises(RequestError) as info:  # 3 + 2 > 4: refused, nothing taken
        pool.alloc(2, "header.k", "alice")
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details.startswith("header.k: this caller's KV-cache quota is full")
    assert (pool.held("alice"), pool.pages_free) == (3, 7)
    b = pool.alloc(4, "x", "bob")  # another caller has its own quota
    pool.share(a[:2])  # a fork's shared pages count once
    assert (pool.held("alice"), pool.held("bob")) == (3, 4)
    pool.free(a)
    assert pool.held("alice") == 2  # the shared two are still referenced
    pool.free(a[:2])
    pool.free(b)
    assert (pool.held("alice"), pool.held("bob"), pool.pages_free) == (0, 0, 10)
    assert len(pool.alloc(4, "x", "alice")) == 4  # freed pages give the quota back


def _params(op: Op, ids: tuple[str, ...], new: list[int], store: bool = True) -> Any:
    cu = [0]
    for n in new:
        cu.append(cu[-1] + n)
    batch = len(ids)
    if op is Op.CACHE_DECODE:
        return make_params(op, pb.FLOAT32, (batch, 4, 16), (cu[-1], 2, 16), cu,
                           cache_ids=ids, store=store)
    return make_params(op, pb.FLOAT32, (0, 2, 16), (cu[-1], 2, 16), cu, [0] * (batch + 1),
                       cache_ids=ids, store=store)


def _create(reg: CacheRegistry, ids: list[str], owner: str = "") -> None:
    reg.call("CreateCaches", pb.CreateCachesRequest(
        cache_ids=ids, layout=pb.CacheLayout(dtype=pb.FLOAT32, num_kv_heads=2, head_dim=16)),
        owner)


def test_registry_reserves_then_keeps_or_rolls_back() -> None:
    pool = KvPool(torch.zeros(8 * PAGE, dtype=torch.uint8), PAGE)
    reg = CacheRegistry(pool, ttl_seconds=0)
    _create(reg, ["a", "b"])
    work = reg.begin(_params(Op.APPEND_KV, ("a", "b"), [20, 3]), "")
    assert pool.pages_used == 3 and work.seq_lens == [20, 3]
    assert work.slot_offsets[:17] == list(range(16)) + [0]  # token 16 starts a's second page
    assert work.slot_pages[16] == work.block_table[0][1]
    with pytest.raises(RequestError) as info:  # busy: one call per cache at a time
        reg.begin(_params(Op.CACHE_DECODE, ("b",), [1]), "")
    assert info.value.code == grpc.StatusCode.ABORTED and "cache_ids[0]" in info.value.details
    assert work.finish(True) == (20, 3)
    # A decode step without store rolls back; so does a failed call.
    w2 = reg.begin(_params(Op.CACHE_DECODE, ("a", "b"), [13, 0], store=False), "")
    assert pool.pages_used == 4 and w2.seq_lens == [33, 3]
    assert w2.finish(True) == (20, 3) and pool.pages_used == 3
    w3 = reg.begin(_params(Op.APPEND_KV, ("a",), [12]), "")
    assert w3.finish(False) == (20,) and pool.pages_used == 3
    # Pool full: refused before anything is reserved, the caches as they were.
    with pytest.raises(RequestError) as info:
        reg.begin(_params(Op.APPEND_KV, ("a", "b"), [16 * 4, 16 * 2]), "")
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert pool.pages_used == 3
    listed = reg.call("ListCaches", pb.ListCachesRequest(), "")
    assert [(c.cache_id, c.length, c.busy) for c in listed.caches] == [
        ("a", 20, False), ("b", 3, False)]


def test_decode_steps_place_each_new_token_in_its_own_slot() -> None:
    """One token per cache, with and without a fresh page among them (16-token pages): the
    slots, tables and lengths each cache's own, stored or rolled back."""
    pool = KvPool(torch.zeros(16 * PAGE, dtype=torch.uint8), PAGE)
    reg = CacheRegistry(pool, ttl_seconds=0)
    ids = ("a", "b", "c", "d")
    _create(reg, list(ids))
    reg.begin(_params(Op.APPEND_KV, ids, [5, 14, 17, 1]), "").finish(True)
    for step, store in enumerate((True, False, True, True)):
        before = {c.cache_id: (c.length, c.pages) for c in
                  reg.call("ListCaches", pb.ListCachesRequest(), "").caches}
        new = [1, 1, 0, 1] if step == 1 else [1, 1, 1, 1]
        w = reg.begin(_params(Op.CACHE_DECODE, ids, new, store=store), "")
        stepped = [cid for cid, n in zip(ids, new, strict=True) if n]
        assert w.seq_lens == [before[cid][0] + n for cid, n in zip(ids, new, strict=True)]
        assert [len(r) for r in w.rows()] == [-(-n // 16) for n in w.seq_lens]
        # What begin counted for the plan: the keys, and the table's width with fresh pages.
        assert (w.keys, w.width) == (sum(w.seq_lens), max(len(r) for r in w.rows()))
        assert w.slot_offsets == [before[cid][0] % 16 for cid in stepped]
        rows = dict(zip(ids, w.rows(), strict=True))
        # The fresh page past its row where a cache gets one (step 3: b's), none otherwise.
        assert w.new_pages == ([-1, w.slot_pages[1], -1, -1] if step == 3 else None)
        assert w.slot_pages == [rows[cid][before[cid][0] // 16] for cid in stepped]
        assert len(set(w.slot_pages)) == len(stepped)  # no two caches share a page
        lengths = w.finish(True)
        assert list(lengths) == (w.seq_lens if store else [before[c][0] for c in ids])
    # Steps 0-2 fit the pages the caches had; step 3 took a fresh page for b's 17th token.
    assert [c.length for c in reg.call("ListCaches", pb.ListCachesRequest(), "").caches] == [
        8, 17, 20, 4]
    assert pool.pages_used == 1 + 2 + 2 + 1


def test_one_token_steps_on_caches_empty_full_forked_failed_and_released() -> None:
    """A step of one token per cache (16-token pages) over an empty cache, one at a page
    boundary, one mid-page and a fork sharing full pages: a fresh page exactly where a token is
    past its cache's pages; a failed step gives every page back (by owner), a stored one keeps
    them, a cache released during its step frees its pages at the step's end."""
    pool = KvPool(torch.zeros(32 * PAGE, dtype=torch.uint8), PAGE)
    reg = CacheRegistry(pool, ttl_seconds=0)
    _create(reg, ["empty", "full", "mid"], owner="o")
    reg.begin(_params(Op.APPEND_KV, ("full", "mid"), [32, 5]), "o").finish(True)
    reg.call("ForkCache", pb.ForkCacheRequest(source_id="full", target_id="fork"), "o")
    ids = ("empty", "full", "mid", "fork")
    used, held = pool.pages_used, pool.held("o")
    assert (used, held) == (3, 3)  # full's two pages (the fork shares both), mid's one
    w = reg.begin(_params(Op.CACHE_DECODE, ids, [1] * 4, store=True), "o")
    assert w.seq_lens == [1, 33, 6, 33] and w.slot_offsets == [0, 0, 5, 0]
    assert (w.keys, w.width) == (73, 3)  # full's and fork's rows grow to three pages
    fresh = [p for p in w.new_pages if p >= 0]  # type: ignore[union-attr]
    assert [p >= 0 for p in w.new_pages] == [True, True, False, True]  # type: ignore[union-attr]
    assert w.slot_pages == [w.new_pages[0], w.new_pages[1], w.block_table[2][0],  # type: ignore[index]
                            w.new_pages[3]]  # type: ignore[index]
    assert len(set(fresh)) == 3 and pool.pages_used == used + 3
    assert w.finish(False) == (0, 32, 5, 32)  # failed: the caches as they were
    assert (pool.pages_used, pool.held("o")) == (used, held)
    w = reg.begin(_params(Op.CACHE_DECODE, ids, [1] * 4, store=True), "o")
    reg.call("ReleaseCaches", pb.ReleaseCachesRequest(cache_ids=["mid"]), "o")
    assert pool.pages_used == used + 3  # mid's page is still written by the step
    assert w.finish(True) == (1, 33, 6, 33)
    assert pool.pages_used == used + 3 - 1  # mid's page went at the step's end
    listed = reg.call("ListCaches", pb.ListCachesRequest(), "o").caches
    assert [(c.cache_id, c.length, c.pages, c.busy) for c in listed] == [
        ("empty", 1, 1, False), ("fork", 33, 3, False), ("full", 33, 3, False)]
    # No new tokens (a step without k/v): the caches' own rows, nothing reserved or kept.
    ids = ("empty", "fork", "full")
    w = reg.begin(_params(Op.CACHE_DECODE, ids, [0] * 3, store=True), "o")
    assert w.seq_lens == [1, 33, 33] and w.slot_pages == [] and w.new_pages is None
    assert pool.pages_used == used + 2
    assert all(r is c for r, c in zip(w.block_table, w.rows(), strict=True))
    assert w.finish(True) == (1, 33, 33) and pool.pages_used == used + 2


def test_free_gives_pages_back_last_in_first_out_counted_by_owner() -> None:
    """``free`` hands pages back so the next ``alloc`` of as many returns them in order; pages
    shared since keep a reference; the pages each owner holds are counted down, when one call
    frees one owner's pages and when it frees several owners'."""
    pool = KvPool(torch.zeros(12 * PAGE, dtype=torch.uint8), PAGE)
    keep = pool.alloc(2, "x", "a")
    pages = pool.alloc(5, "x", "b")
    pool.free(pages[:3])
    pool.share(pages[3:])  # shared since: one reference each stays
    pool.free(pages[3:])
    pool.free([])
    assert pool.alloc(3, "x", "c") == pages[:3]
    assert [pool.refs(p) for p in pages] == [1, 1, 1, 1, 1] and keep
    assert (pool.held("a"), pool.held("b"), pool.held("c")) == (2, 2, 3)
    pool.free([keep[0], pages[3], pages[0]])  # three owners in one call
    assert (pool.held("a"), pool.held("b"), pool.held("c")) == (1, 1, 2)
    assert pool.alloc(3, "x", "d") == [keep[0], pages[3], pages[0]]


def test_cached_keys_count_against_the_request_flops_limit() -> None:
    # A one-token step is cheap on the wire but reads every cached key: the limit the front
    # end checks on new tokens is applied here to the whole call.
    pool = KvPool(torch.zeros(8 * PAGE, dtype=torch.uint8), PAGE)
    per_key = 4 * 4 * 16  # 4 * heads * head_dim FLOPs per (query, key) pair
    reg = CacheRegistry(pool, ttl_seconds=0, max_request_flops=per_key * 40)
    _create(reg, ["a"])
    reg.begin(_params(Op.APPEND_KV, ("a",), [39]), "").finish(True)
    assert reg.begin(_params(Op.CACHE_DECODE, ("a",), [1], store=False), "").finish(True) == (39,)
    reg.begin(_params(Op.APPEND_KV, ("a",), [1]), "").finish(True)
    used = pool.pages_used
    with pytest.raises(RequestError) as info:  # 41 keys x 1 query: over by one pair
        reg.begin(_params(Op.CACHE_DECODE, ("a",), [1]), "")
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-request-flops" in info.value.details and "1.05e+04" in info.value.details
    # Nothing reserved, the cache not left busy: a smaller call still goes through.
    assert pool.pages_used == used
    assert reg.begin(_params(Op.CACHE_DECODE, ("a",), [0]), "").finish(True) == (40,)


def test_fork_shares_full_pages_and_release_frees_them_last() -> None:
    pool = KvPool(torch.zeros(8 * PAGE, dtype=torch.uint8), PAGE)
    reg = CacheRegistry(pool, ttl_seconds=0)
    _create(reg, ["a"])
    reg.begin(_params(Op.APPEND_KV, ("a",), [40]), "").finish(True)  # 3 pages, last partial
    info = reg.call("ForkCache", pb.ForkCacheRequest(source_id="a", target_id="f"), "")
    assert (info.length, info.pages, info.shared_pages) == (40, 3, 2)
    assert pool.pages_used == 4  # two shared, the partial one copied
    info = reg.call("ForkCache", pb.ForkCacheRequest(source_id="a", target_id="g", length=32),
                    "")
    assert (info.length, info.pages, info.shared_pages) == (32, 2, 2) and pool.pages_used == 4
    code = _registry_code(reg, "ForkCache", pb.ForkCacheRequest(source_id="a", target_id="h",
                                                                length=41))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(RequestError) as info:  # one id, not a list: named without an index
        reg.call("ForkCache", pb.ForkCacheRequest(source_id="a", target_id=""), "")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(info.value).startswith("target_id: 0 bytes"), str(info.value)
    reg.call("ReleaseCaches", pb.ReleaseCachesRequest(cache_ids=["a"]), "")
    assert pool.pages_used == 3  # a's own partial page went; the shared two stay
    reg.call("ReleaseCaches", pb.ReleaseCachesRequest(all=True), "")
    assert pool.pages_used == 0


def _registry_code(reg: CacheRegistry, method: str, req: Any, owner: str = "") -> Any:
    with pytest.raises(RequestError) as info:
        reg.call(method, req, owner)
    return info.value.code


def test_ttl_expires_idle_caches_never_busy_ones() -> None:
    now = [0.0]
    pool = KvPool(torch.zeros(8 * PAGE, dtype=torch.uint8), PAGE)
    reg = CacheRegistry(pool, ttl_seconds=10, clock=lambda: now[0])
    try:
        _create(reg, ["idle", "busy"])
        work = reg.begin(_params(Op.APPEND_KV, ("busy",), [5]), "")
        now[0] = 11.0
        assert reg.expire() == 1  # "idle" only
        assert [c.cache_id for c in reg.call("ListCaches", pb.ListCachesRequest(), "").caches] \
            == ["busy"]
        work.finish(True)  # used just now: its idle clock restarts
        now[0] = 20.0
        assert reg.expire() == 0
        now[0] = 21.5
        assert reg.expire() == 1 and pool.pages_used == 0 and reg.expired_total == 2
    finally:
        reg.close()


def test_release_while_busy_frees_pages_when_the_call_ends() -> None:
    pool = KvPool(torch.zeros(8 * PAGE, dtype=torch.uint8), PAGE)
    reg = CacheRegistry(pool, ttl_seconds=0)
    _create(reg, ["a"])
    work = reg.begin(_params(Op.APPEND_KV, ("a",), [20]), "")
    reg.call("ReleaseCaches", pb.ReleaseCachesRequest(cache_ids=["a"]), "")
    assert pool.pages_used == 2  # the running call still writes into them
    assert _registry_code(reg, "ListCaches", pb.ListCachesRequest(cache_ids=["a"])) == \
        grpc.StatusCode.NOT_FOUND
    work.finish(True)
    assert pool.pages_used == 0


def test_free_gives_pages_back_last_in_first_out() -> None:
    """An alloc of as many pages as were just freed hands back the same pages in order."""
    pool = KvPool(torch.zeros(8 * PAGE, dtype=torch.uint8), PAGE)
    a = pool.alloc(5, "x")
    pool.free(a[1:4])
    assert pool.alloc(3, "x") == a[1:4]


def test_steps_that_store_nothing_on_a_page_boundary_reuse_their_caches_spare_pages() -> None:
    """A decode step without store on caches at a page boundary starts a page per sequence:
    the first takes them from the pool and leaves them as the caches' spares, and later steps
    take those again, whatever other caches did in between (a host's two layers in flight),
    so their block tables repeat (the GPU path's staged table is not rewritten) and the pool
    hands out nothing; the caches end as they were. A failed step gives back the pages it
    took; a stored one makes the spare its cache's page; a released cache frees its spare."""
    pool = KvPool(torch.zeros(40 * PAGE, dtype=torch.uint8), PAGE)
    reg = CacheRegistry(pool, ttl_seconds=0)
    ids, other = tuple(f"b{i}" for i in range(6)), ("o0", "o1")
    _create(reg, [*ids, *other])
    reg.begin(_params(Op.APPEND_KV, ids + other, [16] * 8), "").finish(True)  # a page each
    used = pool.pages_used
    tables, bases = [], []
    for _ in range(3):
        work = reg.begin(_params(Op.CACHE_DECODE, ids, [1] * 6, store=False), "")
        assert all(len(row) == 2 for row in work.rows())  # each a second page
        assert work.slot_pages == work.new_pages and work.slot_offsets == [0] * 6
        tables.append(work.rows())
        bases.append(work.block_table)
        # Another set's step in between takes pages of its own, not these.
        w2 = reg.begin(_params(Op.CACHE_DECODE, other, [1, 1], store=False), "")
        assert not set(w2.new_pages) & set(work.new_pages)  # type: ignore[arg-type]
        assert work.finish(True) == (16,) * 6 and w2.finish(True) == (16, 16)
    assert tables[0] == tables[1] == tables[2]
    assert pool.pages_used == used + 8  # the spares: one per cache
    # The rows are the caches' own page lists (the new pages past them, ``new_pages``): the
    # same objects step after step, so nothing copies them and a staging does not rewrite them.
    assert all(x is y is z for x, y, z in zip(*bases, strict=True))
    spares = tables[0]
    # A failed step on caches of which one has no spare: the fresh page goes back, the
    # spares stay.
    _create(reg, ["new"])
    reg.begin(_params(Op.APPEND_KV, ("new",), [16]), "").finish(True)
    w = reg.begin(_params(Op.CACHE_DECODE, ("b0", "new"), [1, 1], store=False), "")
    assert w.new_pages[0] == spares[0][1] and pool.pages_used == used + 8 + 2  # type: ignore[index]
    assert w.finish(False) == (16, 16) and pool.pages_used == used + 8 + 1
    # A stored step: the spare is the cache's second page now, and the next boundary (32)
    # takes a fresh page.
    w = reg.begin(_params(Op.CACHE_DECODE, ("b0",), [1], store=True), "")
    assert w.finish(True) == (17,)
    listed = reg.call("ListCaches", pb.ListCachesRequest(cache_ids=["b0"]), "")
    assert (listed.caches[0].length, listed.caches[0].pages) == (17, 2)
    assert pool.pages_used == used + 8 + 1
    # Released: its pages and its spare go.
    reg.call("ReleaseCaches", pb.ReleaseCachesRequest(cache_ids=["b1"]), "")
    assert pool.pages_used == used + 8 + 1 - 2


def test_spare_pages_go_to_a_call_that_finds_the_pool_or_its_quota_full() -> None:
    """Spares are reserved, not owned: a call that would find the pool full, or its caller's
    quota, gets the spares of caches in no call (a quota: only its caller's) first."""
    pool = KvPool(torch.zeros(6 * PAGE, dtype=torch.uint8), PAGE, caller_pages=4)
    reg = CacheRegistry(pool, ttl_seconds=0)
    _create(reg, ["a", "b"], owner="x")
    _create(reg, ["c"], owner="y")
    reg.begin(_params(Op.APPEND_KV, ("a", "b"), [16, 16]), "x").finish(True)
    reg.begin(_params(Op.CACHE_DECODE, ("a", "b"), [1, 1], store=False), "x").finish(True)
    assert (pool.pages_used, pool.held("x")) == (4, 4)  # two pages, two spares
    # x's quota (4) is full: its own spares make room for an append that needs one more page
    # (of two tokens: one token a cache would take as a step does, into its spare).
    reg.begin(_params(Op.APPEND_KV, ("a",), [2]), "x").finish(True)
    assert (pool.pages_used, pool.held("x")) == (3, 3)
    reg.begin(_params(Op.CACHE_DECODE, ("b",), [1], store=False), "x").finish(True)
    assert pool.held("x") == 4 and pool.pages_free == 2
    # The pool (6) is full for y's three pages: x's idle spare goes.
    reg.begin(_params(Op.APPEND_KV, ("c",), [48]), "y").finish(True)
    assert (pool.held("x"), pool.held("y"), pool.pages_free) == (3, 3, 0)
    # No spare left: full is full.
    with pytest.raises(RequestError) as err:
        reg.begin(_params(Op.APPEND_KV, ("c",), [16]), "y")
    assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED


# ---- end to end ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_then_decode_steps_match_the_reference(srv: ServerHandle,
                                                      dtype: torch.dtype) -> None:
    stub = srv.stub()
    ids, model = session(stub, f"steps-{dtype}-", [0, 1, 16, 37], dtype=dtype)
    for i in range(5):  # crosses page boundaries: 16 -> 21, 37 -> 42
        r = decode_step(stub, ids, model, heads=4, seed=100 + i)
    assert r.stats.flops == 4 * sum(model.k[i].shape[0] for i in ids) * 4 * 16
    decode_step(stub, ids, model, heads=4, seed=200, new=False)  # no new token: attend only
    decode_step(stub, ids, model, heads=4, seed=300, store=False)  # attended to, then dropped
    stub.ReleaseCaches(pb.ReleaseCachesRequest(cache_ids=ids), timeout=10)


def test_steps_through_the_server_with_spares_and_memos_match_the_reference(
        srv: ServerHandle) -> None:
    """Through the server (cpu backend), caches on and off page boundaries: steps without
    store (spare pages, then the step memo), stored steps that cross pages (the stored-step
    memo between crossings), a refused step, and steps without store again, each checked
    against the reference; the pool holds the caches' pages and one spare per cache on a
    boundary, and nothing once they are released."""
    stub = srv.stub()
    pool = stub.ListCaches(pb.ListCachesRequest(pool_only=True), timeout=10).pool
    ids, model = session(stub, "memo-", [16, 32, 15, 0])
    for i in range(3):  # 16, 32 and 0 start a page: each takes its spare after the first
        decode_step(stub, ids, model, heads=4, seed=400 + i, store=False)
    used = stub.ListCaches(pb.ListCachesRequest(pool_only=True), timeout=10).pool.pages_used
    assert used == pool.pages_used + (1 + 2 + 1 + 0) + 3  # the caches' pages, three spares
    for i in range(20):  # 15 -> 35 and 0 -> 20: through page starts
        decode_step(stub, ids, model, heads=4, seed=500 + i)
    bad = rand(4, 4, 16, seed=1)  # refused: 3 query heads do not group over 2 kv heads
    with pytest.raises(grpc.RpcError) as err:
        collect(stub.CacheDecode(cache_decode_messages(
            ids, bad[:, :3], rand(4, 2, 16, seed=2), rand(4, 2, 16, seed=3)), timeout=30))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    for i in range(3):
        decode_step(stub, ids, model, heads=4, seed=600 + i, store=False)
        decode_step(stub, ids, model, heads=4, seed=700 + i)
    stub.ReleaseCaches(pb.ReleaseCachesRequest(cache_ids=ids), timeout=10)
    after = stub.ListCaches(pb.ListCachesRequest(pool_only=True), timeout=10).pool
    assert after.pages_used == pool.pages_used


def test_prefill_against_a_cached_prefix(srv: ServerHandle) -> None:
    stub = srv.stub()
    ids, model = session(stub, "pf-", [0, 19, 33], heads=8, kv_heads=2)
    q_lens, k_lens = [5, 1, 17], [5, 1, 17]  # chunked prefill: new queries = new keys
    q = rand(sum(q_lens), 8, 16, seed=7)
    k, v = rand(sum(k_lens), 2, 16, seed=8), rand(sum(k_lens), 2, 16, seed=9)
    for store in (False, True):
        r = collect(stub.CachePrefill(cache_prefill_messages(
            ids, q, k, v, q_lens, k_lens, store=store), timeout=30))
        trial = Model(2, 16, torch.float32)
        trial.k, trial.v = dict(model.k), dict(model.v)
        trial.append(ids, k, v, k_lens)
        kk, vv, cu_k = trial.packed(ids)
        cu_q = [0, 5, 6, 23]
        out, lse = prefill_oracle(q, kk, vv, cu_q, cu_k, causal=True)
        torch.testing.assert_close(r.out.double(), out, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(r.lse.double(), lse.double(), atol=1e-4, rtol=1e-4)
        want = [model.k[i].shape[0] + (n if store else 0) for i, n in zip(ids, k_lens,
                                                                           strict=True)]
        assert list(r.stats.cache_lengths) == want
    model.k, model.v = trial.k, trial.v
    decode_step(stub, ids, model, heads=8, seed=11)  # the stored chunk is there for the next step
    stub.ReleaseCaches(pb.ReleaseCachesRequest(cache_ids=ids), timeout=10)


def test_fork_then_both_diverge_correctly(srv: ServerHandle) -> None:
    stub = srv.stub()
    ids, model = session(stub, "fork-", [37])
    info = stub.ForkCache(pb.ForkCacheRequest(source_id=ids[0], target_id="fork-child",
                                              length=20), timeout=10)
    assert (info.length, info.shared_pages) == (20, 1)
    model.create(["fork-child"])
    model.k["fork-child"], model.v["fork-child"] = model.k[ids[0]][:20], model.v[ids[0]][:20]
    for i in range(3):
        decode_step(stub, [ids[0], "fork-child"], model, heads=4, seed=40 + i)
    stub.ReleaseCaches(pb.ReleaseCachesRequest(all=True), timeout=10)


def test_refusals_name_the_field_and_change_nothing(srv: ServerHandle) -> None:
    stub = srv.stub()
    ids, model = session(stub, "bad-", [3, 4])
    q, k, v = rand(2, 4, 16, seed=1), rand(2, 1, 16, seed=2), rand(2, 1, 16, seed=3)
    code, details = _code(lambda: collect(stub.CacheDecode(cache_decode_messages(ids, q, k, v),
                                                           timeout=10)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("header.k.shape[1]")
    q64 = rand(2, 4, 16, seed=1, dtype=torch.float16)
    k2, v2 = rand(2, 2, 16, seed=2, dtype=torch.float16), rand(2, 2, 16, seed=3,
                                                                 dtype=torch.float16)
    code, details = _code(lambda: collect(stub.CacheDecode(
        cache_decode_messages(ids, q64, k2, v2), timeout=10)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("header.q.dtype")
    q, k, v = rand(2, 4, 16, seed=1), rand(2, 2, 16, seed=2), rand(2, 2, 16, seed=3)
    code, details = _code(lambda: collect(stub.CacheDecode(
        cache_decode_messages([ids[0], "nope"], q, k, v), timeout=10)))
    assert code == grpc.StatusCode.NOT_FOUND and details.startswith("header.cache.cache_ids[1]")
    code, details = _code(lambda: collect(stub.CacheDecode(
        cache_decode_messages([ids[0], ids[0]], q, k, v), timeout=10)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "appears twice" in details
    code, details = _code(lambda: collect(stub.CacheDecode(
        cache_decode_messages(ids[:1], q, k, v), timeout=10)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(
        "header.cache.cache_ids")
    code, _ = _code(lambda: stub.CreateCaches(pb.CreateCachesRequest(
        cache_ids=[ids[1]], layout=layout(torch.float32, 2, 16)), timeout=10))
    assert code == grpc.StatusCode.ALREADY_EXISTS
    code, details = _code(lambda: stub.CreateCaches(pb.CreateCachesRequest(
        cache_ids=["x"], layout=layout(torch.float32, 2, 264)), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("layout.head_dim")
    # A stateless Prefill must not name caches; AppendKV takes no queries.
    req = list(cache_prefill_messages(ids, q, k, v, [1, 1], [1, 1]))
    code, details = _code(lambda: collect(stub.Prefill(iter(req), timeout=10)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("header.cache")
    code, details = _code(lambda: collect(stub.AppendKV(iter(req), timeout=10)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("header.q")
    listed = stub.ListCaches(pb.ListCachesRequest(cache_ids=ids), timeout=10)
    assert [c.length for c in listed.caches] == [3, 4]  # nothing changed
    decode_step(stub, ids, model, heads=4, seed=5)
    stub.ReleaseCaches(pb.ReleaseCachesRequest(cache_ids=ids), timeout=10)
    code, details = _code(lambda: stub.ReleaseCaches(
        pb.ReleaseCachesRequest(cache_ids=ids), timeout=10))
    assert code == grpc.StatusCode.NOT_FOUND and details.startswith("cache_ids[0]")


def test_200k_caches_list_through_pages_with_the_ids_created(start_server: Any) -> None:
    # One reply of 100k caches passed gRPC's 4 MiB and failed (issue 63): every page is
    # bounded now, and the client follows the pages.
    from attention_client import AttentionClient

    srv = start_server(kv_cache_bytes=64 * PAGE, kv_page_bytes=PAGE)
    stub = srv.stub()
    ids = [f"seq-{(i * 7919) % 200_000:06d}" for i in range(200_000)]  # not in id order
    for at in range(0, len(ids), 50_000):
        stub.CreateCaches(pb.CreateCachesRequest(cache_ids=ids[at : at + 50_000],
                                                 layout=layout(torch.float32, 2, 16)),
                          timeout=60)
    first = stub.ListCaches(pb.ListCachesRequest(), timeout=10)
    assert len(first.caches) == 1000 and first.next_page_token  # the default page
    assert first.pool.caller_caches == 200_000
    with AttentionClient(srv.target) as client:
        assert [c["cache_id"] for c in client.list_caches()] == sorted(ids)
        pool = client.kv_pool_info()
    assert pool["caller_caches"] == 200_000 and pool["caches_live"] == 200_000
    only = stub.ListCaches(pb.ListCachesRequest(pool_only=True), timeout=10)
    assert not only.caches and not only.next_page_token and only.pool.caller_caches == 200_000


def test_a_page_ends_before_2_mib_and_tokens_are_checked(start_server: Any) -> None:
    srv = start_server(kv_cache_bytes=64 * PAGE, kv_page_bytes=PAGE)
    stub = srv.stub()
    ids = [f"{i:05d}" + "x" * 251 for i in range(10_000)]  # 256-byte ids
    stub.CreateCaches(pb.CreateCachesRequest(cache_ids=ids, layout=layout(torch.float32, 2, 16)),
                      timeout=60)
    seen: list[str] = []
    request = pb.ListCachesRequest(page_size=10_000)
    while True:
        page = stub.ListCaches(request, timeout=10)
        assert page.ByteSize() <= (2 << 20) + 256 and page.caches
        seen += [c.cache_id for c in page.caches]
        if not page.next_page_token:
            break
        request.page_token = page.next_page_token
    assert seen == ids and len(seen) > len(page.caches)  # more than one page, none twice
    # Named ids page in their order.
    named = ids[::-1][:7]
    request = pb.ListCachesRequest(cache_ids=named, page_size=3)
    got: list[str] = []
    for _ in range(3):
        page = stub.ListCaches(request, timeout=10)
        got += [c.cache_id for c in page.caches]
        request.page_token = page.next_page_token
    assert got == named and not request.page_token
    for bad in ("i0", "i7", "x", "a", "ifoo"):
        code, details = _code(lambda bad=bad: stub.ListCaches(
            pb.ListCachesRequest(cache_ids=named, page_token=bad), timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("page_token: ")
    code, details = _code(lambda: stub.ListCaches(pb.ListCachesRequest(page_token="i3"),
                                                  timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("page_token: ")


def test_full_pool_answers_exhausted_and_loses_nothing(start_server: Any) -> None:
    srv = start_server(kv_cache_bytes=4 * PAGE, kv_page_bytes=PAGE)
    stub = srv.stub()
    ids, model = session(stub, "full-", [30, 10])  # 3 of 4 pages
    k, v = rand(20, 2, 16, seed=1), rand(20, 2, 16, seed=2)
    code, details = _code(lambda: collect(stub.AppendKV(append_messages(ids, k, v, [10, 10]),
                                                        timeout=10)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "pool is full" in details
    pool = stub.ListCaches(pb.ListCachesRequest(), timeout=10).pool
    assert (pool.pages_used, pool.pages_total) == (3, 4)
    decode_step(stub, ids, model, heads=4, seed=3)  # both fit their last pages: still correct
    m = srv.scrape() if srv.server.metrics_port else None
    assert m is None or sample(m, "attention_kv_caches", "attention_kv_caches") == 2


def test_caches_belong_to_their_token(start_server: Any) -> None:
    srv = start_server(auth_token="alice,bob", kv_cache_bytes=16 * PAGE, kv_page_bytes=PAGE)
    alice, bob = [(("authorization", f"Bearer {t}"),) for t in ("alice", "bob")]
    stub = srv.stub()
    ids, model = session(stub, "mine-", [5], metadata=alice)
    q, k, v = rand(1, 4, 16, seed=1), rand(1, 2, 16, seed=2), rand(1, 2, 16, seed=3)
    code, _ = _code(lambda: collect(stub.CacheDecode(cache_decode_messages(ids, q, k, v),
                                                     timeout=10, metadata=bob)))
    assert code == grpc.StatusCode.NOT_FOUND
    assert not stub.ListCaches(pb.ListCachesRequest(), timeout=10, metadata=bob).caches
    code, _ = _code(lambda: stub.ReleaseCaches(pb.ReleaseCachesRequest(cache_ids=ids),
                                               timeout=10, metadata=bob))
    assert code == grpc.StatusCode.NOT_FOUND
    # Bob may use the same id for his own cache: a separate one.
    stub.CreateCaches(pb.CreateCachesRequest(cache_ids=ids, layout=layout(torch.float32, 2, 16)),
                      timeout=10, metadata=bob)
    decode_step(stub, ids, model, heads=4, seed=4, metadata=alice)
    assert stub.ListCaches(pb.ListCachesRequest(), timeout=10, metadata=bob).caches[0].length == 0


def test_a_caller_past_its_quota_is_refused_and_others_are_not(start_server: Any) -> None:
    srv = start_server(auth_token="alice,bob", kv_cache_bytes=16 * PAGE, kv_page_bytes=PAGE,
                       kv_cache_bytes_per_caller=3 * PAGE)
    alice, bob = [(("authorization", f"Bearer {t}"),) for t in ("alice", "bob")]
    stub = srv.stub()
    ids, model = session(stub, "q-", [30, 10], metadata=alice)  # 2 + 1 pages: the quota
    k, v = rand(3, 2, 16, seed=1), rand(3, 2, 16, seed=2)
    code, details = _code(lambda: collect(stub.AppendKV(
        append_messages(ids[:1], k, v, [3]), timeout=10, metadata=alice)))  # a 4th page
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details.startswith("header.k: this caller's KV-cache quota is full")
    pool = stub.ListCaches(pb.ListCachesRequest(), timeout=10, metadata=alice).pool
    assert (pool.caller_pages_used, pool.caller_pages_limit, pool.pages_used) == (3, 3, 3)
    # A fork that needs a copied page is refused too; nothing of alice's changed.
    code, _ = _code(lambda: stub.ForkCache(pb.ForkCacheRequest(
        source_id=ids[0], target_id="f", length=20), timeout=10, metadata=alice))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    decode_step(stub, ids, model, heads=4, seed=3, metadata=alice)  # fits its pages: correct
    # Bob's quota is his own, and the pool has room: he gets his three pages.
    session(stub, "q-", [48], metadata=bob)
    got = stub.ListCaches(pb.ListCachesRequest(), timeout=10, metadata=bob).pool
    assert (got.caller_pages_used, got.pages_used) == (3, 6)
    # Releasing gives alice's quota back.
    stub.ReleaseCaches(pb.ReleaseCachesRequest(cache_ids=ids[1:]), timeout=10, metadata=alice)
    collect(stub.AppendKV(append_messages(ids[:1], k, v, [3]), timeout=10, metadata=alice))
    got = stub.ListCaches(pb.ListCachesRequest(), timeout=10, metadata=alice).pool
    assert got.caller_pages_used == 3 and got.caches_live == 2


def test_caches_off_answer_failed_precondition(start_server: Any) -> None:
    srv = start_server(kv_cache_bytes=0)
    stub = srv.stub()
    assert stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).kv_cache_bytes == 0
    code, details = _code(lambda: stub.CreateCaches(pb.CreateCachesRequest(
        cache_ids=["a"], layout=layout(torch.float32, 2, 16)), timeout=10))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "--kv-cache-bytes" in details


def test_idle_caches_expire_after_the_ttl(start_server: Any) -> None:
    srv = start_server(kv_cache_bytes=16 * PAGE, kv_page_bytes=PAGE, kv_cache_ttl=0.5,
                       metrics_port=0)
    stub = srv.stub()
    ids, _ = session(stub, "ttl-", [3])
    assert wait_until(lambda: not stub.ListCaches(pb.ListCachesRequest(), timeout=10).caches,
                      timeout=10)
    code, _ = _code(lambda: stub.ListCaches(pb.ListCachesRequest(cache_ids=ids), timeout=10))
    assert code == grpc.StatusCode.NOT_FOUND
    m = srv.scrape()
    assert sample(m, "attention_kv_caches_expired", "attention_kv_caches_expired_total") == 1
    assert sample(m, "attention_kv_pool_used_bytes", "attention_kv_pool_used_bytes") == 0


def test_a_second_call_on_a_busy_cache_is_aborted(start_server: Any) -> None:
    gate = GatedBackend()
    gate.release.set()  # warm up, then close the gate
    srv = start_server(backend=gate, kv_cache_bytes=16 * PAGE, kv_page_bytes=PAGE)
    gate.release.clear()
    stub = srv.stub()
    stub.CreateCaches(pb.CreateCachesRequest(cache_ids=["a"], layout=layout(torch.float32, 2,
                                                                            16)), timeout=10)
    k, v = rand(4, 2, 16, seed=1), rand(4, 2, 16, seed=2)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(lambda: collect(stub.AppendKV(append_messages(["a"], k, v, [4]),
                                                          timeout=30)))
        assert gate.entered.wait(10)
        code, details = _code(lambda: collect(stub.AppendKV(append_messages(["a"], k, v, [4]),
                                                            timeout=10)))
        assert code == grpc.StatusCode.ABORTED and "in use" in details
        gate.release.set()
        assert list(first.result(30).stats.cache_lengths) == [4]


def test_a_step_whose_caller_left_during_its_launch_stores_nothing(start_server: Any) -> None:
    """A step cut off by its deadline while its launch runs (the launch cannot stop: a GPU
    kernel already queued) leaves the cache as it was: the client heard DEADLINE_EXCEEDED, so
    storing its token would put it in twice when the client retries."""
    gate = GatedBackend(heed_cancel=False)
    gate.release.set()  # warm up, then close the gate
    srv = start_server(backend=gate, kv_cache_bytes=16 * PAGE, kv_page_bytes=PAGE)
    stub = srv.stub()
    ids, _ = session(stub, "gone-", [4])
    gate.release.clear()
    q, k, v = rand(1, 4, 16, seed=3), rand(1, 2, 16, seed=4), rand(1, 2, 16, seed=5)
    code, _ = _code(lambda: collect(stub.CacheDecode(cache_decode_messages(ids, q, k, v),
                                                     timeout=0.5)))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert gate.saw_cancel.wait(10), "the engine never heard that the caller left"
    gate.release.set()  # the launch now runs to its end

    def appended() -> bool:  # once the cut-off step has ended, the cache takes a new call
        try:
            collect(stub.AppendKV(append_messages(ids, k, v, [1]), timeout=10))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.ABORTED, exc
            return False
        return True

    assert wait_until(appended, timeout=10)
    listed = stub.ListCaches(pb.ListCachesRequest(cache_ids=ids), timeout=10)
    assert [c.length for c in listed.caches] == [5]  # 4 + the append; not the step's token


def test_concurrent_steps_on_many_caches_equal_solo_calls_bitwise(start_server: Any) -> None:
    solo_srv = start_server(kv_cache_bytes=64 * PAGE, kv_page_bytes=PAGE, batching=False)
    batch_srv = start_server(kv_cache_bytes=64 * PAGE, kv_page_bytes=PAGE, batching=True,
                             max_queue_delay_ms=30.0)
    lens = [3, 17, 0, 40, 9, 16, 1, 25]
    outs: dict[str, list[torch.Tensor]] = {}
    merged = []
    for name, srv in (("solo", solo_srv), ("batch", batch_srv)):
        stub = srv.stub()
        ids, _ = session(stub, "c", lens)
        barrier = threading.Barrier(len(ids))

        def steps(i: int, stub: Any = stub, ids: list[str] = ids,
                  barrier: threading.Barrier = barrier) -> list[Any]:
            got = []
            for s in range(3):
                q = rand(1, 4, 16, seed=1000 * i + s)
                k, v = rand(1, 2, 16, seed=1000 * i + s + 1), rand(1, 2, 16,
                                                                     seed=1000 * i + s + 2)
                barrier.wait(10)
                got.append(collect(stub.CacheDecode(cache_decode_messages([ids[i]], q, k, v),
                                                    timeout=30)))
            return got

        with ThreadPoolExecutor(len(ids)) as pool:
            results = list(pool.map(steps, range(len(ids))))
        outs[name] = [r.out for rs in results for r in rs]
        if name == "batch":
            merged = [r.stats.batch_requests for rs in results for r in rs]
    assert max(merged) > 1, "no step was merged with another: the test proves nothing"
    for a, b in zip(outs["solo"], outs["batch"], strict=True):
        assert torch.equal(a, b)


def test_warmup_is_outside_the_quota_and_leaks_no_page_when_skipped() -> None:
    """Warm-up runs its two caches under a server owner, which a one-page quota does not
    hold; a pool too small for them skips warm-up and leaves every page free (the merged
    group's first cache used to stay busy, and its page taken, when the second was refused)."""
    from attention_service.engine.backends import CpuBackend
    from attention_service.engine.warmup import warm_caches

    launched = []

    class Recording(CpuBackend):
        def launch(self, plan):  # type: ignore[no-untyped-def]
            launched.append(plan.key)
            return super().launch(plan)

    caps = CacheRegistry(KvPool(torch.zeros(8 * PAGE, dtype=torch.uint8), PAGE,
                                caller_pages=1), ttl_seconds=0)
    warm_caches(Recording(), caps, (torch.float32,))
    assert len(launched) == 6 and caps.gauges()[:3] == (0, 8, 0)
    launched.clear()
    tiny = CacheRegistry(KvPool(torch.zeros(1 * PAGE, dtype=torch.uint8), PAGE),
                         ttl_seconds=0)
    warm_caches(Recording(), tiny, (torch.float32,))
    assert len(launched) == 1  # AppendKV alone; the pair is refused a second page
    assert tiny.gauges()[:3] == (0, 1, 0)


def test_resolved_id_lists_are_kept_only_for_accepted_calls_and_never_go_stale(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's id list is resolved once and kept (a step stream names the same caches every
    step), but only once a call naming it is accepted, only up to the memo's bounds, and it is
    forgotten when any cache goes: a cache released and made again under its id is the new
    one, and a busy cache refuses the call as before."""
    from attention_service.engine import kv_caches

    pool = KvPool(torch.zeros(16 * PAGE, dtype=torch.uint8), PAGE)
    reg = CacheRegistry(pool, ttl_seconds=0)
    _create(reg, ["a", "b"])
    step = _params(Op.CACHE_DECODE, ("a", "b"), [1, 1], store=True)
    w = reg.begin(step, "")
    assert list(reg._resolved) == [("", ("a", "b"))]
    with pytest.raises(RequestError) as info:  # busy: refused, nothing more kept
        reg.begin(_params(Op.CACHE_DECODE, ("b", "a"), [1, 1]), "")
    assert info.value.code == grpc.StatusCode.ABORTED
    assert "cache_ids[0]" in info.value.details and len(reg._resolved) == 1
    assert w.finish(True) == (1, 1)
    reg.call("ReleaseCaches", pb.ReleaseCachesRequest(cache_ids=["a"]), "")
    assert not reg._resolved
    _create(reg, ["a"])  # a new cache under the old id: length 0, not the released one's 1
    w = reg.begin(step, "")
    assert w.seq_lens == [1, 2] and w.finish(True) == (1, 2)
    monkeypatch.setattr(kv_caches, "_MAX_KEPT_LIST", 1)  # longer lists: resolved, not kept
    reg._resolved.clear()
    reg.begin(step, "").finish(True)
    assert not reg._resolved


def test_a_step_on_a_full_pool_never_takes_back_the_spares_it_uses() -> None:
    """A step whose caches hold spares, on a full pool: the pages it still needs come from
    other caches' spares, never from its own (which it uses), and with none left it is
    refused with nothing changed; no page ends up in two caches or free while used."""
    pool = KvPool(torch.zeros(5 * PAGE, dtype=torch.uint8), PAGE)
    reg = CacheRegistry(pool, ttl_seconds=0)
    _create(reg, ["c", "a", "b"])
    reg.begin(_params(Op.APPEND_KV, ("c", "a", "b"), [16, 16, 16]), "").finish(True)
    for one in ("c", "a"):  # c's and a's spares: the pool is full
        reg.begin(_params(Op.CACHE_DECODE, (one,), [1], store=False), "").finish(True)
    assert pool.pages_free == 0
    spare_a = reg.begin(_params(Op.CACHE_DECODE, ("a",), [1], store=False), "")
    a_page = spare_a.new_pages[0]  # type: ignore[index]
    spare_a.finish(True)
    w = reg.begin(_params(Op.CACHE_DECODE, ("a", "b"), [1, 1], store=True), "")
    assert w.new_pages[0] == a_page and w.new_pages[1] != a_page  # type: ignore[index]
    assert all(pool.refs(p) == 1 for p in w.new_pages)  # type: ignore[union-attr]
    assert w.finish(True) == (17, 17)
    a_pages = reg.begin(_params(Op.CACHE_DECODE, ("a",), [0], store=False), "")
    b_pages = reg.begin(_params(Op.CACHE_DECODE, ("b",), [0], store=False), "")
    assert not set(a_pages.block_table[0]) & set(b_pages.block_table[0])
    a_pages.finish(True)
    b_pages.finish(True)
    # No spare left to take: a step that needs a page is refused and changes nothing.
    _create(reg, ["d"])
    with pytest.raises(RequestError) as err:
        reg.begin(_params(Op.APPEND_KV, ("d",), [1]), "")
    assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and pool.pages_free == 0
    # Both caches release cleanly: every page was referenced once.
    reg.call("ReleaseCaches", pb.ReleaseCachesRequest(cache_ids=["a", "b", "c"]), "")
    assert pool.pages_used == 0


class _Forgetful(dict):  # type: ignore[type-arg]
    """A memo store that keeps nothing: the registry works every step out again."""

    def __setitem__(self, key: object, value: object) -> None:
        pass


def test_a_step_memo_answers_exactly_as_working_the_step_out_again() -> None:
    """Random calls (steps with and without store, failed steps, appends, a fork, a release,
    a second id list over some of the same caches, a full pool that takes spares back) on two
    registries, one of which keeps no step memo: every call's work and end are the same."""
    rng = random.Random(7)
    regs = []
    for memo in (True, False):
        pool = KvPool(torch.zeros(70 * PAGE, dtype=torch.uint8), PAGE)
        reg = CacheRegistry(pool, ttl_seconds=0)
        if not memo:
            reg._memos = _Forgetful()
        _create(reg, [f"s{i}" for i in range(6)])
        regs.append(reg)
    lists = [tuple(f"s{i}" for i in range(6)), ("s1", "s3", "s4")]
    params: dict[tuple[object, ...], Any] = {}  # one Params object per call form, as a host's

    def form(op: Op, ids: tuple[str, ...], new: list[int], store: bool) -> Any:
        key = (op, ids, tuple(new), store)
        if key not in params:
            params[key] = _params(op, ids, new, store=store)
        return params[key]

    def both(call: Any) -> list[Any]:
        out = []
        for reg in regs:
            try:
                out.append(call(reg))
            except RequestError as exc:
                out.append((exc.code, exc.details))
        assert out[0] == out[1]
        return out

    def check_pages(reg: CacheRegistry) -> None:
        """Every page is free with no reference, or held exactly as often as caches name it
        (in their pages or as their spare), by one owner, counted once per owner."""
        pool = reg.pool
        assert pool is not None
        named: collections.Counter[int] = collections.Counter()
        owners: dict[int, str] = {}
        for c in reg._caches.values():
            for page in [*c.pages, *([c.spare] if c.spare >= 0 else [])]:
                named[page] += 1
                assert owners.setdefault(page, c.owner) == c.owner
        free = set(pool._free)
        assert len(free) == len(pool._free) and not free & set(named)
        assert all(pool.refs(p) == named[p] for p in range(pool.pages_total))
        assert pool._held == dict(collections.Counter(owners.values()))

    def fields(w: Any) -> tuple[object, ...]:
        return (w.seq_lens, w.rows(), w.slot_pages, w.slot_offsets, w.new_pages, w.width,
                w.keys, w.flops, w.kv_bytes)

    both(lambda r: r.begin(form(Op.APPEND_KV, lists[0], [16, 16, 16, 32, 32, 0], True),
                           "").finish(True))
    both(lambda r: _create(r, ["fill"], owner="f"))
    hits, filled = 0, False
    for step in range(300):
        ids = lists[rng.random() < 0.3]
        kind = rng.random()
        if kind < 0.08:  # an append of a few tokens to each: lengths move off the boundary
            n = [rng.choice([1, 15, 16, 16, 32]) for _ in ids]  # often back on a boundary
            both(lambda r, ids=ids, n=n: r.begin(form(Op.APPEND_KV, ids, n, True),
                                                 "").finish(True))
            continue
        if kind < 0.16 and not filled:  # another caller fills the pool (spares go first)
            free = regs[0].pool.pages_free  # type: ignore[union-attr]
            both(lambda r, free=free: r.begin(form(Op.APPEND_KV, ("fill",), [16 * free], True),
                                              "f").finish(True) if free else None)
            filled = True
            continue
        if kind < 0.2 and filled:  # and lets go
            both(lambda r: r.call("ReleaseCaches", pb.ReleaseCachesRequest(all=True),
                                  "f").released)
            both(lambda r: r.call("CreateCaches", pb.CreateCachesRequest(
                cache_ids=["fill"], layout=pb.CacheLayout(
                    dtype=pb.FLOAT32, num_kv_heads=2, head_dim=16)), "f").created)
            filled = False
            continue
        if kind < 0.1 and step > 100:  # a release, a fork, a new cache in its place
            both(lambda r: r.call("ReleaseCaches", pb.ReleaseCachesRequest(cache_ids=["s3"]),
                                  "").released)
            both(lambda r: r.call("ForkCache", pb.ForkCacheRequest(
                source_id="s4", target_id="s3"), "").length)
            continue
        store, ok = rng.random() < 0.35, rng.random() < 0.9
        p = form(Op.CACHE_DECODE, ids, [1] * len(ids), store)
        hits += regs[0]._memos.get(("", ids)) is not None and not store
        works: list[Any] = []
        for reg in regs:  # a full pool refuses both alike
            try:
                works.append(reg.begin(p, ""))
            except RequestError as exc:
                works.append((exc.code, exc.details))
        if isinstance(works[0], tuple) or isinstance(works[1], tuple):
            assert works[0] == works[1]
            continue
        assert fields(works[0]) == fields(works[1])
        assert works[0].finish(ok) == works[1].finish(ok)
        assert regs[0].pool.pages_used == regs[1].pool.pages_used  # type: ignore[union-attr]
        check_pages(regs[0])
        if rng.random() < 0.02:  # a full pool: an append that takes the spares back
            both(lambda r: r.begin(form(Op.APPEND_KV, ("s0",), [200], False), "").finish(True))
    assert hits > 50  # the memo was used


@pytest.mark.parametrize("between", [
    [(Op.APPEND_KV, ("a",), [3], True)],  # every cache one version up, three tokens longer
    [(Op.CACHE_DECODE, ("a", "b"), [0, 0], True)],  # one version up, no token longer
    [(Op.APPEND_KV, ("a", "b"), [0, 2], True)],
])
def test_a_stored_step_follows_its_memo_only_after_that_step_stored(
        between: list[tuple[Op, tuple[str, ...], list[int], bool]]) -> None:
    """A stored step that failed leaves a memo whose tokens were never kept: a later change
    that moves each cache's version by one, whatever it did, must not make the next step
    follow from it (a review found the next step then wrote over a stored token)."""
    regs = []
    for memo in (True, False):
        reg = CacheRegistry(KvPool(torch.zeros(16 * PAGE, dtype=torch.uint8), PAGE),
                            ttl_seconds=0)
        if not memo:
            reg._memos = _Forgetful()
        _create(reg, ["a", "b"])
        reg.begin(_params(Op.APPEND_KV, ("a", "b"), [5, 5]), "").finish(True)
        regs.append(reg)
    step = _params(Op.CACHE_DECODE, ("a", "b"), [1, 1], store=True)  # one form, as a host's
    for ok in (True, False):  # a memo that stored, then one whose step failed
        assert [r.begin(step, "").finish(ok) for r in regs] == [(6, 6), (6, 6)]
    for op, ids, new, store in between:
        for r in regs:
            r.begin(_params(op, ids, new, store=store), "").finish(True)
    works = [r.begin(step, "") for r in regs]
    assert (works[0].seq_lens, works[0].slot_offsets) == (works[1].seq_lens,
                                                          works[1].slot_offsets)
    assert works[0].finish(True) == works[1].finish(True)
