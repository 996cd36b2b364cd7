"""Dynamic batching through a real server (cpu backend): merged launches, each caller's own
rows, keys kept apart, token budget, cancellation, queue bound, and the metrics that show it.

A ``StepBackend`` holds launches until the test opens them, so what piles up in the queue (and
therefore how requests merge) is decided by the test, not by timing.
"""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from attention_client import AsyncAttentionClient
from attention_service.params import Op
from attention_wire.pb import attention_pb2 as pb

from ..batch_helpers import Req, StepBackend, decode_req, prefill_req, start_all
from ..svc_helpers import collect, random_qkv, sample, wait_until

pytestmark = pytest.mark.timeout(60)


def _batching_server(start_server, backend: StepBackend, **overrides):  # type: ignore[no-untyped-def]
    # No warm-up: its launches would go through the held gate (launch 0 is the test's).
    return start_server(backend=backend, batching=True, metrics_port=0, warmup=False,
                        **overrides)


def _depth(srv, rpc: str = "Prefill") -> int:  # type: ignore[no-untyped-def]
    return int(srv.server.executor.queue_depth(Op(rpc)))


def _queued(srv) -> int:  # type: ignore[no-untyped-def]
    return _depth(srv, "Prefill") + _depth(srv, "Decode")


def _hold_device(pool: ThreadPoolExecutor, srv, backend: StepBackend):  # type: ignore[no-untyped-def]
    """Send one request whose launch (number 0) stays held: later requests pile up behind it."""
    blocker = prefill_req(999, [4])
    fut = start_all(pool, srv, [blocker])[0]
    assert backend.wait_launches(1)
    return blocker, fut


def _queue_in_order(pool: ThreadPoolExecutor, srv, reqs: list[Req]):  # type: ignore[no-untyped-def]
    """Send requests one by one, each queued before the next is sent (a known FIFO order)."""
    futures, calls = [], []
    base = _queued(srv)
    for i, r in enumerate(reqs):
        call = r.send(srv)
        calls.append(call)
        futures.append(pool.submit(collect, call))
        assert wait_until(lambda i=i: _queued(srv) == base + i + 1), "request never queued"
    return calls, futures


def test_concurrent_async_clients_share_launches_and_get_their_rows(start_server) -> None:  # type: ignore[no-untyped-def]
    backend = StepBackend()
    srv = _batching_server(start_server, backend)
    reqs = [
        prefill_req(i, [1 + (7 * i) % 23, 3 + i], lse=i % 3 == 0, dtype=torch.bfloat16)
        for i in range(16)
    ]
    before = srv.scrape()
    tensors = []
    for i in range(16):  # the same inputs as reqs[i], as the client takes them
        lens = [1 + (7 * i) % 23, 3 + i]
        tensors.append((random_qkv(sum(lens), sum(lens), 4, 2, 16, torch.bfloat16, seed=i), lens))

    async def drive() -> list[object]:
        async with AsyncAttentionClient(srv.target, timeout=30) as client:
            calls = [
                asyncio.ensure_future(client.attention(
                    q, k, v, torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32),
                    causal=True, return_lse=i % 3 == 0,
                ))
                for i, ((q, k, v), lens) in enumerate(tensors)
            ]
            # Hold the device until all 16 wait, then let it go: they must merge.
            while _depth(srv) + sum(backend.batch_sizes()) < 16:
                await asyncio.sleep(0.01)
            backend.open_all()
            return list(await asyncio.gather(*calls))

    results = asyncio.run(drive())
    assert len(backend.plans) < 16
    assert sum(backend.batch_sizes()) == 16
    for req, res in zip(reqs, results, strict=True):
        out, lse = res if req.lse is not None else (res, None)
        torch.testing.assert_close(out.double(), req.out, atol=1.6e-2, rtol=1.6e-2)
        if req.lse is not None:
            torch.testing.assert_close(lse.double(), req.lse.double(), atol=1e-4, rtol=1e-4)
    after = srv.scrape()
    launches = sample(after, "attention_batches", "attention_batches_total", rpc="Prefill") - (
        sample(before, "attention_batches", "attention_batches_total", rpc="Prefill"))
    assert launches == len(backend.plans) < 16


