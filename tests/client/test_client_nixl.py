"""``register_nixl`` against the real server (cpu backend), one process and a process group:
tensors in a NIXL region, or staged into it, reach the engine over UCX and outputs come back
the same way, nothing as gRPC bytes; sync and async; registered again after a server restart.
Skipped without NIXL (``pip install 'attention-client[nixl]'``)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import tempfile
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch

from attention_client import AsyncAttentionClient, AttentionClient
from attention_client._call_streams import SocketStream
from attention_kernels import decode_ref, prefill_ref
from attention_wire.pb import attention_pb2 as pb

from ._server import RunningServer, require_server, start_server

pytest.importorskip("nixl_cu13")
pytestmark = pytest.mark.timeout(120)
CU = [0, 10, 30]


@pytest.fixture(scope="module", params=["1", "2"], ids=["one-process", "two-frontends"])
def srv(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    require_server()
    running = start_server("--frontends", request.param, "--metrics-port", "0")
    yield running
    running.stop()


def _ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return prefill_ref(q.double(), k.double(), v.double(), torch.tensor(CU, dtype=torch.int32),
                       causal=True, return_lse=True)


def _qkv(dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=g).to(dtype)
                 for s in ((30, 4, 16), (30, 2, 16), (30, 2, 16)))


def _attention_in_region(c: AttentionClient, region: object, seed: int) -> None:
    """q, k, v placed in ``region``: the answer matches the float64 reference, and no tensor
    byte went as gRPC bytes."""
    q, k, v = (region.empty(t.shape, torch.float32) for t in _qkv())  # type: ignore[attr-defined]
    for t, src in zip((q, k, v), _qkv(seed=seed), strict=True):
        t.copy_(src)
    out = c.attention(q, k, v, CU, causal=True)
    torch.testing.assert_close(out.double(), _ref(q, k, v)[0], atol=2e-5, rtol=2e-5)
    assert c.last_stats["bytes_in"] == 0  # type: ignore[index]


def test_tensors_in_a_nixl_region_travel_by_nixl(srv: RunningServer) -> None:
    with AttentionClient(srv.target) as c:
        assert c.info()["nixl"]
        region = c.register_nixl(1 << 20)
        assert region.kind == "nixl"
        q, k, v = (region.empty(t.shape, torch.float32) for t in _qkv())
        for t, src in zip((q, k, v), _qkv(seed=1), strict=True):
            t.copy_(src)
        out, lse = c.attention(q, k, v, CU, causal=True, return_lse=True)
        ref, ref_lse = _ref(q, k, v)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse.double(), ref_lse.double(), atol=1e-5, rtol=1e-5)
        s = c.last_stats
        assert s is not None and s["bytes_in"] == 0 and s["bytes_out"] == 0
        assert s["region_bytes_in"] == (q.numel() + 2 * k.numel()) * 4
        assert c.list_regions() == [{"name": region.name, "kind": "nixl",
                                     "byte_size": 1 << 20, "inflight": 0}]
        region.close()
        assert c.list_regions() == []
        listed = c.info()["nixl_transports"]
    # The transports UCX picked to read the inputs and write the outputs (its own protocol
    # tables), in the engine's metrics and in GetServerInfo.
    picked = _transports(srv)
    assert {p["op"] for p in picked} == {"read", "write"}, picked
    assert all(p["peer"] == "intra-node" and p["local_memory"] == p["remote_memory"] == "host"
               and re.fullmatch(r"[a-z][a-z0-9_]*", p["transport"]) for p in picked), picked
    assert sorted(map(sorted, (p.items() for p in listed))) == sorted(
        map(sorted, (p.items() for p in picked))), (listed, picked)
    # The process's agent went with its last region: NIXL's progress thread spins a core.
    from attention_client import _regions

    assert not _regions._NIXL


def _transports(running: RunningServer) -> list[dict[str, str]]:
    """The server's ``attention_nixl_transport`` series, as label dicts."""
    return [dict(re.findall(r'(\w+)="([^"]*)"', line))
            for line in running.metrics().splitlines()
            if line.startswith("attention_nixl_transport{") and line.endswith(" 1.0")]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tensors_outside_a_nixl_region_are_staged_into_it(
    srv: RunningServer, dtype: torch.dtype,
) -> None:
    with AttentionClient(srv.target) as c:
        c.register_nixl(1 << 20)
        q, k, v = _qkv(dtype, seed=2)
        out = c.decode(q[:2], k, v, CU)
        ref = decode_ref(q[:2].double(), k.double(), v.double(),
                         torch.tensor(CU, dtype=torch.int32))
        torch.testing.assert_close(out.double(), ref, atol=1.6e-2, rtol=1.6e-2)
        s = c.last_stats
        assert s is not None and s["bytes_in"] == 0 and s["region_bytes_in"] > 0


