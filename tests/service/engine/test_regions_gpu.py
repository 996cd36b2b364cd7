"""CUDA IPC regions (and system regions page-locked by the cuda backend) on the GPU: the bytes
never leave the device; wrong device, bad handle, and spans out of bounds, of the wrong size,
misaligned or in no region are refused naming the field; regions belong to their token; a
region dropped while its call runs. Skipped without a GPU.

Client and server are always separate processes here: CUDA refuses to open an IPC handle in
the process that exported it (error 201), so an in-process server could not take a region of
its own test process."""

from __future__ import annotations

import os
import socket
import tempfile
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from attention_client import AttentionClient
from attention_kernels import decode_ref, prefill_ref
from attention_wire import cuda_ipc
from attention_wire.messages import SOCKET_FRAME, STEP_SOCKET_HELLO
from attention_wire.pb import attention_pb2 as pb

from ..batch_helpers import Steps
from ..group_helpers import Group
from ..svc_helpers import ServerHandle, make_config, spec

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
BF16 = 3.2e-2
CU = [0, 100, 130, 387]


@pytest.fixture(scope="module")
def gpu_server():  # type: ignore[no-untyped-def]
    # One process, not this one; with a step socket (test_cache_decode_steps_...).
    g = Group(1, "--no-warmup", "--step-socket", _socket_path(), device="cuda", timeout=240)
    yield g
    assert g.stop() == 0


def _socket_path() -> str:
    return os.path.join(tempfile.mkdtemp(dir="/tmp"), "steps.sock")


def _qkv(seed: int, dtype: torch.dtype = torch.bfloat16, total: int = 387):  # type: ignore[no-untyped-def]
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(total, h, 128, generator=g, device="cuda").to(dtype) for h in (16, 4, 4))


