"""paged_decode / paged_prefill (K/V in pages through a block table) vs the float64 reference.

The pages are built the way the server's pool builds them: one uint8 byte pool cut into pages
of a fixed byte size, K at offset 0 of a page and V right after ``page_tokens`` K rows, both
``as_strided`` views, so the page stride exceeds ``page_tokens * H_kv * D`` and K and V of a
page interleave. Pages go to sequences in shuffled order. Everything the kernels must not read
is poisoned: the whole pool starts as NaN (unused pages, the slots past a sequence's end, the
tail of each page), and the table entries past each sequence's length name a NaN page, -1 or
2**31 - 1 (an address far outside the pool).
"""

from __future__ import annotations

import math

import pytest
import torch

from attention_kernels import (
    decode,
    decode_ref,
    gather_pages,
    paged_decode,
    paged_decode_ref,
    paged_prefill,
    paged_prefill_ref,
    prefill,
    prefill_ref,
    supported_head_dim,
)
from attention_kernels.configs import DecodeConfig, PrefillConfig
from tests.kernels.conftest import (
    DEVICE,
    DTYPES,
    ON_GPU,
    TOL,
    check_lse,
    cu_seqlens,
    poison_,
    randn,
    rel_err,
)

ODD_HEAD_DIM = 40  # not a power of two (padded to 64 in the kernels)
assert supported_head_dim(ODD_HEAD_DIM)
PAGE_ALIGN = 256  # the server's pages are a multiple of 256 bytes


