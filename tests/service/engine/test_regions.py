"""Same-host shared-memory regions at the wire level (raw stubs): registration and its errors,
requests that name spans instead of sending bytes, bounds and size checks naming the field,
regions per token, registration off by default where it must be, and a region dropped and
unmapped while a call uses it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from attention_service.config import ServerConfig
from attention_wire import shm
from attention_wire.pb import attention_pb2 as pb
from attention_wire.pb import attention_pb2_grpc as pb_grpc

from ..region_helpers import Shm
from ..svc_helpers import (
    TOLERANCE,
    GatedBackend,
    ServerHandle,
    prefill_oracle,
    random_qkv,
    sample,
    spec,
    wait_until,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_tracebacks")]
MiB = 1 << 20


@pytest.fixture
def obj() -> Iterator[Shm]:
    o = Shm()
    yield o
    o.close()


def _register(stub: Any, name: str, key: str, size: int, offset: int = 0,
              metadata: Any = ()) -> pb.RegionInfo:
    req = pb.RegisterRegionRequest(name=name, byte_size=size,
                                   system=pb.SystemRegion(key=key, offset=offset))
    return stub.RegisterRegion(req, timeout=10, metadata=metadata)


def _code(fn: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


def test_register_list_unregister(server: ServerHandle, obj: Shm) -> None:
    stub = server.stub()
    info = _register(stub, "r1", obj.key, 4096, offset=8192)
    assert (info.name, info.kind, info.byte_size, info.inflight) == ("r1", "system", 4096, 0)
    listed = stub.ListRegions(pb.ListRegionsRequest(), timeout=10).regions
    assert [r.name for r in listed] == ["r1"]
    reply = stub.UnregisterRegion(pb.UnregisterRegionRequest(name="r1"), timeout=10)
    assert reply.released == 1
    assert not stub.ListRegions(pb.ListRegionsRequest(), timeout=10).regions
    code, details = _code(lambda: stub.UnregisterRegion(
        pb.UnregisterRegionRequest(name="r1"), timeout=10))
    assert code == grpc.StatusCode.NOT_FOUND and details.startswith("name:")


@pytest.mark.parametrize("case", [
    "duplicate", "missing_key", "slash_key", "past_end", "bad_name", "empty", "no_source",
    "cuda_on_cpu",
])
def test_registration_errors(server: ServerHandle, obj: Shm, case: str) -> None:
    stub = server.stub()
    req = pb.RegisterRegionRequest(name=f"e-{case}", byte_size=4096,
                                   system=pb.SystemRegion(key=obj.key))
    expect = {
        "duplicate": (grpc.StatusCode.ALREADY_EXISTS, "name"),
        "missing_key": (grpc.StatusCode.NOT_FOUND, "system.key"),
        "slash_key": (grpc.StatusCode.INVALID_ARGUMENT, "system"),
        "past_end": (grpc.StatusCode.INVALID_ARGUMENT, "system"),
        "bad_name": (grpc.StatusCode.INVALID_ARGUMENT, "name"),
        "empty": (grpc.StatusCode.INVALID_ARGUMENT, "byte_size"),
        "no_source": (grpc.StatusCode.INVALID_ARGUMENT, "source"),
        "cuda_on_cpu": (grpc.StatusCode.INVALID_ARGUMENT, "cuda"),
    }[case]
    if case == "duplicate":
        stub.RegisterRegion(req, timeout=10)
    elif case == "missing_key":
        req.system.key = "attention-test-does-not-exist"
    elif case == "slash_key":
        req.system.key = "../etc/passwd"
    elif case == "past_end":
        req.system.offset = obj.size - 100
    elif case == "bad_name":
        req.name = "no spaces/or slashes"
    elif case == "empty":
        req.byte_size = 0
    elif case == "no_source":
        req.ClearField("system")
    elif case == "cuda_on_cpu":
        req.cuda.ipc_handle = b"\0" * 64
    code, details = _code(lambda: stub.RegisterRegion(req, timeout=10))
    assert code == expect[0], details
    assert details.startswith(expect[1]), details
    stub.UnregisterRegion(pb.UnregisterRegionRequest(name=""), timeout=10)


def test_regions_per_caller_are_bounded(start_server: Any, obj: Shm) -> None:
    srv = start_server()
    stub = srv.stub()
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert (info.max_regions_per_caller, info.system_region_bytes_per_caller,
            info.gpu_region_bytes_per_caller) == (64, 0, 0)
    for i in range(64):
        _register(stub, f"n{i}", obj.key, 4096)
    code, details = _code(lambda: _register(stub, "n64", obj.key, 4096))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith("name:"), details
    assert "64" in details and "--max-regions-per-caller" in details
    assert stub.UnregisterRegion(pb.UnregisterRegionRequest(), timeout=10).released == 64


def test_system_region_bytes_per_caller_are_bounded(start_server: Any, obj: Shm) -> None:
    """Past --system-region-bytes-per-caller: RESOURCE_EXHAUSTED naming byte_size, before
    anything is mapped; per token; room comes back with an unregistration."""
    srv = start_server(auth_token="token-a,token-b", max_regions_per_caller=3,
                       system_region_bytes_per_caller=MiB // 2,
                       gpu_region_bytes_per_caller=MiB)
    stub = srv.stub()
    a = (("authorization", "Bearer token-a"),)
    b = (("authorization", "Bearer token-b"),)
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10, metadata=a)
    assert (info.max_regions_per_caller, info.system_region_bytes_per_caller,
            info.gpu_region_bytes_per_caller) == (3, MiB // 2, MiB)
    _register(stub, "big", obj.key, MiB // 4, metadata=a)
    _register(stub, "more", obj.key, MiB // 8, offset=MiB // 4, metadata=a)
    code, details = _code(lambda: _register(stub, "over", obj.key, MiB // 4, metadata=a))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert details.startswith("byte_size:") and str(MiB // 2) in details, details
    assert "--system-region-bytes-per-caller" in details
    assert {r.name for r in stub.ListRegions(pb.ListRegionsRequest(), timeout=10,
                                             metadata=a).regions} == {"big", "more"}
    _register(stub, "fits", obj.key, MiB // 8, metadata=a)  # exactly at the limit
    code, details = _code(lambda: _register(stub, "fourth", obj.key, 1, metadata=a))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "3 regions" in details, details
    # Another token has its own room (its own object: a's is a's while registered).
    other = Shm()
    try:
        _register(stub, "big", other.key, MiB // 2, metadata=b)
        stub.UnregisterRegion(pb.UnregisterRegionRequest(name="big"), timeout=10, metadata=a)
        _register(stub, "again", obj.key, MiB // 4, metadata=a)  # room came back
        stub.UnregisterRegion(pb.UnregisterRegionRequest(), timeout=10, metadata=b)
    finally:
        other.close()
    stub.UnregisterRegion(pb.UnregisterRegionRequest(), timeout=10, metadata=a)


def test_a_registration_being_mapped_holds_its_name_key_and_room(
    obj: Shm, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Name, key, count and bytes are taken before the (slow) mapping, so registrations racing
    for them cannot both win; a failed mapping gives them back."""
    from attention_service.engine import regions as regions_mod
    from attention_service.errors import RequestError

    class _Cpu:
        name = "cpu"

    reg = regions_mod.RegionRegistry(_Cpu(), allowed=True, max_per_owner=2,
                                     system_bytes_per_owner=MiB // 2)
    entered, release = threading.Event(), threading.Event()
    real_open = regions_mod.RegionRegistry._open_system

    def slow_open(self: Any, src: Any, nbytes: int) -> Any:
        if src.offset == 4096:  # the first registration's mapping waits for the test
            entered.set()
            assert release.wait(10)
        if src.offset == 8192:
            raise RequestError(grpc.StatusCode.NOT_FOUND, "system.key: gone")
        return real_open(self, src, nbytes)

    monkeypatch.setattr(regions_mod.RegionRegistry, "_open_system", slow_open)

    def req(name: str, size: int, offset: int = 0, key: str = obj.key) -> Any:
        return pb.RegisterRegionRequest(name=name, byte_size=size,
                                        system=pb.SystemRegion(key=key, offset=offset))

    def code(fn: Any) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(RequestError) as info:
            fn()
        return info.value.code, info.value.details

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(reg.register, "a", req("slow", MiB // 4, offset=4096))
        assert entered.wait(10)
        assert code(lambda: reg.register("a", req("slow", 4096)))[0] == (
            grpc.StatusCode.ALREADY_EXISTS)
        assert code(lambda: reg.register("b", req("theirs", 4096)))[0] == (
            grpc.StatusCode.PERMISSION_DENIED)
        c, details = code(lambda: reg.register("a", req("second", MiB // 2)))
        assert c == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith("byte_size")
        # A failed mapping gives its claim back: the same name then registers.
        assert code(lambda: reg.register("a", req("gone", 4096, offset=8192)))[0] == (
            grpc.StatusCode.NOT_FOUND)
        reg.register("a", req("gone", 4096))
        c, details = code(lambda: reg.register("a", req("third", 4096)))
        assert c == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith("name")
        release.set()
        assert first.result(10).name == "slow"
    assert reg.unregister("a", "") == 2
    reg.register("b", req("theirs", 4096))  # a's object is free again
    reg.close()


def test_idle_regions_are_dropped_after_the_ttl(obj: Shm) -> None:
    """A region no call has used for the TTL is dropped (its quota comes back, later calls get
    NOT_FOUND); one a call holds is never dropped, however long the call; using a region
    restarts its clock. A fake clock drives expire() directly (ttl 0 starts no sweeper)."""
    from attention_service.engine import regions as regions_mod
    from attention_service.errors import RequestError
    from attention_service.params import RegionSpan

    class _Cpu:
        name = "cpu"

    now = [100.0]
    reg = regions_mod.RegionRegistry(_Cpu(), allowed=True, max_per_owner=2, clock=lambda: now[0])
    reg.ttl = 10.0  # after construction: the test calls expire() itself

    def req(name: str, offset: int) -> Any:
        return pb.RegisterRegionRequest(name=name, byte_size=4096,
                                        system=pb.SystemRegion(key=obj.key, offset=offset))

    span = {"q": RegionSpan("held", 0, 16)}
    reg.register("a", req("idle", 0))
    reg.register("a", req("held", 8192))
    with pytest.raises(RequestError):  # max_per_owner 2: full
        reg.register("a", req("third", 16384))
    now[0] += 9.0
    _, release, _ = reg.acquire("a", span)  # "held" is in use from here on
    now[0] += 5.0  # "idle" unused for 14 s, "held" in use
    assert reg.expire() == 1
    assert reg.gauges() == (1, 1)
    with pytest.raises(RequestError) as info:
        reg.acquire("a", {"k": RegionSpan("idle", 0, 16)})
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    assert info.value.details.startswith("header.regions.k.region:")
    assert "--region-ttl" in info.value.details
    reg.register("a", req("third", 16384))  # the dropped region's quota came back
    now[0] += 60.0
    assert reg.expire() == 1  # only "third": "held" is still in use, for 65 s now
    assert [r.name for r in reg.call("ListRegions", None, "a").regions] == ["held"]
    release()
    now[0] += 9.0
    assert reg.expire() == 0  # its clock restarted when the call let go
    now[0] += 2.0
    assert reg.expire() == 1 and reg.gauges() == (0, 3)
    reg.close()


def test_idle_regions_expire_on_a_server(start_server: Any, obj: Shm) -> None:
    """--region-ttl end to end: the sweeper drops an unused region, the metrics count it, and
    its name is free again."""
    srv = start_server(region_ttl=0.3, metrics_port=0)
    stub = srv.stub()
    _register(stub, "short", obj.key, 4096)
    m = srv.scrape()
    assert sample(m, "attention_regions", "attention_regions") == 1
    assert wait_until(lambda: not stub.ListRegions(pb.ListRegionsRequest(), timeout=10).regions,
                      timeout=10)
    m = srv.scrape()
    assert sample(m, "attention_regions", "attention_regions") == 0
    assert sample(m, "attention_regions_expired", "attention_regions_expired_total") == 1
    _register(stub, "short", obj.key, 4096)  # the name is free again
    stub.UnregisterRegion(pb.UnregisterRegionRequest(), timeout=10)


def test_registration_off_where_it_must_be(start_server: Any, obj: Shm) -> None:
    for overrides in ({"regions": "off"}, {"host": "0.0.0.0"}):  # auto, no auth, not loopback
        srv = start_server(**overrides)
        code, details = _code(lambda srv=srv: _register(srv.stub(), "x", obj.key, 4096))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith("regions")
        info = srv.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        assert info.regions is False
    assert ServerConfig(host="0.0.0.0", auth_token="t").regions_allowed
    assert ServerConfig(host="::1").regions_allowed
    assert ServerConfig(host="localhost").regions_allowed
    assert not ServerConfig(host="10.1.2.3").regions_allowed
    assert ServerConfig(host="10.1.2.3", regions="on").regions_allowed


# ---- requests that name spans -------------------------------------------------------------

def _region_request(
    obj: Shm, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], *,
    name: str = "reg", lse: bool = True, send: tuple[str, ...] = (),
) -> tuple[list[pb.PrefillRequest], dict[str, int]]:
    """q, k, v written into the object (except those in ``send``, which go as chunks); out
    and lse spans after them. Returns the messages and each tensor's offset."""
    offsets = {"q": 0, "k": 64 * 1024, "v": 128 * 1024, "out": 192 * 1024, "lse": 256 * 1024}
    regions = pb.TensorRegions()
    chunks = []
    for name_, t in (("q", q), ("k", k), ("v", v)):
        if name_ in send:
            field = {"q": pb.Q, "k": pb.K, "v": pb.V}[name_]
            data = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            chunks.append(pb.TensorChunk(field=field, offset=0, data=data))
            continue
        span = obj.put(offsets[name_], t)
        span.region = name
        getattr(regions, name_).CopyFrom(span)
    regions.out.CopyFrom(pb.RegionSpan(region=name, offset=offsets["out"],
                                       byte_size=q.numel() * q.element_size()))
    if lse:
        regions.lse.CopyFrom(pb.RegionSpan(region=name, offset=offsets["lse"],
                                           byte_size=q.shape[1] * q.shape[0] * 4))
    header = pb.PrefillHeader(q=spec(q), k=spec(k), v=spec(v), cu_seqlens_q=cu, causal=True,
                              return_lse=lse, regions=regions)
    return [pb.PrefillRequest(header=header, chunks=chunks)], offsets


@pytest.mark.parametrize("send", [(), ("k",)], ids=["all-in-region", "k-as-bytes"])
def test_request_reads_and_writes_the_region(server: ServerHandle, obj: Shm, send) -> None:
    stub = server.stub()
    _register(stub, "reg", obj.key, obj.size)
    try:
        q, k, v = random_qkv(40, 40, 4, 2, 16, torch.float32, seed=7)
        cu = [0, 15, 40]
        obj.bytes[:] = 0xFF  # poison: NaN everywhere the server must write
        msgs, off = _region_request(obj, q, k, v, cu, send=send)
        resp = list(stub.Prefill(iter(msgs), timeout=30))
        assert len(resp) == 1 and resp[0].HasField("stats")  # nothing streamed back
        stats = resp[0].stats
        ref, ref_lse = prefill_oracle(q, k, v, cu, causal=True)
        out, lse = obj.get(off["out"], q), obj.get(off["lse"], torch.empty(4, 40))
        tol = TOLERANCE[torch.float32]
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double(), ref_lse.double(), atol=1e-5, rtol=1e-5)
        kv = k.numel() * 4
        assert stats.bytes_in == (kv if send else 0) and stats.bytes_out == 0
        assert stats.region_bytes_in == q.numel() * 4 + kv * (1 if send else 2)
        assert stats.region_bytes_out == q.numel() * 4 + 4 * 40 * 4  # out, lse [4, 40] float32
    finally:
        stub.UnregisterRegion(pb.UnregisterRegionRequest(name="reg"), timeout=10)


@pytest.mark.parametrize("case", [
    "past_end", "size_mismatch", "unknown_region", "misaligned", "lse_without_return_lse",
    "chunks_for_region_tensor", "no_region_name",
])
def test_bad_spans_are_refused_naming_the_field(server: ServerHandle, obj: Shm, case) -> None:
    stub = server.stub()
    _register(stub, "reg", obj.key, obj.size)
    try:
        q, k, v = random_qkv(8, 8, 2, 1, 8, torch.float32)
        msgs, _ = _region_request(obj, q, k, v, [0, 8], lse=case != "lse_without_return_lse")
        h = msgs[0].header
        expect = {
            "past_end": (grpc.StatusCode.INVALID_ARGUMENT, "header.regions.q"),
            "size_mismatch": (grpc.StatusCode.INVALID_ARGUMENT, "header.regions.k.byte_size"),
            "unknown_region": (grpc.StatusCode.NOT_FOUND, "header.regions.v.region"),
            "misaligned": (grpc.StatusCode.INVALID_ARGUMENT, "header.regions.q.offset"),
            "lse_without_return_lse": (grpc.StatusCode.INVALID_ARGUMENT, "header.regions.lse"),
            "chunks_for_region_tensor": (grpc.StatusCode.INVALID_ARGUMENT, "chunks[q]"),
            "no_region_name": (grpc.StatusCode.INVALID_ARGUMENT, "header.regions.out.region"),
        }[case]
        if case == "past_end":
            h.regions.q.offset = obj.size - 4
        elif case == "size_mismatch":
            h.regions.k.byte_size += 4
        elif case == "unknown_region":
            h.regions.v.region = "nobody"
        elif case == "misaligned":
            h.regions.q.offset = 2
        elif case == "lse_without_return_lse":
            h.regions.lse.CopyFrom(pb.RegionSpan(region="reg", offset=0, byte_size=4))
        elif case == "chunks_for_region_tensor":
            msgs.append(pb.PrefillRequest(chunks=[pb.TensorChunk(field=pb.Q, data=b"\0" * 4)]))
        elif case == "no_region_name":
            h.regions.out.region = ""
        code, details = _code(lambda: list(stub.Prefill(iter(msgs), timeout=30)))
        assert code == expect[0], details
        assert details.startswith(expect[1]), details
        # Refusals leave nothing held: the region is idle and the server keeps serving.
        listed = stub.ListRegions(pb.ListRegionsRequest(), timeout=10).regions
        assert [(r.name, r.inflight) for r in listed] == [("reg", 0)]
    finally:
        stub.UnregisterRegion(pb.UnregisterRegionRequest(name="reg"), timeout=10)


def test_regions_belong_to_their_token(start_server: Any, obj: Shm) -> None:
    srv = start_server(auth_token="token-a,token-b")
    stub = srv.stub()
    a = (("authorization", "Bearer token-a"),)
    b = (("authorization", "Bearer token-b"),)
    _register(stub, "mine", obj.key, obj.size, metadata=a)
    q, k, v = random_qkv(8, 8, 2, 1, 8, torch.float32)
    msgs, off = _region_request(obj, q, k, v, [0, 8], name="mine")
    # Token b names a's region: NOT_FOUND, never the bytes, and nothing written.
    obj.bytes[off["out"] : off["out"] + 64] = 0x7F
    code, details = _code(lambda: list(stub.Prefill(iter(msgs), timeout=30, metadata=b)))
    assert code == grpc.StatusCode.NOT_FOUND and "mine" in details
    assert (obj.bytes[off["out"] : off["out"] + 64] == 0x7F).all()
    assert not stub.ListRegions(pb.ListRegionsRequest(), timeout=10, metadata=b).regions
    code, _ = _code(lambda: stub.UnregisterRegion(pb.UnregisterRegionRequest(name="mine"),
                                                  timeout=10, metadata=b))
    assert code == grpc.StatusCode.NOT_FOUND
    # Token b names a's object by its key (anyone on the host can list /dev/shm): refused
    # while a has it registered, under any name, with the same key spelled either way.
    for key in (obj.key, "/" + obj.key.lstrip("/")):
        code, details = _code(lambda key=key: _register(stub, "stolen", key, 4096, metadata=b))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "system.key" in details
    other = Shm()
    try:
        _register(stub, "mine", other.key, 4096, metadata=b)  # b's own namespace and object
        resp = list(stub.Prefill(iter(msgs), timeout=30, metadata=a))  # a's call still works
        assert resp[-1].HasField("stats")
        _register(stub, "again", obj.key, 4096, metadata=a)  # a may name its object twice
        stub.UnregisterRegion(pb.UnregisterRegionRequest(), timeout=10, metadata=a)  # all a's
        _register(stub, "now_mine", obj.key, 4096, metadata=b)  # free again: b may take it
    finally:
        other.close()
    code, _ = _code(lambda: _register(stub, "x", obj.key, 4096))  # no token at all
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_region_dropped_and_unmapped_while_a_call_uses_it(start_server: Any) -> None:
    backend = GatedBackend()
    srv = start_server(backend=backend)
    stub = srv.stub()
    client_side = Shm()  # the client's mapping; the test keeps a second one to look at
    watcher = shm.map_object(client_side.key, 0, client_side.size)
    _register(stub, "going", client_side.key, client_side.size)
    q, k, v = random_qkv(16, 16, 2, 1, 8, torch.float32, seed=3)
    msgs, off = _region_request(client_side, q, k, v, [0, 16], name="going")
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(lambda: list(stub.Prefill(iter(msgs), timeout=30)))
        assert backend.entered.wait(10)  # in the engine, holding the region
        listed = stub.ListRegions(pb.ListRegionsRequest(), timeout=10).regions
        assert [(r.name, r.inflight) for r in listed] == [("going", 1)]
        # The client drops it and unmaps and unlinks its object, mid-call.
        assert stub.UnregisterRegion(pb.UnregisterRegionRequest(name="going"),
                                     timeout=10).released == 1
        client_side.close()
        assert not stub.ListRegions(pb.ListRegionsRequest(), timeout=10).regions
        code, details = _code(lambda: list(stub.Prefill(iter(msgs), timeout=30)))
        assert code == grpc.StatusCode.NOT_FOUND and "going" in details  # new calls: gone
        backend.release.set()
        resp = fut.result(30)
    assert resp[-1].HasField("stats")  # the call that held it finishes, correct
    out = torch.from_numpy(np.frombuffer(watcher.view, np.uint8)[off["out"]:off["out"] + 16 * 64]
                           .copy()).view(torch.float32).view(16, 2, 8)
    ref, _ = prefill_oracle(q, k, v, [0, 16], causal=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    watcher.close()


def test_regions_rpcs_need_the_token(start_server: Any, obj: Shm) -> None:
    srv = start_server(auth_token="t")
    code, _ = _code(lambda: srv.stub().ListRegions(pb.ListRegionsRequest(), timeout=10))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    stub = pb_grpc.AttentionServiceStub(srv.channel())
    reply = stub.ListRegions(pb.ListRegionsRequest(), timeout=10,
                             metadata=(("authorization", "Bearer t"),))
    assert not reply.regions


def test_concurrent_region_calls_under_batching(start_server: Any, obj: Shm) -> None:
    srv = start_server(batching=True)
    stub = srv.stub()
    _register(stub, "reg", obj.key, obj.size)
    reqs = []
    for i in range(8):  # each call in its own 96 KiB slice of the object
        q, k, v = random_qkv(12, 12, 2, 1, 8, torch.float32, seed=40 + i)
        base = i * 96 * 1024
        regions = pb.TensorRegions()
        for j, (name, t) in enumerate((("q", q), ("k", k), ("v", v))):
            span = obj.put(base + j * 8192, t)
            span.region = "reg"
            getattr(regions, name).CopyFrom(span)
        regions.out.CopyFrom(pb.RegionSpan(region="reg", offset=base + 4 * 8192,
                                           byte_size=q.numel() * 4))
        header = pb.PrefillHeader(q=spec(q), k=spec(k), v=spec(v), cu_seqlens_q=[0, 12],
                                  causal=True, regions=regions)
        reqs.append(([pb.PrefillRequest(header=header)], q, k, v, base + 4 * 8192))
    barrier = threading.Barrier(8)

    def go(r):  # type: ignore[no-untyped-def]
        barrier.wait(10)
        return list(stub.Prefill(iter(r[0]), timeout=30))

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(go, reqs))
    for (_, q, k, v, out_at), resp in zip(reqs, results, strict=True):
        assert resp[-1].HasField("stats")
        ref, _ = prefill_oracle(q, k, v, [0, 12], causal=True)
        torch.testing.assert_close(obj.get(out_at, q).double(), ref, atol=2e-5, rtol=2e-5)


def test_ipc_mappings_open_each_allocation_once() -> None:
    """CUDA maps an IPC handle once per process: regions of one allocation share a mapping,
    closed with the last of them; a failed open leaves nothing counted."""
    from attention_service.engine.regions import IpcMappings

    opened: list[bytes] = []
    closed: list[int] = []

    def open_handle(handle: bytes) -> tuple[int, int]:
        if handle == b"bad":
            raise ValueError("not a handle")
        opened.append(handle)
        return 1000 * len(opened), 4096

    maps = IpcMappings(open_handle, closed.append)
    assert maps.open(b"a") == (1000, 4096)
    assert maps.open(b"a") == (1000, 4096)  # the same mapping, not a second open
    assert maps.open(b"b") == (2000, 4096)
    assert opened == [b"a", b"b"] and len(maps) == 2
    with pytest.raises(ValueError):
        maps.open(b"bad")
    assert len(maps) == 2
    maps.release(b"a")
    assert closed == []  # one region of "a" still uses it
    maps.release(b"a")
    maps.release(b"b")
    assert closed == [1000, 2000] and len(maps) == 0
    assert maps.open(b"a") == (3000, 4096)  # opened afresh after its last close


@pytest.mark.parametrize("kind", ["symlink", "directory", "fifo", "device"])
def test_an_object_that_is_not_shared_memory_is_refused_without_a_path(
    server: ServerHandle, obj: Shm, kind: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A key naming a symbolic link (to a real object: never followed), a directory, a FIFO or
    a device node: INVALID_ARGUMENT naming system.key with the caller's key, no server path,
    no traceback in the log, nothing registered."""
    import os
    import stat

    from attention_wire import shm

    key = f"attention-test-{kind}-{os.getpid()}"
    path = os.path.join(shm.SHM_DIR, key)
    try:
        if kind == "symlink":
            os.symlink(os.path.join(shm.SHM_DIR, obj.key), path)
        elif kind == "directory":
            os.mkdir(path)
        elif kind == "fifo":
            os.mkfifo(path)
        else:
            try:
                os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # like /dev/null
            except PermissionError:
                pytest.skip("mknod needs root")
        req = pb.RegisterRegionRequest(name=f"x-{kind}", byte_size=4096,
                                       system=pb.SystemRegion(key=key))
        code, details = _code(lambda: server.stub().RegisterRegion(req, timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.startswith("system.key") and key in details, details
        assert shm.SHM_DIR not in details, details
        assert "Traceback" not in caplog.text
        assert server.stub().ListRegions(pb.ListRegionsRequest(), timeout=10).regions == []
    finally:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        elif os.path.lexists(path):
            os.unlink(path)


def test_gpu_mirrors_have_their_own_bound_apart_from_host_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A NIXL region of GPU memory takes a mirror on the server's GPU: it counts against
    --gpu-region-bytes-per-caller, not the host bytes of --system-region-bytes-per-caller, and
    a NIXL region of host memory the other way round (mirrors stood in for by host tensors)."""
    from attention_service.engine import regions as regions_mod
    from attention_service.errors import RequestError

    class _Cuda:  # VRAM regions are a cuda server's
        name = "cuda"

    def fake_open(self: Any, owner: str, src: Any, memory: str, nbytes: int) -> Any:
        return torch.zeros(nbytes, dtype=torch.uint8), lambda: None, None

    monkeypatch.setattr(regions_mod.RegionRegistry, "_open_nixl", fake_open)
    reg = regions_mod.RegionRegistry(_Cuda(), allowed=True, system_bytes_per_owner=MiB,
                                     gpu_bytes_per_owner=MiB // 2)

    def nixl(name: str, size: int, memory: str) -> Any:
        return pb.RegisterRegionRequest(name=name, byte_size=size, nixl=pb.NixlRegion(
            agent_name="agent", agent_metadata=b"m", address=4096, memory=memory))

    reg.register("a", nixl("gpu", MiB // 2, "VRAM"))  # the GPU bound, exactly
    reg.register("a", nixl("host", MiB, "DRAM"))  # the host bound, exactly: GPU not counted
    for name, size, memory, flag in (("gpu2", 1, "VRAM", "--gpu-region-bytes-per-caller"),
                                     ("host2", 1, "DRAM", "--system-region-bytes-per-caller")):
        with pytest.raises(RequestError) as info:
            reg.register("a", nixl(name, size, memory))
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.details.startswith("byte_size") and flag in info.value.details
    reg.register("b", nixl("gpu", MiB // 2, "VRAM"))  # per caller
    with pytest.raises(RequestError) as info:  # the kind is read before any bound
        reg.register("a", nixl("odd", 1, "vram"))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details.startswith("nixl.memory")
    assert reg.unregister("a", "gpu") == 1
    reg.register("a", nixl("gpu2", MiB // 2, "VRAM"))  # room again
    reg.close()
