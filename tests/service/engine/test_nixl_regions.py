"""NIXL regions at the wire level (issue 66): a client agent in this process registers host
memory, the server's engine pulls a call's inputs from it and pushes the outputs back over UCX
(shared memory or TCP on loopback), and every bad registration or span is refused naming the
field. Skipped without NIXL (``pip install nixl-cu13``)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from attention_wire.pb import attention_pb2 as pb

from ..svc_helpers import (
    TOLERANCE,
    ServerHandle,
    chunk_messages,
    decode_oracle,
    prefill_oracle,
    random_qkv,
    spec,
)

nixl = pytest.importorskip("nixl_cu13")
pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_tracebacks")]


class Agent:
    """A client's NIXL agent with one registered host buffer."""

    def __init__(self, nbytes: int, name: str | None = None) -> None:
        self.name = name or f"test-client-{uuid.uuid4().hex[:8]}"
        self.agent = nixl.nixl_agent(self.name, nixl.nixl_agent_config(backends=["UCX"]))
        self.buf = np.zeros(nbytes, np.uint8)
        self.reg = self.agent.register_memory([(self.buf.ctypes.data, nbytes, 0, "")], "DRAM")

    def region(self, name: str = "nx", nbytes: int | None = None, partial: bool = False,
               **changes: Any) -> pb.RegisterRegionRequest:
        """Its registration: the agent's full metadata, or (``partial``) only this memory's,
        as attention_client sends it after ConnectNixl."""
        meta = (self.agent.get_partial_agent_metadata(self.reg, False, ["UCX"]) if partial
                else self.agent.get_agent_metadata())
        src = pb.NixlRegion(agent_metadata=meta, address=self.buf.ctypes.data,
                            agent_name=self.name)
        for field, value in changes.items():
            setattr(src, field, value)
        return pb.RegisterRegionRequest(name=name, byte_size=nbytes or self.buf.nbytes,
                                        nixl=src)

    def connect_request(self) -> pb.ConnectNixlRequest:
        none = nixl._bindings.nixlRegDList(self.agent.nixl_mems["DRAM"], [])
        return pb.ConnectNixlRequest(agent_name=self.name, agent_metadata=(
            self.agent.get_partial_agent_metadata(none, True, ["UCX"])))

    def put(self, offset: int, t: torch.Tensor) -> pb.RegionSpan:
        data = t.contiguous().view(torch.uint8).numpy().reshape(-1)
        self.buf[offset : offset + data.size] = data
        return pb.RegionSpan(region="nx", offset=offset, byte_size=data.size)

    def get(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        n = like.numel() * like.element_size()
        raw = torch.from_numpy(self.buf[offset : offset + n].copy())
        return raw.view(like.dtype).view(like.shape)


@pytest.fixture
def agent() -> Iterator[Agent]:
    a = Agent(1 << 20)
    yield a
    a.agent.deregister_memory(a.reg)


def _code(fn: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


def _prefill(agent: Agent, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             cu: list[int]) -> tuple[list[pb.PrefillRequest], dict[str, int]]:
    """A prefill whose q, k, v, out and lse all live in the agent's region."""
    offsets, at = {}, 0
    for name, t in (("q", q), ("k", k), ("v", v), ("out", q)):
        offsets[name] = at
        at += -(-t.numel() * t.element_size() // 256) * 256
    offsets["lse"] = at
    regions = pb.TensorRegions(q=agent.put(offsets["q"], q), k=agent.put(offsets["k"], k),
                               v=agent.put(offsets["v"], v))
    regions.out.CopyFrom(pb.RegionSpan(region="nx", offset=offsets["out"],
                                       byte_size=q.numel() * q.element_size()))
    regions.lse.CopyFrom(pb.RegionSpan(region="nx", offset=offsets["lse"],
                                       byte_size=q.shape[0] * q.shape[1] * 4))
    header = pb.PrefillHeader(q=spec(q), k=spec(k), v=spec(v), cu_seqlens_q=cu, causal=True,
                              return_lse=True, regions=regions)
    return [pb.PrefillRequest(header=header)], offsets


def test_server_info_says_nixl_is_there(server: ServerHandle,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from attention_service.engine.nixl_agent import backend_name

    info = server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert info.nixl and info.nixl_backend.startswith("UCX"), info
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    assert backend_name() == "UCX UCX_TLS=tcp,self"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_prefill_reads_and_writes_client_memory_through_nixl(
    server: ServerHandle, agent: Agent, dtype: torch.dtype,
) -> None:
    stub = server.stub()
    info = stub.RegisterRegion(agent.region(), timeout=10)
    assert (info.kind, info.byte_size) == ("nixl", agent.buf.nbytes)
    try:
        q, k, v = random_qkv(37, 37, 4, 2, 24, dtype, seed=3)
        cu = [0, 11, 37]
        agent.buf[:] = 0xFF  # poison: NaN wherever the server must write
        msgs, off = _prefill(agent, q, k, v, cu)
        resp = list(stub.Prefill(iter(msgs), timeout=30))
        assert len(resp) == 1 and resp[0].HasField("stats")  # nothing streamed back
        ref, ref_lse = prefill_oracle(q, k, v, cu, causal=True)
        out, lse = agent.get(off["out"], q), agent.get(off["lse"], torch.empty(4, 37))
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double(), ref_lse.double(), atol=1e-4, rtol=1e-4)
        assert resp[0].stats.bytes_in == 0 and resp[0].stats.bytes_out == 0
    finally:
        stub.UnregisterRegion(pb.UnregisterRegionRequest(name="nx"), timeout=10)


def test_a_decode_reads_and_writes_client_memory_through_nixl(
    server: ServerHandle, agent: Agent,
) -> None:
    stub = server.stub()
    stub.RegisterRegion(agent.region(), timeout=10)
    try:
        q, _, _ = random_qkv(3, 3, 4, 2, 16, torch.float32, seed=5)
        _, k, v = random_qkv(30, 30, 4, 2, 16, torch.float32, seed=6)
        cu = [0, 4, 20, 30]
        agent.buf[:] = 0xFF
        spans = pb.TensorRegions(q=agent.put(0, q), k=agent.put(4096, k), v=agent.put(16384, v))
        spans.out.CopyFrom(pb.RegionSpan(region="nx", offset=32768, byte_size=q.numel() * 4))
        header = pb.DecodeHeader(q=spec(q), k=spec(k), v=spec(v), cu_seqlens_k=cu,
                                 regions=spans)
        list(stub.Decode(iter([pb.DecodeRequest(header=header)]), timeout=30))
        ref, _ = decode_oracle(q, k, v, cu)
        out = agent.get(32768, q)
        tol = TOLERANCE[torch.float32]
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    finally:
        stub.UnregisterRegion(pb.UnregisterRegionRequest(name="nx"), timeout=10)


@pytest.mark.parametrize(("case", "field", "code"), [
    ("garbage_metadata", "nixl.agent_metadata", grpc.StatusCode.INVALID_ARGUMENT),
    ("no_metadata", "nixl.agent_metadata", grpc.StatusCode.INVALID_ARGUMENT),
    ("wrong_name", "nixl.agent_name", grpc.StatusCode.INVALID_ARGUMENT),
    ("no_name", "nixl.agent_name", grpc.StatusCode.INVALID_ARGUMENT),
    ("no_address", "nixl.address", grpc.StatusCode.INVALID_ARGUMENT),
    ("bad_memory", "nixl.memory", grpc.StatusCode.INVALID_ARGUMENT),
    ("vram", "nixl.memory", grpc.StatusCode.INVALID_ARGUMENT),  # a cpu server has no GPU
])
def test_bad_registrations_are_refused_naming_the_field(
    server: ServerHandle, agent: Agent, case: str, field: str, code: grpc.StatusCode,
) -> None:
    changes: dict[str, Any] = {
        "garbage_metadata": {"agent_metadata": b"not metadata"},
        "no_metadata": {"agent_metadata": b""},
        "wrong_name": {"agent_name": "someone-else"},
        "no_name": {"agent_name": ""},
        "no_address": {"address": 0},
        "bad_memory": {"memory": "HBM"},
        "vram": {"memory": "VRAM"},
    }[case]
    stub = server.stub()
    got, details = _code(lambda: stub.RegisterRegion(agent.region(f"bad-{case}", **changes),
                                                     timeout=10))
    assert got == code and details.startswith(field + ":"), details
    assert not stub.ListRegions(pb.ListRegionsRequest(), timeout=10).regions  # nothing left
    # The same agent still registers and serves after a refusal.
    stub.RegisterRegion(agent.region(), timeout=10)
    stub.UnregisterRegion(pb.UnregisterRegionRequest(name="nx"), timeout=10)


def test_another_caller_cannot_take_over_an_agent_name(agent: Agent) -> None:
    """Peers are one caller's: registering another's agent name (whatever the metadata) is
    refused, so a caller cannot redirect transfers meant for another's memory."""
    from attention_service.engine.nixl_agent import NixlAgent
    from attention_service.errors import RequestError

    meta = agent.agent.get_agent_metadata()
    peers = NixlAgent()
    peers.add_peer("alice", agent.name, meta)
    with pytest.raises(RequestError) as info:
        peers.add_peer("mallory", agent.name, meta)
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert info.value.details.startswith("nixl.agent_name:")
    peers.add_peer("alice", agent.name, meta)  # alice's second region: counted
    peers.drop_peer(agent.name)
    with pytest.raises(RequestError):  # still alice's: one region is left
        peers.add_peer("mallory", agent.name, meta)
    peers.drop_peer(agent.name)
    with pytest.raises(RequestError):  # idle, still known (connected): alice's
        peers.connect("mallory", agent.name, meta)


def test_a_backend_that_cannot_connect_is_unavailable_not_bad_metadata(
        agent: Agent, monkeypatch: pytest.MonkeyPatch) -> None:
    """NIXL's backend failing on good metadata (a connection it could not set up) answers
    UNAVAILABLE naming the field, which clients retry; unreadable metadata stays
    INVALID_ARGUMENT; neither leaves the agent known."""
    from attention_service.engine.nixl_agent import NixlAgent
    from attention_service.errors import RequestError

    meta = agent.agent.get_agent_metadata()
    peers = NixlAgent()
    server_agent = peers._nixl()
    for kind, code in (("nixlBackendError", grpc.StatusCode.UNAVAILABLE),
                       ("nixlMismatchError", grpc.StatusCode.INVALID_ARGUMENT)):
        failure = type(kind, (Exception,), {})

        def refuse(metadata: bytes, failure: type = failure) -> None:
            raise failure("ucp_ep_create failed")

        monkeypatch.setattr(server_agent, "add_remote_agent", refuse)
        with pytest.raises(RequestError) as info:
            peers.connect("alice", agent.name, meta)
        assert info.value.code == code and info.value.details.startswith("agent_metadata:")
        assert not peers.knows(agent.name)
    monkeypatch.undo()
    peers.connect("alice", agent.name, meta)  # the next try goes through
    assert peers.knows(agent.name)


def test_idle_agents_are_kept_up_to_a_cap_per_caller(
        agent: Agent, monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent whose regions all went stays connected (its next region needs no
    ConnectNixl), up to MAX_IDLE_PEERS per caller: past that the oldest idle one goes."""
    from attention_service.engine import nixl_agent

    monkeypatch.setattr(nixl_agent, "MAX_IDLE_PEERS", 1)
    other = Agent(4096)
    peers = nixl_agent.NixlAgent()
    peers.connect("alice", agent.name, agent.agent.get_agent_metadata())
    peers.add_peer("alice", other.name, other.agent.get_agent_metadata())
    assert peers.knows(agent.name) and peers.knows(other.name)  # one idle: at the cap
    peers.drop_peer(other.name)  # two idle now: the older (agent) goes
    assert not peers.knows(agent.name) and peers.knows(other.name)
    peers.connect("mallory", agent.name, agent.agent.get_agent_metadata())  # free again
    other.agent.deregister_memory(other.reg)


def test_connect_once_then_regions_send_only_their_own_memory(server: ServerHandle) -> None:
    """ConnectNixl carries the agent's connection metadata once; each region then sends its
    own memory's metadata (NIXL's partial metadata), and calls move bytes through it."""
    a = Agent(1 << 16)
    stub = server.stub()
    # A region of an agent the server does not know, with no connection in its metadata.
    code, details = _code(lambda: stub.RegisterRegion(a.region(partial=True), timeout=10))
    assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, details)
    assert details.startswith("nixl.agent_name:") and "ConnectNixl" in details
    reply = stub.ConnectNixl(a.connect_request(), timeout=10)
    assert reply.backend == "UCX" and reply.server_agent.startswith("attention-server-")
    assert stub.RegisterRegion(a.region(partial=True), timeout=10).kind == "nixl"
    q, k, v = random_qkv(8, 8, 2, 2, 8, torch.float32, seed=3)
    msgs, offsets = _prefill(a, q, k, v, [0, 3, 8])
    list(stub.Prefill(iter(msgs), timeout=30))
    want = prefill_oracle(q, k, v, [0, 3, 8], causal=True)[0].float()
    assert torch.allclose(a.get(offsets["out"], q), want, atol=1e-4)
    # A second region of the same agent: its own metadata merges in, the first keeps working.
    b2 = np.zeros(1 << 12, np.uint8)
    reg2 = a.agent.register_memory([(b2.ctypes.data, b2.nbytes, 0, "")], "DRAM")
    second = pb.RegisterRegionRequest(name="nx2", byte_size=b2.nbytes, nixl=pb.NixlRegion(
        agent_metadata=a.agent.get_partial_agent_metadata(reg2, False, ["UCX"]),
        address=b2.ctypes.data, agent_name=a.name))
    assert stub.RegisterRegion(second, timeout=10).kind == "nixl"
    list(stub.Prefill(iter(msgs), timeout=30))
    assert torch.allclose(a.get(offsets["out"], q), want, atol=1e-4)
    stub.UnregisterRegion(pb.UnregisterRegionRequest(), timeout=10)
    a.agent.deregister_memory(reg2)


def test_no_nixl_refuses_nixl_regions_and_serves_the_rest(start_server: Any,
                                                          agent: Agent) -> None:
    """--no-nixl: NIXL metadata never reaches NIXL; the other regions and calls go on."""
    srv = start_server(nixl=False)
    stub = srv.stub()
    assert not stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).nixl
    for call in (lambda: stub.ConnectNixl(agent.connect_request(), timeout=10),
                 lambda: stub.RegisterRegion(agent.region(), timeout=10)):
        code, details = _code(call)
        assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, details)
        assert details.startswith("nixl: ") and "--no-nixl" in details
    q, k, v = random_qkv(8, 8, 2, 2, 8, torch.float32, seed=4)
    header = pb.PrefillHeader(q=spec(q), k=spec(k), v=spec(v), cu_seqlens_q=[0, 8])
    msgs = [pb.PrefillRequest(header=header),
            *chunk_messages(pb.PrefillRequest, {pb.Q: q, pb.K: k, pb.V: v})]
    assert list(stub.Prefill(iter(msgs), timeout=30))[-1].HasField("stats")


def test_metadata_names_its_agent_and_a_restarted_agent_replaces_its_old_self(
        agent: Agent) -> None:
    """The agent a blob is of is read before NIXL sees it (NIXL would merge another agent's
    metadata into that agent); an agent that restarted under its old name (new connection
    info) replaces the old one for the same caller."""
    from attention_service.engine.nixl_agent import NixlAgent, metadata_agent
    from attention_service.errors import RequestError

    meta = agent.agent.get_agent_metadata()
    assert metadata_agent(meta) == agent.name
    assert metadata_agent(agent.connect_request().agent_metadata) == agent.name
    assert metadata_agent(b"nixlSerDes|Agent\xff\xff\xff\xff\xff\xff\xff\x7fx|") is None
    assert metadata_agent(b"junk") is None
    peers = NixlAgent()
    peers.connect("alice", agent.name, meta)
    with pytest.raises(RequestError) as info:  # alice's blob under another (new) name
        peers.connect("alice", "not-" + agent.name, meta)
    assert info.value.details.startswith("agent_name:") and not peers.knows("not-" + agent.name)
    again = Agent(4096, name=agent.name)  # the same name, a new process's connection info
    peers.connect("alice", agent.name, again.agent.get_agent_metadata())
    assert peers.knows(agent.name)
    again.agent.deregister_memory(again.reg)


@pytest.mark.parametrize(("change", "field"), [
    ({"agent_name": ""}, "agent_name"),
    ({"agent_metadata": b""}, "agent_metadata"),
    ({"agent_metadata": b"not metadata"}, "agent_metadata"),
    ({"agent_name": "someone-else"}, "agent_name"),
    ({"agent_metadata": "region"}, "agent_metadata"),  # no connection info in it
])
def test_bad_connects_are_refused_naming_the_field(server: ServerHandle, agent: Agent,
                                                   change: dict[str, Any], field: str) -> None:
    request = agent.connect_request()
    for name, value in change.items():
        if value == "region":
            value = agent.agent.get_partial_agent_metadata(agent.reg, False, ["UCX"])
        setattr(request, name, value)
    code, details = _code(lambda: server.stub().ConnectNixl(request, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"{field}:"), details


def test_a_range_the_client_agent_does_not_cover_is_refused_at_registration(
    server: ServerHandle,
) -> None:
    a = Agent(1 << 16)  # 64 KiB registered with the agent ...
    stub = server.stub()
    code, details = _code(lambda: stub.RegisterRegion(a.region(nbytes=1 << 20), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("nixl.address:")
    assert not stub.ListRegions(pb.ListRegionsRequest(), timeout=10).regions
    assert stub.RegisterRegion(a.region(nbytes=1 << 16), timeout=10).kind == "nixl"
    stub.UnregisterRegion(pb.UnregisterRegionRequest(name="nx"), timeout=10)


_CHILD = """
import sys, time, numpy as np
from nixl_cu13 import nixl_agent, nixl_agent_config
a = nixl_agent(sys.argv[1], nixl_agent_config(backends=["UCX"]))
b = np.zeros(1 << 16, np.uint8)
a.register_memory([(b.ctypes.data, b.nbytes, 0, "")], "DRAM")
print("READY", a.get_agent_metadata().hex(), b.ctypes.data, flush=True)
time.sleep(120)
"""


def test_a_client_killed_after_registering_fails_its_call_not_the_server(
    server: ServerHandle,
) -> None:
    """The client's agent dies (kill -9) with its region registered: its next call fails
    UNAVAILABLE naming the field, at once; the server serves other calls."""
    name = f"test-victim-{uuid.uuid4().hex[:8]}"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, name], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None
        line = ""
        while not line.startswith("READY"):  # NIXL logs to stdout too
            line = child.stdout.readline()
            assert line, "the client agent died before it was ready"
        _, meta, address = line.split()
        stub = server.stub()
        stub.RegisterRegion(pb.RegisterRegionRequest(
            name="nx", byte_size=1 << 16, nixl=pb.NixlRegion(
                agent_metadata=bytes.fromhex(meta), address=int(address), agent_name=name)),
            timeout=10)
    finally:
        child.kill()
        child.wait(10)
    try:
        q, k, v = random_qkv(8, 8, 2, 2, 8, torch.float32, seed=1)
        spans = pb.TensorRegions(q=pb.RegionSpan(region="nx", offset=0, byte_size=512),
                                 k=pb.RegionSpan(region="nx", offset=512, byte_size=512),
                                 v=pb.RegionSpan(region="nx", offset=1024, byte_size=512))
        header = pb.PrefillHeader(q=spec(q), k=spec(k), v=spec(v), cu_seqlens_q=[0, 8],
                                  regions=spans)
        code, details = _code(lambda: list(stub.Prefill(
            iter([pb.PrefillRequest(header=header)]), timeout=30)))
        assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
        assert details.startswith("header.regions.q: NIXL"), details
    finally:
        stub.UnregisterRegion(pb.UnregisterRegionRequest(name="nx"), timeout=10)
    header = pb.PrefillHeader(q=spec(q), k=spec(k), v=spec(v), cu_seqlens_q=[0, 8])
    msgs = [pb.PrefillRequest(header=header),
            *chunk_messages(pb.PrefillRequest, {pb.Q: q, pb.K: k, pb.V: v})]
    assert list(stub.Prefill(iter(msgs), timeout=30))[-1].HasField("stats")


def test_transfers_are_counted_by_direction(start_server: Any) -> None:
    srv = start_server(metrics_port=0)
    a = Agent(1 << 20)
    stub = srv.stub()
    stub.RegisterRegion(a.region(), timeout=10)
    q, k, v = random_qkv(16, 16, 2, 2, 8, torch.float32, seed=8)
    msgs, _ = _prefill(a, q, k, v, [0, 16])
    list(stub.Prefill(iter(msgs), timeout=30))
    m = srv.scrape()
    moved = {s.labels["direction"]: s.value for s in m["attention_nixl_bytes"].samples}
    # In: q, k, v and the registration's two probe bytes; out: out and lse.
    assert moved == {"in": 3 * q.numel() * 4 + 2, "out": q.numel() * 4 + 16 * 2 * 4}
    counts = {s.labels["direction"]: s.value for s in m["attention_nixl_transfer_seconds"].samples
              if s.name.endswith("_count")}
    assert counts == {"in": 2, "out": 1}  # the registration's probe and the call's pull
    stub.UnregisterRegion(pb.UnregisterRegionRequest(name="nx"), timeout=10)


# A stand-in for the metadata helper (its protocol, no NIXL): a blob "crash" aborts it,
# "hang" never answers, "raise" is refused as NIXL refuses a blob, anything else is read.
_FAKE_HELPER = r'''
import os, sys, time
def read(n):
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            sys.exit(0)
        data += chunk
    return data
def answer(text):
    os.write(1, len(text).to_bytes(4, "little") + text)
answer(b"ready")
while True:
    blobs = [read(int.from_bytes(read(4), "little"))
             for _ in range(int.from_bytes(read(4), "little"))]
    if b"crash" in blobs:
        os.abort()
    if b"hang" in blobs:
        time.sleep(3600)
    if b"exit" in blobs:
        sys.exit(0)
    answer(b"nixlMismatchError" if b"raise" in blobs else b"ok")
'''


def test_the_metadata_helper_survives_crashes_and_hangs_of_its_reader() -> None:
    """A blob that crashes the reader or never finishes raises Unread (crashed or not), and
    the next blob gets a new helper; NIXL's refusal comes back by name; a helper that cannot
    start (or talks nonsense) is Unread, not crashed."""
    from attention_service.engine.nixl_vet import MetadataVetter, Unread

    vetter = MetadataVetter([sys.executable, "-c", _FAKE_HELPER], timeout=2.0)
    try:
        assert vetter.check([b"fine"]) == "ok"
        with pytest.raises(Unread) as info:
            vetter.check([b"fine", b"crash"])
        assert info.value.crashed and "SIGABRT" in info.value.why
        assert vetter.check([b"fine"]) == "ok"  # a new helper
        with pytest.raises(Unread) as info:
            vetter.check([b"hang"])
        assert not info.value.crashed and "within 2 s" in info.value.why
        assert vetter.check([b"fine", b"raise"]) == "nixlMismatchError"
        with pytest.raises(Unread) as info:  # ended, but not by a crash signal: not the blob
            vetter.check([b"exit"])
        assert not info.value.crashed and "ended (exit 0)" in info.value.why
    finally:
        vetter.close()
    for command in ([sys.executable, "-c", "import sys; sys.exit(3)"],  # never ready
                    [sys.executable, "-c", "import os; os.write(1, b'2026 NIXL INFO'); input()"],
                    ["/nonexistent/attention-helper"]):  # cannot be spawned
        broken = MetadataVetter(command, timeout=2.0)
        with pytest.raises(Unread) as info:
            broken.check([b"fine"])
        assert not info.value.crashed and "could not start" in info.value.why
        broken.close()


def test_metadata_that_crashes_nixl_is_refused_and_the_server_goes_on(
        server: ServerHandle, agent: Agent, monkeypatch: pytest.MonkeyPatch) -> None:
    """ConnectNixl and a region's registration read the caller's blob in a helper process
    first: a blob NIXL's parser dies on (here: a helper that dies on any blob) is
    INVALID_ARGUMENT naming the field, and that caller's next blob within the back-off is
    UNAVAILABLE (try again) without being read; one NIXL raises on is refused as NIXL refuses
    it. Neither leaves an agent known; the server serves on."""
    import time

    from attention_service.engine import nixl_agent
    from attention_service.engine.nixl_vet import MetadataVetter

    monkeypatch.setattr(nixl_agent, "VET_BACKOFF_S", 0.5)
    peers = server.server.core.regions.nixl
    real = peers._vetter
    stub = server.stub()

    def refused(call: Any, field: str) -> tuple[grpc.StatusCode, str]:
        code, details = _code(call)
        assert details.startswith(f"{field}:"), details
        return code, details

    def connect() -> Any:
        return stub.ConnectNixl(agent.connect_request(), timeout=20)

    def register() -> Any:
        return stub.RegisterRegion(agent.region(), timeout=20)

    crashing = MetadataVetter([sys.executable, "-c",
                               _FAKE_HELPER.replace('if b"crash" in blobs', "if blobs")])
    monkeypatch.setattr(peers, "_vetter", crashing)
    try:
        # Sent at once: one is read (and crashes the helper); the others wait for it, then
        # meet the back-off.
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: refused(connect, "agent_metadata"), range(4)))
        codes = sorted(c.name for c, _ in results)
        assert codes == ["INVALID_ARGUMENT"] + ["UNAVAILABLE"] * 3, results
        time.sleep(0.6)
        code, details = refused(connect, "agent_metadata")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "crashed" in details
        code, details = refused(register, "nixl.agent_metadata")  # within the back-off
        assert code == grpc.StatusCode.UNAVAILABLE and "try again in" in details
        time.sleep(0.6)
        code, details = refused(register, "nixl.agent_metadata")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "crashed" in details
    finally:
        crashing.close()
    time.sleep(0.6)
    raising = MetadataVetter([sys.executable, "-c",
                              _FAKE_HELPER.replace('if b"raise" in blobs', "if blobs")])
    monkeypatch.setattr(peers, "_vetter", raising)
    try:
        for call, field in ((connect, "agent_metadata"), (register, "nixl.agent_metadata")):
            code, details = refused(call, field)  # no back-off: NIXL refused, nothing crashed
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "nixlMismatchError" in details
    finally:
        raising.close()
    assert not peers.knows(agent.name)
    monkeypatch.setattr(peers, "_vetter", real)
    connect()  # the real helper reads it fine
    stub.RegisterRegion(agent.region(partial=True), timeout=20)
    assert peers.knows(agent.name)


def test_the_helper_loads_again_a_blob_whose_peer_it_could_not_reach(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """NIXL's nixlBackendError (the peer not reached) is tried again after each wait; any
    other refusal, and the last backend failure, are raised as they are."""
    from attention_service.engine import nixl_vet

    class nixlBackendError(Exception):  # noqa: N801 (NIXL's own class name)
        pass

    class nixlMismatchError(Exception):  # noqa: N801
        pass

    waits: list[float] = []
    monkeypatch.setattr(nixl_vet.time, "sleep", waits.append)

    class Agent:
        def __init__(self, fails: list[Exception]) -> None:
            self.fails, self.loaded = fails, []

        def add_remote_agent(self, blob: bytes) -> None:
            if self.fails:
                raise self.fails.pop(0)
            self.loaded.append(blob)

    agent = Agent([nixlBackendError(), nixlBackendError()])
    nixl_vet._load(agent, b"blob")
    assert agent.loaded == [b"blob"] and waits == list(nixl_vet._BACKEND_RETRY_S[:2])
    waits.clear()
    with pytest.raises(nixlBackendError):
        nixl_vet._load(Agent([nixlBackendError() for _ in range(9)]), b"blob")
    assert waits == list(nixl_vet._BACKEND_RETRY_S)
    waits.clear()
    with pytest.raises(nixlMismatchError):
        nixl_vet._load(Agent([nixlMismatchError()]), b"blob")
    assert waits == []


_UCX_LOG = """\
[1.0] [vm:1:0]   +--------+-------------+------+
[1.0] [vm:1:0]   | srv self cfg#1                                                  |
[1.0] [vm:1:0]   | remote memory write by ucp_put*(multi) from host memory to host |
[1.0] [vm:1:0]   | 0..inf | zero-copy   | cma/memory                               |
[1.0] [vm:1:0]   | srv intra-node cfg#2                                            |
[1.0] [vm:1:0]   | remote memory write by ucp_put* from host memory to cuda/dev[1] |
[1.0] [vm:1:0]   | 0..inf | software emulation | tcp/lo                            |
[1.0] [vm:1:0]   | srv intra-node cfg#2                                                  |
[1.0] [vm:1:0]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[1] |
[1.0] [vm:1:0]   +--------+-------------+------+
[1.0] [vm:1:0]   | Range  | Description |              Config                            |
[1.0] [vm:1:0]   | 0..inf | zero-copy   | cuda_ipc/cuda                                  |
[1.0] [vm:1:0]   | srv intra-node cfg#2                                     |
[1.0] [vm:1:0]   | active message by ucp_am_send* from host memory          |
[1.0] [vm:1:0]   |          0 | short              | tcp/lo        |
[1.0] [vm:1:0]   | client-7 intra-node cfg#1                                       |
[1.0] [vm:1:0]   | remote memory write by ucp_put*(multi) from host memory to host |
[1.0] [vm:1:0]   | 0..inf | zero-copy   | tcp/lo                                   |
[1.0] [vm:1:0]       parser.c:2578 UCX  WARN  unused environment variable: UCX_X
[1.0] [vm:1:0]   | srv inter-node cfg#3                                            |
[1.0] [vm:1:0]   | remote memory write by ucp_put*(multi) from host memory to cuda/dev[0] |
[1.0] [vm:1:0]   | 0..8k  | short       | 50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1 |
[1.0] [vm:1:0]   | 8k..inf | zero-copy  | tcp/eth0"""


def test_ucx_protocol_tables_name_the_transport_of_each_peer_op_and_memory(
        tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """``ucx_choices`` reads the tables of agent ``srv``'s transfers (not its loopback's, not
    another agent's in the same process, not the selections UCX makes ahead for an endpoint):
    each (peer, op, memory here, memory there, transport) once, lanes of one transport as
    one; a line still being written waits; UCX's warnings are logged."""
    import logging

    from attention_service.engine.ucx_choices import UcxChoices

    path = tmp_path / "ucx.log"
    text = _UCX_LOG + "\n"
    cut = text.index("| 8k..inf") + 4
    path.write_text(text[:cut])
    choices = UcxChoices(str(path), "srv")
    with caplog.at_level(logging.INFO, logger="attention_service"):
        first = choices.read()
        assert first == [("intra-node", "read", "cuda", "cuda", "cuda_ipc"),
                         ("inter-node", "write", "host", "cuda", "rc_mlx5")]
        with path.open("a") as f:
            f.write(text[cut:])
        assert choices.read() == [*first, ("inter-node", "write", "host", "cuda", "tcp")]
        assert choices.read() == [*first, ("inter-node", "write", "host", "cuda", "tcp")]
    assert any(r.levelno == logging.WARNING and "unused environment variable: UCX_X"
               in r.getMessage() for r in caplog.records)
    assert sum("by cuda_ipc" in r.getMessage() for r in caplog.records) == 1
    assert UcxChoices(None, "srv").read() == []
    assert UcxChoices(str(tmp_path / "not-yet"), "srv").read() == []


def test_ucx_output_is_routed_only_while_ucx_loads(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The engine points UCX's output at its file only around the agent's making (processes
    started later see the operator's environment), and not at all where the operator routes
    it."""
    import os

    from attention_service.engine import ucx_choices

    for key in ("UCX_PROTO_INFO", "UCX_LOG_FILE"):
        monkeypatch.delenv(key, raising=False)
    ucx_choices._log_file.cache_clear()
    try:
        with ucx_choices.loading("a") as choices:
            assert choices.path is not None and os.environ["UCX_LOG_FILE"] == choices.path
            assert os.environ["UCX_PROTO_INFO"] == "y"
        assert "UCX_LOG_FILE" not in os.environ and "UCX_PROTO_INFO" not in os.environ
        ucx_choices._log_file.cache_clear()
        monkeypatch.setenv("UCX_LOG_FILE", "/var/log/ucx.log")
        with ucx_choices.loading("a") as choices:
            assert choices.path is None and os.environ["UCX_LOG_FILE"] == "/var/log/ucx.log"
        assert choices.read() == [] and os.environ["UCX_LOG_FILE"] == "/var/log/ucx.log"
    finally:
        ucx_choices._log_file.cache_clear()