def test_held_device_merges_queue_into_one_launch_and_metrics_move(start_server) -> None:  # type: ignore[no-untyped-def]
    backend = StepBackend()
    srv = _batching_server(start_server, backend)
    reqs = [prefill_req(i, [2 + i % 5, 1 + (3 * i) % 11], lse=i % 2 == 0) for i in range(15)]
    before = srv.scrape()
    with ThreadPoolExecutor(16) as pool:
        blocker, blocker_fut = _hold_device(pool, srv, backend)
        futures = start_all(pool, srv, reqs)
        assert wait_until(lambda: _depth(srv) == 15)
        assert sample(srv.scrape(), "attention_queue_depth", "attention_queue_depth",
                      rpc="Prefill") == 15
        backend.open_all()
        responses = [f.result(30) for f in futures]
        blocker_resp = blocker_fut.result(30)
    assert backend.batch_sizes() == [1, 15]
    blocker.check(blocker_resp)
    for req, resp in zip(reqs, responses, strict=True):
        req.check(resp)
        assert resp.stats.batch_requests == 15
        assert resp.stats.batch_tokens == sum(r.tokens for r in reqs)
        assert resp.stats.queue_seconds > 0
    assert blocker_resp.stats.batch_requests == 1

    after = srv.scrape()

    def delta(family: str, name: str, **labels: str) -> float:
        return sample(after, family, name, **labels) - sample(before, family, name, **labels)

    everyone = [blocker_resp, *responses]
    all_reqs = [blocker, *reqs]
    pre = {"rpc": "Prefill"}
    assert delta("attention_batches", "attention_batches_total", **pre) == 2
    assert delta("attention_batch_requests", "attention_batch_requests_count", **pre) == 2
    assert delta("attention_batch_requests", "attention_batch_requests_sum", **pre) == 16
    # The 15-request launch lands in the (8, 16] bucket, the blocker in le=1.
    assert delta("attention_batch_requests", "attention_batch_requests_bucket", le="8.0",
                 **pre) == 1
    assert delta("attention_batch_requests", "attention_batch_requests_bucket", le="16.0",
                 **pre) == 2
    assert delta("attention_batch_tokens", "attention_batch_tokens_sum", **pre) == sum(
        r.tokens for r in all_reqs)
    assert delta("attention_requests", "attention_requests_total", code="OK", **pre) == 16
    assert delta("attention_tokens", "attention_tokens_total", **pre) == sum(
        r.tokens for r in all_reqs)
    assert delta("attention_flops", "attention_flops_total", **pre) == sum(
        r.stats.flops for r in everyone)
    assert delta("attention_input_bytes", "attention_input_bytes_total", **pre) == sum(
        r.stats.bytes_in for r in everyone)
    assert delta("attention_output_bytes", "attention_output_bytes_total", **pre) == sum(
        r.stats.bytes_out for r in everyone)
    assert delta("attention_queue_wait_seconds", "attention_queue_wait_seconds_count",
                 **pre) == 16
    assert delta("attention_stage_seconds", "attention_stage_seconds_count", stage="kernel",
                 **pre) == 2
    assert delta("attention_prefill_kernel_flops_per_second",
                 "attention_prefill_kernel_flops_per_second_count", **pre) == 2
    # The kernel counters count each launch's work once: the sum of its members' FLOPs.
    assert delta("attention_kernel_flops", "attention_kernel_flops_total", **pre) == sum(
        r.stats.flops for r in everyone)
    assert _depth(srv) == 0
    info = srv.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert info.batching is True


def test_different_keys_never_share_a_launch(start_server) -> None:  # type: ignore[no-untyped-def]
    backend = StepBackend()
    srv = _batching_server(start_server, backend)
    kinds = [
        dict(dim=16, causal=True),
        dict(dim=16, causal=False),
        dict(dim=32, causal=True),
        dict(dim=16, causal=True, dtype=torch.float16),
        dict(dim=16, causal=True, heads=2, kv_heads=1),
        dict(dim=16, causal=True, scale=0.5),
    ]
    reqs = [prefill_req(10 * j + i, [3 + i, 5], **kw) for i in range(3)  # type: ignore[arg-type]
            for j, kw in enumerate(kinds)]
    reqs += [decode_req(100 + i, [4, 9]) for i in range(3)]
    with ThreadPoolExecutor(len(reqs) + 1) as pool:
        _hold_device(pool, srv, backend)
        futures = start_all(pool, srv, reqs)
        assert wait_until(lambda: _queued(srv) == len(reqs))
        backend.open_all()
        responses = [f.result(30) for f in futures]
    for req, resp in zip(reqs, responses, strict=True):
        req.check(resp)
        assert resp.stats.batch_requests == 3
    # One launch per key (7 keys), each holding the three requests of that key.
    assert backend.batch_sizes()[1:] == [3] * 7
    assert len({p.key for p in backend.plans[1:]}) == 7