def _ref(q, k, v, cu=CU):  # type: ignore[no-untyped-def]
    return prefill_ref(q.double(), k.double(), v.double(), torch.tensor(cu, dtype=torch.int32,
                       device=q.device), causal=True, return_lse=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _check_calls(target: str) -> None:
    with AttentionClient(target, timeout=120) as c:
        region = c.register_cuda(64 << 20)
        assert region.kind == "cuda"
        q, k, v = (region.empty(t.shape, t.dtype) for t in _qkv(0))
        for t, src in zip((q, k, v), _qkv(1), strict=True):
            t.copy_(src)
        out, lse = c.attention(q, k, v, torch.tensor(CU), causal=True, return_lse=True)
        ref, ref_lse = _ref(q, k, v)
        assert out.is_cuda and out.dtype == torch.bfloat16 and _rel(out, ref) < BF16
        torch.testing.assert_close(lse.double(), ref_lse.double(), atol=2e-3, rtol=0)
        s = c.last_stats
        assert s is not None and s["bytes_in"] == 0 and s["bytes_out"] == 0
        assert s["region_bytes_in"] == (q.numel() + 2 * k.numel()) * 2
        # In place: the kernel writes the caller's own tensor.
        dst = region.empty(q.shape, q.dtype).fill_(float("nan"))
        assert c.attention(q, k, v, torch.tensor(CU), causal=True, out=dst) is dst
        assert _rel(dst, ref) < BF16
        # CUDA tensors outside the region are staged device to device.
        q2, k2, v2 = _qkv(2)
        out2 = c.attention(q2, k2, v2, torch.tensor(CU), causal=True)
        assert c.last_stats["bytes_in"] == 0 and _rel(out2, _ref(q2, k2, v2)[0]) < BF16  # type: ignore[index]
        # Decode through the region.
        qd = q2[:3].contiguous()
        od = c.decode(qd, k2, v2, torch.tensor(CU))
        cu = torch.tensor(CU, dtype=torch.int32, device="cuda")
        assert _rel(od, decode_ref(qd.double(), k2.double(), v2.double(), cu)) < BF16


def test_cuda_region_one_process(gpu_server) -> None:  # type: ignore[no-untyped-def]
    _check_calls(gpu_server.target)


def test_cuda_region_through_a_process_group(gpu_group) -> None:  # type: ignore[no-untyped-def]
    _check_calls(gpu_group.target)


def test_system_region_is_page_locked_on_cuda(gpu_server) -> None:  # type: ignore[no-untyped-def]
    with AttentionClient(gpu_server.target, timeout=120) as c:
        c.register_shm(64 << 20)
        q, k, v = (t.cpu() for t in _qkv(3))
        out = c.attention(q, k, v, torch.tensor(CU), causal=True)
        assert not out.is_cuda and _rel(out, _ref(q, k, v)[0].cpu()) < BF16
        assert c.last_stats["bytes_in"] == 0 and c.last_stats["h2d_seconds"] > 0  # type: ignore[index]


def _register_raw(stub, **cuda):  # type: ignore[no-untyped-def]
    req = pb.RegisterRegionRequest(name="raw", byte_size=1 << 20, cuda=pb.CudaRegion(**cuda))
    return stub.RegisterRegion(req, timeout=30)


def test_bad_cuda_registrations_name_the_field(gpu_server) -> None:  # type: ignore[no-untyped-def]
    torch.cuda.set_device(0)  # the driver API needs the primary context current (cuda_ipc)
    mem = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    exp = cuda_ipc.export(mem.data_ptr())
    uuid = cuda_ipc.device_uuid(0)
    stub = gpu_server.stub()
    cases = [
        (dict(ipc_handle=exp.handle, device_uuid=b"\x01" * 16, offset=exp.offset),
         "cuda.device_uuid"),
        (dict(ipc_handle=b"\x00" * 64, device_uuid=uuid), "cuda.ipc_handle"),
        (dict(ipc_handle=exp.handle[:10], device_uuid=uuid), "cuda.ipc_handle"),
        (dict(ipc_handle=exp.handle, device_uuid=uuid, offset=exp.allocation_bytes),
         "cuda"),
    ]
    for fields, field in cases:
        with pytest.raises(grpc.RpcError) as info:
            _register_raw(stub, **fields)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert info.value.details().startswith(field), info.value.details()
    assert not stub.ListRegions(pb.ListRegionsRequest(), timeout=10).regions


def _span(region, t: torch.Tensor) -> pb.RegionSpan:  # type: ignore[no-untyped-def]
    off = region.locate(t)
    assert off is not None
    return pb.RegionSpan(region=region.name, offset=off, byte_size=t.numel() * t.element_size())


def _raw_request(region, q, k, v, out, lse) -> pb.PrefillRequest:  # type: ignore[no-untyped-def]
    """A request whose five tensors are all spans of one CUDA region (no bytes at all)."""
    regions = pb.TensorRegions(q=_span(region, q), k=_span(region, k), v=_span(region, v),
                               out=_span(region, out), lse=_span(region, lse))
    header = pb.PrefillHeader(q=spec(q), k=spec(k), v=spec(v), cu_seqlens_q=CU, causal=True,
                              return_lse=True, regions=regions)
    return pb.PrefillRequest(header=header)


def _region_tensors(region, seed: int):  # type: ignore[no-untyped-def]
    """q, k, v copied into ``region``; out and lse there too, poisoned with NaN."""
    q, k, v = (region.empty(t.shape, t.dtype).copy_(t) for t in _qkv(seed))
    out = region.empty(q.shape, q.dtype).fill_(float("nan"))
    lse = region.empty((q.shape[1], q.shape[0]), torch.float32).fill_(float("nan"))
    torch.cuda.synchronize()
    return q, k, v, out, lse


CUDA_SPAN_CASES = {
    "past_end": (grpc.StatusCode.INVALID_ARGUMENT, "header.regions.q"),
    "size_mismatch": (grpc.StatusCode.INVALID_ARGUMENT, "header.regions.k.byte_size"),
    "misaligned": (grpc.StatusCode.INVALID_ARGUMENT, "header.regions.q.offset"),
    "lse_misaligned": (grpc.StatusCode.INVALID_ARGUMENT, "header.regions.lse.offset"),
    "out_too_small": (grpc.StatusCode.INVALID_ARGUMENT, "header.regions.out.byte_size"),
    "unknown_region": (grpc.StatusCode.NOT_FOUND, "header.regions.v.region"),
}


@pytest.fixture(scope="module")
def gpu_group():  # type: ignore[no-untyped-def]
    g = Group(2, "--no-warmup", "--step-socket", _socket_path(), device="cuda", timeout=240)
    yield g
    assert g.stop() == 0


@pytest.mark.parametrize("server", ["gpu_server", "gpu_group"])
def test_bad_cuda_spans_are_refused_naming_the_field(request, server: str) -> None:  # type: ignore[no-untyped-def]
    """The system-region bounds cases of test_regions.py, in a CUDA IPC region, on one
    process and through a group: a span past the region's end, of the wrong size, misaligned
    for its dtype, or in no region is refused naming the field, nothing is written, and the
    region stays idle and usable."""
    srv = request.getfixturevalue(server)
    stub = srv.stub()
    with AttentionClient(srv.target, timeout=120) as c:
        region = c.register_cuda(4 << 20)
        q, k, v, out, lse = _region_tensors(region, 21)
        # The well-formed request first: the raw path computes into the region.
        resp = list(stub.Prefill(iter([_raw_request(region, q, k, v, out, lse)]), timeout=60))
        assert len(resp) == 1 and resp[0].stats.bytes_in == 0 and resp[0].stats.bytes_out == 0
        torch.cuda.synchronize()
        ref, ref_lse = _ref(q, k, v)
        assert _rel(out, ref) < BF16
        torch.testing.assert_close(lse.double(), ref_lse.double(), atol=2e-3, rtol=0)
        for case, (code, field) in CUDA_SPAN_CASES.items():
            out.fill_(float("nan"))
            torch.cuda.synchronize()
            msg = _raw_request(region, q, k, v, out, lse)
            r = msg.header.regions
            if case == "past_end":
                r.q.offset = region.nbytes - 2
            elif case == "size_mismatch":
                r.k.byte_size += 2
            elif case == "misaligned":
                r.q.offset += 1  # bfloat16: odd offsets are misaligned
            elif case == "lse_misaligned":
                r.lse.offset += 2  # float32
            elif case == "out_too_small":
                r.out.byte_size -= 2
            elif case == "unknown_region":
                r.v.region = "nobody"
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Prefill(iter([msg]), timeout=60))
            assert info.value.code() == code, (case, info.value.details())
            assert info.value.details().startswith(field), (case, info.value.details())
            torch.cuda.synchronize()
            assert torch.isnan(out).all(), case  # refused before the kernel: nothing written
            listed = stub.ListRegions(pb.ListRegionsRequest(), timeout=10).regions
            assert [(x.name, x.inflight) for x in listed] == [(region.name, 0)], case
        # Still usable after every refusal.
        list(stub.Prefill(iter([_raw_request(region, q, k, v, out, lse)]), timeout=60))
        torch.cuda.synchronize()
        assert _rel(out, ref) < BF16


