"""The staged CacheDecode launch's host side (engine/decode_steps.py), without a GPU: shape
buckets, which launches take the path, the tables a launch stages (its copy table, padding rows
and slots included), and the copies those tables drive, run with the reference's memmove over
host addresses. engine/test_decode_steps_gpu.py runs it for real."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import attention_kernels
from attention_service.engine import decode_steps, paged_store
from attention_service.engine.decode_steps import (
    MAX_BATCH,
    DecodeSteps,
    Staging,
    StepShape,
    _StepGraph,
    bucket,
    places,
    step_shape,
)
from attention_service.engine.dtypes import WIRE_DTYPES
from attention_service.engine.jobs import PINNED, BatchPlan, ByteBase, CacheWork, Job
from attention_service.params import Op, make_params

H, HKV, D = 4, 2, 8
PAGE_TOKENS = 4
NAMES = ("q", "k", "v", "out", "lse")


class Arena:
    """Host memory the tests treat as page-locked (``pinned``): jobs' tensors as spans of it,
    as a step socket's frames or a front end's arena hold them."""

    def __init__(self, nbytes: int = 1 << 18, pinned: bool = True) -> None:
        self.base = ByteBase(torch.full((nbytes,), 0xFF, dtype=torch.uint8), pinned=pinned)
        self.at = 0

    def place(self, t: torch.Tensor) -> tuple[ByteBase, int, torch.dtype, tuple[int, ...]]:
        n = t.numel() * t.element_size()
        self.base.u8[self.at : self.at + n] = t.reshape(-1).view(torch.uint8)
        span = (self.base, self.at, t.dtype, tuple(t.shape))
        self.at += -(-n // 128) * 128
        return span

    def spans_of(self, job: Job) -> Job:
        """``job`` with its tensors moved into spans of this arena (outputs poisoned: 0xFF)."""
        spans = {}
        for name in NAMES:
            t = job.tensor(name)
            if t is not None:
                spans[name] = self.place(t)
        return Job(job.params, cache=job.cache, spans=spans)


def _step(seq_lens: list[int], new: bool, seed: int, pages_from: int = 0,
          arena: Arena | None = None) -> Job:
    """A CacheDecode job over caches of ``seq_lens`` keys (after its new token, if ``new``),
    its tensors spans of ``arena`` (a fresh one if None)."""
    g = torch.Generator().manual_seed(seed)
    b = len(seq_lens)
    q = torch.randn(b, H, D, generator=g)
    rows = b if new else 0
    k, v = torch.randn(rows, HKV, D, generator=g), torch.randn(rows, HKV, D, generator=g)
    params = make_params(Op.CACHE_DECODE, WIRE_DTYPES[q.dtype], tuple(q.shape), tuple(k.shape),
                         list(range(b + 1)) if new else [0] * (b + 1), None, return_lse=True,
                         cache_ids=tuple(f"c{seed}.{pages_from}.{i}" for i in range(b)))
    table, slot_pages, slot_offsets, page = [], [], [], pages_from
    for n in seq_lens:
        pages = list(range(page, page + -(-n // PAGE_TOKENS)))
        page += len(pages)
        table.append(pages)
        if new:
            slot_pages.append(pages[(n - 1) // PAGE_TOKENS])
            slot_offsets.append((n - 1) % PAGE_TOKENS)
    pool = torch.zeros(page + 1, PAGE_TOKENS, HKV, D)
    job = Job(params, q, k, v, torch.zeros_like(q), torch.zeros(b, H))
    job.cache = CacheWork(k_pages=pool, v_pages=pool, block_table=table, seq_lens=seq_lens,
                          slot_pages=slot_pages, slot_offsets=slot_offsets, flops=0, kv_bytes=0,
                          finish=lambda ok: ())
    return (arena or Arena()).spans_of(job)


def _copied(staging: Staging) -> tuple[int, int]:
    """Copy-table rows the staging's last fill wrote (inputs, outputs)."""
    ins, outs = staging.copy_rows
    return len(ins), len(outs)


def _staged(plan: BatchPlan, staging: Staging | None = None
            ) -> tuple[StepShape, _StepGraph, Staging]:
    """The plan's shape, a graph of it on the CPU (run eagerly) and a staging filled for it,
    its tables copied to the graph's as a replay's first node does."""
    where = places(plan)
    assert where is not None
    shape = step_shape(plan, where)
    work = plan.jobs[0].cache
    assert work is not None
    graph = _StepGraph(attention_kernels, shape, work.k_pages, work.v_pages,
                       torch.device("cpu"), capture=None)
    staging = staging or Staging(shape, pin=False)
    staging.fill(plan, shape, where, graph.addresses)
    graph.dev_u8.copy_(staging.u8)
    return shape, graph, staging


