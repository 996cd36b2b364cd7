"""The staged CacheDecode launch's host side (engine/decode_steps.py), without a GPU: shape
buckets, which launches take the path, and how a batch is packed into one staging buffer
(padding rows and slots included). tests/service/test_decode_steps_gpu.py runs it for real."""

from __future__ import annotations

import pytest
import torch

from attention_service.engine.backends import WIRE_DTYPES
from attention_service.engine.batch_plan import BatchPlan
from attention_service.engine.decode_steps import (
    MAX_BATCH,
    Staging,
    StepShape,
    bucket,
    eligible,
)
from attention_service.engine.jobs import CacheWork, Job
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
    shape = StepShape(second.key, 4, StepShape.of(first).width, 4)  # same bucket, fewer rows
    staging.fill(second, shape)
    assert staging.lens.tolist() == [3] * b + [0] * (4 - b)
    torch.testing.assert_close(staging.views["q"][:b], second.jobs[0].q, rtol=0, atol=0)
    assert staging.slots[0].tolist() == [0, 1, 2][:b] + [0] * (4 - b)  # one page each
    assert staging.slots[1].tolist() == [2] * 4
