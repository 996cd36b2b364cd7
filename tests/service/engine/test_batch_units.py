"""Merge (jobs.BatchPlan), the one launch path on cpu (each job's rows into its own
destinations), the launch policy (executor.BatchQueue) and the executor, without a server."""

from __future__ import annotations

import contextlib
import math
import select
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
import torch

from attention_kernels import decode_ref, prefill_ref
from attention_service.engine.backends import CpuBackend
from attention_service.engine.dtypes import WIRE_DTYPES
from attention_service.engine.executor import BatchQueue, Executor, Hold
from attention_service.engine.jobs import (
    CACHED_KEYS_PER_TOKEN,
    BatchPlan,
    CacheWork,
    Job,
    batch_key,
)
from attention_service.errors import Cancelled, RequestError
from attention_service.params import Op, make_params

from ..batch_helpers import AsyncCpu, later
from ..svc_helpers import cu_from_lengths, random_qkv, span_jobs

pytestmark = pytest.mark.timeout(30)


def _job(op: Op, q, k, v, cu_k, cu_q=None, *, causal=False, scale=None, lse=False, splits=0):  # type: ignore[no-untyped-def]
    params = make_params(
        op, WIRE_DTYPES[q.dtype], tuple(q.shape), tuple(k.shape), cu_k, cu_q, causal=causal,
        softmax_scale=scale, return_lse=lse, num_splits=splits,
    )
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)  # poisoned: every row must be written
    lse_t = torch.full(params.lse_shape, float("nan")) if lse else None
    return Job(params, q, k, v, out, lse_t)


def _prefill_job(
    seed: int, len_q: list[int], len_k: list[int] | None = None, *, dim: int = 8,
    causal: bool = True, lse: bool = False, scale: float | None = None,
) -> Job:
    cu_q = cu_from_lengths(len_q)
    cu_k = cu_from_lengths(len_k if len_k is not None else len_q)
    q, k, v = random_qkv(cu_q[-1], cu_k[-1], 4, 2, dim, torch.float32, seed=seed)
    return _job(Op.PREFILL, q, k, v, cu_k, cu_q, causal=causal, scale=scale, lse=lse)


def _decode_job(seed: int, len_k: list[int], *, lse: bool = False, splits: int = 0) -> Job:
    cu_k = cu_from_lengths(len_k)
    q, k, v = random_qkv(len(len_k), cu_k[-1], 4, 2, 8, torch.float32, seed=seed)
    return _job(Op.DECODE, q, k, v, cu_k, lse=lse, splits=splits)


# ---- BatchPlan and the cpu launch ---------------------------------------------------------

def test_plan_merges_cu_seqlens_and_offsets() -> None:
    a = _prefill_job(1, [2, 3], [4, 0], lse=False)
    b = _prefill_job(2, [0, 5], [1, 6], lse=True)
    plan = BatchPlan([a, b])
    assert plan.cu_seqlens_q == [0, 2, 5, 5, 10]
    assert plan.cu_seqlens_k == [0, 4, 4, 5, 11]
    assert (plan.q_offsets, plan.k_offsets) == ([0, 5, 10], [0, 4, 11])
    assert (plan.max_seqlen_q, plan.max_seqlen_k) == (5, 6)
    assert plan.return_lse and plan.tokens == 10
    assert plan.flops == a.params.flops + b.params.flops
    assert plan.kv_bytes == sum(j.k.nbytes + j.v.nbytes for j in (a, b))


def test_cuda_launch_packs_and_scatters_each_jobs_rows() -> None:
    """The GPU launch's packing and output scatter (``cuda_launch``) on host tensors: job i's
    rows land at its offsets, an empty job is skipped, and each job gets back its own rows."""
    from attention_service.engine import cuda_launch

    jobs = [_prefill_job(1, [2, 3], [4, 0]), _prefill_job(2, [0]), _prefill_job(3, [0, 5], [1, 6])]
    plan = BatchPlan(jobs)
    cpu = torch.device("cpu")
    q = cuda_launch._packed(plan, "q", plan.total_q, (4, 8), plan.q_offsets, cpu)
    k = cuda_launch._packed(plan, "k", plan.total_k, (2, 8), plan.k_offsets, cpu)
    assert torch.equal(q, torch.cat([j.q for j in jobs]))
    assert torch.equal(k, torch.cat([j.k for j in jobs]))
    out = torch.randn(q.shape)
    cuda_launch._scatter_rows(plan, out)
    for i, job in enumerate(jobs):
        assert torch.equal(job.out, out[plan.q_offsets[i] : plan.q_offsets[i + 1]])