def test_buckets_are_powers_of_two() -> None:
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 63, 64, 65)] == [1, 1, 2, 4, 4, 8, 64, 64, 128]


def test_only_cache_decode_launches_with_keys_and_device_readable_tensors_take_the_path() -> None:
    assert places(BatchPlan([_step([5, 9], new=True, seed=0)])) is not None
    assert places(BatchPlan([_step([0], new=False, seed=0)])) is None  # no keys at all
    assert places(BatchPlan([_step([1] * (MAX_BATCH + 1), new=False, seed=0)])) is None
    job = _step([3], new=True, seed=0)
    job.params = make_params(Op.CACHE_PREFILL, job.params.dtype, (1, H, D), (1, HKV, D), [0, 1],
                             [0, 1])
    assert places(BatchPlan([job])) is None
    # Pageable host memory (a frame read when no pinned block was left): the general path.
    assert places(BatchPlan([_step([5], new=True, seed=0, arena=Arena(pinned=False))])) is None
    pageable = _step([5], new=True, seed=0)
    pageable.out = torch.zeros(1, H, D)  # one tensor given as a plain (pageable) tensor
    assert places(BatchPlan([pageable])) is None
    # Registered host memory (an arena, a shared-memory region) counts where the device
    # reads registered memory at its host address.
    arena = Arena(pinned=False)
    PINNED[arena.base.ptr] = arena.base.nbytes
    try:
        plan = BatchPlan([_step([5], new=True, seed=0, arena=arena)])
        assert places(plan) is not None and places(plan, registered=False) is None
    finally:
        PINNED.pop(arena.base.ptr)


def test_device_memory_counts_only_on_the_launching_device() -> None:
    """A span of another GPU's memory (a CUDA IPC region opened there) is not taken at its
    address: a kernel reading it needs peer access (the general path copies it)."""
    from types import SimpleNamespace

    from attention_service.engine.decode_steps import _place

    job = _step([5], new=True, seed=0)
    other = SimpleNamespace(on_device=True, u8=SimpleNamespace(device=torch.device("cuda", 1)),
                            device_readable=True, pinned=False, ptr=1 << 20)
    span = job.span("q")
    assert span is not None
    job = Job(job.params, cache=job.cache,
              spans={**{n: job.span(n) for n in NAMES}, "q": (other, *span[1:])})  # type: ignore[misc]
    assert _place(job, "q", True, torch.device("cuda", 0)) is None
    assert _place(job, "q", True, torch.device("cuda", 1)) is not None
    assert _place(job, "q", True, None) is not None  # no device named: tests without one
    assert places(BatchPlan([job]), device=torch.device("cuda", 0)) is None


def test_a_batch_is_gathered_padded_and_scattered_through_its_copy_table() -> None:
    """Three jobs in one arena (5 sequences: bucket 8, 3 new tokens: bucket 4): the gather
    puts every q and new k/v in its rows of the buffers, padding tokens repeat the first, and
    the scatter writes each job's out/lse rows into its own spans, no byte around them."""
    arena = Arena()
    jobs = [_step([5, 9], new=True, seed=1, arena=arena),
            _step([12], new=True, seed=2, pages_from=10, arena=arena),
            _step([4, 7], new=False, seed=3, pages_from=20, arena=arena)]  # no new tokens
    before = arena.base.u8.clone()
    plan = BatchPlan(jobs)
    shape, graph, staging = _staged(plan)
    assert (shape.batch, shape.width, shape.new_rows, shape.jobs, shape.unit) == (8, 4, 4, 4, 8)
    for view in staging.views.values():
        assert (view.data_ptr() - staging.u8.data_ptr()) % 128 == 0  # every field aligned
    graph.gather()
    b = graph.buf
    assert torch.equal(b["q"][:5], torch.cat([j.q for j in jobs]))
    new_k, new_v = torch.cat([j.k for j in jobs[:2]]), torch.cat([j.v for j in jobs[:2]])
    assert torch.equal(b["k"][:3], new_k) and torch.equal(b["v"][:3], new_v)
    assert torch.equal(b["k"][3], new_k[0]) and torch.equal(b["v"][3], new_v[0])  # padding
    assert staging.slots[0].tolist() == [1, 4, 12, 1]  # the padding slot repeats slot 0
    assert staging.slots[1].tolist() == [0, 0, 3, 0]
    assert staging.lens.tolist() == [5, 9, 12, 4, 7, 0, 0, 0]
    assert staging.table[0, :2].tolist() == [0, 1]
    assert staging.table[1, :3].tolist() == [2, 3, 4]
    assert staging.table[2, :3].tolist() == [10, 11, 12]
    assert staging.table[3, :1].tolist() == [20]
    graph.out.copy_(torch.randn(graph.out.shape))
    graph.lse.copy_(torch.randn(graph.lse.shape))
    graph.scatter()
    for i, job in enumerate(jobs):
        r0, r1 = plan.rows(i)
        assert torch.equal(job.out, graph.out[r0:r1])
        assert torch.equal(job.lse, graph.lse[r0:r1])
    changed = (arena.base.u8 != before).nonzero().flatten()
    spans = [job.span(n) for job in jobs for n in ("out", "lse")]
    assert all(any(s[1] <= at < s[1] + s[2].itemsize * torch.Size(s[3]).numel()  # type: ignore[index]
                   for s in spans) for at in changed.tolist())


