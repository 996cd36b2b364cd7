"""The staged CacheDecode launch's host side (engine/decode_steps.py), without a GPU: shape
buckets, which launches take the path, and how a batch is packed into one staging buffer
(padding rows and slots included). engine/test_decode_steps_gpu.py runs it for real."""

from __future__ import annotations

import os

import pytest
import torch

from attention_service.engine.decode_steps import (
    MAX_BATCH,
    Staging,
    StepShape,
    bucket,
    eligible,
)
from attention_service.engine.dtypes import WIRE_DTYPES
from attention_service.engine.jobs import BatchPlan, ByteBase, CacheWork, Job
from attention_service.params import Op, make_params

H, HKV, D = 4, 2, 8
PAGE_TOKENS = 4


def _step(seq_lens: list[int], new: bool, seed: int, pages_from: int = 0) -> Job:
    """A CacheDecode job over caches of ``seq_lens`` keys (after its new token, if ``new``)."""
    g = torch.Generator().manual_seed(seed)
    b = len(seq_lens)
    q = torch.randn(b, H, D, generator=g)
    rows = b if new else 0
    k, v = torch.randn(rows, HKV, D, generator=g), torch.randn(rows, HKV, D, generator=g)
    params = make_params(Op.CACHE_DECODE, WIRE_DTYPES[q.dtype], tuple(q.shape), tuple(k.shape),
                         list(range(b + 1)) if new else [0] * (b + 1), None, return_lse=True)
    table, slot_pages, slot_offsets, page = [], [], [], pages_from
    for n in seq_lens:
        pages = list(range(page, page + -(-n // PAGE_TOKENS)))
        page += len(pages)
        table.append(pages)
        if new:
            slot_pages.append(pages[(n - 1) // PAGE_TOKENS])
            slot_offsets.append((n - 1) % PAGE_TOKENS)
    pool = torch.zeros(page + 1, PAGE_TOKENS, HKV, D)
    job = Job(params, q, k, v, torch.full_like(q, float("nan")), torch.full((b, H), float("nan")))
    job.cache = CacheWork(k_pages=pool, v_pages=pool, block_table=table, seq_lens=seq_lens,
                          slot_pages=slot_pages, slot_offsets=slot_offsets, flops=0, kv_bytes=0,
                          finish=lambda ok: ())
    return job


def test_buckets_are_powers_of_two() -> None:
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 63, 64, 65)] == [1, 1, 2, 4, 4, 8, 64, 64, 128]


def test_only_cache_decode_launches_with_host_tensors_and_keys_take_the_path() -> None:
    assert eligible(BatchPlan([_step([5, 9], new=True, seed=0)]))
    assert not eligible(BatchPlan([_step([0], new=False, seed=0)]))  # no keys at all
    assert not eligible(BatchPlan([_step([1] * (MAX_BATCH + 1), new=False, seed=0)]))
    job = _step([3], new=True, seed=0)
    job.params = make_params(Op.CACHE_PREFILL, job.params.dtype, (1, H, D), (1, HKV, D), [0, 1],
                             [0, 1])
    assert not eligible(BatchPlan([job]))


def test_staging_packs_a_batch_and_pads_it_harmlessly() -> None:
    a = _step([5, 9], new=True, seed=1)
    b = _step([12], new=True, seed=2, pages_from=10)
    c = _step([4], new=False, seed=3, pages_from=20)  # no new token: no slot
    plan = BatchPlan([a, b, c])
    shape = StepShape.of(plan)
    assert (shape.batch, shape.width, shape.new_rows) == (4, 4, 4)
    staging = Staging(shape, pin=False)
    assert staging.u8.numel() == shape.layout[1]
    for view in staging.views.values():
        assert (view.data_ptr() - staging.u8.data_ptr()) % 128 == 0  # every field aligned
    staging.views["q"].fill_(float("nan"))
    staging.lens[:] = -1
    staging.fill(plan, shape)
    v = staging.views
    torch.testing.assert_close(v["q"][:4], torch.cat([a.q, b.q, c.q]), rtol=0, atol=0)
    new_k = torch.cat([a.k, b.k])
    torch.testing.assert_close(v["k"][:3], new_k, rtol=0, atol=0)
    torch.testing.assert_close(v["k"][3], new_k[0], rtol=0, atol=0)  # padding repeats row 0
    torch.testing.assert_close(v["v"][:3], torch.cat([a.v, b.v]), rtol=0, atol=0)
    assert staging.slots[0].tolist() == [1, 4, 12, 1]  # the padding slot repeats slot 0
    assert staging.slots[1].tolist() == [0, 0, 3, 0]
    assert staging.lens.tolist() == [5, 9, 12, 4]
    assert staging.table[0, :2].tolist() == [0, 1]
    assert staging.table[1, :3].tolist() == [2, 3, 4]
    assert staging.table[2, :3].tolist() == [10, 11, 12]
    assert staging.table[3, :1].tolist() == [20]


def test_a_staging_rewrites_its_table_only_when_it_changed() -> None:
    first = BatchPlan([_step([5, 9], new=False, seed=1)])
    shape = StepShape.of(first)
    staging = Staging(shape, pin=False)
    staging.fill(first, shape)
    assert staging.table[0, :2].tolist() == [0, 1]
    assert staging.table[1, :3].tolist() == [2, 3, 4]
    staging.table[:] = -1  # the same pages again: left as it is (nothing else writes it)
    staging.fill(BatchPlan([_step([5, 9], new=False, seed=2)]), shape)
    assert (staging.table == -1).all()
    moved = BatchPlan([_step([5, 9], new=False, seed=3, pages_from=7)])  # other pages
    staging.fill(moved, shape)
    assert staging.table[0, :2].tolist() == [7, 8]
    assert staging.table[1, :3].tolist() == [9, 10, 11]


def test_padding_rows_have_no_keys() -> None:
    plan = BatchPlan([_step([7, 2, 30], new=False, seed=4)])
    shape = StepShape.of(plan)
    assert (shape.batch, shape.width, shape.new_rows) == (4, 8, 0)
    staging = Staging(shape, pin=False)
    staging.lens[:] = 99
    staging.fill(plan, shape)
    assert staging.lens.tolist() == [7, 2, 30, 0]


def test_more_new_tokens_than_sequences_get_their_own_bucket() -> None:
    job = _step([6], new=True, seed=7)
    # Three new tokens for the one sequence (cu_seqlens_k [0, 3]).
    job.k, job.v = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    job.params = make_params(Op.CACHE_DECODE, job.params.dtype, (1, H, D), (3, HKV, D), [0, 3])
    work = job.cache
    assert work is not None
    work.slot_pages, work.slot_offsets = [0, 1, 1], [3, 0, 1]
    plan = BatchPlan([job])
    shape = StepShape.of(plan)
    assert (shape.batch, shape.new_rows) == (1, 4)
    staging = Staging(shape, pin=False)
    staging.fill(plan, shape)
    torch.testing.assert_close(staging.views["k"][:3], job.k, rtol=0, atol=0)
    assert staging.slots.tolist() == [[0, 1, 1, 0], [3, 0, 1, 3]]


@pytest.mark.parametrize("b", [1, 2, 3])
def test_a_reused_staging_is_refilled_exactly(b: int) -> None:
    first = BatchPlan([_step([9] * 4, new=True, seed=5)])
    second = BatchPlan([_step([3] * b, new=True, seed=6)])
    staging = Staging(StepShape.of(first), pin=False)
    staging.fill(first, StepShape.of(first))
    # the same bucket, fewer rows
    shape = StepShape(second.key, second.shared, 4, StepShape.of(first).width, 4)
    staging.fill(second, shape)
    assert staging.lens.tolist() == [3] * b + [0] * (4 - b)
    torch.testing.assert_close(staging.views["q"][:b], second.jobs[0].q, rtol=0, atol=0)
    assert staging.slots[0].tolist() == [0, 1, 2][:b] + [0] * (4 - b)  # one page each
    assert staging.slots[1].tolist() == [2] * 4


# ---- FP8 caches on the staged path: its host side, and its device work run eagerly on the
# CPU (the kernels under TRITON_INTERPRET=1); test_decode_steps_gpu.py adds the CUDA graphs.

FP8 = torch.float8_e4m3fn
# Per kv head (keys, values), per sequence: caches of different scales share a launch.
SCALES = [((0.02, 0.5), (0.01, 0.04)), ((0.3, 0.001), (0.2, 0.5)), ((1.0, 1.0), (0.05, 0.05)),
          ((7.0, 0.1), (3.0, 0.002))]


def _fp8_step(seq_lens: list[int], seed: int, send_fp8: bool, new: bool = True,
              first: int = 0, pages_from: int = 0,
              pool: torch.Tensor | None = None) -> tuple[Job, torch.Tensor]:
    """A bf16 step over an FP8 pool (random e4m3 contents, or ``pool``; sequence i's cache
    has scales ``SCALES[first + i]``), one new token per sequence (``new``; else none), sent
    in bf16 (``send_fp8`` False: the engine quantizes it with its cache's scales) or already
    as e4m3."""
    from attention_kernels import quantize_kv

    job = _step(seq_lens, new=new, seed=seed, pages_from=pages_from)
    if pool is None:
        g = torch.Generator().manual_seed(seed + 100)
        pages = job.cache.k_pages.shape[0]  # type: ignore[union-attr]
        pool = (torch.randn(pages, PAGE_TOKENS, HKV, D, generator=g) * 100).to(FP8)
    scales = SCALES[first : first + len(seq_lens)]
    ks, vs = (torch.tensor([s[i] for s in scales]) for i in (0, 1))  # [batch, H_kv]
    q, k, v = job.q.bfloat16(), job.k.bfloat16(), job.v.bfloat16()
    if send_fp8 and new:
        k, v = quantize_kv(k, ks)[0], quantize_kv(v, vs)[0]
    if not new:  # no tokens: empty k/v in the dtype the batch's tokens travel in
        k, v = k.to(FP8 if send_fp8 else torch.bfloat16), v.to(FP8 if send_fp8 else torch.bfloat16)
    job.params = make_params(Op.CACHE_DECODE, WIRE_DTYPES[q.dtype], tuple(q.shape),
                             tuple(k.shape), job.params.cu_seqlens_k, None, return_lse=True,
                             kv_dtype=WIRE_DTYPES[k.dtype])
    job.q, job.k, job.v = q, k, v
    job.out = torch.full_like(q, float("nan"))
    job.lse = torch.full((len(seq_lens), H), float("nan"))
    work = job.cache
    assert work is not None
    work.k_pages, work.v_pages, work.seq_scales = pool, pool.clone(), scales
    return job, pool


def test_fp8_staging_holds_one_byte_keys_and_values() -> None:
    job, _ = _fp8_step([5, 9], seed=8, send_fp8=True)
    plan = BatchPlan([job])
    assert eligible(plan) and plan.fp8
    shape = StepShape.of(plan)
    staging = Staging(shape, pin=False)
    assert staging.views["k"].dtype == FP8 and staging.views["q"].dtype == torch.bfloat16
    staging.fill(plan, shape)
    assert torch.equal(staging.views["k"][:2].view(torch.uint8), job.k.view(torch.uint8))
    scales = staging.views["scales"]  # [k/v, batch bucket, H_kv]; padding rows 1
    want = torch.tensor([[s[0] for s in SCALES[:2]], [s[1] for s in SCALES[:2]]])
    torch.testing.assert_close(scales[:, :2], want, rtol=0, atol=0)
    assert (scales[:, 2:] == 1).all()
    assert "new_scales" not in staging.views  # FP8 tokens: stored as sent
    # Caches of other scales are the same key: the same bucket, the same graph.
    other, _ = _fp8_step([5, 9], seed=8, send_fp8=True)
    other.cache.seq_scales = [((0.5, 0.5), (0.5, 0.5))] * 2  # type: ignore[union-attr]
    assert StepShape.of(BatchPlan([other])) == shape
    bf16_in, _ = _fp8_step([5, 9, 1], seed=8, send_fp8=False)
    plan = BatchPlan([bf16_in])
    shape = StepShape.of(plan)
    staging = Staging(shape, pin=False)
    staging.fill(plan, shape)
    new = staging.views["new_scales"]  # one row per new token, padding repeats row 0
    assert new[0, :4, 0].tolist() == pytest.approx([0.02, 0.3, 1.0, 0.02])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "") in ("", "0"),
                    reason="runs the Triton kernels on the CPU: needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("send_fp8", [False, True])
def test_fp8_step_runs_eagerly_like_the_reference(send_fp8: bool) -> None:
    """The staged work (store the new tokens, quantizing bf16 ones; paged FP8 decode) of a
    batch [job with 2 sequences and tokens, a token-less job, a job with a token], each
    sequence's cache of other scales, equals the float64 reference on the dequantized pool,
    sequence by sequence; the stored bytes are each token quantized with its own cache's
    scales."""
    import attention_kernels
    from attention_kernels import quantize_kv
    from attention_kernels.paged_reference import paged_decode_ref
    from attention_service.engine.decode_steps import _StepGraph

    g = torch.Generator().manual_seed(9)
    kp = (torch.randn(30, PAGE_TOKENS, HKV, D, generator=g) * 100).to(FP8)
    vp = (torch.randn(30, PAGE_TOKENS, HKV, D, generator=g) * 100).to(FP8)
    jobs = [_fp8_step([5, 9], seed=9, send_fp8=send_fp8, first=0),
            _fp8_step([4], seed=10, send_fp8=send_fp8, new=False, first=2, pages_from=10),
            _fp8_step([12], seed=11, send_fp8=send_fp8, first=3, pages_from=20)]
    for job, _ in jobs:
        assert job.cache is not None
        job.cache.k_pages, job.cache.v_pages = kp, vp
    plan = BatchPlan([j for j, _ in jobs])
    assert plan.seq_new_rows == [1, 1, 0, 1]
    shape = StepShape.of(plan)
    graph = _StepGraph(attention_kernels, shape, kp, vp, torch.device("cpu"), capture=None)
    staging = Staging(shape, pin=False)
    staging.fill(plan, shape)
    for j, _ in jobs:
        j.out.fill_(float("nan"))
    graph.run_staged(staging)  # what a graph replays: staging in, the work, outputs back
    staging.scatter(plan)
    for job, _ in jobs:  # each token stored with its own cache's scales
        work = job.cache
        assert work is not None and work.seq_scales is not None
        if not work.slot_pages:
            continue
        ks = torch.tensor([s[0] for s in work.seq_scales])
        want_k = job.k if send_fp8 else quantize_kv(job.k, ks)[0]
        slots = (torch.tensor(work.slot_pages), torch.tensor(work.slot_offsets))
        assert torch.equal(kp[slots].view(torch.uint8), want_k.view(torch.uint8))
    b = len(plan.seq_lens)
    table = torch.zeros(b, shape.width, dtype=torch.int32)
    for i, row in enumerate(plan.block_table):
        table[i, : len(row)] = torch.tensor(row)
    ks, vs = (torch.tensor([s[i] for s in plan.seq_scales]) for i in (0, 1))  # [b, H_kv]
    q = torch.cat([j.q for j, _ in jobs])
    ref, ref_lse = paged_decode_ref(q.double(), kp, vp, table,
                                    torch.tensor(plan.seq_lens, dtype=torch.int32),
                                    return_lse=True, k_scale=ks, v_scale=vs)
    out = graph.out[:b].double()
    assert not out.isnan().any()
    # Each job's rows came back through the staging into its own destination.
    assert torch.equal(torch.cat([j.out for j, _ in jobs]).double(), out)
    for i in range(b):  # each relative to its own norm: magnitudes differ per sequence
        err = ((out[i] - ref[i].double()).norm() / ref[i].double().norm()).item()
        assert err < 1.6e-2, (i, err)
    torch.testing.assert_close(graph.lse[:b].double(), ref_lse.double(), atol=2e-3, rtol=0)


def test_jobs_in_an_arena_pack_and_unpack_through_numpy() -> None:
    """Jobs whose tensors are spans of a front end's arena (the process group's path): fill
    packs their bytes, scatter writes each job's out/lse rows back into the arena, and no
    torch view of the arena is made on the way."""
    arena = ByteBase(torch.full((1 << 16,), 0xFF, dtype=torch.uint8))  # NaN-ish poison
    at = 0

    def place(t: torch.Tensor) -> tuple[ByteBase, int, torch.dtype, tuple[int, ...]]:
        nonlocal at
        arena.u8[at : at + t.numel() * t.element_size()] = t.reshape(-1).view(torch.uint8)
        span = (arena, at, t.dtype, tuple(t.shape))
        at += -(-t.numel() * t.element_size() // 128) * 128
        return span

    sources = [_step([5, 9], new=True, seed=11), _step([12], new=True, seed=12, pages_from=10)]
    jobs = [Job(s.params, cache=s.cache, spans={n: place(getattr(s, n)) for n in
                                                ("q", "k", "v", "out", "lse")})
            for s in sources]
    plan = BatchPlan(jobs)
    shape = StepShape.of(plan)
    staging = Staging(shape, pin=False)
    staging.fill(plan, shape)
    torch.testing.assert_close(staging.views["q"][:3], torch.cat([s.q for s in sources]))
    torch.testing.assert_close(staging.views["k"][:3], torch.cat([s.k for s in sources]))
    torch.testing.assert_close(staging.views["v"][:3], torch.cat([s.v for s in sources]))
    staging.out.copy_(torch.randn(staging.out.shape))
    staging.lse.copy_(torch.randn(staging.lse.shape))
    staging.scatter(plan)
    assert all(j._tensors[n] is None for j in jobs for n in ("q", "k", "v", "out", "lse"))
    for i, job in enumerate(jobs):
        r0, r1 = plan.rows(i)
        assert torch.equal(job.out, staging.out[r0:r1])  # views made now, for the check
        assert torch.equal(job.lse, staging.lse[r0:r1])
