"""Merge/split (batch_plan.py) and the launch policy (batch_queue.py), without a server."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
import torch
from attention_kernels import decode_ref, prefill_ref
from attention_service.batch_plan import BatchPlan, batch_key, budget_tokens
from attention_service.batch_queue import BatchQueue, Waiter
from attention_service.errors import RequestError
from attention_service.execution import Job

from .svc_helpers import cu_from_lengths, random_qkv

pytestmark = pytest.mark.timeout(30)


def _prefill_job(
    seed: int, len_q: list[int], len_k: list[int] | None = None, *, dim: int = 8,
    causal: bool = True, lse: bool = False, scale: float | None = None,
) -> Job:
    cu_q = cu_from_lengths(len_q)
    cu_k = cu_from_lengths(len_k if len_k is not None else len_q)
    q, k, v = random_qkv(cu_q[-1], cu_k[-1], 4, 2, dim, torch.float32, seed=seed)
    return Job(
        rpc="Prefill", q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=max(len_q), max_seqlen_k=max(len_k or len_q), causal=causal,
        softmax_scale=scale, return_lse=lse, num_splits=0, flops=seed, tokens=cu_q[-1],
    )


def _decode_job(seed: int, len_k: list[int], *, lse: bool = False, splits: int = 0) -> Job:
    cu_k = cu_from_lengths(len_k)
    q, k, v = random_qkv(len(len_k), cu_k[-1], 4, 2, 8, torch.float32, seed=seed)
    return Job(
        rpc="Decode", q=q, k=k, v=v, cu_seqlens_q=None, cu_seqlens_k=cu_k, max_seqlen_q=1,
        max_seqlen_k=max(len_k), causal=False, softmax_scale=None, return_lse=lse,
        num_splits=splits, flops=0, tokens=cu_k[-1],
    )


# ---- batch_plan ---------------------------------------------------------------------------

def test_plan_merges_cu_seqlens_and_offsets() -> None:
    a = _prefill_job(1, [2, 3], [4, 0], lse=False)
    b = _prefill_job(2, [0, 5], [1, 6], lse=True)
    plan = BatchPlan([a, b])
    assert plan.cu_seqlens_q == [0, 2, 5, 5, 10]
    assert plan.cu_seqlens_k == [0, 4, 4, 5, 11]
    assert (plan.q_offsets, plan.k_offsets) == ([0, 5, 10], [0, 4, 11])
    assert (plan.max_seqlen_q, plan.max_seqlen_k) == (5, 6)
    assert plan.return_lse and plan.tokens == 10 and plan.flops == 3
    assert plan.kv_bytes == sum(j.k.nbytes + j.v.nbytes for j in (a, b))


def test_merged_reference_split_equals_each_job_alone() -> None:
    jobs = [_prefill_job(1, [3, 4], [5, 4], lse=True), _prefill_job(2, [6], lse=False),
            _prefill_job(3, [1, 2], [0, 7], lse=True)]
    plan = BatchPlan(jobs)
    merged = plan.merged_job(*(torch.cat([getattr(j, n) for j in jobs]) for n in "qkv"))
    out, lse = prefill_ref(
        merged.q, merged.k, merged.v, torch.tensor(merged.cu_seqlens_q, dtype=torch.int32),
        torch.tensor(merged.cu_seqlens_k, dtype=torch.int32), causal=True, return_lse=True,
    )
    for job, (o, l_) in zip(jobs, plan.split(out, lse), strict=True):
        ref_o, ref_l = prefill_ref(
            job.q, job.k, job.v, torch.tensor(job.cu_seqlens_q, dtype=torch.int32),
            torch.tensor(job.cu_seqlens_k, dtype=torch.int32), causal=True, return_lse=True,
        )
        torch.testing.assert_close(o, ref_o)
        if job.return_lse:
            assert l_ is not None and l_.is_contiguous() and l_.shape == ref_l.shape
            torch.testing.assert_close(l_, ref_l)
        else:
            assert l_ is None


def test_decode_split_keeps_batch_major_lse() -> None:
    jobs = [_decode_job(1, [3, 0, 5], lse=True), _decode_job(2, [7], lse=True)]
    plan = BatchPlan(jobs)
    assert plan.cu_seqlens_q is None and plan.cu_seqlens_k == [0, 3, 3, 8, 15]
    merged = plan.merged_job(*(torch.cat([getattr(j, n) for j in jobs]) for n in "qkv"))
    out, lse = decode_ref(merged.q, merged.k, merged.v,
                          torch.tensor(merged.cu_seqlens_k, dtype=torch.int32), return_lse=True)
    for job, (o, l_) in zip(jobs, plan.split(out, lse), strict=True):
        ref_o, ref_l = decode_ref(job.q, job.k, job.v,
                                  torch.tensor(job.cu_seqlens_k, dtype=torch.int32),
                                  return_lse=True)
        torch.testing.assert_close(o, ref_o)
        assert l_ is not None and l_.shape == (job.q.shape[0], 4)
        torch.testing.assert_close(l_, ref_l)


def test_batch_key_separates_what_cannot_share_a_launch() -> None:
    base = _prefill_job(1, [4])
    assert batch_key(base) == batch_key(_prefill_job(2, [9, 1], lse=True))
    assert batch_key(base) == batch_key(_prefill_job(3, [4], scale=1 / math.sqrt(8)))
    assert batch_key(base) != batch_key(_prefill_job(4, [4], causal=False))
    assert batch_key(base) != batch_key(_prefill_job(5, [4], dim=16))
    assert batch_key(base) != batch_key(_prefill_job(6, [4], scale=0.3))
    assert batch_key(base) != batch_key(_decode_job(7, [4]))
    assert batch_key(_decode_job(8, [4])) != batch_key(_decode_job(9, [4], splits=2))
    with pytest.raises(ValueError, match="different batch keys"):
        BatchPlan([base, _prefill_job(4, [4], causal=False)])


def test_budget_tokens_counts_the_larger_side() -> None:
    assert budget_tokens(_prefill_job(1, [2, 3])) == 5
    assert budget_tokens(_prefill_job(1, [1], [40])) == 40  # few queries, long prefix
    assert budget_tokens(_decode_job(1, [10, 20])) == 30


# ---- batch_queue --------------------------------------------------------------------------

@pytest.fixture
def loop():  # type: ignore[no-untyped-def]
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def _waiter(loop: asyncio.AbstractEventLoop, job: Job, at: float) -> Waiter:
    job.submitted_at = at
    return Waiter(job, loop, loop.create_future())


def _tokens(batch: list[Waiter]) -> list[int]:
    return [w.tokens for w in batch]


def test_idle_device_launches_at_once(loop) -> None:  # type: ignore[no-untyped-def]
    q = BatchQueue(max_batch_tokens=100, max_delay_s=0.002, max_size=10)
    assert q.next_batch(0.0, device_idle=True) == ([], None)
    q.add(_waiter(loop, _prefill_job(1, [5]), at=1.0))
    q.add(_waiter(loop, _prefill_job(2, [7]), at=1.0001))
    batch, wait = q.next_batch(1.0002, device_idle=True)
    assert _tokens(batch) == [5, 7] and wait is None and len(q) == 0


def test_busy_device_waits_for_delay_or_full_budget(loop) -> None:  # type: ignore[no-untyped-def]
    q = BatchQueue(max_batch_tokens=20, max_delay_s=0.002, max_size=10)
    q.add(_waiter(loop, _prefill_job(1, [5]), at=1.0))
    batch, wait = q.next_batch(1.0005, device_idle=False)
    assert batch == [] and wait == pytest.approx(0.0015)
    batch, wait = q.next_batch(1.002, device_idle=False)  # the oldest hit the delay
    assert _tokens(batch) == [5] and wait is None
    q.add(_waiter(loop, _prefill_job(2, [8]), at=2.0))
    q.add(_waiter(loop, _prefill_job(3, [12]), at=2.0))
    q.add(_waiter(loop, _prefill_job(4, [3]), at=2.0))
    batch, _ = q.next_batch(2.0, device_idle=False)  # 23 tokens wait: the budget is full
    assert _tokens(batch) == [8, 12]
    assert q.next_batch(2.0, device_idle=False)[0] == []  # 3 tokens: not yet


def test_fifo_packing_and_oversized_job_alone(loop) -> None:  # type: ignore[no-untyped-def]
    q = BatchQueue(max_batch_tokens=64, max_delay_s=0.0, max_size=10)
    for i, n in enumerate([20, 100, 20, 20, 30]):
        q.add(_waiter(loop, _prefill_job(i, [n]), at=1.0 + i))
    batches = []
    while len(q):
        batches.append(_tokens(q.next_batch(9.0, device_idle=True)[0]))
    assert batches == [[20], [100], [20, 20], [30]]


def test_keys_are_batched_apart_oldest_first(loop) -> None:  # type: ignore[no-untyped-def]
    q = BatchQueue(max_batch_tokens=1000, max_delay_s=0.0, max_size=10)
    q.add(_waiter(loop, _prefill_job(1, [4], dim=16), at=2.0))
    q.add(_waiter(loop, _prefill_job(2, [5]), at=1.0))
    q.add(_waiter(loop, _decode_job(3, [6]), at=1.5))
    q.add(_waiter(loop, _prefill_job(4, [7]), at=3.0))
    order = []
    while len(q):
        batch = q.next_batch(9.0, device_idle=True)[0]
        order.append((batch[0].job.rpc, _tokens(batch)))
    assert order == [("Prefill", [5, 7]), ("Decode", [6]), ("Prefill", [4])]


def test_cancelled_waiters_are_removed_or_skipped(loop) -> None:  # type: ignore[no-untyped-def]
    q = BatchQueue(max_batch_tokens=100, max_delay_s=0.0, max_size=10)
    ws = [_waiter(loop, _prefill_job(i, [n]), at=float(i)) for i, n in enumerate([3, 4, 5, 6])]
    for w in ws:
        q.add(w)
    assert q.remove(ws[1]) and not q.remove(ws[1])
    assert q.depth("Prefill") == 3
    ws[0].job.cancel.set()  # cancelled without removal (a race): never launched either
    ws[3].job.cancel.set()
    assert _tokens(q.next_batch(9.0, device_idle=True)[0]) == [5]
    assert len(q) == 0 and q.next_batch(9.0, device_idle=True) == ([], None)


def test_queue_bound_and_drain(loop) -> None:  # type: ignore[no-untyped-def]
    q = BatchQueue(max_batch_tokens=100, max_delay_s=0.0, max_size=2)
    q.add(_waiter(loop, _prefill_job(1, [3]), at=1.0))
    q.add(_waiter(loop, _decode_job(2, [3]), at=1.0))
    with pytest.raises(RequestError) as info:
        q.add(_waiter(loop, _prefill_job(3, [3]), at=1.0))
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (q.depth("Prefill"), q.depth("Decode")) == (1, 1)
    assert len(q.drain()) == 2 and len(q) == 0 and q.depth("Decode") == 0
    q.add(_waiter(loop, _prefill_job(4, [3]), at=2.0))  # usable after a drain
    assert _tokens(q.next_batch(2.0, device_idle=True)[0]) == [3]