class Paged:
    """A paged KV cache holding ``lens`` keys per sequence, plus the same keys packed."""

    def __init__(self, lens: list[int], page_tokens: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, seed: int = 0, spare_pages: int = 3,
                 separate_v: bool = False,
                 kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                 width: int = 0) -> None:
        """``separate_v``: V in a pool of its own, with other page, token and head strides
        than K (padded heads), so a K/V stride mix-up shows. ``kv``: the packed keys and
        values to lay out (``[sum(lens), kv_heads, head_dim]`` of ``dtype``; default random).
        ``width``: at least this many table columns (the extra ones poisoned)."""
        g = torch.Generator().manual_seed(seed)
        row = kv_heads * head_dim
        # Strictly more than K + V of page_tokens tokens: every page has an unused (NaN) tail.
        page_bytes = (2 * page_tokens * row * dtype.itemsize // PAGE_ALIGN + 1) * PAGE_ALIGN
        used = [math.ceil(n / page_tokens) for n in lens]
        num_pages = sum(used) + spare_pages
        pool = torch.empty(num_pages * page_bytes, dtype=torch.uint8, device=DEVICE)
        typed = pool.view(dtype)
        typed.fill_(float("nan"))
        shape = (num_pages, page_tokens, kv_heads, head_dim)
        strides = (page_bytes // dtype.itemsize, row, head_dim, 1)
        self.k_pages = typed.as_strided(shape, strides, 0)
        self.v_pages = typed.as_strided(shape, strides, page_tokens * row)
        assert self.k_pages.stride(0) > page_tokens * row
        if separate_v:
            padded = torch.full((num_pages + 1, page_tokens, kv_heads, head_dim + 8),
                                float("nan"), dtype=dtype, device=DEVICE)
            self.v_pages = padded[1:, :, :, :head_dim]

        perm = torch.randperm(num_pages, generator=g).tolist()
        nan_page = perm.pop()  # a spare page, all NaN
        width = max(max(used, default=0) + 2, width)
        poison = [nan_page, -1, 2**31 - 1]
        table = []
        for n_pages in used:
            mine, perm = perm[:n_pages], perm[n_pages:]
            table.append(mine + [poison[i % 3] for i in range(width - n_pages)])
        self.block_table = torch.tensor(table, dtype=torch.int32, device=DEVICE).reshape(
            len(lens), width)
        self.seqlens_k = torch.tensor(lens, dtype=torch.int32, device=DEVICE)

        self.cu_k = cu_seqlens(lens)
        self.k, self.v = kv if kv is not None else (
            randn(sum(lens), kv_heads, head_dim, dtype=dtype) for _ in range(2))
        for b, n in enumerate(lens):
            k0 = int(self.cu_k[b])
            for j0 in range(0, n, page_tokens):
                page, j1 = table[b][j0 // page_tokens], min(n, j0 + page_tokens)
                self.k_pages[page, : j1 - j0] = self.k[k0 + j0 : k0 + j1]
                self.v_pages[page, : j1 - j0] = self.v[k0 + j0 : k0 + j1]

    @property
    def cache(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.k_pages, self.v_pages, self.block_table

    def double(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.k_pages.double(), self.v_pages.double(), self.block_table


def run_decode(
    lens: list[int], page_tokens: int, heads: int, kv_heads: int, head_dim: int,
    dtype: torch.dtype, num_splits: int = 0, config: DecodeConfig | None = None,
    separate_v: bool = False, width: int = 0,
) -> tuple[Paged, torch.Tensor, torch.Tensor, torch.Tensor]:
    c = Paged(lens, page_tokens, kv_heads, head_dim, dtype, separate_v=separate_v, width=width)
    q = randn(len(lens), heads, head_dim, dtype=dtype)
    out = torch.empty_like(q)
    lse = torch.empty(len(lens), heads, dtype=torch.float32, device=DEVICE)
    poison_(out)
    poison_(lse)
    got, got_lse = paged_decode(q, *c.cache, c.seqlens_k, num_splits=num_splits,
                                return_lse=True, out=out, lse_out=lse, _config=config)
    assert got.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
    ref, ref_lse = paged_decode_ref(q.double(), *c.double(), c.seqlens_k, return_lse=True)
    err = rel_err(got, ref)
    assert err < TOL[dtype], f"relative error {err:.3g} >= {TOL[dtype]:.3g}"
    empty = torch.tensor(lens) == 0
    assert (got.cpu()[empty] == 0).all(), "empty sequences give zeros"
    check_lse(got_lse, ref_lse, dtype)
    return c, q, got, got_lse


def run_prefill(
    lens_q: list[int], lens_k: list[int], page_tokens: int, heads: int, kv_heads: int,
    head_dim: int, causal: bool, dtype: torch.dtype, config: PrefillConfig | None = None,
    separate_v: bool = False,
) -> tuple[Paged, torch.Tensor, torch.Tensor, torch.Tensor]:
    c = Paged(lens_k, page_tokens, kv_heads, head_dim, dtype, separate_v=separate_v)
    cu_q = cu_seqlens(lens_q)
    q = randn(sum(lens_q), heads, head_dim, dtype=dtype)
    out = torch.empty_like(q)
    lse = torch.empty(heads, sum(lens_q), dtype=torch.float32, device=DEVICE)
    poison_(out)
    poison_(lse)
    got, got_lse = paged_prefill(q, *c.cache, cu_q, c.seqlens_k, causal=causal,
                                 return_lse=True, out=out, lse_out=lse, _config=config)
    assert got.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
    ref, ref_lse = paged_prefill_ref(q.double(), *c.double(), cu_q, c.seqlens_k, causal=causal,
                                     return_lse=True)
    if sum(lens_q):
        err = rel_err(got, ref)
        assert err < TOL[dtype], f"relative error {err:.3g} >= {TOL[dtype]:.3g}"
        empty_rows = torch.isneginf(ref_lse.cpu()).t()  # [total_q, H]: rows that see no key
        assert (got.cpu()[empty_rows] == 0).all()
    check_lse(got_lse, ref_lse, dtype)
    return c, q, got, got_lse


# Empty, one key, a partial last page, and lengths off the key-block grid (16 under the
# interpreter, 32/64 on a GPU).
DECODE_LENS = [0, 1, 23, 40, 5] if not ON_GPU else [0, 1, 23, 40, 5, 3000, 129]
PAGE_SIZES = [1, 7, 16, 64]


@pytest.mark.parametrize("page_tokens", PAGE_SIZES, ids=lambda p: f"page{p}")
@pytest.mark.parametrize("num_splits", [1, 3, 8], ids=lambda s: f"splits{s}")
def test_decode_lengths_pages_splits(page_tokens: int, num_splits: int) -> None:
    run_decode(DECODE_LENS, page_tokens, 8, 2, 64, torch.float16, num_splits)


@pytest.mark.parametrize("head_dim", [64, 128, ODD_HEAD_DIM])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_head_dims_and_dtypes(head_dim: int, dtype: torch.dtype) -> None:
    run_decode([19, 2], 16, 4, 2, head_dim, dtype, num_splits=2)


@pytest.mark.parametrize("kv_heads", [8, 2, 1], ids=["mha", "gqa4", "gqa8"])
def test_decode_gqa(kv_heads: int) -> None:
    run_decode([30, 7], 5, 8, kv_heads, 64, torch.bfloat16, num_splits=2)


def test_decode_automatic_splits_and_hint() -> None:
    c, q, got, got_lse = run_decode([50, 3, 0], 16, 4, 1, 64, torch.float32, 0)
    for hint in (1, 50, 10_000):
        out, lse = paged_decode(q, *c.cache, c.seqlens_k, max_seqlen_k=hint, return_lse=True)
        assert rel_err(out, got) < (1e-3 if ON_GPU else 1e-5)
        check_lse(lse, got_lse, torch.float16)


@pytest.mark.parametrize("page_tokens", [7, 16])
def test_decode_k_and_v_with_different_strides(page_tokens: int) -> None:
    run_decode([30, 7], page_tokens, 4, 2, 64, torch.float16, 2, separate_v=True)


def test_decode_key_block_larger_than_page() -> None:
    # 32-key blocks over 16-token pages: each block spans two pages (per-key table loads).
    run_decode([70, 33], 16, 4, 2, 64, torch.float16, 3, config=DecodeConfig(32, 4, 1))


def page_spans() -> set[int]:
    from attention_kernels import decode_kernel

    return {plan.launch.kwargs["PAGE_SPAN"] for plan in decode_kernel._PLANS._plans.values()
            if plan.launch is not None}


@pytest.mark.parametrize("page_tokens", [1, 7, 16])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("span", [0, 8], ids=["per_block", "span8"])
def test_decode_page_lookups(monkeypatch: pytest.MonkeyPatch, span: int, page_tokens: int,
                             num_splits: int) -> None:
    """Both ways a split finds its keys' pages: the table entries of its whole range at once
    (``PAGE_SPAN``; 8 here) or each block's one block ahead (ranges of more pages, or
    ``PAGE_SPAN`` 0)."""
    from attention_kernels import decode_kernel

    monkeypatch.setattr(decode_kernel, "PAGE_SPAN", span)
    decode_kernel._PLANS.clear()
    try:
        run_decode(DECODE_LENS, page_tokens, 8, 2, 64, torch.float16, num_splits)
        run_decode([5, 0, 9], page_tokens, 8, 2, 64, torch.float16, num_splits)
        assert page_spans() <= {0, span}
    finally:
        decode_kernel._PLANS.clear()


def test_decode_splits_that_fill_the_page_span(monkeypatch: pytest.MonkeyPatch) -> None:
    """Splits whose keys fill the page span exactly. On a GPU the pipelined key loop computes
    the addresses of blocks past its end as well, whose span indices then run past the span:
    before they were clamped (``_paging.block_kv_ptrs``) that gather read past its shared
    memory, an illegal address on an H100 with the real span (1024 16-token pages, 1 x 16K
    keys in one split). Under the interpreter (no look-ahead) an 8-page span checks the
    bound's arithmetic. The tables are ``Paged``'s: two columns wider than the longest
    sequence, so splits sized on the table's width hold exactly ``span`` pages."""
    from attention_kernels import decode_kernel

    span = decode_kernel.PAGE_SPAN if ON_GPU else 8
    page = 16 if ON_GPU else 8  # smaller than a key block (64 on a GPU, 16 interpreted)
    monkeypatch.setattr(decode_kernel, "PAGE_SPAN", span)
    decode_kernel._PLANS.clear()
    try:
        for lens, splits in (([(span - 2) * page], 1), ([(2 * span - 2) * page, 7], 2)):
            run_decode(lens, page, 4, 2, 128, torch.bfloat16, splits)
            assert page_spans() == {span}
            decode_kernel._PLANS.clear()
    finally:
        decode_kernel._PLANS.clear()


def test_decode_wide_table_takes_per_block_lookups() -> None:
    """A block table wider than ``PAGE_SPAN`` pages per split (its extra columns poisoned)
    takes the per-block lookups, and they read no entry past a sequence's length (pages of 7
    tokens: smaller than any key block, where spans apply)."""
    from attention_kernels import decode_kernel

    decode_kernel._PLANS.clear()
    try:
        run_decode([70, 3, 0], 7, 4, 2, 64, torch.bfloat16, 1,
                   width=decode_kernel.PAGE_SPAN + 1)
        assert page_spans() == {0}
        run_decode([70, 3, 0], 7, 4, 2, 64, torch.bfloat16, 1)
        assert page_spans() == {0, decode_kernel.PAGE_SPAN}
    finally:
        decode_kernel._PLANS.clear()


@pytest.mark.parametrize(("max_keys", "splits", "block_n", "page", "span", "want"), [
    (4096, 16, 64, 16, 1024, 1024),  # 16 pages per split
    (4096, 16, 64, 16, 16, 16),  # exactly the span
    (4096, 8, 64, 16, 16, 0),  # 32 pages: per-block lookups
    (4096, 16, 64, 7, 38, 38),  # 256 keys from any 7-token slot: up to 38 pages
    (4096, 16, 64, 7, 37, 0),
    (100, 3, 64, 1, 64, 64),  # splits rounded up to one 64-key block
    (4096, 16, 64, 64, 1024, 0),  # a block within one page: one scalar lookup per block
    (4096, 16, 32, 64, 1024, 0),
])
def test_page_span_bound(monkeypatch: pytest.MonkeyPatch, max_keys: int, splits: int,
                         block_n: int, page: int, span: int, want: int) -> None:
    from attention_kernels import decode_kernel

    monkeypatch.setattr(decode_kernel, "PAGE_SPAN", span)
    assert decode_kernel._page_span(max_keys, splits, block_n, page) == want


@pytest.mark.parametrize(("lens", "page_tokens", "splits", "tile"), [
    ([300] * 7, 16, 1, (64, 4)),  # 14 programs, one split: 3-4 per SM of the 4 SMs faked
    ([300] * 7, 64, 1, (64, 2)),  # the same over pages of 32 tokens and more: 2 warps
    ([1100], 16, 2, (64, 4)),  # splits of 550 keys: not the contiguous rule's 128-key tile
])
def test_shape_rule_on_pages(monkeypatch: pytest.MonkeyPatch, lens: list[int], page_tokens: int,
                             splits: int, tile: tuple[int, int]) -> None:
    """paged_decode takes the shape rule's one-split tile (on a faked 4-SM Hopper): 64 keys
    in 2 warps, or in 4 over pages smaller than 32 tokens (16 tokens: four per block); not the
    contiguous long-split tile; and the answer matches the reference."""
    from attention_kernels import decode_kernel
    from attention_kernels.configs import DECODE_TILE

    monkeypatch.setattr(decode_kernel, "paged_decode_config", lambda *a, **k: DECODE_TILE)
    monkeypatch.setattr(decode_kernel, "_shape_rule_sms", lambda device: 4)
    decode_kernel._PLANS.clear()
    try:
        run_decode(lens, page_tokens, 4, 2, 128, torch.bfloat16, splits)
        (plan,) = decode_kernel._PLANS._plans.values()
        kwargs = plan.launch.kwargs
        assert (kwargs["BLOCK_N"], kwargs["num_warps"]) == tile
    finally:
        decode_kernel._PLANS.clear()


@pytest.mark.parametrize(("splits", "est", "block_n", "want"), [
    (16, 4096, 64, 32),  # 4 blocks per split -> 2
    (8, 4096, 64, 16),  # 8 blocks -> 4
    (8, 8192, 128, 16),  # 8 of D 64's 128-key blocks -> 4
    (16, 16384, 64, 16),  # 16 blocks per split: long enough
    (16, 32768, 64, 16),
    (16, 2048, 64, 16),  # 2 blocks: halves would be one block
    (1, 4096, 64, 1),  # one split (many programs already)
])
def test_paged_split_count(splits: int, est: int, block_n: int, want: int) -> None:
    from attention_kernels.configs import paged_split_count

    assert paged_split_count(splits, est, block_n) == want


@pytest.mark.parametrize(("splits", "est", "block_n", "units", "want"), [
    (2, 8192, 64, 64, 4),  # 8 x 8K at 8 kv heads: 128 programs of 64 blocks -> 256
    (16, 32768, 64, 8, 32),  # 1 x 32K: 32 blocks per split
    (16, 16384, 64, 8, 32),  # 1 x 16K: 16 blocks, the least that doubles
    (16, 15360, 64, 8, 16),  # 15 blocks: neither rule
    (2, 8192, 128, 64, 4),  # D 64's 128-key blocks
    (1, 4096, 64, 128, 2),  # 16 x 4K: one split, one program per SM
    (1, 4096, 64, 256, 1),  # 32 x 4K: two programs per SM already
    (2, 8192, 64, 67, 2),  # 134 programs: more than the SMs
    (16, 8192, 64, 8, 32),  # 8 blocks: the short-split rule
])
def test_paged_split_count_one_program_per_sm(splits: int, est: int, block_n: int, units: int,
                                              want: int) -> None:
    """Where a launch would put about one program on each of 132 SMs, long splits double in
    count at an H200's DRAM bandwidth; at an H100's only the short-split rule applies."""
    from attention_kernels.configs import paged_split_count

    assert paged_split_count(splits, est, block_n, units, 132, 4800.0) == want
    h100 = splits * 2 if est // splits <= 8 * block_n else splits  # the short-split rule only
    assert paged_split_count(splits, est, block_n, units, 132, 3352.0) == h100


def test_short_paged_splits_on_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a (faked) H100 a paged 1 x 4K decode takes twice the automatic splits and
    runs them in 2 stages, and 1 x 8K in the short paged splits' tile; contiguous keys keep
    the automatic count and tile; the answers match the reference."""
    from attention_kernels import decode_kernel
    from attention_kernels.configs import (
        DECODE_TILE,
        MANY_PROGRAMS_TILE,
        SHORT_PAGED_SPLIT_TILE,
    )

    monkeypatch.setattr(decode_kernel, "paged_decode_config", lambda *a, **k: DECODE_TILE)
    monkeypatch.setattr(decode_kernel, "decode_config", lambda *a, **k: DECODE_TILE)
    monkeypatch.setattr(decode_kernel, "_shape_rule_sms", lambda device: 132)
    # An H100's automatic count at 8 kv heads (the interpreter's is at most 4).
    monkeypatch.setattr(decode_kernel, "choose_num_splits", lambda *a: 16)
    decode_kernel._PLANS.clear()
    try:
        # 2 kv heads (GQA 4): the short-split rule reads the split length alone, and the
        # interpreter runs a quarter of 8 kv heads' programs (30 -> ~8 s on a 2-core box).
        c = Paged([4000], 16, 2, 128, torch.bfloat16)
        q = randn(1, 8, 128, dtype=torch.bfloat16)
        want = paged_decode_ref(q.double(), *c.double(), c.seqlens_k)
        # The hint sizes the splits: 4K keys make splits of two 64-key blocks, 8K of four.
        for hint, paged_tile in ((4096, MANY_PROGRAMS_TILE), (8192, SHORT_PAGED_SPLIT_TILE)):
            for fn, args in ((paged_decode, (*c.cache, c.seqlens_k)),
                             (decode, (c.k, c.v, c.cu_k))):
                decode_kernel._PLANS.clear()
                got = fn(q, *args, max_seqlen_k=hint)
                assert rel_err(got, want) < TOL[torch.bfloat16]
                (plan,) = decode_kernel._PLANS._plans.values()
                splits, cfg = plan.launch.grid[0], plan.launch.kwargs
                want_splits, tile = ((32, paged_tile) if fn is paged_decode
                                     else (16, DECODE_TILE))
                assert (splits, cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"]) == (
                    want_splits, tile.block_n, tile.num_warps, tile.num_stages)
    finally:
        decode_kernel._PLANS.clear()


@pytest.mark.parametrize(("gbps", "want_splits"), [(4800.0, 32), (3352.0, 16)])
def test_long_paged_splits_by_bandwidth(monkeypatch: pytest.MonkeyPatch, gbps: float,
                                        want_splits: int) -> None:
    """On a (faked) Hopper GPU of 132 SMs a paged 1 x 16K decode (16 splits of 16 blocks,
    one program per SM) takes twice the splits at an H200's DRAM bandwidth and the automatic
    count at an H100's; contiguous keys keep the automatic count; answers match the
    reference."""
    from attention_kernels import decode_kernel
    from attention_kernels.configs import DECODE_TILE

    monkeypatch.setattr(decode_kernel, "paged_decode_config", lambda *a, **k: DECODE_TILE)
    monkeypatch.setattr(decode_kernel, "decode_config", lambda *a, **k: DECODE_TILE)
    monkeypatch.setattr(decode_kernel, "_shape_rule_sms", lambda device: 132)
    monkeypatch.setattr(decode_kernel, "_dram_gbps", lambda device: gbps)
    monkeypatch.setattr(decode_kernel, "choose_num_splits", lambda *a: 16)
    decode_kernel._PLANS.clear()
    try:
        # 2 kv heads: 32 programs, within the 132 SMs as 8 kv heads' 128 are (the rule's
        # condition), at a quarter of the interpreter's time.
        c = Paged([3000], 16, 2, 128, torch.bfloat16)
        q = randn(1, 8, 128, dtype=torch.bfloat16)
        want = paged_decode_ref(q.double(), *c.double(), c.seqlens_k)
        for fn, args, splits in ((paged_decode, (*c.cache, c.seqlens_k), want_splits),
                                 (decode, (c.k, c.v, c.cu_k), 16)):
            decode_kernel._PLANS.clear()
            got = fn(q, *args, max_seqlen_k=16384)  # the hint sizes the splits
            assert rel_err(got, want) < TOL[torch.bfloat16]
            (plan,) = decode_kernel._PLANS._plans.values()
            assert plan.launch.grid[0] == splits
    finally:
        decode_kernel._PLANS.clear()


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("page_tokens", [7, 16])
def test_decode_paged_equals_contiguous(num_splits: int, page_tokens: int) -> None:
    """Same data, same blocks and splits: the same arithmetic in the same order."""
    c, q, got, got_lse = run_decode([45, 0, 17], page_tokens, 8, 2, 64, torch.bfloat16,
                                    num_splits)
    want, want_lse = decode(q, c.k, c.v, c.cu_k, num_splits=num_splits, return_lse=True)
    if ON_GPU:  # compiled code may contract differently: one rounding of P at most
        assert rel_err(got, want) < 1e-3
        assert (got_lse - want_lse).nan_to_num(posinf=0, neginf=0).abs().max() < 1e-5
    else:
        assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


@pytest.mark.parametrize("return_lse", [False, True])
def test_decode_return_lse_flag(return_lse: bool) -> None:
    c = Paged([9, 4], 7, 2, 64, torch.float16)
    q = randn(2, 4, 64, dtype=torch.float16)
    res = paged_decode(q, *c.cache, c.seqlens_k, return_lse=return_lse)
    ref = paged_decode_ref(q.double(), *c.double(), c.seqlens_k, return_lse=return_lse)
    if return_lse:
        assert isinstance(res, tuple) and res[1].shape == (2, 4)
        check_lse(res[1], ref[1], torch.float16)
        res, ref = res[0], ref[0]
    assert isinstance(res, torch.Tensor) and rel_err(res, ref) < TOL[torch.float16]


def test_decode_no_pages_and_empty_batch() -> None:
    q = randn(2, 4, 64, dtype=torch.float16)
    pages = randn(0, 16, 2, 64, dtype=torch.float16)
    table = torch.zeros(2, 0, dtype=torch.int32, device=DEVICE)
    lens = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    out, lse = paged_decode(q, pages, pages, table, lens, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()
    out = paged_decode(q[:0], pages, pages, table[:0], lens[:0])
    assert out.shape == (0, 4, 64)


# Per sequence (q, k): q but no keys; keys but no query; equal (a fresh prompt); q longer than
# k (under causal the first rows see nothing); a short chunk after a long cached prefix that
# ends inside a page.
PREFILL_Q = [3, 0, 23, 6, 2]
PREFILL_K = [0, 9, 23, 2, 40]


@pytest.mark.parametrize("page_tokens", PAGE_SIZES, ids=lambda p: f"page{p}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_prefill_lengths_and_pages(page_tokens: int, causal: bool) -> None:
    run_prefill(PREFILL_Q, PREFILL_K, page_tokens, 4, 2, 64, causal, torch.float16)


@pytest.mark.parametrize("head_dim", [64, 128, ODD_HEAD_DIM])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_head_dims_and_dtypes(head_dim: int, dtype: torch.dtype) -> None:
    run_prefill([17, 4], [17, 30], 16, 2, 1, head_dim, True, dtype)


@pytest.mark.parametrize("kv_heads", [8, 2, 1], ids=["mha", "gqa4", "gqa8"])
def test_prefill_gqa(kv_heads: int) -> None:
    run_prefill([20, 5], [20, 33], 7, 8, kv_heads, 64, True, torch.bfloat16)


@pytest.mark.parametrize("page_tokens", [7, 16])
def test_prefill_k_and_v_with_different_strides(page_tokens: int) -> None:
    run_prefill([20, 5], [20, 33], page_tokens, 4, 2, 64, True, torch.float16, separate_v=True)


@pytest.mark.parametrize(
    "config",
    [PrefillConfig(16, 32, 4, 1), PrefillConfig(64, 64, 4, 1)],
    ids=["m16n32", "m64n64"],
)
def test_prefill_other_blocks(config: PrefillConfig) -> None:
    # n32 over 16-token pages: blocks span pages; n64 over 64-token pages: one page a block.
    page_tokens = 16 if config.block_n == 32 else 64
    run_prefill([50, 3], [60, 70], page_tokens, 2, 1, 64, True, torch.float16, config=config)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_prefill_paged_equals_contiguous(causal: bool) -> None:
    c, q, got, got_lse = run_prefill([9, 20, 0], [30, 20, 5], 7, 4, 2, 64, causal,
                                     torch.bfloat16)
    cu_q = cu_seqlens([9, 20, 0])
    want, want_lse = prefill(q, c.k, c.v, cu_q, c.cu_k, causal=causal, return_lse=True)
    if ON_GPU:
        assert rel_err(got, want) < 1e-3
    else:
        assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


def test_tables_that_are_not_contiguous() -> None:
    """A block table sliced from a wider one (row stride 3 for 2 columns) or stored column
    major: the launch copies it, and the plan takes the copy's row stride (it took the
    caller's, and a sequence read its pages from the wrong entries: a NaN page here)."""
    lens = torch.tensor([4, 7], dtype=torch.int32, device=DEVICE)
    k_pages = randn(4, 4, 2, 16, dtype=torch.float32)
    v_pages = randn(4, 4, 2, 16, dtype=torch.float32)
    k_pages[3], v_pages[3] = float("nan"), float("nan")  # a page no sequence owns
    wide = torch.tensor([[0, 3, 3], [1, 2, 3]], dtype=torch.int32, device=DEVICE)
    column_major = wide[:, :2].t().contiguous().t()
    for table in (wide[:, :2], column_major):
        assert not table.is_contiguous()
        q = randn(2, 4, 16, dtype=torch.float32)
        got = paged_decode(q, k_pages, v_pages, table, lens, num_splits=1)
        ref = paged_decode_ref(q.double(), k_pages.double(), v_pages.double(), table, lens)
        assert rel_err(got, ref) < TOL[torch.float32]
        cu_q = cu_seqlens([2, 3])
        qp = randn(5, 4, 16, dtype=torch.float32)
        got = paged_prefill(qp, k_pages, v_pages, table, cu_q, lens, causal=True)
        ref = paged_prefill_ref(qp.double(), k_pages.double(), v_pages.double(), table, cu_q,
                                lens, causal=True)
        assert rel_err(got, ref) < TOL[torch.float32]


def test_prefill_no_queries() -> None:
    c = Paged([5, 0], 16, 2, 64, torch.float16)
    q = randn(0, 4, 64, dtype=torch.float16)
    out, lse = paged_prefill(q, *c.cache, cu_seqlens([0, 0]), c.seqlens_k, return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (4, 0)


def test_prefill_no_pages() -> None:
    q = randn(5, 4, 64, dtype=torch.float16)
    pages = randn(0, 16, 2, 64, dtype=torch.float16)
    table = torch.zeros(1, 0, dtype=torch.int32, device=DEVICE)
    lens = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out, lse = paged_prefill(q, pages, pages, table, cu_seqlens([5]), lens, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_refs_equal_contiguous_refs_on_gathered_data() -> None:
    c = Paged([13, 0, 31], 5, 2, 64, torch.float32)
    k, v, cu_k = gather_pages(*c.cache, c.seqlens_k)
    assert torch.equal(k, c.k) and torch.equal(v, c.v) and torch.equal(cu_k, c.cu_k)
    assert k.is_contiguous() and cu_k.dtype == torch.int32

    q = randn(3, 4, 64, dtype=torch.float32)
    got = paged_decode_ref(q, *c.cache, c.seqlens_k, return_lse=True, softmax_scale=0.3)
    want = decode_ref(q, c.k, c.v, c.cu_k, return_lse=True, softmax_scale=0.3)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

    cu_q = cu_seqlens([4, 2, 31])
    qp = randn(37, 4, 64, dtype=torch.float32)
    got = paged_prefill_ref(qp, *c.cache, cu_q, c.seqlens_k, causal=True, return_lse=True)
    want = prefill_ref(qp, c.k, c.v, cu_q, c.cu_k, causal=True, return_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_gather_pages_validates_values() -> None:
    c = Paged([13, 4], 5, 2, 64, torch.float32)
    table = c.block_table.clone()
    table[1, 0] = c.k_pages.shape[0]  # a page past the pool, within the sequence's length
    with pytest.raises(ValueError, match="outside"):
        gather_pages(c.k_pages, c.v_pages, table, c.seqlens_k)
    longest = c.block_table.shape[1] * 5  # what a table row can hold
    too_long = torch.tensor([13, longest + 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="block_table rows hold"):
        gather_pages(c.k_pages, c.v_pages, c.block_table, too_long)


def test_bad_inputs_raise() -> None:
    c = Paged([13, 4], 5, 2, 64, torch.float16)
    kp, vp, table = c.cache
    lens = c.seqlens_k
    q = randn(2, 4, 64, dtype=torch.float16)
    cu_q = cu_seqlens([1, 1])
    decode_args = {"q": q, "k_pages": kp, "v_pages": vp, "block_table": table, "seqlens_k": lens}
    prefill_args = {**decode_args, "cu_seqlens_q": cu_q}
    strided = randn(*kp.shape[:3], 128, dtype=torch.float16)[..., ::2]  # head-dim stride 2
    bad = [
        ({"block_table": table.long()}, "block_table must be int32"),
        ({"block_table": table[:1]}, "block_table must be 2-D"),
        ({"seqlens_k": lens.long()}, "seqlens_k must be int32"),
        ({"seqlens_k": lens[:1]}, "seqlens_k must be 1-D"),
        ({"k_pages": c.k}, "k_pages must be 4-D"),
        ({"v_pages": vp.float()}, "k_pages, v_pages dtypes differ"),
        ({"k_pages": strided, "v_pages": strided}, "k_pages must have unit stride"),
        ({"q": randn(2, 4, 32, dtype=torch.float16)}, "head_dim of q"),
        ({"q": randn(2, 3, 64, dtype=torch.float16)}, "multiple of num_kv_heads"),
        ({"q": q.double(), "k_pages": kp.double(), "v_pages": vp.double()}, "float64"),
    ]
    for fn, args in ((paged_decode, decode_args), (paged_prefill, prefill_args)):
        for change, match in bad:
            with pytest.raises(ValueError, match=match):
                fn(**{**args, **change})
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode(**decode_args, num_splits=-1)
    with pytest.raises(ValueError, match="cu_seqlens_q must be int32"):
        paged_prefill(**{**prefill_args, "cu_seqlens_q": cu_q.long()})
    with pytest.raises(ValueError, match="block_table must be 2-D \\[batch=3"):
        paged_prefill(**{**prefill_args, "cu_seqlens_q": cu_seqlens([1, 1, 0])})


GUARDED_TABLE_SCRIPT = r"""
import ctypes, mmap, sys
import torch
from attention_kernels import paged_decode, paged_prefill
from tests.kernels.test_paged import Paged

# The block table ends exactly where a PROT_NONE page begins: one table read past its last
# entry (a masked-off key's page lookup) is a segfault instead of a silent read of the heap.
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
size = mmap.PAGESIZE
base = libc.mmap(None, 2 * size, mmap.PROT_READ | mmap.PROT_WRITE,
                 mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
assert base not in (None, ctypes.c_void_p(-1).value)
assert libc.mprotect(base + size, size, 0) == 0  # PROT_NONE
arena = torch.frombuffer((ctypes.c_char * size).from_address(base), dtype=torch.int32)
lens = [7, 40, 33]  # the last sequence ends inside its last page and its last key block
for page_tokens in (1, 5, 7):
    c = Paged(lens, page_tokens, 2, 64, torch.float16)
    used = -(-max(lens) // page_tokens)
    table = arena[arena.numel() - len(lens) * used:].view(len(lens), used)
    table.copy_(c.block_table[:, :used])
    q = torch.randn(len(lens), 4, 64).half()
    for splits in (1, 3):
        paged_decode(q, c.k_pages, c.v_pages, table, c.seqlens_k, num_splits=splits)
    qp = torch.randn(sum(lens), 4, 64).half()
    cu_q = torch.tensor([0, 7, 47, 80], dtype=torch.int32)
    for causal in (False, True):
        paged_prefill(qp, c.k_pages, c.v_pages, table, cu_q, c.seqlens_k, causal=causal)
print("ok")
"""


@pytest.mark.skipif(ON_GPU, reason="a guard page needs host memory (the interpreter's case)")
def test_masked_keys_never_read_the_table_past_its_end() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", GUARDED_TABLE_SCRIPT], capture_output=True,
                          text=True, timeout=300, cwd=root,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (
        f"rc {proc.returncode} (-11: a read past the block table)\n{proc.stdout}{proc.stderr}")


def test_warmup_compiles_the_paged_variants() -> None:
    from attention_kernels import warmup

    assert warmup((64,), (torch.float16,), DEVICE, with_lse=False, page_tokens=(16, 5)) > 0


@pytest.mark.skipif(not ON_GPU, reason="compiled variants exist on a GPU only")
def test_warmup_compiles_what_paged_decode_serves() -> None:
    """After ``warmup`` at D 128 with 16-token pages, paged decodes of other batch sizes,
    lengths, GQA ratios and table widths (the one-split rule's tile at 64 x 8 kv heads, the
    short-split tiles at 1 x 4K and 1 x 8K with their lengths hinted, and per-block page
    lookups included), eager or for CUDA graphs, compile nothing new."""
    import contextlib

    from attention_kernels import decode_kernel, for_cuda_graphs, warmup

    def variants() -> int:
        kernels = (decode_kernel._decode_split_kernel, decode_kernel._decode_merge_kernel)
        return sum(len(c[0]) for kernel in kernels for c in kernel.device_caches.values())

    warmup((128,), (torch.bfloat16,), DEVICE, page_tokens=(16,))
    before = variants()
    for batch, ctx, heads, kv_heads, width in ((1, 4096, 32, 8, 0), (1, 8192, 32, 8, 0),
                                               (64, 1024, 32, 8, 0),
                                               (3, 1000, 16, 2, 0), (2, 300, 32, 8, 5000)):
        # The last: a table too wide for one page span per split (per-block lookups).
        c = Paged([ctx] * batch, 16, kv_heads, 128, torch.bfloat16, width=width)
        q = randn(batch, heads, 128, dtype=torch.bfloat16)
        for lse in (False, True):
            for scope in (contextlib.nullcontext(), for_cuda_graphs()):
                with scope:
                    paged_decode(q, *c.cache, c.seqlens_k, return_lse=lse)
                    paged_decode(q, *c.cache, c.seqlens_k, return_lse=lse, max_seqlen_k=ctx)
    assert variants() == before
