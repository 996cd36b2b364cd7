"""The staged CacheDecode launch on the GPU (engine/decode_steps.py), CUDA graphs on and off,
against the float64 paged reference: padded batches, steps with and without new tokens, a
graph replayed with new data, tensors on the device (CUDA IPC regions) as well as the host,
and nothing in the pool written but the new tokens' slots."""

from __future__ import annotations

import math

import pytest
import torch

import attention_kernels
from attention_kernels.paged_reference import paged_decode_ref
from attention_service.engine.decode_steps import DecodeSteps
from attention_service.engine.dtypes import WIRE_DTYPES
from attention_service.engine.jobs import BatchPlan, CacheWork, Job
from attention_service.params import Op, make_params

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 2e-3}  # fp32 dots: TF32
PAGE_TOKENS = 16


class Pool:
    def __init__(self, pages: int, kv_heads: int, dim: int, dtype: torch.dtype) -> None:
        g = torch.Generator(device="cuda").manual_seed(pages)
        shape = (pages, PAGE_TOKENS, kv_heads, dim)
        self.k = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
        self.v = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
        self.next = 1  # page 0 is left to padding and stale slots: never handed out here

    def take(self, n: int) -> list[int]:
        pages = list(range(self.next, self.next + n))
        self.next += n
        return pages