def test_merge_edge_cases_in_one_launch(start_server) -> None:  # type: ignore[no-untyped-def]
    """lse asked by some only, q shorter than k, a request with no keys at all, zero-length
    sequences, and an explicit scale equal to the default: one key, one launch, all correct."""
    backend = StepBackend()
    srv = _batching_server(start_server, backend)
    reqs = [
        prefill_req(1, [5, 3], lse=True),
        prefill_req(2, [4, 1, 6], k_lengths=[9, 0, 20], lse=True),
        prefill_req(3, [3, 2], k_lengths=[0, 0], lse=True),  # no keys: zeros, lse -inf
        prefill_req(4, [0, 7], lse=False),
        prefill_req(5, [6], scale=1 / math.sqrt(16), lse=True),
    ]
    with ThreadPoolExecutor(8) as pool:
        _hold_device(pool, srv, backend)
        futures = start_all(pool, srv, reqs)
        assert wait_until(lambda: _depth(srv) == len(reqs))
        backend.open_all()
        responses = [f.result(30) for f in futures]
    assert backend.batch_sizes() == [1, len(reqs)]
    for req, resp in zip(reqs, responses, strict=True):
        req.check(resp)
    assert bool(torch.isneginf(responses[2].lse).all()) and not responses[2].out.any()


def test_decode_requests_merge_with_batch_major_lse(start_server) -> None:  # type: ignore[no-untyped-def]
    backend = StepBackend()
    srv = _batching_server(start_server, backend)
    reqs = [
        decode_req(1, [5, 0, 17], lse=True),
        decode_req(2, [30], lse=False),
        decode_req(3, [1, 2, 3, 4], lse=True),
        decode_req(4, [0], lse=True),
    ]
    before = srv.scrape()
    with ThreadPoolExecutor(8) as pool:
        _hold_device(pool, srv, backend)
        futures = start_all(pool, srv, reqs)
        assert wait_until(lambda: _depth(srv, "Decode") == len(reqs))
        backend.open_all()
        responses = [f.result(30) for f in futures]
    assert backend.batch_sizes() == [1, 4]
    for req, resp in zip(reqs, responses, strict=True):
        req.check(resp)  # lse [batch, heads] of the caller's own sequences
        assert resp.stats.batch_tokens == sum(r.tokens for r in reqs)
    after = srv.scrape()
    sums = [sample(m, "attention_batch_tokens", "attention_batch_tokens_sum", rpc="Decode")
            for m in (before, after)]
    assert sums[1] - sums[0] == 5 + 17 + 30 + 10
    assert sample(after, "attention_decode_kernel_bytes_per_second",
                  "attention_decode_kernel_bytes_per_second_count", rpc="Decode") == 1


def test_request_over_the_budget_runs_alone(start_server) -> None:  # type: ignore[no-untyped-def]
    backend = StepBackend()
    srv = _batching_server(start_server, backend, max_batch_tokens=64)
    # Arrival order is fixed: FIFO packing within 64 tokens gives [20] [100] [20 20] [30].
    reqs = [prefill_req(i, [n]) for i, n in enumerate([20, 100, 20, 20, 30])]
    with ThreadPoolExecutor(8) as pool:
        _hold_device(pool, srv, backend)
        _, futures = _queue_in_order(pool, srv, reqs)
        backend.open_all()
        responses = [f.result(30) for f in futures]
    for req, resp in zip(reqs, responses, strict=True):
        req.check(resp)
    tokens = [[j.params.tokens for j in p.jobs] for p in backend.plans[1:]]
    assert tokens == [[20], [100], [20, 20], [30]]
    assert responses[1].stats.batch_requests == 1 and responses[1].stats.batch_tokens == 100


def test_cancelled_while_queued_leaves_the_queue(start_server) -> None:  # type: ignore[no-untyped-def]
    backend = StepBackend()
    srv = _batching_server(start_server, backend)
    reqs = [prefill_req(i, [n]) for i, n in enumerate([3, 11, 5])]  # 11 tokens: the victim
    with ThreadPoolExecutor(8) as pool:
        _hold_device(pool, srv, backend)
        calls, futures = _queue_in_order(pool, srv, reqs)
        calls[1].cancel()
        assert wait_until(lambda: _depth(srv) == 2), "cancelled request still queued"
        backend.open_all()
        reqs[0].check(futures[0].result(30))
        reqs[2].check(futures[2].result(30))
        with pytest.raises(grpc.RpcError) as info:
            futures[1].result(30)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    assert [[j.params.tokens for j in p.jobs] for p in backend.plans[1:]] == [[3, 5]]


