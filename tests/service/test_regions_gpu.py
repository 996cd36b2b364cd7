"""CUDA IPC regions (and system regions page-locked by the cuda backend) on the GPU: the bytes
never leave the device; wrong device, bad handle and bounds are refused naming the field; a
region dropped while its call runs. Skipped without a GPU.

Client and server are always separate processes here: CUDA refuses to open an IPC handle in
the process that exported it (error 201), so an in-process server could not take a region of
its own test process."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from attention_client import AttentionClient
from attention_kernels import decode_ref, prefill_ref
from attention_wire import cuda_ipc
from attention_wire.pb import attention_pb2 as pb

from .batch_helpers import Steps
from .group_helpers import Group
from .svc_helpers import ServerHandle, make_config

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
BF16 = 3.2e-2
CU = [0, 100, 130, 387]


@pytest.fixture(scope="module")
def gpu_server():  # type: ignore[no-untyped-def]
    g = Group(1, "--no-warmup", device="cuda", timeout=240)  # one process, not this one
    yield g
    assert g.stop() == 0


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


def test_cuda_region_through_a_process_group() -> None:
    g = Group(2, "--no-warmup", device="cuda", timeout=240)
    try:
        _check_calls(g.target)
    finally:
        assert g.stop() == 0


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