def _job(pool: Pool, seq_lens: list[int], new: int, heads: int, seed: int,
         lse: bool = True) -> Job:
    """A step over fresh caches of ``seq_lens`` keys, the last ``new`` of each sequence's
    keys its new tokens (usually 1; 0: none)."""
    g = torch.Generator().manual_seed(seed)
    b, kv_heads, dim, dtype = len(seq_lens), pool.k.shape[2], pool.k.shape[3], pool.k.dtype
    # Page-locked host tensors, as a step socket's frames and a front end's arena are: the
    # launch's copies read them at their addresses.
    q = torch.randn(b, heads, dim, generator=g).to(dtype).pin_memory()
    rows = b * new
    k = torch.randn(rows, kv_heads, dim, generator=g).to(dtype).pin_memory()
    v = torch.randn(rows, kv_heads, dim, generator=g).to(dtype).pin_memory()
    cu = [new * i for i in range(b + 1)]
    params = make_params(Op.CACHE_DECODE, WIRE_DTYPES[dtype], tuple(q.shape), tuple(k.shape), cu,
                         return_lse=lse)
    table, slot_pages, slot_offsets = [], [], []
    for n in seq_lens:
        pages = pool.take(math.ceil(n / PAGE_TOKENS))
        table.append(pages)
        for pos in range(n - new, n):
            slot_pages.append(pages[pos // PAGE_TOKENS])
            slot_offsets.append(pos % PAGE_TOKENS)
    out = torch.full_like(q, float("nan")).pin_memory()  # poisoned destinations
    lse_t = torch.full((b, heads), float("nan")).pin_memory() if lse else None
    job = Job(params, q, k, v, out, lse_t)
    job.cache = CacheWork(k_pages=pool.k, v_pages=pool.v, block_table=table, seq_lens=seq_lens,
                          slot_pages=slot_pages, slot_offsets=slot_offsets, flops=0, kv_bytes=0,
                          finish=lambda ok: ())
    return job


def _expected(pool_k: torch.Tensor, pool_v: torch.Tensor, jobs: list[Job]) -> None:
    """Write every job's new tokens into copies of the pool, as the launch must."""
    for job in jobs:
        work = job.cache
        assert work is not None
        for i, (p, o) in enumerate(zip(work.slot_pages, work.slot_offsets, strict=True)):
            pool_k[p, o] = job.k[i].cuda()
            pool_v[p, o] = job.v[i].cuda()


def _table(job: Job) -> tuple[torch.Tensor, torch.Tensor]:
    """A job's block table (rows padded with page 0) and lengths, on the GPU."""
    work = job.cache
    assert work is not None
    width = max(len(r) for r in work.block_table)
    table = torch.tensor([r + [0] * (width - len(r)) for r in work.block_table],
                         dtype=torch.int32, device="cuda")
    return table, torch.tensor(work.seq_lens, dtype=torch.int32, device="cuda")


def _check(jobs: list[Job], pool_k: torch.Tensor, pool_v: torch.Tensor, heads: int) -> None:
    for job in jobs:
        table, lens = _table(job)
        ref, ref_lse = paged_decode_ref(job.q.cuda(), pool_k, pool_v, table, lens,
                                        return_lse=True)
        tol = TOL[job.q.dtype]
        out = job.out.cpu()
        assert not out.isnan().any()
        torch.testing.assert_close(out.double(), ref.double().cpu(), atol=tol, rtol=tol)
        if job.lse is not None:
            torch.testing.assert_close(job.lse.cpu().double(), ref_lse.double().cpu(),
                                       atol=2e-2, rtol=2e-3)


def _on_device(job: Job) -> Job:
    """The job with every tensor on the GPU (as a CUDA IPC region's are), outputs poisoned."""
    for name in ("q", "k", "v"):
        job.set_tensor(name, job.tensor(name).cuda())  # type: ignore[union-attr]
    job.out = torch.full_like(job.q, float("nan"))
    if job.lse is not None:
        job.lse = torch.full_like(job.lse, float("nan"), device="cuda")
    return job


@pytest.fixture(params=[True, False], ids=["graphs", "eager"])
def steps(request: pytest.FixtureRequest) -> DecodeSteps:
    streams = [torch.cuda.Stream() for _ in range(2)]
    return DecodeSteps(attention_kernels, torch.device("cuda", torch.cuda.current_device()),
                       streams, graphs=request.param)


@pytest.mark.parametrize(("dtype", "heads", "kv_heads", "dim"), [
    (torch.bfloat16, 32, 8, 128), (torch.float16, 12, 4, 96), (torch.float32, 8, 8, 64),
    (torch.bfloat16, 8, 2, 59),  # any head dim (issue 65)
])
def test_steps_match_the_reference(steps: DecodeSteps, dtype: torch.dtype, heads: int,
                                   kv_heads: int, dim: int) -> None:
    pool = Pool(256, kv_heads, dim, dtype)
    before_k, before_v = pool.k.clone(), pool.v.clone()
    # Launches: one lone step, a padded batch of three jobs (5 sequences -> bucket 8,
    # one job without new tokens), and a batch whose widths need a wider table bucket.
    launches = [
        [_job(pool, [33], 1, heads, 1)],
        [_job(pool, [1, 17], 1, heads, 2), _job(pool, [16], 0, heads, 3),
         _job(pool, [100, 5], 1, heads, 4, lse=False)],
        [_job(pool, [300], 1, heads, 5), _job(pool, [2], 1, heads, 6)],
        [_job(pool, [40], 3, heads, 7)],  # several new tokens for one sequence
    ]
    for i, jobs in enumerate(launches):
        plan = BatchPlan(jobs)
        assert steps.places(plan) is not None
        steps.launch(plan, i % 2).wait()
        _expected(before_k, before_v, jobs)
        _check(jobs, before_k, before_v, heads)
    # Nothing else in the pool changed: padding slots repeat real writes, never page 0 or
    # another cache's keys.
    torch.testing.assert_close(pool.k, before_k, rtol=0, atol=0)
    torch.testing.assert_close(pool.v, before_v, rtol=0, atol=0)


def test_device_tensors_take_the_graph_variant(steps: DecodeSteps) -> None:
    """Jobs whose q, new k/v and outputs are all on the GPU (CUDA IPC regions) run on the
    staged path too: a padded batch (new-token rows padded as well), a job without new tokens,
    one without lse; against the reference, the pool changed only in the new tokens' slots,
    and a replay with new data. A launch mixing host and device jobs, and a job mixing them,
    take it as well (each copy reads its own address); a pageable tensor does not."""
    pool = Pool(256, 4, 128, torch.bfloat16)
    expect_k, expect_v = pool.k.clone(), pool.v.clone()
    for round_ in range(3):  # the same bucket: later rounds replay the first graph
        jobs = [_on_device(_job(pool, [1 + round_, 70], 1, 16, 50 + round_)),
                _on_device(_job(pool, [16], 0, 16, 60 + round_)),
                _on_device(_job(pool, [33, 5, 129], 1, 16, 70 + round_, lse=False))]
        plan = BatchPlan(jobs)
        assert steps.places(plan) is not None
        steps.launch(plan, 0).wait()
        _expected(expect_k, expect_v, jobs)
        _check(jobs, expect_k, expect_v, 16)
        assert steps.captured == (1 if steps.use_graphs else 0)
    host, device = _job(pool, [9], 1, 16, 80), _on_device(_job(pool, [9], 1, 16, 81))
    half = _job(pool, [9, 40], 1, 16, 82)
    half.out = torch.full_like(half.q, float("nan"), device="cuda")  # q on the host, out on the GPU
    mixed = [host, device, half]
    assert steps.places(BatchPlan(mixed)) is not None
    steps.launch(BatchPlan(mixed), 1).wait()
    _expected(expect_k, expect_v, mixed)
    _check(mixed, expect_k, expect_v, 16)
    torch.testing.assert_close(pool.k, expect_k, rtol=0, atol=0)
    torch.testing.assert_close(pool.v, expect_v, rtol=0, atol=0)
    pageable = _job(pool, [9], 1, 16, 83)
    pageable.q = pageable.q.clone()  # pageable host memory: the general path
    assert not pageable.q.is_pinned() and steps.places(BatchPlan([pageable])) is None


def test_a_graph_replays_with_new_data(steps: DecodeSteps) -> None:
    pool = Pool(128, 2, 64, torch.bfloat16)
    expect_k, expect_v = pool.k.clone(), pool.v.clone()
    # The same shape bucket and caches (no ids) every time, new pages and data each: the
    # staging last written for these caches is found on the stream it was staged on, whichever
    # stream is asked for, and rewritten, so one capture replays four times with new tables.
    for seed in range(4):
        jobs = [_job(pool, [20 + seed, 7], 1, 8, 10 + seed)]
        steps.launch(BatchPlan(jobs), seed % 2).wait()
        _expected(expect_k, expect_v, jobs)
        _check(jobs, expect_k, expect_v, 8)
    assert steps.captured == (1 if steps.use_graphs else 0)


def test_steps_in_flight_on_one_stream_get_stagings_of_their_own(steps: DecodeSteps) -> None:
    """Two launches of one shape bucket issued on one stream before either is waited for (the
    executor's retry of a failed batch job by job can do this): the second takes a second
    staging (and graph), so neither overwrites the other's inputs or outputs; later launches
    reuse both."""
    pool = Pool(128, 2, 64, torch.bfloat16)
    expect_k, expect_v = pool.k.clone(), pool.v.clone()
    for round_ in range(2):
        jobs = [[_job(pool, [30 + i, 9], 1, 8, 40 + 2 * round_ + i)] for i in range(2)]
        pending = [steps.launch(BatchPlan(j), 0) for j in jobs]  # both in flight
        for p in pending:
            p.wait()
        for j in jobs:
            _expected(expect_k, expect_v, j)
        for j in jobs:
            _check(j, expect_k, expect_v, 8)
        assert steps.captured == (2 if steps.use_graphs else 0)
    torch.testing.assert_close(pool.k, expect_k, rtol=0, atol=0)


def test_a_step_goes_to_the_stream_whose_staging_holds_its_table(steps: DecodeSteps) -> None:
    """Two layers' steps staged on streams 0 and 1; when the round robin then names the
    other stream for each (a merged launch shifted it), each still runs where its table is
    staged: no staging's table is rewritten, and the results match."""
    pool = Pool(128, 2, 64, torch.bfloat16)
    expect_k, expect_v = pool.k.clone(), pool.v.clone()
    layers = [_job(pool, [40, 9], 0, 8, 90), _job(pool, [17, 70], 0, 8, 91)]

    def step(layer: int, stream: int, seed: int) -> None:
        job = layers[layer]
        job.q = torch.randn(job.q.shape, generator=torch.Generator().manual_seed(seed)
                            ).to(job.q.dtype).pin_memory()
        job.out.fill_(float("nan"))
        steps.launch(BatchPlan([job]), stream).wait()
        _check([job], expect_k, expect_v, 8)

    step(0, 0, 1)
    step(1, 1, 2)
    stagings = {i: g._free[0] for (_, i, _), g in steps._graphs.items()}
    tables = {i: s.table_rows for i, s in stagings.items()}
    step(0, 1, 3)  # layer 0's table is staged on stream 0
    step(1, 0, 4)
    assert {i: s.table_rows for i, s in stagings.items()} == tables
    assert len(steps._graphs) == 2  # none made for a stream the step did not run on
    assert steps.captured == (2 if steps.use_graphs else 0)


@pytest.mark.parametrize("send_fp8", [False, True], ids=["bf16-in", "fp8-in"])
def test_fp8_cache_steps(steps: DecodeSteps, send_fp8: bool) -> None:
    """FP8 pool, each job's caches with scales of their own (one launch): new tokens sent in
    bf16 are quantized inside the graph with their cache's scales, FP8 ones stored as sent;
    outputs match the reference on the dequantized pool and the pool holds exactly the
    quantized tokens."""
    from attention_kernels import quantize_kv

    heads, kv_heads, dim = 16, 4, 128
    pool = Pool(64, kv_heads, dim, torch.bfloat16)
    base = torch.arange(1, kv_heads + 1, dtype=torch.float32)
    job_scales = [(tuple((0.01 * base).tolist()), tuple((0.02 * base).tolist())),
                  (tuple((0.3 * base).tolist()), tuple((0.005 * base).tolist()))]
    pool.k = (pool.k * 3).to(FP8)
    pool.v = (pool.v * 3).to(FP8)
    expect_k, expect_v = pool.k.clone(), pool.v.clone()
    for round_ in range(3):  # one stream: later rounds replay the first round's graph
        jobs = [_job(pool, [37, 200], 1, heads, 20 + round_),
                _job(pool, [5], 1, heads, 30 + round_)]
        if round_ == 2:  # other scales, the same graph: scales are staged inputs
            job_scales = job_scales[::-1]
        for job, scales in zip(jobs, job_scales, strict=True):
            ks, vs = (torch.tensor(s) for s in scales)
            q = job.q.to(torch.bfloat16)
            k, v = job.k.to(torch.bfloat16), job.v.to(torch.bfloat16)
            k8, v8 = quantize_kv(k, ks)[0], quantize_kv(v, vs)[0]
            if send_fp8:
                k, v = k8, v8
            job.params = make_params(Op.CACHE_DECODE, WIRE_DTYPES[q.dtype], tuple(q.shape),
                                     tuple(k.shape), job.params.cu_seqlens_k, return_lse=True,
                                     kv_dtype=WIRE_DTYPES[k.dtype])
            job.q, job.k, job.v = q.pin_memory(), k.pin_memory(), v.pin_memory()
            job.out = torch.full_like(q, float("nan")).pin_memory()
            work = job.cache
            assert work is not None
            work.k_pages, work.v_pages = pool.k, pool.v
            work.seq_scales = [scales] * len(work.seq_lens)
            for i, (p, o) in enumerate(zip(work.slot_pages, work.slot_offsets, strict=True)):
                expect_k[p, o] = k8[i].cuda()
                expect_v[p, o] = v8[i].cuda()
        plan = BatchPlan(jobs)
        assert steps.places(plan) is not None and plan.fp8
        steps.launch(plan, 0).wait()
        assert steps.captured == (1 if steps.use_graphs else 0)
        assert torch.equal(pool.k.view(torch.uint8), expect_k.view(torch.uint8))
        assert torch.equal(pool.v.view(torch.uint8), expect_v.view(torch.uint8))
        for job, scales in zip(jobs, job_scales, strict=True):
            table, lens = _table(job)
            ks, vs = (torch.tensor(s, device="cuda") for s in scales)
            ref = paged_decode_ref(job.q.cuda().double(), pool.k, pool.v, table, lens,
                                   k_scale=ks, v_scale=vs)
            out = job.out.double()
            assert not out.isnan().any()
            err = ((out - ref.double().cpu()).norm() / ref.double().norm()).item()
            assert err < TOL[torch.bfloat16], err


FP8 = torch.float8_e4m3fn