def test_a_refill_leaves_no_stale_copy_rows() -> None:
    """A staging filled for four jobs, then for three of the same bucket: the rows the first
    fill wrote past the second's copy nothing now (length 0), so the scatter writes only the
    three jobs' outputs, none into the first launch's spans."""
    arena = Arena()
    four = BatchPlan([_step([5], new=True, seed=s, arena=arena) for s in (4, 5, 6, 7)])
    shape, graph, staging = _staged(four)
    assert _copied(staging) == (12, 8)
    three = BatchPlan([_step([5, 6], new=True, seed=8, arena=arena),
                       _step([7], new=True, seed=9, arena=arena),
                       _step([3], new=False, seed=10, arena=arena)])
    assert StepShape.of(three) == shape
    staging.fill(three, shape, places(three), graph.addresses)
    assert _copied(staging) == (9, 6)  # 7 inputs, the padding token's k and v; 3 out, 3 lse
    assert (staging.copies[9 : shape.copies_in, 2] == 0).all()
    assert (staging.copies[shape.copies_in + 6 :, 2] == 0).all()
    graph.dev_u8.copy_(staging.u8)
    for job in four.jobs:
        job.out.fill_(-1.0)
        job.lse.fill_(-1.0)
    graph.out.copy_(torch.randn(graph.out.shape))
    graph.gather()
    graph.scatter()
    assert torch.equal(graph.buf["q"], torch.cat([j.q for j in three.jobs]))
    assert torch.equal(torch.cat([j.out for j in three.jobs]), graph.out)
    assert all((j.out == -1).all() and (j.lse == -1).all() for j in four.jobs)


def test_a_staging_rewrites_its_copies_only_when_they_changed() -> None:
    """The same tensors again (a step socket's reused blocks): the copy table is left as it
    is; tensors elsewhere rewrite it."""
    arena = Arena()
    first = BatchPlan([_step([5, 9], new=True, seed=1, arena=arena)])
    shape, graph, staging = _staged(first)
    written = staging.copies.copy()
    staging.copies[:] = -1  # nothing else writes it
    again = Job(first.jobs[0].params, cache=first.jobs[0].cache,
                spans={n: first.jobs[0].span(n) for n in NAMES})  # type: ignore[misc]
    again_plan = BatchPlan([again])
    staging.fill(again_plan, shape, places(again_plan), graph.addresses)
    assert (staging.copies == -1).all()
    moved = BatchPlan([_step([5, 9], new=True, seed=2, arena=arena)])  # other spans
    staging.fill(moved, shape, places(moved), graph.addresses)
    assert (staging.copies[: _copied(staging)[0], 2] == written[: _copied(staging)[0], 2]).all()
    assert (staging.copies[: _copied(staging)[0], 0] != written[: _copied(staging)[0], 0]).all()


