"""The client's same-host path against the real server (cpu backend), one process and a
process group: tensors in a registered region travel by reference, others are staged into it,
outputs come back through it; opt-out, fallback, ``out=``, scratch after failures, async."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch

from attention_client import (
    AsyncAttentionClient,
    AttentionClient,
    AttentionError,
    AttentionInputError,
    AttentionResourceError,
)
from attention_kernels import decode_ref, prefill_ref
from attention_wire.pb import attention_pb2 as pb
from attention_wire.pb.attention_pb2_grpc import AttentionServiceStub

from ._server import RunningServer, require_server, start_server

pytestmark = pytest.mark.timeout(120)
CU = [0, 10, 30]


def _client_objects(pid: int | None = None) -> set[str]:
    """This process's (or ``pid``'s) client objects in /dev/shm (``attention-client-<pid>-*``).
    Only those: other test processes (pytest-xdist workers, their servers' arenas) create and
    remove objects of their own at any time."""
    prefix = f"attention-client-{os.getpid() if pid is None else pid}-"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


@pytest.fixture(scope="module", params=["1", "2"], ids=["one-process", "two-frontends"])
def srv(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    require_server()
    running = start_server("--frontends", request.param)
    yield running
    running.stop()


def _ref(q, k, v, cu=CU, cu_k=None, causal=True):  # type: ignore[no-untyped-def]
    t = [torch.as_tensor(np.asarray(x, dtype=np.float64)) if isinstance(x, np.ndarray)
         else x.double() for x in (q, k, v)]
    cu_k_t = torch.tensor(cu_k, dtype=torch.int32) if cu_k is not None else None
    return prefill_ref(*t, torch.tensor(cu, dtype=torch.int32), cu_k_t, causal=causal,
                       return_lse=True)


def _close(got, ref, tol=2e-5):  # type: ignore[no-untyped-def]
    got = torch.as_tensor(np.asarray(got, dtype=np.float64)) if isinstance(got, np.ndarray) \
        else got.double()
    torch.testing.assert_close(got, ref.double(), atol=tol, rtol=tol)


def test_tensors_in_a_region_travel_by_reference(srv: RunningServer) -> None:
    with AttentionClient(srv.target) as c:
        region = c.register_shm(1 << 20)
        q = region.empty((30, 4, 16), torch.float32)
        k = region.empty((30, 2, 16), torch.float32)
        v = region.empty((30, 2, 16), torch.float32)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape))
        out, lse = c.attention(q, k, v, CU, causal=True, return_lse=True)
        ref, ref_lse = _ref(q, k, v)
        _close(out, ref)
        _close(lse, ref_lse, 1e-5)
        s = c.last_stats
        assert s is not None and s["bytes_in"] == 0 and s["bytes_out"] == 0
        assert s["region_bytes_in"] == (q.numel() + 2 * k.numel()) * 4
        assert s["region_bytes_out"] == q.numel() * 4 + 4 * 30 * 4
        # The result is the caller's own: the region's scratch is free again.
        assert out.data_ptr() != q.data_ptr()
        assert c.list_regions() == [{"name": region.name, "kind": "system",
                                     "byte_size": 1 << 20, "inflight": 0}]


@pytest.mark.parametrize("kind", ["numpy-fp16", "torch-bf16", "batch-4d"])
def test_tensors_outside_a_region_are_staged(srv: RunningServer, kind: str) -> None:
    rng = np.random.default_rng(3)
    with AttentionClient(srv.target) as c:
        c.register_shm(1 << 20)
        if kind == "numpy-fp16":
            q, k, v = (rng.standard_normal(s).astype(np.float16)
                       for s in ((30, 4, 16), (30, 2, 16), (30, 2, 16)))
            out = c.attention(q, k, v, CU, causal=True)
            assert isinstance(out, np.ndarray) and out.dtype == np.float16
            _close(out, _ref(q, k, v)[0], 2e-3)
        elif kind == "torch-bf16":
            q, k, v = (torch.randn(s).bfloat16() for s in ((30, 4, 16), (30, 2, 16), (30, 2, 16)))
            qd = q[:2]
            out, lse = c.decode(qd, k, v, CU, return_lse=True)
            ref, ref_lse = decode_ref(qd.double(), k.double(), v.double(),
                                      torch.tensor(CU, dtype=torch.int32), return_lse=True)
            assert out.dtype == torch.bfloat16 and lse.shape == (2, 4)
            _close(out, ref, 1.6e-2)
            _close(lse, ref_lse, 1e-4)
        else:
            q, k, v = (torch.randn(s) for s in ((3, 7, 4, 8), (3, 9, 2, 8), (3, 9, 2, 8)))
            out, lse = c.attention(q, k, v, causal=True, return_lse=True)
            for b in range(3):
                ref, ref_lse = _ref(q[b], k[b], v[b], [0, 7], [0, 9])
                _close(out[b], ref)
                _close(lse[b], ref_lse, 1e-5)
        s = c.last_stats
        assert s is not None and s["bytes_in"] == 0 and s["region_bytes_in"] > 0


def test_no_room_falls_back_to_bytes(srv: RunningServer) -> None:
    q, k, v = (torch.randn(s) for s in ((300, 4, 16), (300, 2, 16), (300, 2, 16)))
    with AttentionClient(srv.target) as c:
        c.register_shm(16 * 1024)  # too small for q
        out = c.attention(q, k, v, [0, 300], causal=True)
        _close(out, _ref(q, k, v, [0, 300])[0])
        s = c.last_stats
        assert s is not None and s["bytes_in"] > 0 and s["bytes_out"] > 0


def test_out_is_written_in_place(srv: RunningServer) -> None:
    with AttentionClient(srv.target) as c:
        region = c.register_shm(1 << 20)
        q, k, v = (torch.randn(s) for s in ((30, 4, 16), (30, 2, 16), (30, 2, 16)))
        out = region.empty((30, 4, 16), torch.float32)
        out.fill_(float("nan"))
        got = c.attention(q, k, v, CU, causal=True, out=out)
        assert got is out
        _close(out, _ref(q, k, v)[0])
        assert c.last_stats["bytes_out"] == 0  # type: ignore[index]
        with pytest.raises(ValueError, match="out"):
            c.attention(q, k, v, CU, causal=True, out=torch.empty(30, 4, 16))  # not in a region
        # Another shape or dtype, of any size: refused, naming out (its bytes would be
        # the result's read another way).
        for wrong in (region.empty((29, 4, 16), torch.float32),
                      region.empty((60, 4, 16), torch.float16),
                      region.empty((120, 16), torch.float32)):
            with pytest.raises(AttentionInputError, match="out has shape"):
                c.attention(q, k, v, CU, causal=True, out=wrong)
        bare = AttentionClient(srv.target)  # no region registered
        with bare, pytest.raises(AttentionInputError, match="registered region"):
            bare.attention(q, k, v, CU, causal=True, out=out)
        # An empty batch: nothing to write, so out= of the empty result's shape is returned
        # as it is, in a region or not.
        empty = torch.zeros(0, 4, 16)
        for target in (region.empty((0, 4, 16), torch.float32), torch.empty(0, 4, 16)):
            assert c.attention(empty, empty[:, :2], empty[:, :2], out=target) is target
            assert c.decode(empty, empty[:, :2], empty[:, :2], [0], out=target) is target


def test_opt_out_per_call_and_per_client(srv: RunningServer) -> None:
    q, k, v = (torch.randn(s) for s in ((30, 4, 16), (30, 2, 16), (30, 2, 16)))
    with AttentionClient(srv.target) as c:
        c.register_shm(1 << 20)
        c.attention(q, k, v, CU, causal=True, use_regions=False)
        assert c.last_stats["region_bytes_in"] == 0 and c.last_stats["bytes_in"] > 0  # type: ignore[index]
    with AttentionClient(srv.target, use_regions=False) as c:
        c.register_shm(1 << 20)
        out = c.attention(q, k, v, CU, causal=True)
        assert c.last_stats["region_bytes_in"] == 0  # type: ignore[index]
        _close(out, _ref(q, k, v)[0])


def test_region_space_comes_back_when_arrays_go(srv: RunningServer) -> None:
    with AttentionClient(srv.target) as c:
        region = c.register_shm(64 * 1024)
        a = region.empty((8192,), np.float32)  # 32 KiB
        b = region.empty((4096,), np.float32)  # 16 KiB
        view = a[10:20]
        with pytest.raises(MemoryError):
            region.empty((8192,), np.float32)
        del a
        gc.collect()
        with pytest.raises(MemoryError):  # a view of it is still alive
            region.empty((8192,), np.float32)
        del view
        gc.collect()
        c_ = region.empty((8192,), np.float32)
        assert c_.size == 8192 and b.size == 4096


def test_failed_call_scratch_is_reused_once_the_server_is_idle(srv: RunningServer) -> None:
    q, k, v = (torch.randn(s) for s in ((30, 4, 16), (30, 2, 16), (30, 2, 16)))
    with AttentionClient(srv.target) as c:
        region = c.register_shm(64 * 1024)  # room for one call's scratch at a time
        free = region._free.free_bytes
        with pytest.raises(AttentionError) as info:
            c.attention(q, k, v, [0, 10, 31], causal=True)  # the server refuses cu_seqlens
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert region.has_quarantine and region._free.free_bytes < free
        out = c.attention(q, k, v, CU, causal=True)  # asks the server, frees, stages again
        _close(out, _ref(q, k, v)[0])
        assert c.last_stats["bytes_in"] == 0  # type: ignore[index]
        assert not region.has_quarantine and region._free.free_bytes == free


def test_close_unregisters_and_removes_the_object(srv: RunningServer) -> None:
    c = AttentionClient(srv.target)
    region = c.register_shm(4096)
    name = region.name
    before = _client_objects()
    c.close()
    with AttentionClient(srv.target) as other:
        assert name not in [r["name"] for r in other.list_regions()]
    assert region.closed
    assert len(_client_objects() - before) == 0


def test_a_region_never_closed_is_removed_when_the_process_ends(srv: RunningServer) -> None:
    """A script that ends (or raises) without ``close`` must not leave its object in
    /dev/shm for good; the server still holds its own mapping until it drops the region."""
    script = (
        "import sys\n"
        "from attention_client import AttentionClient\n"
        "c = AttentionClient(sys.argv[1])\n"
        "region = c.register_shm(1 << 20)\n"
        "x = region.empty((16, 4), 'float32')\n"
        "import os\n"
        "print(region.name, os.getpid(), flush=True)\n"
        "raise SystemExit(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, srv.target], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    name, pid = done.stdout.split()[:2]
    assert _client_objects(int(pid)) == set()  # the script's object is gone with it
    with AttentionClient(srv.target) as other:  # still registered, until dropped
        assert name in [r["name"] for r in other.list_regions()]
    with grpc.insecure_channel(srv.target) as channel:
        AttentionServiceStub(channel).UnregisterRegion(pb.UnregisterRegionRequest(name=name),
                                                       timeout=30)


def test_region_size_must_be_an_int(srv: RunningServer) -> None:
    with AttentionClient(srv.target) as c:
        for bad in (1e6, "4096", True):
            with pytest.raises(AttentionInputError, match="nbytes must be an int"):
                c.register_shm(bad)  # type: ignore[arg-type]


def test_registration_refused_leaves_nothing_behind() -> None:
    require_server()
    running = start_server("--regions", "off")
    try:
        before = _client_objects()
        with AttentionClient(running.target) as c:
            assert c.info()["regions"] is False
            with pytest.raises(AttentionError) as info:
                c.register_shm(4096)
            assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
            q = torch.randn(4, 2, 8)
            c.attention(q, q[:, :1], q[:, :1], causal=True)  # bytes, as ever
        assert _client_objects() == before
    finally:
        running.stop()


def test_a_region_too_large_is_refused_and_leaves_no_object(srv: RunningServer) -> None:
    before = _client_objects()
    with AttentionClient(srv.target) as c:
        with pytest.raises(AttentionResourceError, match="nbytes"):
            c.register_shm(1 << 50)  # 1 PiB: more than any address space here
        assert c._live_regions() == []
    assert _client_objects() == before


def _qkv_ref():  # type: ignore[no-untyped-def]
    """Random q, k, v of the CU layout and the reference output of a causal call on them."""
    q, k, v = (torch.randn(s) for s in ((30, 4, 16), (30, 2, 16), (30, 2, 16)))
    return q, k, v, _ref(q, k, v)[0]


def _restart(running: RunningServer) -> RunningServer:
    """Stop the server and start a new one on the same port: regions are gone."""
    port = running.port
    running.stop()
    return start_server("--port", str(port))


def test_regions_are_registered_again_after_a_server_restart() -> None:
    """A restarted server knows none of a client's regions: the client's next call (staged
    or in place, out= included) registers them again and goes through, and closing a
    region the server forgot is quiet."""
    require_server()
    running = start_server()
    q, k, v, ref = _qkv_ref()
    try:
        with AttentionClient(running.target, timeout=30) as c:
            region = c.register_shm(1 << 20)
            _close(c.attention(q, k, v, CU, causal=True), ref)
            running = _restart(running)
            _close(c.attention(q, k, v, CU, causal=True), ref)  # staged, after registering
            assert c.last_stats["bytes_in"] == 0  # type: ignore[index]
            assert [r["name"] for r in c.list_regions()] == [region.name]
            running = _restart(running)
            out = region.empty((30, 4, 16), torch.float32)
            assert c.attention(q, k, v, CU, causal=True, out=out) is out
            _close(out, ref)
            running = _restart(running)
            region.close()  # the new server never knew it: nothing to unregister, no error
            assert c.list_regions() == []
            _close(c.attention(q, k, v, CU, causal=True), ref)  # bytes now: no region left
    finally:
        running.stop()


def test_a_region_the_server_dropped_as_idle_is_registered_again() -> None:
    """--region-ttl: the server drops a region no call used for the TTL; the client's next
    call registers it again and still travels through it."""
    require_server()
    running = start_server("--region-ttl", "0.3")
    q, k, v, ref = _qkv_ref()
    try:
        with AttentionClient(running.target, timeout=30) as c:
            region = c.register_shm(1 << 20)
            _close(c.attention(q, k, v, CU, causal=True), ref)
            deadline = time.monotonic() + 10
            while c.list_regions() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.list_regions() == []  # dropped by the server, not by the client
            _close(c.attention(q, k, v, CU, causal=True), ref)
            assert c.last_stats["bytes_in"] == 0  # type: ignore[index]
            assert [r["name"] for r in c.list_regions()] == [region.name]
    finally:
        running.stop()


def test_async_regions_are_registered_again_after_a_server_restart() -> None:
    require_server()
    running = start_server()
    q, k, v, ref = _qkv_ref()

    async def main() -> None:
        nonlocal running
        async with AsyncAttentionClient(running.target, timeout=30) as c:
            region = await c.register_shm(1 << 20)
            _close(await c.attention(q, k, v, CU, causal=True), ref)
            running = _restart(running)
            _close(await c.decode(q[:2], k, v, CU[:1] + [15, 30]),
                   decode_ref(q[:2].double(), k.double(), v.double(),
                              torch.tensor([0, 15, 30], dtype=torch.int32)))
            assert [r["name"] for r in await c.list_regions()] == [region.name]
            running = _restart(running)
            await region.aclose()  # unknown to the new server: quiet

    try:
        asyncio.run(main())
    finally:
        running.stop()


def test_a_region_as_a_context_manager_unregisters_on_exit(srv: RunningServer) -> None:
    q, k, v = (torch.randn(s) for s in ((30, 4, 16), (30, 2, 16), (30, 2, 16)))
    with AttentionClient(srv.target) as c:
        with c.register_shm(1 << 20) as region:
            assert [r["name"] for r in c.list_regions()] == [region.name]
            qr = region.empty(q.shape, q.dtype)
            qr.copy_(q)
            _close(c.attention(qr, k, v, CU, causal=True), _ref(q, k, v)[0])
            assert c.last_stats["region_bytes_in"] > 0  # type: ignore[index]
        assert region.closed and c.list_regions() == []
        # The region is gone from the client too: the next call sends bytes.
        _close(c.attention(q, k, v, CU, causal=True), _ref(q, k, v)[0])
        s = c.last_stats
        assert s is not None and s["bytes_in"] > 0 and s["region_bytes_in"] == 0
        with pytest.raises(RuntimeError), c.register_shm(1 << 20) as region2:
            raise RuntimeError("the caller's own error")
        assert region2.closed and c.list_regions() == []  # unregistered on the way out too


def test_async_client_regions(srv: RunningServer) -> None:
    q, k, v = (torch.randn(s) for s in ((30, 4, 16), (30, 2, 16), (30, 2, 16)))

    async def main() -> None:
        async with AsyncAttentionClient(srv.target) as c:
            async with await c.register_shm(1 << 20) as region:
                outs = await asyncio.gather(*(c.attention(q, k, v, CU, causal=True)
                                              for _ in range(4)))
                for out in outs:
                    _close(out, _ref(q, k, v)[0])
                assert c.last_stats["bytes_in"] == 0  # type: ignore[index]
                with pytest.raises(RuntimeError, match="aclose"):
                    region.close()
                assert [r["name"] for r in await c.list_regions()] == [region.name]
            assert await c.list_regions() == []

    asyncio.run(main())


def test_channels_spread_calls_over_front_ends() -> None:
    """``channels=4``: four connections, and a group's front ends each get some of them."""
    require_server()
    running = start_server("--frontends", "2", "--log-level", "INFO", "--access-log")
    try:
        q, k, v = (torch.randn(s) for s in ((30, 4, 16), (30, 2, 16), (30, 2, 16)))
        with AttentionClient(running.target, channels=4, use_regions=False) as c:
            for _ in range(16):
                _close(c.attention(q, k, v, CU, causal=True), _ref(q, k, v)[0])
        served = {line.split("[frontend ", 1)[1][0] for line in running.lines
                  if "rpc=Prefill code=OK" in line and "[frontend " in line}
        peers = {line.rsplit("peer=", 1)[1].split()[0] for line in running.lines
                 if "rpc=Prefill code=OK" in line}
        assert len(peers) == 4  # four connections, used in turn
        assert served  # which front ends took them is the kernel's choice (SO_REUSEPORT hash)
        with pytest.raises(ValueError, match="channels"):
            AttentionClient(running.target, channels=0)
    finally:
        running.stop()


def test_cache_decode_steps_go_through_a_region(srv: RunningServer) -> None:
    """decode_step / decode_steps / KvCache.decode with q, k_new, v_new and out in (or staged
    into) a region: no tensor bytes on the wire, the answers and the caches as with bytes;
    a span another call could not use is refused before any cache changes."""
    ids = ["rg-a", "rg-b"]
    with AttentionClient(srv.target) as c, c.kv_cache(2, 16, "float32") as cache:
        region = c.register_shm(1 << 20)
        prompt = torch.randn(9, 2, 16)
        cache.append(ids, prompt, prompt, [0, 4, 9])
        keys = {"rg-a": [prompt[:4]], "rg-b": [prompt[4:]]}
        q, kn = region.empty((2, 4, 16), torch.float32), region.empty((2, 2, 16), torch.float32)
        out = region.empty((2, 4, 16), torch.float32)
        with c.decode_steps() as steps:
            for n, call in enumerate((steps.step, c.decode_step, steps.step, cache.decode)):
                q.copy_(torch.randn(2, 4, 16))
                kn.copy_(torch.randn(2, 2, 16))
                out.fill_(float("nan"))
                got = call(q, ids, kn, kn, out=out) if n != 2 else call(q.clone(), ids, kn, kn)
                for i, cid in enumerate(ids):
                    keys[cid].append(kn[i : i + 1].clone())
                ks = [torch.cat(keys[cid]) for cid in ids]
                cu_k = [0, len(ks[0]), len(ks[0]) + len(ks[1])]
                ref = decode_ref(q.double(), torch.cat(ks).double(), torch.cat(ks).double(),
                                 torch.tensor(cu_k, dtype=torch.int32))
                _close(got, ref)
                s = c.last_stats
                assert s is not None and s["bytes_in"] == 0 and s["region_bytes_in"] > 0
                assert s["cache_lengths"] == [len(k) for k in ks]
                if n != 2:
                    assert got is out and s["bytes_out"] == 0
        # A span past the region's end (a region too small for it is another matter: the
        # client checks that): the server refuses it naming the field, and the caches keep
        # their lengths.
        lengths = [i["length"] for i in cache.info()]
        stub = AttentionServiceStub(c._base_channels[0])
        header = pb.DecodeHeader(
            q=pb.TensorSpec(dtype=pb.FLOAT32, shape=[2, 4, 16]),
            k=pb.TensorSpec(dtype=pb.FLOAT32, shape=[2, 2, 16]),
            v=pb.TensorSpec(dtype=pb.FLOAT32, shape=[2, 2, 16]),
            cache=pb.CacheTarget(cache_ids=ids, store=True),
            regions=pb.TensorRegions(
                q=pb.RegionSpan(region=region.name, offset=(1 << 20) - 256, byte_size=512),
                k=pb.RegionSpan(region=region.name, offset=0, byte_size=256),
                v=pb.RegionSpan(region=region.name, offset=256, byte_size=256)))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.CacheDecode(iter([pb.DecodeRequest(header=header)]),
                                  metadata=c._metadata or None))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "header.regions.q" in err.value.details()
        assert [i["length"] for i in cache.info()] == lengths