def test_numpy_inputs_and_the_async_client(srv: RunningServer) -> None:
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal(s).astype(np.float32)
               for s in ((30, 4, 16), (30, 2, 16), (30, 2, 16)))

    async def run() -> np.ndarray:
        async with AsyncAttentionClient(srv.target) as c:
            region = await c.register_nixl(1 << 20)
            out = await c.attention(q, k, v, CU, causal=True)
            assert c.last_stats["bytes_in"] == 0  # type: ignore[index]
            await region.aclose()
            return out  # type: ignore[no-any-return]

    out = asyncio.run(run())
    ref, _ = _ref(*(torch.from_numpy(x) for x in (q, k, v)))
    torch.testing.assert_close(torch.from_numpy(out).double(), ref, atol=2e-5, rtol=2e-5)


def test_a_nixl_region_is_registered_again_after_a_server_restart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The restarted server knows neither the region nor the agent: the client introduces
    its agent again (ConnectNixl) and registers the region again."""
    require_server()
    connects = _count_connects(monkeypatch)
    running = start_server()
    q, k, v = _qkv(seed=5)
    ref, _ = _ref(q, k, v)
    try:
        with AttentionClient(running.target, timeout=30) as c:
            region = c.register_nixl(1 << 20)
            torch.testing.assert_close(c.attention(q, k, v, CU, causal=True).double(), ref,
                                       atol=2e-5, rtol=2e-5)
            port = running.port
            running.stop()
            running = start_server("--port", str(port))
            out = c.attention(q, k, v, CU, causal=True)
            torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
            assert c.last_stats["bytes_in"] == 0  # type: ignore[index]
            assert [r["name"] for r in c.list_regions()] == [region.name]
            assert len(connects) == 2 and connects[0] == connects[1]
    finally:
        running.stop()


def test_nixl_that_cannot_start_says_so_on_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    """UCX with no transport it may use (here ``UCX_TLS`` naming none): the server refuses NIXL
    regions with FAILED_PRECONDITION and serves the rest; the client's ``register_nixl`` says
    what to check instead of a NIXL traceback."""
    import subprocess
    import sys

    import grpc

    from attention_wire.pb import attention_pb2 as pb
    from attention_wire.pb.attention_pb2_grpc import AttentionServiceStub

    require_server()
    monkeypatch.setenv("UCX_TLS", "no-such-transport")
    running = start_server()
    try:
        with grpc.insecure_channel(running.target) as ch:
            stub = AttentionServiceStub(ch)
            with pytest.raises(grpc.RpcError) as info:
                stub.RegisterRegion(pb.RegisterRegionRequest(
                    name="nx", byte_size=4096, nixl=pb.NixlRegion(
                        agent_metadata=b"m", address=4096, agent_name="a")), timeout=30)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert info.value.details().startswith("nixl: ")
        with AttentionClient(running.target) as c:  # everything else still works
            q, k, v = _qkv()
            torch.testing.assert_close(c.attention(q, k, v, CU, causal=True).double(),
                                       _ref(q, k, v)[0], atol=2e-5, rtol=2e-5)
    finally:
        running.stop()
    code = ("from attention_client._regions import create_nixl_region\n"
            "try:\n    create_nixl_region(4096)\nexcept Exception as e:\n"
            "    print('ERR', type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60).stdout
    line = next(x for x in out.splitlines() if x.startswith("ERR"))
    assert "AttentionError FAILED_PRECONDITION: register_nixl: NIXL could not start" in line
    assert "UCX_TLS" in line


def test_cache_decode_steps_go_through_a_nixl_region(srv: RunningServer) -> None:
    """A KV-cache decode step's q, new tokens and out travel through the NIXL region like a
    stateless call's; the caches grow as with bytes, and a step's answer matches the reference
    over the whole context."""
    g = torch.Generator().manual_seed(9)
    ks = torch.randn(12, 2, 16, generator=g)
    vs = torch.randn(12, 2, 16, generator=g)
    with AttentionClient(srv.target) as c:
        c.register_nixl(1 << 20)
        with c.kv_cache(2, 16, torch.float32) as cache:
            assert cache.append(["s"], ks, vs) == [12]
            for step in range(3):
                q = torch.randn(1, 4, 16, generator=g)
                k1, v1 = torch.randn(1, 2, 16, generator=g), torch.randn(1, 2, 16, generator=g)
                out = cache.decode(q, ["s"], k1, v1)
                assert c.last_stats["bytes_in"] == 0 and c.last_stats["region_bytes_in"] > 0
                ks, vs = torch.cat([ks, k1]), torch.cat([vs, v1])
                ref = decode_ref(q.double(), ks.double(), vs.double(),
                                 torch.tensor([0, 13 + step], dtype=torch.int32))
                torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
            assert cache.lengths == {"s": 15}


def test_nixl_region_steps_through_the_step_socket() -> None:
    """Steps through the step socket with q, the new tokens and ``out`` in a NIXL region: UCX
    moves them (no tensor bytes in the frames), the answers match the reference over the
    whole context; a span past the region's end is refused naming ``header.regions.q`` and
    changes no cache (the socket's region checks are the gRPC path's)."""
    from .test_client_kv_cache import HKV, D

    require_server()
    tmp = tempfile.mkdtemp(dir="/tmp", prefix="sn-")
    g = torch.Generator().manual_seed(5)
    ks, vs = torch.randn(12, HKV, D, generator=g), torch.randn(12, HKV, D, generator=g)
    try:
        running = start_server("--step-socket", os.path.join(tmp, "s.sock"))
        try:
            _steps_through_a_nixl_region(running, os.path.join(tmp, "s.sock"), g, ks, vs)
        finally:
            running.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _steps_through_a_nixl_region(running: RunningServer, path: str, g: torch.Generator,
                                 ks: torch.Tensor, vs: torch.Tensor) -> None:
    """The test's steps and refusal against ``running`` (its step socket at ``path``)."""
    from .test_client_kv_cache import HKV, D, H
    from .test_client_step_socket import (
        _accepted,
        _connect,
        _lengths,
        _region_header,
        _result,
        _send_frame,
    )

    with AttentionClient(running.target) as c, c.kv_cache(HKV, D, torch.float32) as cache:
        region = c.register_nixl(1 << 20)
        cache.append(["n"], ks, vs)
        q, out = (region.empty((1, H, D), torch.float32) for _ in "qo")
        k1, v1 = (region.empty((1, HKV, D), torch.float32) for _ in "kv")
        with c.decode_steps(step_socket=True) as steps:
            for step in range(3):
                for t in (q, k1, v1):
                    t.copy_(torch.randn(t.shape, generator=g))
                out.fill_(float("nan"))
                assert steps.step(q, ["n"], k1, v1, out=out, use_regions=True) is out
                assert isinstance(steps._stream, SocketStream)
                s = c.last_stats
                assert s["bytes_in"] == s["bytes_out"] == 0 and s["region_bytes_in"] > 0
                assert s["cache_lengths"] == [13 + step]
                ks, vs = torch.cat([ks, k1]), torch.cat([vs, v1])
                ref = decode_ref(q.double(), ks.double(), vs.double(),
                                 torch.tensor([0, 13 + step], dtype=torch.int32))
                torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
        with _connect(path) as sock:
            _accepted(sock)
            _send_frame(sock, pb.DecodeRequest(
                header=_region_header(["n"], region.name, (1 << 20) - 256)
            ).SerializeToString())
            answer = _result(sock)
            assert answer.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "header.regions.q" in answer.error.details
        assert _lengths(cache) == [15]