def test_a_staging_rewrites_its_table_only_when_it_changed() -> None:
    first = BatchPlan([_step([5, 9], new=False, seed=1)])
    _, _, staging = _staged(first)
    assert staging.table[0, :2].tolist() == [0, 1]
    assert staging.table[1, :3].tolist() == [2, 3, 4]
    staging.table[:] = -1  # the same pages again: left as it is (nothing else writes it)
    _staged(BatchPlan([_step([5, 9], new=False, seed=2)]), staging)
    assert (staging.table == -1).all()
    moved = BatchPlan([_step([5, 9], new=False, seed=3, pages_from=7)])  # other pages
    _staged(moved, staging)
    assert staging.table[0, :2].tolist() == [7, 8]
    assert staging.table[1, :3].tolist() == [9, 10, 11]
    # One cache gained a page (a new list; the other's is the same object): its row alone
    # is written.
    grown = _step([5, 13], new=False, seed=4)
    assert grown.cache is not None and moved.jobs[0].cache is not None
    kept = moved.jobs[0].cache.block_table
    grown.cache = dataclasses.replace(grown.cache, block_table=[kept[0], [*kept[1], 30]],
                                      width=-1)  # counted again
    staging.table[:] = -1
    _staged(BatchPlan([grown]), staging)
    assert staging.table[1, :4].tolist() == [9, 10, 11, 30]
    assert (staging.table[0] == -1).all() and (staging.table[2:] == -1).all()


def test_decode_steps_write_only_their_fresh_pages_past_the_same_rows() -> None:
    """A step without store on a page boundary starts a page in every row, every step (other
    pages each time with steps in flight): over the same rows (the caches' own page lists)
    a staging writes only those pages' column; over other rows, the rows and the column."""
    bases = [[0, 1], [2, 3, 4]]

    def step(seed: int, added: list[int], rows: list[list[int]]) -> Job:
        job = _step([9, 13], new=True, seed=seed)  # 3 and 4 pages of 4 tokens
        assert job.cache is not None
        job.cache = dataclasses.replace(job.cache, block_table=rows, new_pages=added,
                                        width=-1)  # its width counted again
        return job

    _, _, staging = _staged(BatchPlan([step(1, [20, 21], bases)]))
    assert staging.table[0, :3].tolist() == [0, 1, 20]
    assert staging.table[1, :4].tolist() == [2, 3, 4, 21]
    staging.table[:] = -1
    _staged(BatchPlan([step(2, [22, 23], bases)]), staging)
    expect = torch.full(staging.table.shape, -1, dtype=torch.int32).numpy()
    expect[0, 2], expect[1, 3] = 22, 23
    assert (staging.table == expect).all()
    staging.table[:] = -1  # the same pages again: nothing written
    _staged(BatchPlan([step(3, [22, 23], bases)]), staging)
    assert (staging.table == -1).all()
    _staged(BatchPlan([step(4, [-1, 24], [[0, 1, 5], [6, 7, 8]])]), staging)
    expect[:] = -1
    expect[0, :3], expect[1, :4] = [0, 1, 5], [6, 7, 8, 24]
    assert (staging.table == expect).all()
    # Merged steps carry their pages in launch order, -1 for a step without.
    a, b = step(5, [25, 26], bases), _step([9, 13], new=True, seed=6)
    assert b.cache is not None
    assert BatchPlan([a, b]).new_pages == [25, 26, -1, -1]
    assert BatchPlan([a]).table_width == 4 and BatchPlan([b]).table_width == 4
    # The width counts a fresh page only past a row that long: a shorter row's stays inside.
    assert BatchPlan([step(7, [-1, 26], [[0, 1, 2], [3]])]).table_width == 3
    assert BatchPlan([step(8, [25, -1], [[0, 1, 2], [3]])]).table_width == 4
    assert a.cache is not None and a.cache.rows() == [[0, 1, 25], [2, 3, 4, 26]]


def test_a_staging_rewrites_lengths_and_slots_only_when_they_changed() -> None:
    """A step without store repeats its lengths and slot offsets: left as they are; a list
    that changed is written (its padding too)."""
    _, _, staging = _staged(BatchPlan([_step([5, 9, 2], new=True, seed=1)]))  # 4 rows
    assert staging.lens.tolist() == [5, 9, 2, 0]
    staging.lens[:] = -1
    staging.slots[:] = -1
    _staged(BatchPlan([_step([5, 9, 2], new=True, seed=2)]), staging)
    assert (staging.lens == -1).all() and (staging.slots == -1).all()
    _staged(BatchPlan([_step([6, 9, 2], new=True, seed=3)]), staging)
    assert staging.lens.tolist() == [6, 9, 2, 0]
    assert staging.slots[1].tolist() == [1, 0, 1, 1]  # 5 % 4, 8 % 4, 1 % 4; padding: row 0's
    assert (staging.slots[0] == -1).all()  # the same pages