def test_cuda_regions_belong_to_their_token() -> None:
    """With auth on (a group of two front ends), a CUDA region is its token's: another token
    naming it gets NOT_FOUND (never the bytes, nothing written), cannot list, unregister or
    register its allocation, and has a namespace of its own."""
    g = Group(2, "--no-warmup", "--auth-token", "token-a,token-b", device="cuda", timeout=240)
    b_md = (("authorization", "Bearer token-b"),)
    try:
        stub = g.stub()
        with AttentionClient(g.target, token="token-a", timeout=120) as a, \
                AttentionClient(g.target, token="token-b", timeout=120) as b:
            region = a.register_cuda(4 << 20)
            q, k, v, out, lse = _region_tensors(region, 22)
            out.fill_(7.0)
            torch.cuda.synchronize()
            msg = _raw_request(region, q, k, v, out, lse)
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Prefill(iter([msg]), timeout=60, metadata=b_md))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()
            assert region.name in info.value.details()
            torch.cuda.synchronize()
            assert (out == 7.0).all()  # b's call wrote nothing into a's memory
            assert b.list_regions() == []
            with pytest.raises(grpc.RpcError) as info:
                stub.UnregisterRegion(pb.UnregisterRegionRequest(name=region.name), timeout=10,
                                      metadata=b_md)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            assert [r["name"] for r in a.list_regions()] == [region.name]  # still a's
            # b cannot register a's allocation itself (were its handle to leak).
            exp = cuda_ipc.export(region.locate(q) + region._memory.data_ptr())
            with pytest.raises(grpc.RpcError) as info:
                stub.RegisterRegion(pb.RegisterRegionRequest(
                    name="stolen", byte_size=1 << 20, cuda=pb.CudaRegion(
                        ipc_handle=exp.handle, device_uuid=cuda_ipc.device_uuid(0),
                        offset=exp.offset)), timeout=30, metadata=b_md)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert info.value.details().startswith("cuda.ipc_handle"), info.value.details()
            # b's own region under the same name: a namespace of its own (a system region:
            # two CUDA regions of this one process may share an allocation, as above).
            with b.register_shm(1 << 20, name=region.name):
                assert [r["name"] for r in b.list_regions()] == [region.name]
            # a's request, by a: computed into a's region.
            list(stub.Prefill(iter([msg]), timeout=60,
                              metadata=(("authorization", "Bearer token-a"),)))
            torch.cuda.synchronize()
            assert _rel(out, _ref(q, k, v)[0]) < BF16
        with pytest.raises(grpc.RpcError) as info:  # no token: refused before any lookup
            stub.ListRegions(pb.ListRegionsRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        assert g.stop() == 0


def test_regions_of_one_allocation_share_its_mapping(gpu_server) -> None:  # type: ignore[no-untyped-def]
    """Two regions in one CUDA allocation (what torch's caching allocator does to two small
    regions of one process): both serve, and the allocation stays mapped for the second when
    the first is unregistered (the server shares one mapping: some drivers open a handle only
    once per process)."""
    torch.cuda.set_device(0)
    mem = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
    exp = cuda_ipc.export(mem.data_ptr())
    uuid = cuda_ipc.device_uuid(0)
    stub = gpu_server.stub()
    half = 4 << 20
    for name, start in (("lo", 0), ("hi", half)):
        stub.RegisterRegion(pb.RegisterRegionRequest(
            name=name, byte_size=half, cuda=pb.CudaRegion(
                ipc_handle=exp.handle, device_uuid=uuid, offset=exp.offset + start)), timeout=30)
    try:
        assert sorted(r.name for r in stub.ListRegions(pb.ListRegionsRequest(),
                                                       timeout=10).regions) == ["hi", "lo"]
        q, k, v = _qkv(24)
        nb = [t.numel() * t.element_size() for t in (q, k, v)]
        offs = [0, nb[0], nb[0] + nb[1]]  # q, k, v in "lo"; out in "hi"
        for t, off in zip((q, k, v), offs, strict=True):
            mem[off : off + t.numel() * 2].view(torch.bfloat16).copy_(t.view(-1))
        out = mem[half : half + nb[0]].view(torch.bfloat16).view(q.shape)

        def call() -> None:
            out.fill_(float("nan"))
            torch.cuda.synchronize()
            regions = pb.TensorRegions(out=pb.RegionSpan(region="hi", offset=0, byte_size=nb[0]))
            for name, n, off in zip(("q", "k", "v"), nb, offs, strict=True):
                getattr(regions, name).CopyFrom(pb.RegionSpan(region="lo", offset=off,
                                                              byte_size=n))
            header = pb.PrefillHeader(q=spec(q), k=spec(k), v=spec(v), cu_seqlens_q=CU,
                                      causal=True, regions=regions)
            list(stub.Prefill(iter([pb.PrefillRequest(header=header)]), timeout=60))
            torch.cuda.synchronize()
            assert _rel(out, _ref(q, k, v)[0]) < BF16

        call()
        assert stub.UnregisterRegion(pb.UnregisterRegionRequest(name="hi"), timeout=10).released
        out = mem[half + nb[0] : half + 2 * nb[0]].view(torch.bfloat16).view(q.shape)
        stub.RegisterRegion(pb.RegisterRegionRequest(  # "hi" again, same allocation
            name="hi", byte_size=nb[0], cuda=pb.CudaRegion(
                ipc_handle=exp.handle, device_uuid=uuid, offset=exp.offset + half + nb[0])),
            timeout=30)
        call()  # "lo" kept the mapping open meanwhile
    finally:
        stub.UnregisterRegion(pb.UnregisterRegionRequest(), timeout=10)
    assert not stub.ListRegions(pb.ListRegionsRequest(), timeout=10).regions


def _client_that_drops_its_region(target: str, conn) -> None:  # type: ignore[no-untyped-def]
    """Runs in a child process: a call into its CUDA region, and the region closed mid-call."""
    with AttentionClient(target, timeout=120) as c:
        region = c.register_cuda(64 << 20)
        q, k, v = (region.empty(t.shape, t.dtype).copy_(t) for t in _qkv(5))
        dst = region.empty(q.shape, q.dtype).fill_(float("nan"))
        torch.cuda.synchronize()
        conn.send("registered")
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(lambda: c.attention(q, k, v, torch.tensor(CU), causal=True,
                                                  out=dst))
            assert conn.recv() == "close"
            region.close()  # unregistered mid-call: the server keeps its mapping
            conn.send(("closed", c.list_regions()))
            result = fut.result(120)
        torch.cuda.synchronize()
        conn.send(("done", result is dst, _rel(dst, _ref(q, k, v)[0])))


def test_cuda_region_dropped_while_its_call_runs() -> None:
    import multiprocessing as mp

    from attention_service.engine.backends import CudaBackend

    class Held(Steps, CudaBackend):
        pass

    backend = Held()
    backend.open_all()
    backend.warmup()
    backend.reset()
    handle = ServerHandle(make_config(device="cuda", metrics_port=0, warmup=False),
                          backend=backend)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_client_that_drops_its_region, args=(handle.target, child))
    proc.start()
    try:
        assert parent.poll(120) and parent.recv() == "registered"
        assert backend.wait_launches(1, timeout=60)  # the call is held inside the engine
        parent.send("close")
        assert parent.poll(60)
        tag, listed = parent.recv()
        assert tag == "closed" and listed == []  # gone for new calls already
        backend.open_all()
        assert parent.poll(120)
        tag, same, err = parent.recv()
        assert tag == "done" and same and err < BF16  # the held call finished, correct
    finally:
        backend.open_all()
        proc.join(60)
        handle.close()
    assert proc.exitcode == 0