def test_one_copy_table_packs_and_unpacks_a_batch_in_pinned_memory(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The one-launch packing (``cuda_launch._by_segments``), its table run by the host
    reference: every job's q, k, v land at their offsets of the packed tensors, and each job's
    output rows go back to its own span, nothing else written."""
    from attention_kernels.copy_segments import copy_segments_ref
    from attention_service.engine import cuda_launch
    from attention_service.engine import jobs as jobs_mod

    u8 = torch.zeros(1 << 16, dtype=torch.uint8)
    batch, inputs = span_jobs(u8, [([3, 1], [5, 0]), ([0], [0]), ([1], [2]), ([7], [7])],
                              heads=3, kv_heads=1, dim=8, dtype=torch.bfloat16)
    plan = BatchPlan(batch)
    cpu = torch.device("cpu")
    monkeypatch.setattr(cuda_launch, "can_use_host_pointers", lambda index: True)
    assert cuda_launch._by_segments(plan, cpu) is None  # not page-locked: the old path
    monkeypatch.setitem(jobs_mod.PINNED, u8.data_ptr(), u8.numel())
    assert cuda_launch._by_segments(BatchPlan(batch[:1]), cpu) is None  # a lone job
    seg = cuda_launch._by_segments(plan, cpu)
    assert seg is not None and seg.n_in == 3 * len(batch) and seg.unit == 8
    assert seg.table.shape[1] == 4  # 32-byte rows: the outputs' rows start 16-byte aligned
    seg.q.fill_(math.nan)
    copy_segments_ref(seg.table[: seg.n_in], seg.unit)
    assert torch.equal(seg.q, torch.cat([q for q, _, _ in inputs]))
    assert torch.equal(seg.k, torch.cat([k for _, k, _ in inputs]))
    assert torch.equal(seg.v, torch.cat([v for _, _, v in inputs]))
    before = u8.clone()
    seg.out.copy_(torch.randn(seg.out.shape))
    copy_segments_ref(seg.table[seg.n_in :], seg.unit)
    for i, job in enumerate(batch):
        assert torch.equal(job.out, seg.out[plan.q_offsets[i] : plan.q_offsets[i + 1]])
    written = torch.zeros_like(u8, dtype=torch.bool)
    for job in batch:
        span = job.span("out")
        assert span is not None
        _, at, dtype, shape = span
        written[at : at + math.prod(shape) * dtype.itemsize] = True
    assert torch.equal(u8[~written], before[~written])  # only the outputs' bytes changed
    assert batch[0].q is not None  # a view of the span: still the same bytes, still packed so
    assert cuda_launch._by_segments(plan, cpu) is not None
    batch[0].q = inputs[0][0].clone()  # a tensor given instead: the batch goes the old way
    assert cuda_launch._by_segments(plan, cpu) is None
    # 10-byte kv rows leave 2-byte words only: the copies go the DMA way.
    odd, _ = span_jobs(u8, [([2], [3]), ([1], [1])], heads=3, kv_heads=1, dim=5,
                       dtype=torch.bfloat16)
    assert cuda_launch._by_segments(BatchPlan(odd), cpu) is None
    # A segment past what one launch copies, too.
    monkeypatch.setattr(cuda_launch, "MAX_UNITS", 4)
    assert cuda_launch._by_segments(BatchPlan(span_jobs(u8, [([2], [3]), ([1], [1])], heads=3,
                                                        kv_heads=1, dim=8,
                                                        dtype=torch.bfloat16)[0]), cpu) is None


@pytest.mark.parametrize("max_segment", [0, 100, 1 << 30], ids=["all-dma", "mixed", "all-kernel"])
def test_long_segments_of_a_packed_batch_go_through_the_copy_engines(
    monkeypatch: pytest.MonkeyPatch, max_segment: int,
) -> None:
    """Segments longer than ``PACK_MAX_SEGMENT_BYTES`` leave the kernel's table for one DMA
    copy each (``dma_in`` / ``dma_out``); the table (run by the host reference) and the copies
    together still pack every job's bytes and answer each job in place."""
    from attention_kernels.copy_segments import copy_segments_ref
    from attention_service.engine import cuda_launch
    from attention_service.engine import jobs as jobs_mod

    u8 = torch.zeros(1 << 16, dtype=torch.uint8)
    batch, inputs = span_jobs(u8, [([3, 1], [5, 0]), ([0], [0]), ([1], [2]), ([7], [7])],
                              heads=3, kv_heads=1, dim=8, dtype=torch.bfloat16)
    monkeypatch.setattr(cuda_launch, "can_use_host_pointers", lambda index: True)
    monkeypatch.setitem(jobs_mod.PINNED, u8.data_ptr(), u8.numel())
    monkeypatch.setattr(cuda_launch, "PACK_MAX_SEGMENT_BYTES", max_segment)
    plan = BatchPlan(batch)
    seg = cuda_launch._by_segments(plan, torch.device("cpu"))
    assert seg is not None
    sizes = [n for job in batch for n in (job.q.nbytes, job.k.nbytes, job.v.nbytes)]
    long = [n for n in sizes if n > max_segment]
    assert sorted(d.numel() for d, _ in seg.dma_in) == sorted(long)
    assert seg.n_in == len(sizes) - len(long)
    assert len(seg.dma_out) == sum(job.out.nbytes > max_segment for job in batch)
    if max_segment == 100:
        assert seg.dma_in and seg.n_in  # both ways in one batch
    seg.q.fill_(math.nan)
    seg.k.fill_(math.nan)
    seg.v.fill_(math.nan)
    copy_segments_ref(seg.table[: seg.n_in], seg.unit)
    cuda_launch._copy_each(seg.dma_in)
    assert torch.equal(seg.q, torch.cat([q for q, _, _ in inputs]))
    assert torch.equal(seg.k, torch.cat([k for _, k, _ in inputs]))
    assert torch.equal(seg.v, torch.cat([v for _, _, v in inputs]))
    for job in batch:
        job.out.fill_(math.nan)
    seg.out.copy_(torch.randn(seg.out.shape))
    copy_segments_ref(seg.table[seg.n_in :], seg.unit)
    cuda_launch._copy_each(seg.dma_out)
    for i, job in enumerate(batch):
        assert torch.equal(job.out, seg.out[plan.q_offsets[i] : plan.q_offsets[i + 1]])


def _cu(values: tuple[int, ...] | None) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def test_merged_launch_writes_each_job_its_own_answer() -> None:
    jobs = [_prefill_job(1, [3, 4], [5, 4], lse=True), _prefill_job(2, [6], lse=False),
            _prefill_job(3, [1, 2], [0, 7], lse=True)]
    CpuBackend().launch(BatchPlan(jobs)).wait()
    for job in jobs:
        p = job.params
        ref_o, ref_l = prefill_ref(
            job.q.double(), job.k.double(), job.v.double(), _cu(p.cu_seqlens_q),
            _cu(p.cu_seqlens_k), causal=True, return_lse=True,
        )
        torch.testing.assert_close(job.out.double(), ref_o, atol=2e-5, rtol=2e-5)
        if p.return_lse:
            assert job.lse is not None and job.lse.shape == ref_l.shape
            torch.testing.assert_close(job.lse.double(), ref_l.double(), atol=1e-5, rtol=1e-5)
        else:
            assert job.lse is None


def test_merged_decode_keeps_batch_major_lse() -> None:
    jobs = [_decode_job(1, [3, 0, 5], lse=True), _decode_job(2, [7], lse=True)]
    plan = BatchPlan(jobs)
    assert plan.cu_seqlens_q is None and plan.cu_seqlens_k == [0, 3, 3, 8, 15]
    CpuBackend().launch(plan).wait()
    for job in jobs:
        ref_o, ref_l = decode_ref(job.q.double(), job.k.double(), job.v.double(),
                                  _cu(job.params.cu_seqlens_k), return_lse=True)
        torch.testing.assert_close(job.out.double(), ref_o, atol=2e-5, rtol=2e-5)
        assert job.lse is not None and job.lse.shape == (job.q.shape[0], 4)
        torch.testing.assert_close(job.lse.double(), ref_l.double(), atol=1e-5, rtol=1e-5)


def test_batch_without_keys_writes_zeros_and_minus_inf() -> None:
    job = _prefill_job(1, [3], [0], lse=True)
    CpuBackend().launch(BatchPlan([job])).wait()
    assert torch.equal(job.out, torch.zeros_like(job.out))
    assert job.lse is not None and torch.isneginf(job.lse).all()


def _key(job: Job):  # type: ignore[no-untyped-def]
    return batch_key(job)


def test_batch_key_separates_what_cannot_share_a_launch() -> None:
    base = _prefill_job(1, [4])
    assert _key(base) == _key(_prefill_job(2, [9, 1], lse=True))
    assert _key(base) == _key(_prefill_job(3, [4], scale=1 / math.sqrt(8)))
    assert _key(base) != _key(_prefill_job(4, [4], causal=False))
    assert _key(base) != _key(_prefill_job(5, [4], dim=16))
    assert _key(base) != _key(_prefill_job(6, [4], scale=0.3))
    assert _key(base) != _key(_decode_job(7, [4]))
    assert _key(_decode_job(8, [4])) != _key(_decode_job(9, [4], splits=2))
    with pytest.raises(ValueError, match="different batch keys"):
        BatchPlan([base, _prefill_job(4, [4], causal=False)])


def test_budget_tokens_counts_the_larger_side() -> None:
    assert _prefill_job(1, [2, 3]).params.budget_tokens == 5
    assert _prefill_job(1, [1], [40]).params.budget_tokens == 40  # few queries, long prefix
    assert _decode_job(1, [10, 20]).params.budget_tokens == 30


def _cached_job(op: Op, rows: int, seq_lens: list[int]) -> Job:
    q, k, v = random_qkv(rows, rows, 4, 2, 8, torch.float32, seed=0)
    cu_q = cu_from_lengths([1] * rows)
    job = _job(op, q, k, v, cu_q, None if op.decode_like else cu_q)
    job.cache = CacheWork(
        k_pages=k, v_pages=v, block_table=[[0]] * len(seq_lens), seq_lens=seq_lens,
        slot_pages=[], slot_offsets=[], flops=0, kv_bytes=0, finish=lambda ok: (),
    )
    return job


def test_cached_decode_keys_weigh_a_fraction_of_a_token() -> None:
    # Read in place, not copied: 4K-token caches must not cap a launch at a few steps.
    step = _cached_job(Op.CACHE_DECODE, 2, [4097, 100])
    assert step.budget_tokens == -(-(4097 + 100) // CACHED_KEYS_PER_TOKEN)
    assert _cached_job(Op.CACHE_DECODE, 3, [1, 1, 1]).budget_tokens == 3  # >= one per sequence
    # Cached prefill still counts every cached key (its work grows with queries x keys).
    assert _cached_job(Op.CACHE_PREFILL, 2, [4097, 100]).budget_tokens == 4197
    queue = BatchQueue(16384, 0.0005, 1024)
    for _ in range(300):
        queue.add(_cached_job(Op.CACHE_DECODE, 1, [4097]).queued(lambda value: None))
    batch, _ = queue.next_batch(0.0, device_idle=True)
    assert len(batch) == 16384 // 65  # 65 budget tokens each: 252 steps in one launch


# ---- BatchQueue ---------------------------------------------------------------------------

@pytest.fixture
def loop():  # type: ignore[no-untyped-def]
    return None  # queued jobs carry a done callback now; the fixture name stays for the tests


def _queued(loop: object, job: Job, at: float) -> Job:
    job.submitted_at = at
    return job.queued(lambda value: None)


def _tokens(batch: list[Job]) -> list[int]:
    return [j.weight for j in batch]


def test_idle_device_launches_at_once(loop) -> None:  # type: ignore[no-untyped-def]
    q = BatchQueue(max_batch_tokens=100, max_delay_s=0.002, max_size=10)
    assert q.next_batch(0.0, device_idle=True) == ([], None)
    q.add(_queued(loop, _prefill_job(1, [5]), at=1.0))
    q.add(_queued(loop, _prefill_job(2, [7]), at=1.0001))
    batch, wait = q.next_batch(1.0002, device_idle=True)
    assert _tokens(batch) == [5, 7] and wait is None and len(q) == 0


def test_busy_device_waits_for_delay_or_full_budget(loop) -> None:  # type: ignore[no-untyped-def]
    q = BatchQueue(max_batch_tokens=20, max_delay_s=0.002, max_size=10)
    q.add(_queued(loop, _prefill_job(1, [5]), at=1.0))
    batch, wait = q.next_batch(1.0005, device_idle=False)
    assert batch == [] and wait == pytest.approx(0.0015)
    batch, wait = q.next_batch(1.002, device_idle=False)  # the oldest hit the delay
    assert _tokens(batch) == [5] and wait is None
    q.add(_queued(loop, _prefill_job(2, [8]), at=2.0))
    q.add(_queued(loop, _prefill_job(3, [12]), at=2.0))
    q.add(_queued(loop, _prefill_job(4, [3]), at=2.0))
    batch, _ = q.next_batch(2.0, device_idle=False)  # 23 tokens wait: the budget is full
    assert _tokens(batch) == [8, 12]
    assert q.next_batch(2.0, device_idle=False)[0] == []  # 3 tokens: not yet


def test_fifo_packing_and_oversized_job_alone(loop) -> None:  # type: ignore[no-untyped-def]
    q = BatchQueue(max_batch_tokens=64, max_delay_s=0.0, max_size=10)
    for i, n in enumerate([20, 100, 20, 20, 30]):
        q.add(_queued(loop, _prefill_job(i, [n]), at=1.0 + i))
    batches = []
    while len(q):
        batches.append(_tokens(q.next_batch(9.0, device_idle=True)[0]))
    assert batches == [[20], [100], [20, 20], [30]]


def test_keys_are_batched_apart_oldest_first(loop) -> None:  # type: ignore[no-untyped-def]
    q = BatchQueue(max_batch_tokens=1000, max_delay_s=0.0, max_size=10)
    q.add(_queued(loop, _prefill_job(1, [4], dim=16), at=2.0))
    q.add(_queued(loop, _prefill_job(2, [5]), at=1.0))
    q.add(_queued(loop, _decode_job(3, [6]), at=1.5))
    q.add(_queued(loop, _prefill_job(4, [7]), at=3.0))
    order = []
    while len(q):
        batch = q.next_batch(9.0, device_idle=True)[0]
        order.append((batch[0].params.op.rpc, _tokens(batch)))
    assert order == [("Prefill", [5, 7]), ("Decode", [6]), ("Prefill", [4])]


def test_cancelled_jobs_are_removed_or_skipped(loop) -> None:  # type: ignore[no-untyped-def]
    q = BatchQueue(max_batch_tokens=100, max_delay_s=0.0, max_size=10)
    ws = [_queued(loop, _prefill_job(i, [n]), at=float(i)) for i, n in enumerate([3, 4, 5, 6])]
    for w in ws:
        q.add(w)
    assert q.remove(ws[1]) and not q.remove(ws[1])
    assert q.depth(Op.PREFILL) == 3
    ws[0].cancelled = True  # cancelled without removal (a race): never launched either
    ws[3].cancelled = True
    assert _tokens(q.next_batch(9.0, device_idle=True)[0]) == [5]
    assert len(q) == 0 and q.next_batch(9.0, device_idle=True) == ([], None)
    # ... and handed back, so the executor answers each exactly once.
    assert q.take_dropped() == [ws[0], ws[3]] and q.take_dropped() == []


def test_queue_bound_and_drain(loop) -> None:  # type: ignore[no-untyped-def]
    q = BatchQueue(max_batch_tokens=100, max_delay_s=0.0, max_size=2)
    q.add(_queued(loop, _prefill_job(1, [3]), at=1.0))
    q.add(_queued(loop, _decode_job(2, [3]), at=1.0))
    with pytest.raises(RequestError) as info:
        q.add(_queued(loop, _prefill_job(3, [3]), at=1.0))
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (q.depth(Op.PREFILL), q.depth(Op.DECODE)) == (1, 1)
    assert len(q.drain()) == 2 and len(q) == 0 and q.depth(Op.DECODE) == 0
    q.add(_queued(loop, _prefill_job(4, [3]), at=2.0))  # usable after a drain
    assert _tokens(q.next_batch(2.0, device_idle=True)[0]) == [3]


def test_batching_off_launches_one_job_at_a_time_without_waiting(loop) -> None:  # type: ignore[no-untyped-def]
    q = BatchQueue(max_batch_tokens=1000, max_delay_s=10.0, max_size=10, max_requests=1)
    for i in range(3):
        q.add(_queued(loop, _prefill_job(i, [4 + i]), at=1.0))
    # Busy device, delay far off: a lone job is still a full batch when batching is off.
    assert _tokens(q.next_batch(1.0, device_idle=False)[0]) == [4]
    assert _tokens(q.next_batch(1.0, device_idle=True)[0]) == [5]
    assert _tokens(q.next_batch(1.0, device_idle=True)[0]) == [6]


# ---- executor: every job answered exactly once ----------------------------------------------

class _Slow(CpuBackend):
    """Launches wait for ``gate`` so jobs pile up in the queue."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.sizes: list[int] = []

    def launch(self, plan):  # type: ignore[no-untyped-def]
        self.sizes.append(len(plan))
        self.gate.wait(10)
        return super().launch(plan)


@pytest.mark.parametrize("batching", [True, False])
def test_executor_answers_every_job_once_under_cancellation(batching: bool) -> None:
    backend = _Slow()
    ex = Executor(backend, batching=batching, max_queue_delay_s=0.0)
    answers: dict[int, list[object]] = {}
    lock = threading.Lock()
    jobs = [_prefill_job(i, [3 + i % 4], lse=i % 2 == 0) for i in range(24)]

    def done_for(i: int):  # type: ignore[no-untyped-def]
        def done(value: object) -> None:
            with lock:
                answers.setdefault(i, []).append(value)
        return done

    try:
        for i, job in enumerate(jobs):
            ex.submit(job, done_for(i))
        cancelled = set(range(1, 24, 3))
        for i in cancelled:
            ex.cancel(jobs[i])
        backend.gate.set()
        deadline = threading.Event()
        for _ in range(200):
            with lock:
                if len(answers) == len(jobs):
                    break
            deadline.wait(0.05)
    finally:
        ex.close()
    assert sorted(answers) == list(range(24)) and all(len(a) == 1 for a in answers.values())
    for i, job in enumerate(jobs):
        value = answers[i][0]
        if isinstance(value, Cancelled):
            assert i in cancelled  # only cancelled jobs may end so
            continue
        assert not isinstance(value, BaseException), value
        ref = prefill_ref(job.q.double(), job.k.double(), job.v.double(),
                          _cu(job.params.cu_seqlens_q), causal=True)
        torch.testing.assert_close(job.out.double(), ref, atol=2e-5, rtol=2e-5)
    if not batching:
        assert set(backend.sizes) == {1}
    else:
        assert max(backend.sizes) > 1


def test_closed_executor_refuses_and_answers_what_waited() -> None:
    backend = _Slow()
    ex = Executor(backend, max_queue_delay_s=0.0)
    got: list[object] = []
    ex.submit(_prefill_job(1, [4]), got.append)  # taken by the dispatcher, held at the gate
    ex.submit(_prefill_job(2, [4]), got.append)
    ex.submit(_prefill_job(3, [4]), got.append)
    threading.Timer(0.2, backend.gate.set).start()
    ex.close()
    with pytest.raises(RequestError) as info:
        ex.submit(_prefill_job(4, [4]), got.append)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert len(got) == 3


def test_idle_holds_only_while_nothing_is_queued_or_in_flight() -> None:
    # The engine's channel readers poll for requests only while this holds.
    backend = _Slow()
    ex = Executor(backend, max_queue_delay_s=0.0)
    got: list[object] = []
    try:
        assert ex.idle
        ex.submit(_prefill_job(1, [4]), got.append)
        assert not ex.idle  # queued
        _wait_until(lambda: len(backend.sizes) == 1)
        assert backend.sizes == [1] and not ex.idle  # taken by the dispatcher, held at the gate
        ex.submit(_prefill_job(2, [4]), got.append)  # queued behind it
        assert not ex.idle
        backend.gate.set()
        _wait_until(lambda: len(got) == 2 and ex.idle)
        assert len(got) == 2 and ex.idle
    finally:
        backend.gate.set()
        ex.close()


def _wait_until(ready: Callable[[], bool], seconds: float = 2.0) -> None:
    """Poll ``ready`` every 10 ms for up to ``seconds`` (the caller asserts what it needs)."""
    for _ in range(int(seconds / 0.01)):
        if ready():
            return
        time.sleep(0.01)


def _wait_answers(answers: dict[int, list[object]], n: int, lock: threading.Lock) -> None:
    def ready() -> bool:
        with lock:
            return len(answers) >= n

    _wait_until(ready, 4.0)


def _answers() -> tuple[dict[int, str], dict[int, object], Callable[[int], Any]]:
    """Per job number: the thread that answered it and its answer; and each job's ``done``."""
    where: dict[int, str] = {}
    got: dict[int, object] = {}

    def done_for(i: int) -> Any:
        def done(value: object) -> None:
            where[i] = threading.current_thread().name
            got[i] = value
        return done

    return where, got, done_for


def test_idle_device_issues_on_the_submitting_thread() -> None:
    backend = AsyncCpu()
    ex = Executor(backend, max_queue_delay_s=0.0)
    try:
        time.sleep(0.05)  # the dispatcher is waiting: the device is idle
        got: list[object] = []
        first = _prefill_job(0, [3])
        ex.submit(first, got.append)  # a caller that did not offer its thread
        _wait_until(lambda: bool(got))
        assert backend.threads == ["attention-batcher"]
        # Alone on the idle device it skips the queue (the queue would hand it straight back).
        queued: list[Job] = []
        add = ex._queue.add
        ex._queue.add = lambda j: (queued.append(j), add(j))[1]  # type: ignore[method-assign]
        job = _prefill_job(1, [5])
        ex.submit(job, got.append, issue_here=True)
        assert backend.threads[1:] == [threading.current_thread().name]  # issued right here
        assert not queued
        _wait_until(lambda: len(got) == 2)
    finally:
        ex.close()
    assert len(got) == 2 and not any(isinstance(g, BaseException) for g in got), got
    ref = prefill_ref(job.q.double(), job.k.double(), job.v.double(),
                      _cu(job.params.cu_seqlens_q), causal=True)
    torch.testing.assert_close(job.out.double(), ref, atol=2e-5, rtol=2e-5)


class _HeldFirst(AsyncCpu):
    """Its first launch stays in flight (its wait blocks) until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def launch(self, plan):  # type: ignore[no-untyped-def]
        first = not self.threads
        done = super().launch(plan)
        return later(done, lambda: self.release.wait(5)) if first else done


@pytest.mark.parametrize("in_block", [False, True], ids=["alone", "in-a-block"])
def test_a_lone_job_takes_a_free_launch_slot_while_one_runs(in_block: bool) -> None:
    """One launch in flight: a lone ``issue_here`` job launches at once on its own thread in
    the second slot (a host's other micro-batch overlaps the first's launch), where the queue
    would have held it for the queue delay (1 s here); inside a ``deferring`` block it waits
    for the next launch, which the steps read with it may join."""
    here = threading.current_thread().name
    backend = _HeldFirst()
    ex = Executor(backend, max_queue_delay_s=1.0)
    got: dict[int, object] = {}
    jobs = [_prefill_job(i, [3 + i]) for i in range(2)]
    try:
        time.sleep(0.05)  # the dispatcher is waiting: the device is idle
        ex.submit(jobs[0], lambda v: got.__setitem__(0, v), issue_here=True)
        with ex.deferring() if in_block else contextlib.nullcontext():
            ex.submit(jobs[1], lambda v: got.__setitem__(1, v), issue_here=True)
            assert len(backend.threads) == (1 if in_block else 2)
            backend.release.set()
        _wait_until(lambda: len(got) == 2)
    finally:
        ex.close()
    assert backend.threads[0] == here
    assert (backend.threads[1] == here) != in_block, backend.threads
    assert not any(isinstance(g, BaseException) for g in got.values()), got
    for job in jobs:
        ref = prefill_ref(job.q.double(), job.k.double(), job.v.double(),
                          _cu(job.params.cu_seqlens_q), causal=True)
        torch.testing.assert_close(job.out.double(), ref, atol=2e-5, rtol=2e-5)


def test_a_direct_launch_of_an_inline_op_is_answered_on_the_submitting_thread() -> None:
    """Ops in ``inline_ops`` (cuda: the cached decode steps) launched directly inside the
    submitter's ``deferring()`` block are answered by that thread when the block ends; jobs
    submitted in the same block meanwhile queue behind the launch and share the next one.
    Outside a block, or for other ops, the completer answers."""
    backend = AsyncCpu()
    ex = Executor(backend, max_queue_delay_s=0.0, inline_ops=frozenset({Op.PREFILL}))
    here = threading.current_thread().name
    where, got, done_for = _answers()
    jobs = [_prefill_job(i, [5 + i]) for i in range(5)]
    try:
        time.sleep(0.05)  # the dispatcher is waiting: the device is idle
        with ex.deferring():
            ex.submit(jobs[0], done_for(0), issue_here=True)  # launched here, left in flight
            assert backend.threads == [here] and not got
            ex.submit(jobs[1], done_for(1), issue_here=True)  # the device is busy: queued
            ex.submit(jobs[2], done_for(2), issue_here=True)
            assert 0 not in got
        assert where[0] == here  # answered when the block ended
        ex.submit(jobs[3], done_for(3), issue_here=True)  # no block: the completer answers
        ex.submit(jobs[4], done_for(4))
        _wait_until(lambda: len(got) == 5)
    finally:
        ex.close()
    assert not any(isinstance(g, BaseException) for g in got.values()), got
    assert {where[i] for i in (1, 2, 3, 4)} == {"attention-completer"}, where
    # 1 and 2 waited behind 0's launch and went out together (3 may have joined them).
    assert got[1].batch_requests >= 2 and got[2].batch_requests >= 2  # type: ignore[union-attr]
    for job in jobs:
        ref = prefill_ref(job.q.double(), job.k.double(), job.v.double(),
                          _cu(job.params.cu_seqlens_q), causal=True)
        torch.testing.assert_close(job.out.double(), ref, atol=2e-5, rtol=2e-5)
    # Without the op in inline_ops, a direct launch in a block still hands its completion over.
    backend = AsyncCpu()
    ex = Executor(backend, max_queue_delay_s=0.0)
    where.clear()
    try:
        time.sleep(0.05)
        with ex.deferring():
            ex.submit(_prefill_job(5, [4]), done_for(5), issue_here=True)
        _wait_until(lambda: bool(where))
    finally:
        ex.close()
    assert backend.threads == [here] and where == {5: "attention-completer"}, where


class _FailsSecond(_HeldFirst):
    """``_HeldFirst``, and its second launch's wait fails (as a launch the device refused)."""

    def launch(self, plan):  # type: ignore[no-untyped-def]
        second = len(self.threads) == 1
        pending = super().launch(plan)
        if not second:
            return pending

        class _Broken:
            def wait(self) -> object:
                raise RuntimeError("device fault")

        return _Broken()


def test_held_launches_are_answered_by_their_holder_in_order() -> None:
    """Inside ``holding``, direct launches of an inline op take any free slot (the second
    while the first runs) and are answered only by the holder, in launch order, once the
    completer has seen each end and woken the hold's fd; a launch whose wait fails is answered
    with its error; the executor's counts come back (idle), and a launch outside the hold is
    the completer's as before."""
    here = threading.current_thread().name
    backend = _FailsSecond()
    ex = Executor(backend, max_queue_delay_s=1.0, inline_ops=frozenset({Op.PREFILL}))
    hold = Hold()
    where, got, done_for = _answers()
    jobs = [_prefill_job(i, [4 + i]) for i in range(4)]
    try:
        time.sleep(0.05)  # the dispatcher is waiting: the device is idle
        with ex.holding(hold):
            for i in range(3):  # the third waits for a slot: the queue (the completer's)
                ex.submit(jobs[i], done_for(i), issue_here=True)
        assert backend.threads[:2] == [here, here] and len(hold.items) == 2
        time.sleep(0.05)
        assert not got and ex.answer_held(hold) == 2  # 0's launch has not ended: nothing
        backend.release.set()
        while ex.answer_held(hold):
            select.select([hold.fd], [], [], 2.0)
            hold.clear()
        # (job 2, queued, may be answered meanwhile: it is the completer's, checked below)
        assert where[0] == where[1] == here and isinstance(got[1], RuntimeError)
        ex.submit(jobs[3], done_for(3), issue_here=True)  # no hold: the completer answers
        _wait_until(lambda: len(got) == 4 and ex.idle)
        assert ex.idle and not hold.items
    finally:
        backend.release.set()
        ex.close()
        hold.close()
    assert where[2] == where[3] == "attention-completer", where
    hold.wake()  # closed: the completer's late wake-up writes nothing (the fd may be reused)
    hold.close()
    for i in (0, 2, 3):
        job = jobs[i]
        assert not isinstance(got[i], BaseException), got[i]
        ref = prefill_ref(job.q.double(), job.k.double(), job.v.double(),
                          _cu(job.params.cu_seqlens_q), causal=True)
        torch.testing.assert_close(job.out.double(), ref, atol=2e-5, rtol=2e-5)


def test_close_waits_for_a_deferred_launch() -> None:
    """close() during a deferring block: the block's launch is still answered (by its
    thread, at the block's end), and close returns after it."""
    backend = AsyncCpu()
    ex = Executor(backend, max_queue_delay_s=0.0, inline_ops=frozenset({Op.PREFILL}))
    got: list[object] = []
    closed = threading.Event()
    time.sleep(0.05)
    with ex.deferring():
        ex.submit(_prefill_job(0, [3]), got.append, issue_here=True)
        closer = threading.Thread(target=lambda: (ex.close(), closed.set()))
        closer.start()
        time.sleep(0.2)
        assert not closed.is_set()  # it waits for the deferred launch
    closer.join(10)
    assert closed.is_set() and len(got) == 1 and not isinstance(got[0], BaseException), got


def test_direct_and_dispatched_launches_never_overlap_and_answer_once() -> None:
    backend = AsyncCpu(launch_s=0.002)
    ex = Executor(backend, max_queue_delay_s=0.0005)
    answers: dict[int, list[object]] = {}
    lock = threading.Lock()
    jobs = [_prefill_job(i, [1 + i % 7]) for i in range(160)]

    def submit_some(ids: range) -> None:
        for i in ids:
            def done(value: object, i: int = i) -> None:
                with lock:
                    answers.setdefault(i, []).append(value)
            ex.submit(jobs[i], done, issue_here=True)
            time.sleep(0.0005 * (i % 3))

    try:
        threads = [threading.Thread(target=submit_some, args=(range(t, 160, 8),))
                   for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        _wait_answers(answers, len(jobs), lock)
    finally:
        ex.close()
    assert not backend.overlapped
    assert sorted(answers) == list(range(160)) and all(len(a) == 1 for a in answers.values())
    for i, job in enumerate(jobs):
        assert not isinstance(answers[i][0], BaseException), answers[i]
        ref = prefill_ref(job.q.double(), job.k.double(), job.v.double(),
                          _cu(job.params.cu_seqlens_q), causal=True)
        torch.testing.assert_close(job.out.double(), ref, atol=2e-5, rtol=2e-5)
    # Both paths ran: some launches on the submitters' threads, some on the dispatcher.
    assert "attention-batcher" in backend.threads
    assert set(backend.threads) - {"attention-batcher"}


def _submit_or_refusal(ex: Executor, job: Job, got: list[object]) -> None:
    try:
        ex.submit(job, got.append, issue_here=True)
    except RequestError as exc:  # closed first: refused, which answers it too
        got.append(exc)


def test_a_direct_launch_racing_close_is_still_answered() -> None:
    """close() while a submitter issues on its own thread: the completer must not stop before
    that launch is queued, so its caller is answered (stats or UNAVAILABLE), never dropped."""
    for attempt in range(20):
        backend = AsyncCpu(launch_s=0.003)
        ex = Executor(backend, max_queue_delay_s=0.0)
        time.sleep(0.01)  # the dispatcher waits: the next submit issues directly
        got: list[object] = []
        submitter = threading.Thread(target=_submit_or_refusal,
                                     args=(ex, _prefill_job(attempt, [4]), got))
        submitter.start()
        time.sleep(0.001 * (attempt % 4))
        ex.close()
        submitter.join()
        for _ in range(300):
            if got:
                break
            time.sleep(0.01)
        assert len(got) == 1, (attempt, got)