def test_a_page_list_is_converted_once_and_the_memo_stays_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Block-table rows (page lists never changed in place) are converted to int32 once; an
    equal list of its own gets its own array; past the bound the memo starts afresh."""
    row = [5, 6, 7]
    first = paged_store.row_array(row)
    assert paged_store.row_array(row) is first and first.tolist() == row
    twin = list(row)
    assert paged_store.row_array(twin) is not first
    monkeypatch.setattr(paged_store, "_MAX_ROW_INTS", 24)
    monkeypatch.setattr(paged_store, "_ROW_OVERHEAD", 10)
    monkeypatch.setattr(paged_store, "_row_ints", 0)
    monkeypatch.setattr(paged_store, "_row_arrays", {})
    a = paged_store.row_array([1, 2, 3])
    paged_store.row_array([])  # an empty row counts too: 13 + 10
    paged_store.row_array([4, 5])  # 23 + 12 > 24: the memo is dropped, then holds this one
    assert len(paged_store._row_arrays) == 1 and paged_store._row_ints == 12
    assert a.tolist() == [1, 2, 3]
    plan = BatchPlan([_step([5, 9], new=False, seed=1)])
    assert paged_store.block_table(plan).tolist() == [[0, 1, 0], [2, 3, 4]]


def test_padding_rows_have_no_keys() -> None:
    plan = BatchPlan([_step([7, 2, 30], new=False, seed=4)])
    shape = StepShape.of(plan)
    assert (shape.batch, shape.width, shape.new_rows) == (4, 8, 0)
    staging = Staging(shape, pin=False)
    staging.lens[:] = 99
    _staged(plan, staging)
    assert staging.lens.tolist() == [7, 2, 30, 0]


def test_more_new_tokens_than_sequences_get_their_own_bucket() -> None:
    job = _step([6], new=True, seed=7)
    # Three new tokens for the one sequence (cu_seqlens_k [0, 3]).
    k, v = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    params = make_params(Op.CACHE_DECODE, job.params.dtype, (1, H, D), (3, HKV, D), [0, 3],
                         return_lse=True)
    job = Arena().spans_of(Job(params, job.q, k, v, job.out, job.lse, cache=job.cache))
    work = job.cache
    assert work is not None
    work.slot_pages, work.slot_offsets = [0, 1, 1], [3, 0, 1]
    plan = BatchPlan([job])
    shape, graph, staging = _staged(plan)
    assert (shape.batch, shape.new_rows) == (1, 4)
    graph.gather()
    assert torch.equal(graph.buf["k"][:3], k) and torch.equal(graph.buf["k"][3], k[0])
    assert staging.slots.tolist() == [[0, 1, 1, 0], [3, 0, 1, 3]]


def test_a_misaligned_span_takes_a_smaller_unit() -> None:
    """A tensor at an address only 4-byte aligned (a region span at such an offset): the
    launch's copies move 4-byte units, in a bucket of their own, and still copy exactly."""
    arena = Arena()
    job = _step([5, 9], new=True, seed=8, arena=arena)
    base, _, dtype, dims = job.span("q")  # type: ignore[misc]
    q = job.q.clone()
    at = arena.at + 4  # past every span placed: free bytes
    moved = (base, at, dtype, dims)
    base.u8[at : at + q.numel() * 4] = q.reshape(-1).view(torch.uint8)
    job = Job(job.params, cache=job.cache,
              spans={**{n: job.span(n) for n in NAMES if n != "q"}, "q": moved})  # type: ignore[misc]
    plan = BatchPlan([job])
    shape, graph, _ = _staged(plan)
    assert shape.unit == 4 and shape != StepShape.of(plan)
    graph.gather()
    assert torch.equal(graph.buf["q"][:2], q)