def test_cancelled_inside_a_running_launch_spares_its_mates(start_server) -> None:  # type: ignore[no-untyped-def]
    backend = StepBackend()
    srv = _batching_server(start_server, backend)
    reqs = [prefill_req(i, [n], lse=True) for i, n in enumerate([3, 11, 5])]
    with ThreadPoolExecutor(8) as pool:
        _hold_device(pool, srv, backend)
        calls, futures = _queue_in_order(pool, srv, reqs)
        backend.open(0)
        assert backend.wait_launches(2)  # the three are inside launch 1, held there
        calls[1].cancel()
        assert wait_until(lambda: srv.server.servicer.tracker.inflight == 2)
        backend.open_all()
        reqs[0].check(futures[0].result(30))
        reqs[2].check(futures[2].result(30))
        with pytest.raises(grpc.RpcError):
            futures[1].result(30)
    assert backend.batch_sizes() == [1, 3]
    codes = {s.labels["code"]: s.value for s in srv.scrape()["attention_requests"].samples
             if s.name == "attention_requests_total" and s.labels["rpc"] == "Prefill"}
    assert codes["OK"] == 3 and codes["CANCELLED"] == 1


def test_queue_full_is_resource_exhausted(start_server) -> None:  # type: ignore[no-untyped-def]
    backend = StepBackend()
    srv = _batching_server(start_server, backend, max_queue_size=2)
    reqs = [prefill_req(i, [4]) for i in range(2)]
    with ThreadPoolExecutor(8) as pool:
        _hold_device(pool, srv, backend)
        futures = start_all(pool, srv, reqs)
        assert wait_until(lambda: _depth(srv) == 2)
        with pytest.raises(grpc.RpcError) as info:
            collect(prefill_req(7, [4]).send(srv))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.details().startswith("queue:")
        assert "--max-queue-size" in info.value.details()  # the limit an operator raises
        backend.open_all()
        for req, fut in zip(reqs, futures, strict=True):
            req.check(fut.result(30))
    exhausted = sample(srv.scrape(), "attention_requests", "attention_requests_total",
                       rpc="Prefill", code="RESOURCE_EXHAUSTED")
    assert exhausted == 1


class _NoMergeMemory(StepBackend):
    """Runs out of device memory for any launch of more than one request."""

    def launch(self, plan):  # type: ignore[no-untyped-def]
        if len(plan) > 1:
            with self._cv:
                self.plans.append(plan)
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return super().launch(plan)


def test_failed_merged_launch_retries_each_request_alone(start_server) -> None:  # type: ignore[no-untyped-def]
    backend = _NoMergeMemory()
    srv = _batching_server(start_server, backend)
    reqs = [prefill_req(i, [3 + i], lse=i == 1) for i in range(3)]
    with ThreadPoolExecutor(8) as pool:
        _hold_device(pool, srv, backend)
        futures = start_all(pool, srv, reqs)
        assert wait_until(lambda: _depth(srv) == 3)
        backend.open_all()
        for req, fut in zip(reqs, futures, strict=True):
            resp = fut.result(30)
            req.check(resp)
            assert resp.stats.batch_requests == 1
    assert backend.batch_sizes() == [1, 3, 1, 1, 1]


def test_close_refuses_what_still_waits(start_server) -> None:  # type: ignore[no-untyped-def]
    backend = StepBackend()
    srv = _batching_server(start_server, backend)
    with ThreadPoolExecutor(4) as pool:
        _hold_device(pool, srv, backend)
        waiting = start_all(pool, srv, [prefill_req(1, [4])])[0]
        assert wait_until(lambda: _depth(srv) == 1)
        # close() drains the queue at once, then waits for the launch in flight.
        closing = asyncio.run_coroutine_threadsafe(
            asyncio.to_thread(srv.server.executor.close), srv.loop
        )
        with pytest.raises(grpc.RpcError) as info:
            waiting.result(30)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in info.value.details()
        backend.open_all()
        closing.result(30)
    assert _depth(srv) == 0
