"""Server-side KV caches through the clients (cpu backend), checked against the float64
reference on the whole concatenated context."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from attention_client import AsyncAttentionClient, AttentionClient, AttentionError, ProtocolError
from attention_client._decode import prepare_cache_decode
from attention_client._layouts import CacheTarget, KvLayout
from attention_client._prefill import prepare_append_kv, prepare_cache_prefill
from attention_wire.pb import attention_pb2 as pb

from ._server import require_server, start_server
from .test_client_e2e import check_lse, check_out, f64, make

torch = pytest.importorskip("torch")
reference = pytest.importorskip("attention_kernels.reference")

H, HKV, D = 8, 2, 64  # GQA: 4 query heads per kv head


def cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)


class Context:
    """What the caches should hold, in float64 (the inputs' exact values)."""

    def __init__(self, ids: list[str]) -> None:
        self.k = {i: torch.zeros(0, HKV, D, dtype=torch.float64) for i in ids}
        self.v = {i: torch.zeros(0, HKV, D, dtype=torch.float64) for i in ids}

    def add(self, ids: list[str], k, v, lengths: list[int]) -> None:
        starts = np.cumsum([0, *lengths])
        for i, cid in enumerate(ids):
            rows = slice(int(starts[i]), int(starts[i + 1]))
            self.k[cid] = torch.cat([self.k[cid], f64(k)[rows]])
            self.v[cid] = torch.cat([self.v[cid], f64(v)[rows]])

    def packed(self, ids: list[str], k_new=None, v_new=None, per_seq: int = 0):
        """Packed k, v and cu_seqlens of ``ids``' contexts, each followed by its new rows."""
        ks, vs, lengths = [], [], []
        for i, cid in enumerate(ids):
            ks.append(self.k[cid])
            vs.append(self.v[cid])
            if k_new is not None:
                ks.append(f64(k_new)[i * per_seq : (i + 1) * per_seq])
                vs.append(f64(v_new)[i * per_seq : (i + 1) * per_seq])
            lengths.append(len(self.k[cid]) + (per_seq if k_new is not None else 0))
        return torch.cat(ks), torch.cat(vs), cu(lengths)

    def lengths(self, ids: list[str]) -> list[int]:
        return [len(self.k[i]) for i in ids]


@pytest.fixture(scope="module", params=[True, False], ids=["unary", "stream"])
def client(server, request):
    """Both ways a call travels: the unary twin rpcs (small calls, the default) and streams."""
    with AttentionClient(server.target, timeout=60, unary=request.param) as c:
        yield c


@pytest.fixture(autouse=True)
def _no_leftover_caches(client):
    yield
    client.release_caches(all=True)


@pytest.mark.parametrize(("kind", "dtype"), [("numpy", "float16"), ("torch", "bfloat16")])
def test_append_then_decode_loop(client, kind, dtype):
    ids = ["loop-a", "loop-b", "loop-c"]
    prompt = [0, 37, 16]  # an empty cache, a length off the 16 grid, one on it
    ctx = Context(ids)
    with client.kv_cache(HKV, D, dtype) as cache:
        k = make(kind, dtype, sum(prompt), HKV, D, seed=1)
        v = make(kind, dtype, sum(prompt), HKV, D, seed=2)
        assert cache.append(ids, k, v, cu(prompt)) == prompt
        ctx.add(ids, k, v, prompt)
        assert [c["length"] for c in cache.info()] == prompt
        for step in range(4):
            q = make(kind, dtype, 3, H, D, seed=10 + step)
            k_new = make(kind, dtype, 3, HKV, D, seed=20 + step)
            v_new = make(kind, dtype, 3, HKV, D, seed=30 + step)
            out, lse = cache.decode(q, ids, k_new, v_new, return_lse=True, num_splits=step)
            ctx.add(ids, k_new, v_new, [1, 1, 1])
            ref, ref_lse = reference.decode_ref(f64(q), *ctx.packed(ids), return_lse=True)
            check_out(out, ref, dtype, q)  # numpy in -> numpy out, torch in -> torch out
            check_lse(lse, ref_lse)
            assert out.shape == (3, H, D) and lse.shape == (3, H)
            assert cache.lengths == dict(zip(ids, ctx.lengths(ids), strict=True))
        assert [c["length"] for c in cache.info()] == ctx.lengths(ids)
        assert client.last_stats["cache_lengths"] == ctx.lengths(ids)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_prefill_against_cached_prefix(client, kind):
    ids, prefix, new = ["pre-a", "pre-b"], [21, 0], [5, 9]
    ctx = Context(ids)
    with client.kv_cache(HKV, D, "float32") as cache:
        k = make(kind, "float32", sum(prefix), HKV, D, seed=3)
        assert cache.append(ids, k, k, cu(prefix)) == prefix
        ctx.add(ids, k, k, prefix)
        q = make(kind, "float32", sum(new), H, D, seed=4)
        k_new = make(kind, "float32", sum(new), HKV, D, seed=5)
        v_new = make(kind, "float32", sum(new), HKV, D, seed=6)
        out, lse = cache.prefill(q, ids, k_new, v_new, cu(new), causal=True, return_lse=True)
        # The reference: each sequence's cached tokens then its new ones, bottom-right causal.
        full_k = torch.cat([ctx.k["pre-a"], f64(k_new)[:5], ctx.k["pre-b"], f64(k_new)[5:]])
        full_v = torch.cat([ctx.v["pre-a"], f64(v_new)[:5], ctx.v["pre-b"], f64(v_new)[5:]])
        ref, ref_lse = reference.prefill_ref(
            f64(q), full_k, full_v, cu(new), cu([21 + 5, 9]), causal=True, return_lse=True
        )
        check_out(out, ref, "float32", q)
        check_lse(lse, ref_lse)
        assert cache.lengths == {"pre-a": 26, "pre-b": 9}  # store=True kept the new tokens

        # store=False: attended to, then dropped; a 3-D q is one sequence (one id).
        q1 = make(kind, "float32", 3, H, D, seed=7)
        kv1 = make(kind, "float32", 2, HKV, D, seed=8)
        out = cache.prefill(q1, "pre-b", kv1, kv1, causal=False, store=False)
        ref = reference.prefill_ref(
            f64(q1), torch.cat([full_k[26:], f64(kv1)]), torch.cat([full_v[26:], f64(kv1)]),
            cu([3]), cu([11]),
        )
        check_out(out, ref, "float32", q1)
        assert [c["length"] for c in cache.info()] == [26, 9]

        # No new tokens (k, v None): queries against the cache alone.
        out = cache.prefill(q1, "pre-a", None, None)
        ref = reference.prefill_ref(f64(q1), full_k[:26], full_v[:26], cu([3]), cu([26]),
                                    causal=True)
        check_out(out, ref, "float32", q1)
        assert cache.info("pre-a")[0]["length"] == 26


def test_decode_store_false_and_no_new_tokens(client):
    ids = ["st-a", "st-b"]
    ctx = Context(ids)
    with client.kv_cache(HKV, D, np.float16) as cache:
        k = make("numpy", "float16", 30, HKV, D, seed=40)
        cache.append(ids, k, k, [0, 13, 30])
        ctx.add(ids, k, k, [13, 17])
        q = make("numpy", "float16", 2, H, D, seed=41)
        kn = make("numpy", "float16", 2, HKV, D, seed=42)
        out = cache.decode(q, ids, kn, kn, store=False)
        ref = reference.decode_ref(f64(q), *ctx.packed(ids, kn, kn, per_seq=1))
        check_out(out, ref, "float16", q)
        assert [c["length"] for c in cache.info()] == [13, 17]  # unchanged
        out = cache.decode(q, ids)  # no new tokens
        check_out(out, reference.decode_ref(f64(q), *ctx.packed(ids)), "float16", q)
        assert cache.lengths == {"st-a": 13, "st-b": 17}


def test_fork_then_diverge(client):
    ctx = Context(["src", "fork-all", "fork-20"])
    with client.kv_cache(HKV, D, "float16") as cache:
        # Past one page, whatever the server's page size (float16 keys and values).
        n = client.info()["kv_page_bytes"] // (2 * HKV * D * 2) + 22
        k = make("torch", "float16", n, HKV, D, seed=50)
        v = make("torch", "float16", n, HKV, D, seed=51)
        assert cache.append("src", k, v) == [n]
        info = cache.fork("src", "fork-all")
        assert info["cache_id"] == "fork-all" and info["length"] == n
        assert info["shared_pages"] >= 1
        assert cache.fork("src", "fork-20", length=20)["length"] == 20
        assert set(cache.ids) == {"src", "fork-all", "fork-20"}
        ctx.add(["src", "fork-all"], torch.cat([k, k]), torch.cat([v, v]), [n, n])
        ctx.add(["fork-20"], k[:20], v[:20], [20])
        ids = ["src", "fork-all", "fork-20"]
        for step in range(2):  # each fork gets different new tokens
            q = make("torch", "float16", 3, H, D, seed=52 + step)
            kn = make("torch", "float16", 3, HKV, D, seed=54 + step)
            vn = make("torch", "float16", 3, HKV, D, seed=56 + step)
            out = cache.decode(q, ids, kn, vn)
            ctx.add(ids, kn, vn, [1, 1, 1])
            check_out(out, reference.decode_ref(f64(q), *ctx.packed(ids)), "float16", q)
        assert cache.lengths == {"src": n + 2, "fork-all": n + 2, "fork-20": 22}
        assert cache.release() == 3
    assert client.list_caches() == []


def test_release_then_not_found(client):
    cache = client.kv_cache(HKV, D, "float32")
    k = make("numpy", "float32", 4, HKV, D, seed=60)
    cache.append(["rel-a", "rel-b"], np.concatenate([k, k]), np.concatenate([k, k]), [0, 4, 8])
    assert cache.release("rel-a") == 1 and cache.ids == ["rel-b"]
    q = make("numpy", "float32", 1, H, D, seed=61)
    with pytest.raises(AttentionError) as exc:
        cache.decode(q, "rel-a", k[:1], k[:1])  # released: not created again
    assert exc.value.code == grpc.StatusCode.NOT_FOUND and exc.value.method == "CacheDecode"
    with pytest.raises(AttentionError) as exc:
        client.release_caches(["rel-a", "rel-b"])  # all or nothing
    assert exc.value.code == grpc.StatusCode.NOT_FOUND
    assert [c["cache_id"] for c in client.list_caches()] == ["rel-b"]
    assert client.release_caches("rel-b") == 1
    assert cache.release() == 0  # rel-b was released elsewhere: skipped, not an error
    assert client.list_caches() == [] and cache.ids == []


def test_info_drops_caches_the_server_no_longer_has(client, server):
    """A cache gone on the server's side (released elsewhere here; the TTL or a restart
    alike) leaves the handle's ids at its next info(), which lists the rest."""
    cache = client.kv_cache(HKV, D, "float32")
    k = make("numpy", "float32", 6, HKV, D, seed=62)
    cache.append(["gone-a", "gone-b", "gone-c"], k, k, [0, 1, 3, 6])
    assert client.release_caches("gone-b") == 1
    assert cache.ids == ["gone-a", "gone-b", "gone-c"]  # not known yet
    with pytest.raises(AttentionError) as exc:  # named ids must exist
        cache.info(["gone-b"])
    assert exc.value.code == grpc.StatusCode.NOT_FOUND
    assert [(c["cache_id"], c["length"]) for c in cache.info()] == [("gone-a", 1), ("gone-c", 3)]
    assert cache.ids == ["gone-a", "gone-c"] and cache.lengths == {"gone-a": 1, "gone-c": 3}
    # A cache this handle creates while info() lists is not taken for gone.
    client.release_caches("gone-c")
    listing = client._list_caches

    def racing(ids, settings=None):  # type: ignore[no-untyped-def]
        reply = listing(ids, settings)
        if ids is None:  # created after the server listed the caller's caches
            cache.append("gone-new", k[:1], k[:1])
        return reply

    client._list_caches = racing
    try:
        assert [c["cache_id"] for c in cache.info()] == ["gone-a"]
    finally:
        del client._list_caches
    assert cache.ids == ["gone-a", "gone-new"]

    async def main():
        async with AsyncAttentionClient(server.target) as c:
            handle = c.kv_cache(HKV, D, "float32")
            await handle.append(["gone-x", "gone-y"], k[:2], k[:2], [0, 1, 2])
            await c.release_caches("gone-x")
            return [i["cache_id"] for i in await handle.info()], handle.ids

    assert asyncio.run(main()) == (["gone-y"], ["gone-y"])


def test_context_manager_cleanup_and_pool(client):
    pool = client.kv_pool_info()
    assert pool["page_bytes"] > 0 and pool["pages_total"] > 0
    assert client.info()["kv_cache_bytes"] > 0
    with pytest.raises(RuntimeError), client.kv_cache(HKV, D, "float16") as cache:
        k = make("numpy", "float16", 40, HKV, D, seed=70)
        cache.append(["cm-a", "cm-b"], k, k, [0, 10, 40])
        assert client.kv_pool_info()["pages_used"] >= pool["pages_used"] + 2
        assert {c["cache_id"] for c in client.list_caches()} == {"cm-a", "cm-b"}
        raise RuntimeError("the body failed")
    assert client.list_caches() == []
    assert client.kv_pool_info()["pages_used"] == pool["pages_used"]


def test_decode_step_without_handle(client, server):
    ctx = Context(["ds-a", "ds-b"])
    with client.kv_cache(HKV, D, "bfloat16") as cache:
        k = make("torch", "bfloat16", 19, HKV, D, seed=80)
        cache.append(["ds-a", "ds-b"], k, k, [0, 7, 19])
        ctx.add(["ds-a", "ds-b"], k, k, [7, 12])
        # A second client knows nothing of these caches: one ListCaches gives their layout.
        with AttentionClient(server.target) as other:
            q = make("torch", "bfloat16", 2, H, D, seed=81)
            out, lse = other.decode_step(q, ["ds-a", "ds-b"], return_lse=True)
            ref, ref_lse = reference.decode_ref(f64(q), *ctx.packed(["ds-a", "ds-b"]),
                                                return_lse=True)
            check_out(out, ref, "bfloat16", q)
            check_lse(lse, ref_lse)
            kn = make("torch", "bfloat16", 2, HKV, D, seed=82)
            out = other.decode_step(q, ["ds-b", "ds-a"], kn, kn, softmax_scale=0.2)
            ctx.add(["ds-b", "ds-a"], kn, kn, [1, 1])
            ref = reference.decode_ref(f64(q), *ctx.packed(["ds-b", "ds-a"]), softmax_scale=0.2)
            check_out(out, ref, "bfloat16", q)
        assert [c["length"] for c in cache.info()] == [8, 13]


def test_a_layout_remembered_for_a_recycled_id_is_asked_again(client, server):
    """A client remembers each cache's layout for steps without new tokens. Another client
    releases the id and makes it again with other kv heads: the stale step is refused once
    (naming the layout), and the next one asks the server and goes through; the same on a
    step stream."""
    q = np.ones((1, H, D), np.float32)

    def recycle(other: AttentionClient, kv_heads: int, seed: int) -> np.ndarray:
        other.release_caches("recycled")
        k = make("numpy", "float32", 3, kv_heads, D, seed=seed)
        other.kv_cache(kv_heads, D, "float32").append("recycled", k, k)
        return k

    def check(out, k: np.ndarray) -> None:
        t = f64(torch.from_numpy(k))
        check_out(out, reference.decode_ref(f64(torch.from_numpy(q)), t, t, cu([3])),
                  "float32", q)

    zeros = np.zeros((3, HKV, D), np.float32)
    client.kv_cache(HKV, D, "float32").append("recycled", zeros, zeros)
    client.decode_step(q, ["recycled"], store=False)  # remembered: HKV heads
    with AttentionClient(server.target) as other:
        for step in (client.decode_step, client.decode_steps().step):
            k = recycle(other, 2 * HKV, seed=90)
            with pytest.raises(AttentionError) as info:
                step(q, ["recycled"], store=False)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "num_kv_heads" in info.value.details
            check(step(q, ["recycled"], store=False), k)  # asked again
            k = recycle(other, HKV, seed=91)  # and back, for the next round
            with pytest.raises(AttentionError):
                step(q, ["recycled"], store=False)
            check(step(q, ["recycled"], store=False), k)


def test_a_remembered_dtype_refused_by_the_client_is_asked_again(client, server):
    """A step without new tokens whose q does not fit the layout this client remembers (the
    id was released and made again in another dtype elsewhere) asks the server once and goes
    through, rather than failing on the client's stale memory every time."""
    zeros = np.zeros((3, HKV, D), np.float16)
    client.kv_cache(HKV, D, "float16").append("redtyped", zeros, zeros)
    client.decode_step(np.ones((1, H, D), np.float16), ["redtyped"], store=False)  # remembered
    q = np.ones((1, H, D), np.float32)
    with AttentionClient(server.target) as other:
        other.release_caches("redtyped")
        k = make("numpy", "float32", 3, HKV, D, seed=92)
        other.kv_cache(HKV, D, "float32").append("redtyped", k, k)
        for step in (client.decode_step, client.decode_steps().step):
            out = step(q, ["redtyped"], store=False)
            t = f64(torch.from_numpy(k))
            check_out(out, reference.decode_ref(f64(torch.from_numpy(q)), t, t, cu([3])),
                      "float32", q)
    # A q that fits no layout still fails, after that one look-up, naming what is wrong.
    with pytest.raises(ValueError, match="dtype"):
        client.decode_step(np.ones((1, H, D), np.float16), ["redtyped"], store=False)


def test_the_async_client_asks_again_for_a_remembered_dtype(server):
    """The asyncio client's decode_step and decode_steps, as the sync client's: a q that does
    not fit a remembered layout makes them ask the server once."""
    q = np.ones((1, H, D), np.float32)

    async def main(other: AttentionClient) -> list[tuple[np.ndarray, np.ndarray]]:
        got = []
        async with AsyncAttentionClient(server.target) as c:
            zeros = np.zeros((3, HKV, D), np.float16)
            await c.kv_cache(HKV, D, "float16").append("aredtyped", zeros, zeros)
            await c.decode_step(np.ones((1, H, D), np.float16), ["aredtyped"], store=False)
            async with c.decode_steps() as steps:
                for seed, step in enumerate((c.decode_step, steps.step)):
                    other.release_caches("aredtyped")
                    dtype = ("float32", "float16")[seed]
                    k = make("numpy", dtype, 3, HKV, D, seed=93 + seed)
                    other.kv_cache(HKV, D, dtype).append("aredtyped", k, k)
                    qd = q.astype(dtype)
                    got.append((k, qd, await step(qd, ["aredtyped"], store=False)))
        return got

    with AttentionClient(server.target) as other:
        for k, qd, out in asyncio.run(main(other)):
            t = f64(torch.from_numpy(k))
            check_out(out, reference.decode_ref(f64(torch.from_numpy(qd)), t, t, cu([3])),
                      str(qd.dtype), qd)
        other.release_caches(all=True)


def test_a_failed_layout_lookup_reads_as_the_step(client):
    """decode_step without new tokens looks its caches' layout up first: a failure there
    names the step (CacheDecode) and what it was doing, not ListCaches."""
    with pytest.raises(AttentionError) as info:
        client.decode_step(np.ones((1, H, D), np.float16), ["never-made"])
    err = info.value
    assert err.code == grpc.StatusCode.NOT_FOUND and err.method == "CacheDecode"
    assert "looking up the caches' layout" in str(err) and "ListCaches" not in str(err)


def test_many_messages_per_call(server):
    """Appends and prefills larger than one message: chunked like Prefill (here 16 KiB)."""
    ctx = Context(["big"])
    with (
        AttentionClient(server.target, max_chunk_bytes=16 << 10) as c,
        c.kv_cache(HKV, D, "float32") as cache,
    ):
        k = make("numpy", "float32", 600, HKV, D, seed=100)  # 300 KiB each
        v = make("numpy", "float32", 600, HKV, D, seed=101)
        assert cache.append("big", k, v) == [600]
        ctx.add(["big"], k, v, [600])
        q = make("numpy", "float32", 40, H, D, seed=102)
        out = cache.prefill(q, "big", None, None)
        ref = reference.prefill_ref(f64(q), ctx.k["big"], ctx.v["big"], cu([40]), cu([600]),
                                    causal=True)
        check_out(out, ref, "float32", q)
        assert c.last_stats["bytes_in"] == q.nbytes and c.last_stats["cache_lengths"] == [600]


def test_server_refusals(client):
    with client.kv_cache(HKV, D, "float16") as cache:
        cache.create(["ref-a", "ref-b"])
        with pytest.raises(AttentionError) as exc:
            cache.create(["ref-c", "ref-a"])
        assert exc.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert {c["cache_id"] for c in client.list_caches()} == {"ref-a", "ref-b"}  # no ref-c
        with pytest.raises(AttentionError) as exc:  # new tokens of another layout
            client.decode_step(make("numpy", "float16", 1, H, D), "ref-a",
                               *[make("numpy", "float16", 1, HKV * 2, D)] * 2)
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "k" in exc.value.details
        with pytest.raises(AttentionError) as exc:
            cache.fork("ref-a", "ref-b")
        assert exc.value.code == grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(AttentionError) as exc:
            cache.info(["ref-a", "nope"])
        assert exc.value.code == grpc.StatusCode.NOT_FOUND


def test_caches_off():
    require_server()
    running = start_server("--kv-cache-bytes", "0")
    try:
        with AttentionClient(running.target) as c:
            assert c.info()["kv_cache_bytes"] == 0
            with pytest.raises(AttentionError) as exc:
                c.kv_cache(HKV, D, "float16").create("off")
            assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        running.stop()


def test_async_decode_loop(server):
    ids = ["as-a", "as-b"]
    prompt = [9, 0]
    steps = []

    async def main():
        async with AsyncAttentionClient(server.target) as c:
            async with c.kv_cache(HKV, D, "float32") as cache:
                k = make("numpy", "float32", 9, HKV, D, seed=90)
                assert await cache.append(ids, k, k, [0, 9, 9]) == prompt
                for step in range(3):
                    q = make("numpy", "float32", 2, H, D, seed=91 + step)
                    kn = make("numpy", "float32", 2, HKV, D, seed=94 + step)
                    steps.append((q, kn, await cache.decode(q, ids, kn, kn)))
                q = make("numpy", "float32", 2, H, D, seed=99)
                # concurrent steps on disjoint caches of one handle
                outs = await asyncio.gather(
                    c.decode_step(q[:1], "as-a"), cache.decode(q[1:], "as-b", store=False)
                )
                info = await cache.info()
                forked = await cache.fork("as-a", "as-c", length=4)
            return k, q, outs, info, forked, await c.list_caches()

    k, q, outs, info, forked, after = asyncio.run(main())
    ctx = Context(ids)
    ctx.add(ids, k, k, prompt)
    for q_step, kn, out in steps:
        ctx.add(ids, kn, kn, [1, 1])
        check_out(out, reference.decode_ref(f64(q_step), *ctx.packed(ids)), "float32", q_step)
    ref = reference.decode_ref(f64(q), *ctx.packed(ids))
    check_out(np.concatenate(outs), ref, "float32", q)
    assert [c["length"] for c in info] == [12, 3]
    assert forked["length"] == 4 and after == []


def test_async_client_asks_again_for_a_recycled_layout(server):
    """The asyncio client's decode_step and decode_steps forget a remembered layout the
    server refused, as the sync client's do."""
    q = np.ones((1, H, D), np.float32)

    async def main(other: AttentionClient) -> list[tuple[np.ndarray, np.ndarray]]:
        got = []
        async with AsyncAttentionClient(server.target) as c:
            zeros = np.zeros((3, HKV, D), np.float32)
            await c.kv_cache(HKV, D, "float32").append("arecycled", zeros, zeros)
            await c.decode_step(q, ["arecycled"], store=False)  # remembered: HKV heads
            async with c.decode_steps() as steps:
                for step, kv_heads in ((c.decode_step, 2 * HKV), (steps.step, HKV)):
                    other.release_caches("arecycled")
                    k = make("numpy", "float32", 3, kv_heads, D, seed=kv_heads)
                    other.kv_cache(kv_heads, D, "float32").append("arecycled", k, k)
                    with pytest.raises(AttentionError) as info:
                        await step(q, ["arecycled"], store=False)
                    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
                    got.append((k, await step(q, ["arecycled"], store=False)))
        return got

    with AttentionClient(server.target) as other:
        for k, out in asyncio.run(main(other)):
            t = f64(torch.from_numpy(k))
            check_out(out, reference.decode_ref(f64(torch.from_numpy(q)), t, t, cu([3])),
                      "float32", q)
        other.release_caches(all=True)


def test_value_errors_before_anything_is_sent(client):
    cache = client.kv_cache(HKV, D, "float16")
    k = make("numpy", "float16", 6, HKV, D)
    q = make("numpy", "float16", 2, H, D)
    bad = [
        (lambda: cache.append("x", make("numpy", "float32", 6, HKV, D),
                              make("numpy", "float32", 6, HKV, D)), "k has dtype"),
        (lambda: cache.append("x", make("numpy", "float16", 6, 4, D),
                              make("numpy", "float16", 6, 4, D)), "num_kv_heads"),
        (lambda: cache.append("x", make("numpy", "float16", 6, HKV, 32),
                              make("numpy", "float16", 6, HKV, 32)), "head_dim"),
        (lambda: cache.append(["x", "y"], k, k), "cu_seqlens is required"),
        (lambda: cache.append(["x", "y"], k, k, [0, 2, 5]), "cu_seqlens must"),
        (lambda: cache.append(["x", "y", "z"], k, k, [0, 2, 6]), "ids names 3"),
        (lambda: cache.append(["x", "x"], k, k, [0, 2, 6]), "appears twice"),
        (lambda: cache.append([], k, k), "ids is empty"),
        # Unordered ids would pair with rows in an order of the hash seed's choosing.
        (lambda: cache.append({"x", "y"}, k, k, [0, 2, 6]), "got set: its order"),
        (lambda: cache.append({"x": 0, "y": 1}.keys(), k, k, [0, 2, 6]), "got dict_keys"),
        (lambda: client.decode_step(q, frozenset(["x", "y"])), "got frozenset"),
        (lambda: cache.append("x", k, None), "v must be"),
        (lambda: cache.decode(q, ["x", "y"], k[:1], k[:1]), "k_new must hold one"),
        (lambda: cache.decode(q, ["x"], k[:1], k[:1]), "ids names 1"),
        (lambda: cache.decode(make("numpy", "float16", 2, 3, D), ["x", "y"]), "q has 3 heads"),
        (lambda: cache.decode(q, ["x", "y"], k[:2], None), "k_new and v_new"),
        (lambda: cache.decode(q[0], "x"), "q must be 3-D"),
        (lambda: cache.prefill(q, ["x"], k, k, [0, 3]), "cu_seqlens_k is needed"),
        (lambda: cache.prefill(q, ["x"], k, k, [0, 3], [0, 6]), "cu_seqlens_q must"),
        (lambda: cache.prefill(make("numpy", "float32", 2, H, D), "x", None, None), "q has dtype"),
        (lambda: cache.prefill(q[:0], "x", k, k), "q has no tokens"),
        (lambda: cache.fork("x", "y", length=-1), "length"),
        (lambda: cache.append("x\ud800", k, k), "ids[0] is not valid UTF-8"),  # lone surrogate
        (lambda: client.decode_step(q, ["x", "\udfff"]), "cache_ids[1] is not valid UTF-8"),
        (lambda: client.kv_cache(0, D, "float16"), "num_kv_heads"),
        (lambda: client.kv_cache(HKV, D, "float64"), "dtype"),
        (lambda: client.kv_cache(HKV, D, np.int8), "dtype"),
        (lambda: client.release_caches(), "all=True"),
        (lambda: client.decode_step(q, "x"), "cache_ids names 1"),
        (lambda: client.decode_step(q, [1, 2]), "cache_ids[0] must be a str"),
    ]
    for call, words in bad:
        with pytest.raises(ValueError) as exc:
            call()
        assert words in str(exc.value), (words, str(exc.value))
    assert cache.ids == [] and client.list_caches() == []  # nothing was created


def test_dtypes_and_headers():
    """Layout parsing and the headers of the cache ops, without a server."""
    assert KvLayout.of(2, 64, torch.bfloat16) == KvLayout(pb.BFLOAT16, 2, 64)
    assert KvLayout.of(2, 64, np.float16).dtype == KvLayout.of(2, 64, "float16").dtype == pb.FLOAT16
    assert KvLayout.of(2, 64, "FLOAT32").dtype == pb.FLOAT32
    layout = KvLayout(pb.FLOAT16, HKV, D)
    k = make("numpy", "float16", 5, HKV, D)
    prep = prepare_append_kv(k, k, None, CacheTarget(("a",), True, layout))
    header = pb.PrefillHeader.FromString(prep.header)
    assert not header.HasField("q") and list(header.cu_seqlens_k) == [0, 5]
    assert not header.cu_seqlens_q and not header.return_lse
    assert list(header.cache.cache_ids) == ["a"] and header.cache.store
    assert prep.method == "AppendKV" and prep.streamed_out_shape is None

    q = make("torch", "float16", 2, H, D)
    prep = prepare_cache_decode(q, None, None, CacheTarget(("a", "b"), False, layout))
    header = pb.DecodeHeader.FromString(prep.header)
    assert list(header.k.shape) == [0, HKV, D] and not header.cu_seqlens_k
    assert list(header.cache.cache_ids) == ["a", "b"] and not header.cache.store

    prep = prepare_cache_prefill(q[:1], k[:0], k[:0], [0, 1], None, CacheTarget(("a",)))
    header = pb.PrefillHeader.FromString(prep.header)
    assert list(header.cu_seqlens_k) == [0, 0]  # no new keys (empty would mean cu_seqlens_q)
    assert header.causal and prep.method == "CachePrefill"

    # 4-D q (a batch of equal-length sequences) and no new tokens.
    prep = prepare_cache_prefill(
        make("numpy", "float16", 2, 3, H, D), None, None, None, None,
        CacheTarget(("a", "b"), True, layout), return_lse=True,
    )
    header = pb.PrefillHeader.FromString(prep.header)
    assert list(header.cu_seqlens_q) == [0, 3, 6] and list(header.cu_seqlens_k) == [0, 0, 0]
    assert list(header.k.shape) == [0, HKV, D] and prep.user_shape == (2, 3, H, D)

    with pytest.raises(ProtocolError, match="cache_lengths has 1 entries for 2 caches"):
        prep.take_stats({"cache_lengths": [7]})
    prep.take_stats({"cache_lengths": [7, 8]})
    assert prep.cache_lengths == [7, 8]