def test_cache_append_and_prefill_go_through_a_region(srv: RunningServer) -> None:
    """KvCache.append and KvCache.prefill with their tensors in (or staged into) a region: no
    tensor bytes on the wire, the answers and the caches' lengths as with bytes (float64
    reference over everything each cache holds); ``use_regions=False`` sends bytes; a span
    the server cannot use is refused naming the field, before any cache changes."""
    ids = ["rp-a", "rp-b"]
    with AttentionClient(srv.target) as c, c.kv_cache(2, 16, "float32") as cache:
        region = c.register_shm(1 << 20)
        k0 = region.empty((9, 2, 16), torch.float32)
        v0 = region.empty((9, 2, 16), torch.float32)
        k0.copy_(torch.randn(9, 2, 16))
        v0.copy_(torch.randn(9, 2, 16))
        assert cache.append(ids, k0, v0, [0, 4, 9]) == [4, 5]
        s = c.last_stats
        assert s is not None and s["bytes_in"] == 0 and s["region_bytes_in"] == 2 * k0.nbytes
        keys = [k0[:4].clone(), k0[4:].clone()]
        vals = [v0[:4].clone(), v0[4:].clone()]
        # Bytes for an append when asked (a tensor outside any region is staged otherwise).
        k1, v1 = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
        assert cache.append(ids[1], k1, v1, use_regions=False) == [8]
        s = c.last_stats
        assert s is not None and s["bytes_in"] > 0 and s["region_bytes_in"] == 0
        keys[1], vals[1] = torch.cat([keys[1], k1]), torch.cat([vals[1], v1])
        # Prefill: q in the region, new k/v staged, out= in the region; then q staged and the
        # output read back from scratch; then bytes.
        q = region.empty((5, 4, 16), torch.float32)
        out = region.empty((5, 4, 16), torch.float32)
        cu_q, cu_k = [0, 2, 5], [0, 1, 3]
        for n, (kwargs, in_region) in enumerate((({"out": out}, True), ({}, True),
                                                ({"use_regions": False}, False))):
            q.copy_(torch.randn(5, 4, 16))
            out.fill_(float("nan"))
            kn, vn = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
            got = cache.prefill(q if n != 1 else q.clone(), ids, kn, vn, cu_q, cu_k,
                                return_lse=n == 1, **kwargs)
            for i in range(2):
                keys[i] = torch.cat([keys[i], kn[cu_k[i]:cu_k[i + 1]]])
                vals[i] = torch.cat([vals[i], vn[cu_k[i]:cu_k[i + 1]]])
            ks, vs = torch.cat(keys), torch.cat(vals)
            cu_all = [0, len(keys[0]), len(keys[0]) + len(keys[1])]
            ref, ref_lse = _ref(q, ks, vs, cu_q, cu_all)
            if n == 1:
                got, lse = got
                _close(lse, ref_lse, 1e-5)
            _close(got, ref)
            s = c.last_stats
            assert s is not None and s["cache_lengths"] == [len(k) for k in keys]
            if in_region:
                assert s["bytes_in"] == 0 and s["region_bytes_in"] > 0 and s["bytes_out"] == 0
            else:
                assert s["bytes_in"] > 0 and s["region_bytes_in"] == 0 and s["bytes_out"] > 0
            if n == 0:
                assert got is out
        # Spans the server cannot use (past the region's end): refused naming the field, and
        # the caches keep their lengths.
        lengths = [i["length"] for i in cache.info()]
        stub = AttentionServiceStub(c._base_channels[0])
        spec = pb.TensorSpec(dtype=pb.FLOAT32, shape=[2, 2, 16])
        def span(offset: int, nbytes: int) -> pb.RegionSpan:
            return pb.RegionSpan(region=region.name, offset=offset, byte_size=nbytes)

        end = 1 << 20  # a [2, 2, 16] float32 k or v is 256 bytes, a [2, 4, 16] q 512
        append = pb.PrefillHeader(
            k=spec, v=spec, cu_seqlens_k=[0, 1, 2], cache=pb.CacheTarget(cache_ids=ids),
            regions=pb.TensorRegions(k=span(0, 256), v=span(end - 128, 256)))
        prefill = pb.PrefillHeader(
            q=pb.TensorSpec(dtype=pb.FLOAT32, shape=[2, 4, 16]), k=spec, v=spec,
            cu_seqlens_q=[0, 1, 2], cu_seqlens_k=[0, 1, 2], causal=True,
            cache=pb.CacheTarget(cache_ids=ids, store=True),
            regions=pb.TensorRegions(q=span(end - 256, 512), k=span(0, 256),
                                     v=span(256, 256)))
        for rpc, header, field in ((stub.AppendKV, append, "header.regions.v"),
                                   (stub.CachePrefill, prefill, "header.regions.q")):
            with pytest.raises(grpc.RpcError) as err:
                list(rpc(iter([pb.PrefillRequest(header=header)]),
                         metadata=c._metadata or None))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in err.value.details()
            assert [i["length"] for i in cache.info()] == lengths