def test_process_group_bytes_through_pinned_arenas_and_overflow() -> None:
    """gRPC bytes through a group on cuda: requests that fit the (pinned) arena and one that
    does not (a one-off segment); every answer against the reference."""
    g = Group(2, "--no-warmup", "--arena-bytes", str(8 << 20), device="cuda", timeout=240)
    try:
        with AttentionClient(g.target, timeout=120) as c:
            for total in (387, 8192):  # ~2.6 MB (fits) and ~50 MB (overflows 8 MiB)
                cu = [0, total // 3, total]
                q, k, v = (t.cpu() for t in _qkv(7, total=total))
                out = c.attention(q, k, v, torch.tensor(cu), causal=True)
                assert _rel(out, _ref(q, k, v, cu)[0].cpu()) < BF16
                assert c.last_stats["bytes_in"] > 0  # type: ignore[index]
    finally:
        assert g.stop() == 0


@pytest.mark.parametrize("via", ["grpc", "socket"])
@pytest.mark.parametrize("server", ["gpu_server", "gpu_group"])
def test_cache_decode_steps_through_a_cuda_region(request, server: str, via: str) -> None:  # type: ignore[no-untyped-def]
    """A decode loop on server-side caches with q, the new tokens and out in a CUDA IPC
    region, through a CacheDecodeSteps stream or the step socket: no tensor bytes on the
    wire, answers within bf16 tolerance of the float64 reference, the tokens kept; a span
    past the region's end is refused naming the field before any cache changes."""
    target = request.getfixturevalue(server).target
    ids = [f"cuda-step-{i}" for i in range(5)]
    lens = [7, 64, 65, 130, 1]
    with AttentionClient(target, timeout=120) as c, c.kv_cache(4, 128, "bfloat16") as cache:
        region = c.register_cuda(8 << 20)
        g = torch.Generator(device="cuda").manual_seed(7)
        prompt = torch.randn(sum(lens), 4, 128, generator=g, device="cuda").bfloat16()
        cache.append(ids, prompt, prompt, [0, *torch.tensor(lens).cumsum(0).tolist()])
        keys = list(torch.split(prompt, lens))
        q = region.empty((5, 16, 128), torch.bfloat16)
        kn = region.empty((5, 4, 128), torch.bfloat16)
        out = region.empty((5, 16, 128), torch.bfloat16)
        with c.decode_steps(step_socket=via == "socket") as steps:
            for _ in range(3):
                q.copy_(torch.randn(5, 16, 128, generator=g, device="cuda"))
                kn.copy_(torch.randn(5, 4, 128, generator=g, device="cuda"))
                out.fill_(float("nan"))
                got = steps.step(q, ids, kn, kn, out=out)
                torch.cuda.synchronize()
                keys = [torch.cat([k, kn[i : i + 1]]) for i, k in enumerate(keys)]
                cu = [0, *torch.tensor([len(k) for k in keys]).cumsum(0).tolist()]
                packed = torch.cat(keys).double()
                ref = decode_ref(q.double(), packed, packed,
                                 torch.tensor(cu, dtype=torch.int32, device="cuda"))
                assert got is out and _rel(out, ref) < BF16
                s = c.last_stats
                assert s is not None and s["bytes_in"] == 0 and s["bytes_out"] == 0
                assert s["cache_lengths"] == [len(k) for k in keys]
        before = [i["length"] for i in cache.info()]
        stub_channel = c._base_channels[0]
        call = stub_channel.stream_stream("/attention.v1.AttentionService/CacheDecode",
                                          request_serializer=pb.DecodeRequest.SerializeToString,
                                          response_deserializer=pb.AttentionResponse.FromString)
        header = pb.DecodeHeader(
            q=spec(q), k=spec(kn), v=spec(kn), cache=pb.CacheTarget(cache_ids=ids, store=True),
            regions=pb.TensorRegions(
                q=pb.RegionSpan(region=region.name, offset=(8 << 20) - 4096, byte_size=20480),
                k=pb.RegionSpan(region=region.name, offset=0, byte_size=5120),
                v=pb.RegionSpan(region=region.name, offset=8192, byte_size=5120)))
        if via == "grpc":
            with pytest.raises(grpc.RpcError) as err:
                list(call(iter([pb.DecodeRequest(header=header)])))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "header.regions.q" in err.value.details()
        else:
            error = _socket_step(c.info()["step_socket"],
                                 pb.DecodeRequest(header=header).SerializeToString()).error
            assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "header.regions.q" in error.details
        assert [i["length"] for i in cache.info()] == before


def _socket_step(path: str, message: bytes) -> pb.AttentionResult:
    """One step's answer through the step socket at ``path``, spoken by hand."""
    def frame(payload: bytes) -> bytes:
        return SOCKET_FRAME.pack(len(payload)) + payload

    def read(sock: socket.socket) -> bytes:
        data, head = b"", SOCKET_FRAME.size
        while len(data) < head or len(data) < head + SOCKET_FRAME.unpack_from(data)[0]:
            more = sock.recv(1 << 16)
            assert more, "the step socket closed"
            data += more
        return data[head:]

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(60)
        sock.connect(path)
        sock.sendall(frame(STEP_SOCKET_HELLO))
        assert not pb.AttentionResult.FromString(read(sock)).HasField("error")
        sock.sendall(frame(message))
        return pb.AttentionResult.FromString(read(sock))


@pytest.mark.parametrize("server", ["gpu_server", "gpu_group"])
def test_cache_append_and_prefill_through_a_cuda_region(request, server: str) -> None:  # type: ignore[no-untyped-def]
    """AppendKV and CachePrefill with their tensors in a CUDA IPC region (q, k, v and out=):
    no tensor bytes on the wire, answers within bf16 tolerance of the float64 reference over
    everything each cache holds, the tokens kept (odd lengths, a sequence of one token)."""
    target = request.getfixturevalue(server).target
    ids = [f"cuda-prefill-{i}" for i in range(3)]
    lens, new = [5, 130, 64], [1, 77, 9]
    with AttentionClient(target, timeout=120) as c, c.kv_cache(4, 128, "bfloat16") as cache:
        region = c.register_cuda(16 << 20)
        g = torch.Generator(device="cuda").manual_seed(11)

        def filled(shape: tuple[int, ...]) -> torch.Tensor:
            t = region.empty(shape, torch.bfloat16)
            return t.copy_(torch.randn(shape, generator=g, device="cuda"))

        k0, v0 = filled((sum(lens), 4, 128)), filled((sum(lens), 4, 128))
        assert cache.append(ids, k0, v0, [0, *torch.tensor(lens).cumsum(0).tolist()]) == lens
        s = c.last_stats
        assert s is not None and s["bytes_in"] == 0 and s["region_bytes_in"] == 2 * k0.nbytes
        q, kn, vn = filled((sum(new), 16, 128)), filled((sum(new), 4, 128)), filled(
            (sum(new), 4, 128))
        out = region.empty(q.shape, torch.bfloat16).fill_(float("nan"))
        cu_new = [0, *torch.tensor(new).cumsum(0).tolist()]
        got = cache.prefill(q, ids, kn, vn, cu_new, cu_new, out=out)
        torch.cuda.synchronize()
        s = c.last_stats
        assert got is out and s is not None and s["bytes_in"] == 0 and s["bytes_out"] == 0
        assert s["cache_lengths"] == [a + b for a, b in zip(lens, new, strict=True)]
        keys = [torch.cat([a, b]) for a, b in zip(torch.split(k0, lens), torch.split(kn, new),
                                                  strict=True)]
        vals = [torch.cat([a, b]) for a, b in zip(torch.split(v0, lens), torch.split(vn, new),
                                                  strict=True)]
        cu_all = [0, *torch.tensor([len(k) for k in keys]).cumsum(0).tolist()]
        ref = prefill_ref(q.double(), torch.cat(keys).double(), torch.cat(vals).double(),
                          torch.tensor(cu_new, dtype=torch.int32, device="cuda"),
                          torch.tensor(cu_all, dtype=torch.int32, device="cuda"), causal=True)
        assert _rel(out, ref) < BF16
