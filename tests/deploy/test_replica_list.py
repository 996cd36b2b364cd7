"""Several replicas without a proxy (issue 64): the client given a list of targets balances
stateless calls over every replica with gRPC's round_robin, keeps caches, decode steps and
regions on the first, skips a replica that is down, and refuses malformed lists naming the
argument."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch

from attention_client import AsyncAttentionClient, AttentionClient, AttentionInputError
from attention_client._channel import balanced_target
from attention_kernels.reference import prefill_ref
from attention_wire.pb import attention_pb2 as pb
from attention_wire.pb import attention_pb2_grpc as pb_grpc

from ..service.group_helpers import Group
from ..service.svc_helpers import sample

pytestmark = pytest.mark.timeout(180)


def _replica() -> Group:
    return Group(1, "--kv-cache-bytes", str(16 << 20), "--kv-page-bytes", "4096")


@pytest.fixture(scope="module")
def _replicas() -> Iterator[list[Group]]:
    with ThreadPoolExecutor(3) as pool:
        groups = list(pool.map(lambda _: _replica(), range(3)))
    yield groups
    for g in groups:
        g.stop(signal.SIGKILL if g.proc.poll() is None else signal.SIGTERM)


@pytest.fixture
def replicas(_replicas: list[Group]) -> list[Group]:
    """Three live replicas, shared by the module's tests: one a test before killed is started
    again (the tests count each replica's calls from their own start, not from zero)."""
    for i, g in enumerate(_replicas):
        if g.proc.poll() is not None:
            g.stop(signal.SIGTERM)  # reaps it
            _replicas[i] = _replica()
    return _replicas


def ok_calls(metrics: dict[str, Any], rpc: str) -> float:
    """OK calls of ``rpc`` in a replica's scrape, its unary twin's included."""
    return sum(sample(metrics, "attention_requests", "attention_requests_total", rpc=r,
                      code="OK") for r in (rpc, f"{rpc}Unary"))


def _served(groups: list[Group], rpc: str) -> list[float]:
    """Each live replica's OK calls of ``rpc``, by its own counter."""
    return [ok_calls(g.scrape(), rpc) if g.proc.poll() is None else 0.0 for g in groups]


def check_prefill(client: AttentionClient, seed: int) -> None:
    """One causal prefill through ``client``, against the float64 reference."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(9, 2, 16, generator=g) for _ in range(3))
    out = client.attention(q, k, v, [0, 4, 9], causal=True)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    want = prefill_ref(q.double(), k.double(), v.double(), cu, causal=True)
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)


def test_stateless_calls_spread_and_caches_stay_on_the_first(replicas: list[Group]) -> None:
    targets = [g.target for g in replicas]
    before = _served(replicas, "Prefill")
    with AttentionClient(targets) as client:
        assert client.balanced and client.target == targets[0]
        for i in range(60):
            check_prefill(client, i)
        cache = client.kv_cache(2, 16, torch.float32, session="s1")
        ids = ["r-a", "r-b"]
        k, v = torch.randn(7, 2, 16), torch.randn(7, 2, 16)
        assert cache.append(ids, k, v, [0, 3, 7]) == [3, 4]
        with client.decode_steps() as steps:
            for _ in range(5):
                q, kn, vn = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
                out = steps.step(q, ids, kn, vn, store=False)
                assert out.shape == (2, 4, 16) and not out.isnan().any()
        assert [c["length"] for c in cache.info()] == [3, 4]
    spread = [a - b for a, b in zip(_served(replicas, "Prefill"), before, strict=True)]
    assert sum(spread) == 60, spread
    assert all(0.15 * 60 <= n <= 0.6 * 60 for n in spread), spread
    # Every cache call went to the first target: only it holds the caches.
    for g, expect in zip(replicas, (set(ids), set(), set()), strict=True):
        with grpc.insecure_channel(g.target) as ch:
            listed = pb_grpc.AttentionServiceStub(ch).ListCaches(pb.ListCachesRequest(),
                                                                 timeout=10)
        assert {c.cache_id for c in listed.caches} == expect


def test_the_async_client_balances_the_same_way(replicas: list[Group]) -> None:
    targets = [g.target for g in replicas]
    before = _served(replicas, "Prefill")

    async def run() -> None:
        async with AsyncAttentionClient(targets) as client:
            for seed in range(30):
                g = torch.Generator().manual_seed(seed)
                q, k, v = (torch.randn(5, 2, 16, generator=g) for _ in range(3))
                out = await client.attention(q, k, v, [0, 5])
                cu = torch.tensor([0, 5], dtype=torch.int32)
                want = prefill_ref(q.double(), k.double(), v.double(), cu)
                torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)

    asyncio.run(run())
    spread = [a - b for a, b in zip(_served(replicas, "Prefill"), before, strict=True)]
    assert sum(spread) == 30 and min(spread) >= 0.15 * 30, spread


def test_a_replica_that_is_down_is_skipped(replicas: list[Group]) -> None:
    """One of three replicas killed: after a moment no stateless call fails, and every call
    lands on the two left. (The module's replicas: the killed one is started again for any
    test after this one.)"""
    groups = replicas
    before = _served(groups, "Prefill")
    with AttentionClient([g.target for g in groups], timeout=20) as client:
        for i in range(9):
            check_prefill(client, i)
        groups[2].stop(signal.SIGKILL)
        # gRPC's round_robin sees the connection drop; calls made meanwhile are retried
        # on UNAVAILABLE (the unary twins are in the retry policy).
        failures = 0
        for i in range(60):
            try:
                check_prefill(client, 100 + i)
            except Exception:  # noqa: BLE001 (counted: must be none)
                failures += 1
        assert failures == 0
        served = _served(groups, "Prefill")
        assert served[2] == 0 and served[0] + served[1] - before[0] - before[1] >= 60, (
            served, before)


@pytest.mark.parametrize(("target", "message"), [
    ([], "empty list"),
    (["127.0.0.1:1", "127.0.0.1:1"], "twice"),
    (["127.0.0.1:1", "http://h:2"], "URL scheme"),
    (["127.0.0.1:1", "dns:///h:2"], "HOST:PORT"),
    (["127.0.0.1:1", "no-such-host.invalid:2"], "does not resolve"),
])
def test_bad_target_lists_are_refused_naming_the_target(target: list[str], message: str) -> None:
    with pytest.raises(AttentionInputError, match="target") as err:
        AttentionClient(target)
    assert message in str(err.value)


def test_load_balancing_is_checked() -> None:
    with pytest.raises(AttentionInputError, match="load_balancing must be one of"):
        AttentionClient("127.0.0.1:1", load_balancing="random")
    with pytest.raises(AttentionInputError, match="balanced round_robin"):
        AttentionClient(["127.0.0.1:1", "127.0.0.2:1"], load_balancing="pick_first")


def test_a_list_resolves_into_one_address_list() -> None:
    assert balanced_target(["127.0.0.1:5", "localhost:6"]).startswith("ipv4:127.0.0.1:5,")
    assert balanced_target(["dns:///svc:50051"]) == "dns:///svc:50051"
    assert balanced_target(["[::1]:7"]) == "ipv6:[::1]:7"
    # A single target stays as it is: one server, nothing balanced.
    with AttentionClient("127.0.0.1:1", spread=False) as client:
        assert not client.balanced and client.channels == 1