def _count_connects(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The agent names the client sends ConnectNixl for, as it sends them."""
    from attention_client import _core

    sent: list[str] = []
    real = _core.nixl_connect_request

    def counted() -> object:
        request = real()
        sent.append(request.agent_name)
        return request

    monkeypatch.setattr(_core, "nixl_connect_request", counted)
    return sent


def test_two_nixl_regions_of_one_client_both_serve(srv: RunningServer,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent is introduced once (ConnectNixl); each region sends its own memory's
    metadata, which the server adds to the known agent: the first region keeps working."""
    connects = _count_connects(monkeypatch)
    with AttentionClient(srv.target) as c:
        first = c.register_nixl(1 << 20)
        second = c.register_nixl(1 << 20)
        assert len(connects) == 1
        for region in (first, second, first):
            _attention_in_region(c, region, seed=7)
        first.close()
        second.close()


def test_a_server_without_connect_nixl_gets_the_agents_whole_metadata(
        srv: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against a server from before ConnectNixl (the rpc answers UNIMPLEMENTED: here it is
    sent to a method no server has), the registration carries the agent's whole metadata,
    which introduces the agent, and calls go through the region."""
    from attention_client import _channel, client

    real = _channel.small_rpcs

    def without_connect(channel: object) -> dict[str, object]:
        rpcs = real(channel)
        rpcs["ConnectNixl"] = channel.unary_unary(  # type: ignore[attr-defined]
            "/attention.v1.AttentionService/NoSuchRpc",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=lambda b: b)
        return rpcs

    monkeypatch.setattr(client, "small_rpcs", without_connect)
    with AttentionClient(srv.target) as c:
        region = c.register_nixl(1 << 20)
        _attention_in_region(c, region, seed=9)
        assert not c._nixl_connected
        region.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_a_gpu_nixl_region_without_a_gpu_is_refused_before_anything_is_sent() -> None:
    from attention_client import AttentionInputError

    with AttentionClient("127.0.0.1:1") as c, pytest.raises(  # refused before any rpc
            AttentionInputError, match="register_nixl on a GPU needs"):
        c.register_nixl(1 << 20, device="cuda")
    from attention_client import _regions

    assert not _regions._NIXL  # no agent left behind


# The client's GPU: the server's own (GPU 0), and another GPU of the host when it has two.
_CLIENT_GPUS = ["cuda", "cuda:1"] if torch.cuda.device_count() > 1 else ["cuda"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("client_gpu", _CLIENT_GPUS)
def test_gpu_memory_travels_gpu_to_gpu_through_a_nixl_region(client_gpu: str) -> None:
    """A NIXL region of GPU memory (``device="cuda"``) against a cuda server: the server
    mirrors it on its GPU and UCX moves q, k, v in and out back GPU to GPU (on a two-GPU
    host also from another GPU than the server's). Prefill with lse, decode of a tensor staged
    into the region (outside it: copied in on the GPU), and a KV cache step: each matches
    the float64 reference, with no tensor byte as gRPC bytes."""
    require_server()
    from attention_client import AttentionInputError

    running = start_server("--device", "cuda", "--metrics-port", "0", startup_timeout=300)
    try:
        with AttentionClient(running.target, timeout=300) as c:
            with pytest.raises(AttentionInputError, match="is not a GPU"):
                c.register_nixl(1 << 20, device="cpu")
            region = c.register_nixl(4 << 20, device=client_gpu)
            gpu = torch.device("cuda", torch.device(client_gpu).index or 0)
            assert region.kind == "nixl" and region.device == gpu
            src = _qkv(torch.float16, seed=11)
            q, k, v = (region.empty(t.shape, torch.float16) for t in src)
            assert q.device == gpu
            for t, x in zip((q, k, v), src, strict=True):
                t.copy_(x)
            out, lse = c.attention(q, k, v, CU, causal=True, return_lse=True)
            assert out.is_cuda
            ref, ref_lse = _ref(q.cpu(), k.cpu(), v.cpu())
            torch.testing.assert_close(out.cpu().double(), ref, atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(lse.cpu().double(), ref_lse.double(), atol=1e-3,
                                       rtol=1e-3)
            s = c.last_stats
            assert s["bytes_in"] == 0 and s["bytes_out"] == 0
            assert s["region_bytes_in"] == (q.numel() + 2 * k.numel()) * 2
            # Outside the region, on its GPU: staged into it (a copy on the device).
            qd, kd, vd = (x.to(gpu) for x in _qkv(torch.bfloat16, seed=12))
            got = c.decode(qd[:2], kd, vd, CU)
            want = decode_ref(qd[:2].cpu().double(), kd.cpu().double(), vd.cpu().double(),
                              torch.tensor(CU, dtype=torch.int32))
            torch.testing.assert_close(got.cpu().double(), want, atol=1.6e-2, rtol=1.6e-2)
            assert c.last_stats["bytes_in"] == 0 and c.last_stats["region_bytes_in"] > 0
            g = torch.Generator().manual_seed(13)
            ks, vs = torch.randn(9, 2, 16, generator=g), torch.randn(9, 2, 16, generator=g)
            with c.kv_cache(2, 16, torch.float16) as cache:
                cache.append(["s"], ks.half().to(gpu), vs.half().to(gpu))
                q1 = torch.randn(1, 4, 16, generator=g).half()
                k1, v1 = (torch.randn(1, 2, 16, generator=g).half() for _ in range(2))
                step = cache.decode(q1.to(gpu), ["s"], k1.to(gpu), v1.to(gpu))
                assert c.last_stats["bytes_in"] == 0
                want = decode_ref(q1.double(), torch.cat([ks.half(), k1]).double(),
                                  torch.cat([vs.half(), v1]).double(),
                                  torch.tensor([0, 10], dtype=torch.int32))
                torch.testing.assert_close(step.cpu().double(), want, atol=2e-3, rtol=2e-3)
                assert cache.lengths == {"s": 10}
            region.close()
            listed = c.info()["nixl_transports"]
        # UCX's choice for GPU memory on both sides, both ways (printed: which transport), in
        # the metrics and in GetServerInfo.
        picked = _transports(running)
        print("nixl transports:", picked)
        assert {(p["op"], p["local_memory"], p["remote_memory"]) for p in picked} >= {
            ("read", "cuda", "cuda"), ("write", "cuda", "cuda")}, picked
        assert sorted(map(sorted, (p.items() for p in listed))) == sorted(
            map(sorted, (p.items() for p in picked))), (listed, picked)
    finally:
        running.stop()


def test_ucx_defaults_are_set_unless_the_operator_set_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from attention_wire import ucx_defaults

    for key in ucx_defaults.DEFAULTS:  # set first, so monkeypatch restores what was there
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "1m")
    ucx_defaults.apply()
    assert os.environ["UCX_TCP_TX_SEG_SIZE"] == "1m"  # the operator's stays
    assert os.environ["UCX_TCP_RX_SEG_SIZE"] == "64k"
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"


def test_memory_nixl_will_not_register_fails_the_region_and_leaves_no_agent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import nixl_cu13

    from attention_client import AttentionError, _regions

    def refuse(self: object, *args: object, **kwargs: object) -> None:
        raise RuntimeError("no transport for this memory")

    monkeypatch.setattr(nixl_cu13.nixl_agent, "register_memory", refuse)
    with pytest.raises(AttentionError, match="could not register DRAM memory") as info:
        _regions.create_nixl_region(4096)
    assert info.value.code.name == "FAILED_PRECONDITION"
    assert not _regions._NIXL  # the agent (and its progress thread) went with the failure


def test_the_client_agents_progress_thread_waits_instead_of_spinning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The client's agent asks NIXL for a progress thread that waits between polls
    (``NIXL_PROGRESS_WAIT_US``; the wrapper's own is 0, a spin), and an idle agent then costs
    next to no CPU (spinning: ~1 CPU second a second)."""
    import time

    import nixl_cu13
    import nixl_cu13._api as api

    from attention_client import _regions

    seen = []
    real = api.nixlBind.nixlAgent

    def spy(name: str, config: object) -> object:
        seen.append((config.useProgThread, config.pthrDelay))  # type: ignore[attr-defined]
        return real(name, config)

    monkeypatch.setattr(api.nixlBind, "nixlAgent", spy)
    agent = _regions._make_nixl_agent(nixl_cu13, f"attention-client-wait-{os.getpid()}")
    assert seen == [(True, _regions.NIXL_PROGRESS_WAIT_US)]
    assert _regions.NIXL_PROGRESS_WAIT_US > 0
    assert api.nixlBind.nixlAgent is spy  # the constructor is put back
    try:
        cpu, wall = time.process_time(), time.monotonic()
        time.sleep(0.6)
        spent = time.process_time() - cpu
        assert spent < 0.25 * (time.monotonic() - wall), spent
    finally:
        del agent