def test_lse_rows_longer_than_out_rows_are_copied_whole() -> None:
    """head_dim 1 in bf16: a sequence's lse row (4 bytes a head) is twice its out row (2), so
    the output copy's grid is sized by the longer (the CPU copy refuses what the kernel's grid
    would leave out)."""
    b, h, d = 4, 64, 1
    q = torch.randn(b, h, d).bfloat16()
    empty = torch.empty(0, HKV, d).bfloat16()
    params = make_params(Op.CACHE_DECODE, WIRE_DTYPES[q.dtype], (b, h, d), (0, HKV, d),
                         [0] * (b + 1), None, return_lse=True)
    pool = torch.zeros(b, PAGE_TOKENS, HKV, d, dtype=torch.bfloat16)
    cache = CacheWork(k_pages=pool, v_pages=pool, block_table=[[i] for i in range(b)],
                      seq_lens=[3] * b, slot_pages=[], slot_offsets=[], flops=0, kv_bytes=0,
                      finish=lambda ok: ())
    job = Arena().spans_of(Job(params, q, empty, empty, torch.zeros_like(q), torch.zeros(b, h),
                               cache=cache))
    plan = BatchPlan([job])
    shape, graph, _ = _staged(plan)
    assert shape.row_bytes["lse"] == 2 * shape.row_bytes["out"]
    graph.out.copy_(torch.randn(graph.out.shape))
    graph.lse.copy_(torch.randn(graph.lse.shape))
    graph.scatter()
    assert torch.equal(job.out, graph.out) and torch.equal(job.lse, graph.lse)


class _Event:
    def __init__(self, **_: object) -> None:
        pass

    def record(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: object) -> float:
        return 0.0


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, Staging]]:
    """``DecodeSteps.launch`` on the CPU: CUDA's events and stream calls stubbed, the device
    work not run; each launch's (graph, staging) is noted in the list returned."""
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(decode_steps, "stream_ids", lambda s: (0, 0, 1))
    monkeypatch.setattr(decode_steps, "enter_stream", lambda ids: ids)
    monkeypatch.setattr(decode_steps, "leave_stream", lambda ids: None)
    ran: list[tuple[object, Staging]] = []
    monkeypatch.setattr(_StepGraph, "run_staged", lambda g, st: ran.append((g, st)))
    return ran


def test_a_launch_goes_to_the_stream_whose_staging_holds_its_table(
        launches: list[tuple[object, Staging]]) -> None:
    """Two layers' steps staged on streams 0 and 1, then each named on the other stream (a
    merged launch shifted the round robin): each runs where its table is staged, and no graph
    is made for the stream it moved off."""
    steps = DecodeSteps(attention_kernels, torch.device("cpu"), ["s0", "s1"],  # type: ignore[list-item]
                        graphs=False)
    arena = Arena(1 << 20)
    layers = [_step([40, 9], new=False, seed=1, arena=arena),
              _step([17, 70], new=False, seed=2, pages_from=30, arena=arena)]
    for layer, stream in ((0, 0), (1, 1), (0, 1), (1, 0), (0, 0)):
        steps.launch(BatchPlan([layers[layer]]), stream).wait()
    where = {id(g): i for (_, i, _), g in steps._graphs.items()}
    assert sorted(where.values()) == [0, 1]  # one graph per layer's shape, on its own stream
    assert [where[id(g)] for g, _ in launches] == [0, 1, 0, 1, 0]
    ran = launches
    assert ran[0][1] is ran[2][1] is ran[4][1] and ran[1][1] is ran[3][1]  # one staging each


def _rotation(n: int) -> tuple[DecodeSteps, list[Job]]:
    """CPU ``DecodeSteps`` on one stream, and ``n`` hosts' steps of one shape over one pool
    (as the server's caches share one), each on caches of its own."""
    steps = DecodeSteps(attention_kernels, torch.device("cpu"), ["s0"],  # type: ignore[list-item]
                        graphs=False)
    arena = Arena(1 << 20)
    hosts = [_step([40, 9], new=False, seed=h, pages_from=10 * h, arena=arena)
             for h in range(n)]
    pool = hosts[-1].cache.k_pages  # type: ignore[union-attr]
    for host in hosts:
        host.cache.k_pages = host.cache.v_pages = pool  # type: ignore[union-attr]
    return steps, hosts


def test_tables_in_rotation_each_keep_a_staging_up_to_the_cap(
        launches: list[tuple[object, Staging]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Five hosts' steps of one shape, one after another, three times over (as hosts x
    layers rotate): each host's caches get a staging of their own while the graph is under
    its cap (here 3), and then find their table written (or rewritten in the row of a cache
    that gained a page); past the cap a table takes the free staging handed out last."""
    monkeypatch.setattr(decode_steps, "_MAX_STAGINGS", 3)
    steps, hosts = _rotation(5)
    rewrites = []
    fill = Staging.fill

    def spy(st: Staging, plan: BatchPlan, *args: object) -> None:
        rewrites.append(st.table_rows is not plan.block_table)
        fill(st, plan, *args)  # type: ignore[arg-type]
        for i, row in enumerate(plan.block_table):  # it holds the rows it runs with
            assert st.table[i, : len(row)].tolist() == row

    monkeypatch.setattr(Staging, "fill", spy)
    for _ in range(3):
        for host in hosts:
            steps.launch(BatchPlan([host]), 0).wait()
    (graph,) = steps._graphs.values()
    assert graph.made == 3
    held = [launches[h][1] for h in range(5)]
    assert len({id(st) for st in held[:3]}) == 3  # one each while under the cap
    assert held[3] is held[2] and held[4] is held[3]  # then the last used, rewritten
    # Hosts 0 and 1 keep theirs: every later step of theirs finds its table written.
    for h in (0, 1):
        assert all(launches[5 * r + h][1] is held[h] for r in range(3))
        assert not any(rewrites[5 * r + h] for r in (1, 2))
    # Host 0's second cache gains a page (a new list): its own staging again, no new one,
    # and only that row is written.
    work = hosts[0].cache
    assert work is not None
    work.block_table = [work.block_table[0], [*work.block_table[1], 40]]
    monkeypatch.setattr(Staging, "fill", fill)  # the spy's check would see the poison
    held[0].table[0] = -1
    steps.launch(BatchPlan([hosts[0]]), 0).wait()
    assert launches[-1][1] is held[0] and graph.made == 3
    assert (held[0].table[0] == -1).all()
    assert held[0].table[1, : len(work.block_table[1])].tolist() == work.block_table[1]


def test_the_stagings_of_every_bucket_share_one_pinned_budget(
        launches: list[tuple[object, Staging]]) -> None:
    """Past the pinned bytes left to all graphs' stagings (here two stagings' worth), a
    rotation of four hosts makes no more: the misses share what was made."""
    steps, hosts = _rotation(4)
    plan = BatchPlan([hosts[0]])
    steps._budget.left = 2 * step_shape(plan, places(plan)).tables[1]
    for _ in range(2):
        for host in hosts:
            steps.launch(BatchPlan([host]), 0).wait()
    (graph,) = steps._graphs.values()
    assert graph.made == 2 and steps._budget.left == 0
    assert len({id(st) for _, st in launches}) == 2


# ---- FP8 caches on the staged path: its host side, and its device work run eagerly on the
# CPU (the kernels under TRITON_INTERPRET=1); test_decode_steps_gpu.py adds the CUDA graphs.

FP8 = torch.float8_e4m3fn
# Per kv head (keys, values), per sequence: caches of different scales share a launch.
SCALES = [((0.02, 0.5), (0.01, 0.04)), ((0.3, 0.001), (0.2, 0.5)), ((1.0, 1.0), (0.05, 0.05)),
          ((7.0, 0.1), (3.0, 0.002))]


def _fp8_step(seq_lens: list[int], seed: int, send_fp8: bool, new: bool = True,
              first: int = 0, pages_from: int = 0, arena: Arena | None = None) -> Job:
    """A bf16 step over an FP8 pool (random e4m3 contents; sequence i's cache has scales
    ``SCALES[first + i]``), one new token per sequence (``new``; else none), sent in bf16
    (``send_fp8`` False: the engine quantizes it with its cache's scales) or already as e4m3;
    its tensors spans of ``arena``."""
    from attention_kernels import quantize_kv

    plain = _step(seq_lens, new=new, seed=seed, pages_from=pages_from)
    g = torch.Generator().manual_seed(seed + 100)
    pages = plain.cache.k_pages.shape[0]  # type: ignore[union-attr]
    pool = (torch.randn(pages, PAGE_TOKENS, HKV, D, generator=g) * 100).to(FP8)
    scales = SCALES[first : first + len(seq_lens)]
    ks, vs = (torch.tensor([s[i] for s in scales]) for i in (0, 1))  # [batch, H_kv]
    q, k, v = plain.q.bfloat16(), plain.k.bfloat16(), plain.v.bfloat16()
    if send_fp8 and new:
        k, v = quantize_kv(k, ks)[0], quantize_kv(v, vs)[0]
    if not new:  # no tokens: empty k/v in the dtype the batch's tokens travel in
        k, v = k.to(FP8 if send_fp8 else torch.bfloat16), v.to(FP8 if send_fp8 else torch.bfloat16)
    params = make_params(Op.CACHE_DECODE, WIRE_DTYPES[q.dtype], tuple(q.shape),
                         tuple(k.shape), plain.params.cu_seqlens_k, None, return_lse=True,
                         kv_dtype=WIRE_DTYPES[k.dtype])
    work = plain.cache
    assert work is not None
    work.k_pages, work.v_pages, work.seq_scales = pool, pool.clone(), scales
    job = Job(params, q, k, v, torch.zeros_like(q), torch.zeros(len(seq_lens), H), cache=work)
    return (arena or Arena()).spans_of(job)


def test_fp8_staging_holds_scales_and_the_buffers_one_byte_keys() -> None:
    job = _fp8_step([5, 9], seed=8, send_fp8=True)
    plan = BatchPlan([job])
    assert places(plan) is not None and plan.fp8
    shape, graph, staging = _staged(plan)
    assert graph.buf["k"].dtype == FP8 and graph.buf["q"].dtype == torch.bfloat16
    graph.gather()
    assert torch.equal(graph.buf["k"][:2].view(torch.uint8), job.k.view(torch.uint8))
    scales = staging.views["scales"]  # [k/v, batch bucket, H_kv]; padding rows 1
    want = torch.tensor([[s[0] for s in SCALES[:2]], [s[1] for s in SCALES[:2]]])
    torch.testing.assert_close(scales[:, :2], want, rtol=0, atol=0)
    assert (scales[:, 2:] == 1).all()
    assert "new_scales" not in staging.views  # FP8 tokens: stored as sent
    # Caches of other scales are the same key: the same bucket, the same graph.
    other = _fp8_step([5, 9], seed=8, send_fp8=True)
    other.cache.seq_scales = [((0.5, 0.5), (0.5, 0.5))] * 2  # type: ignore[union-attr]
    assert StepShape.of(BatchPlan([other])) == StepShape.of(plan)
    plan = BatchPlan([_fp8_step([5, 9, 1], seed=8, send_fp8=False)])
    _, _, staging = _staged(plan)
    new = staging.views["new_scales"]  # one row per new token, padding repeats row 0
    assert new[0, :4, 0].tolist() == pytest.approx([0.02, 0.3, 1.0, 0.02])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "") in ("", "0"),
                    reason="runs the Triton kernels on the CPU: needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("send_fp8", [False, True])
def test_fp8_step_runs_eagerly_like_the_reference(send_fp8: bool) -> None:
    """The staged work (gather, store the new tokens, quantizing bf16 ones; paged FP8 decode;
    the outputs written to each job's spans) of a batch [job with 2 sequences and tokens, a
    token-less job, a job with a token], each sequence's cache of other scales, equals the
    float64 reference on the dequantized pool, sequence by sequence; the stored bytes are each
    token quantized with its own cache's scales."""
    from attention_kernels import quantize_kv
    from attention_kernels.paged_reference import paged_decode_ref

    g = torch.Generator().manual_seed(9)
    kp = (torch.randn(30, PAGE_TOKENS, HKV, D, generator=g) * 100).to(FP8)
    vp = (torch.randn(30, PAGE_TOKENS, HKV, D, generator=g) * 100).to(FP8)
    arena = Arena()
    jobs = [_fp8_step([5, 9], seed=9, send_fp8=send_fp8, first=0, arena=arena),
            _fp8_step([4], seed=10, send_fp8=send_fp8, new=False, first=2, pages_from=10,
                      arena=arena),
            _fp8_step([12], seed=11, send_fp8=send_fp8, first=3, pages_from=20, arena=arena)]
    for job in jobs:
        assert job.cache is not None
        job.cache.k_pages, job.cache.v_pages = kp, vp
    plan = BatchPlan(jobs)
    assert plan.seq_new_rows == [1, 1, 0, 1]
    shape, graph, staging = _staged(plan)
    graph.run_staged(staging)  # what a graph replays: tables in, the work, outputs out
    for job in jobs:  # each token stored with its own cache's scales
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
    q = torch.cat([j.q for j in jobs])
    ref, ref_lse = paged_decode_ref(q.double(), kp, vp, table,
                                    torch.tensor(plan.seq_lens, dtype=torch.int32),
                                    return_lse=True, k_scale=ks, v_scale=vs)
    out = torch.cat([j.out for j in jobs]).double()  # written into the jobs' spans
    assert not out.isnan().any()
    assert torch.equal(graph.out[:b].double(), out)
    for i in range(b):  # each relative to its own norm: magnitudes differ per sequence
        err = ((out[i] - ref[i].double()).norm() / ref[i].double().norm()).item()
        assert err < 1.6e-2, (i, err)
    lse = torch.cat([j.lse for j in jobs]).double()
    torch.testing.assert_close(lse, ref_lse.double(), atol=2e-3, rtol=0)
