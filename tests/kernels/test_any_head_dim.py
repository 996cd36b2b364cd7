"""Head dims that are not multiples of 8 (issue 65: flash_attn takes any up to 256): prefill,
decode, paged decode and paged prefill against the float64 reference, outputs poisoned first,
lse included. The kernels pad D to a power of two and mask the rest; rows of such dims are not
16-byte multiples, so they never take the descriptor (TMA) kernels."""

from __future__ import annotations

import pytest
import torch

from attention_kernels import (
    decode,
    decode_ref,
    paged_decode,
    paged_decode_ref,
    paged_prefill,
    paged_prefill_ref,
    prefill,
    prefill_kernel,
    prefill_ref,
    supported_head_dim,
)
from attention_kernels.configs import DecodeConfig, PrefillConfig
from tests.kernels import sm90_build
from tests.kernels.conftest import DEVICE, TOL, check_lse, cu_seqlens, poison_, randn, rel_err

# 1 and 3: below any tile; 59 and 130: odd sizes inside a padded tile; 250: near the top.
ODD_DIMS = [1, 3, 59, 130, 250]
DTYPES = [torch.bfloat16, torch.float32]


def test_every_head_dim_from_1_to_256_is_supported() -> None:
    assert all(supported_head_dim(d) for d in range(1, 257))
    assert not any(supported_head_dim(d) for d in (0, -8, 257, 264))


@pytest.mark.parametrize("head_dim", ODD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill(head_dim: int, dtype: torch.dtype) -> None:
    lens_q, lens_k = [7, 1, 12], [9, 4, 12]
    q = randn(sum(lens_q), 4, head_dim, dtype=dtype)
    k = randn(sum(lens_k), 2, head_dim, dtype=dtype)
    v = randn(sum(lens_k), 2, head_dim, dtype=dtype)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    out = torch.empty_like(q)
    poison_(out)
    got, lse = prefill(q, k, v, cu_q, cu_k, causal=True, return_lse=True, out=out)
    ref, ref_lse = prefill_ref(q.double(), k.double(), v.double(), cu_q, cu_k, causal=True,
                               return_lse=True)
    assert rel_err(got, ref) < TOL[dtype]
    check_lse(lse, ref_lse, dtype)


@pytest.mark.parametrize("head_dim", ODD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode(head_dim: int, dtype: torch.dtype) -> None:
    lens = [5, 130, 1]
    q = randn(len(lens), 4, head_dim, dtype=dtype)
    k = randn(sum(lens), 2, head_dim, dtype=dtype)
    v = randn(sum(lens), 2, head_dim, dtype=dtype)
    cu = cu_seqlens(lens)
    out = torch.empty_like(q)
    poison_(out)
    got, lse = decode(q, k, v, cu, num_splits=2, return_lse=True, out=out)
    ref, ref_lse = decode_ref(q.double(), k.double(), v.double(), cu, return_lse=True)
    assert rel_err(got, ref) < TOL[dtype]
    check_lse(lse, ref_lse, dtype)


def _pages(lens: list[int], head_dim: int, dtype: torch.dtype, page: int = 16, heads: int = 2,
           pad: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A NaN-filled pool with each sequence's keys on shuffled pages; the table and lengths.
    ``pad``: rows that many elements wider than the head dim (as a server's pool), the pads
    inf (a kernel that read one into a row would show it)."""
    per = [-(-n // page) for n in lens]
    total = sum(per) + 2  # two pages no sequence owns
    rows = torch.full((total, page, heads, head_dim + pad), float("inf"), device=DEVICE)
    k_pages, v_pages = rows.to(dtype)[..., :head_dim], rows.to(dtype)[..., :head_dim]
    k_pages.fill_(float("nan"))
    v_pages.fill_(float("nan"))
    order = torch.randperm(total)[: sum(per)].tolist()
    width = max(per)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    at = 0
    for b, (n, p) in enumerate(zip(lens, per, strict=True)):
        pages = order[at : at + p]
        at += p
        table[b, :p] = torch.tensor(pages)
        for i, pg in enumerate(pages):
            rows = min(page, n - i * page)
            k_pages[pg, :rows] = randn(rows, heads, head_dim, dtype=dtype)
            v_pages[pg, :rows] = randn(rows, heads, head_dim, dtype=dtype)
    return k_pages, v_pages, table.to(DEVICE), torch.tensor(lens, dtype=torch.int32,
                                                             device=DEVICE)


@pytest.mark.parametrize("head_dim", ODD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode(head_dim: int, dtype: torch.dtype) -> None:
    k_pages, v_pages, table, lens = _pages([20, 3, 40], head_dim, dtype)
    q = randn(3, 4, head_dim, dtype=dtype)
    out = torch.empty_like(q)
    poison_(out)
    got, lse = paged_decode(q, k_pages, v_pages, table, lens, max_seqlen_k=40, num_splits=2,
                            return_lse=True, out=out)
    ref, ref_lse = paged_decode_ref(q.double(), k_pages.double(), v_pages.double(), table,
                                    lens, return_lse=True)
    assert rel_err(got, ref) < TOL[dtype]
    check_lse(lse, ref_lse, dtype)


@pytest.mark.parametrize("head_dim", [3, 59])
def test_paged_prefill(head_dim: int) -> None:
    dtype = torch.bfloat16
    k_pages, v_pages, table, lens = _pages([20, 9], head_dim, dtype)
    lens_q = [4, 9]
    q = randn(sum(lens_q), 4, head_dim, dtype=dtype)
    cu_q = cu_seqlens(lens_q)
    got, lse = paged_prefill(q, k_pages, v_pages, table, cu_q, lens, causal=True,
                             return_lse=True)
    ref, ref_lse = paged_prefill_ref(q.double(), k_pages.double(), v_pages.double(), table,
                                     cu_q, lens, causal=True, return_lse=True)
    assert rel_err(got, ref) < TOL[dtype]
    check_lse(lse, ref_lse, dtype)


@pytest.mark.parametrize("head_dim", [3, 59])
def test_fp8_pages(head_dim: int) -> None:
    """FP8 pages (per-kv-head scales) at odd dims: paged decode against the reference on the
    same FP8 pages."""
    from attention_kernels import quantize_kv

    k_pages, v_pages, table, lens = _pages([20, 7], head_dim, torch.bfloat16)
    scale = torch.tensor([0.02, 0.05], device=DEVICE)
    k8 = quantize_kv(torch.nan_to_num(k_pages.float()), scale)[0]
    v8 = quantize_kv(torch.nan_to_num(v_pages.float()), scale)[0]
    q = randn(2, 4, head_dim, dtype=torch.bfloat16)
    got = paged_decode(q, k8, v8, table, lens, max_seqlen_k=20, k_scale=scale, v_scale=scale)
    ref = paged_decode_ref(q.double(), k8, v8, table, lens, k_scale=scale, v_scale=scale)
    assert rel_err(got, ref) < TOL[torch.bfloat16]


# Rows 144 bytes apart (D 72: the kernels mark their row pointers 16-byte aligned) and 200
# (D 100: 8-byte): on the GPU the marks decide the loads (``_launch.row_align``); a base that is
# not 16-byte aligned takes no mark.
@pytest.mark.parametrize("head_dim, offset_base", [(72, False), (100, False), (72, True)],
                         ids=["72", "100", "72-offset-base"])
def test_marked_rows(head_dim: int, offset_base: bool) -> None:
    dtype = torch.bfloat16
    lens = [70, 3, 130]

    def kv() -> torch.Tensor:
        n = sum(lens) * 2 * head_dim
        flat = randn(n + 1, dtype=dtype)
        return (flat[1:] if offset_base else flat[:n]).view(sum(lens), 2, head_dim)

    q, k, v = randn(3, 4, head_dim, dtype=dtype), kv(), kv()
    cu = cu_seqlens(lens)
    out = torch.empty_like(q)
    poison_(out)
    got = decode(q, k, v, cu, num_splits=2, out=out)
    assert rel_err(got, decode_ref(q.double(), k.double(), v.double(), cu)) < TOL[dtype]
    qp = randn(sum(lens), 4, head_dim, dtype=dtype)
    got = prefill(qp, k, v, cu, cu, causal=True)
    ref = prefill_ref(qp.double(), k.double(), v.double(), cu, cu, causal=True)
    assert rel_err(got, ref) < TOL[dtype]
    k_pages, v_pages, table, seqlens = _pages(lens, head_dim, dtype)
    got = paged_decode(q, k_pages, v_pages, table, seqlens, max_seqlen_k=130, num_splits=2)
    ref = paged_decode_ref(q.double(), k_pages.double(), v_pages.double(), table, seqlens)
    assert rel_err(got, ref) < TOL[dtype]


def test_row_align() -> None:
    """The bytes every row start is a multiple of, where Triton cannot see it itself; each
    stride counted in its own tensor's element size."""
    from attention_kernels._launch import row_align

    def rows(d: int, dtype: torch.dtype = torch.bfloat16, offset: int = 0, heads: int = 8,
             pad: int = 0) -> torch.Tensor:
        token = heads * d + pad
        flat = torch.empty(64 * token + 16, dtype=dtype)
        return flat[offset : offset + 64 * token].view(64, token)[:, : heads * d].view(
            64, heads, d)

    def align(q: torch.Tensor, k: torch.Tensor, out: torch.Tensor | None = None) -> int:
        return row_align(q, k, k, out, (*k.stride()[:2], *k.stride()[:2], None, None, None))

    for d, dtype, want in [(72, torch.bfloat16, 16), (100, torch.bfloat16, 8),
                           (40, torch.float32, 16), (59, torch.bfloat16, 0),
                           (80, torch.bfloat16, 0), (128, torch.bfloat16, 0),
                           (98, torch.bfloat16, 4)]:
        t = rows(d, dtype)
        assert t.data_ptr() % 16 == 0
        assert align(t, t) == want, (d, dtype)
    # bf16 queries of D 72 (144-byte rows), FP8 keys (72-byte rows): 8.
    assert align(rows(72), rows(72, torch.float8_e4m3fn)) == 8
    # FP8 keys of D 128 beside queries whose token stride is 8 elements past a multiple of 16:
    # every row still starts on 16 bytes (counted in elements, the queries' 8 would win).
    assert align(rows(128, heads=4, pad=8), rows(128, torch.float8_e4m3fn)) == 16
    off = rows(72, offset=1)  # a base 2 bytes past 16-byte alignment
    assert align(rows(72), off) == 0 and align(rows(72), rows(72), out=off) == 0
    pages = rows(72).view(8, 8, 8, 72)  # [pages, page tokens, H_kv, D]: strides 4608, 576, 72
    page_strides = (*pages.stride()[1:3], *pages.stride()[1:3], 8, pages.stride(0),
                    pages.stride(0))
    assert row_align(rows(72), pages, pages, None, page_strides) == 16


def test_kv_shift() -> None:
    """Which K/V layouts a program reads skewed, in whole 16-byte (or 8-byte) pieces
    (``kv_shift``): rows a constant skew past a boundary per kv head, the skew plus the head
    dim within the tile, and nothing read past the tensor's storage."""
    from attention_kernels._launch import kv_shift, kv_tile, row_align

    def shift(k: torch.Tensor, d: int, block_d: int = 0) -> int:
        from attention_kernels.configs import padded_head_dim

        pages = k.dim() == 4
        st = k.stride()[1:] if pages else k.stride()
        strides = (st[0], st[1], st[0], st[1], 1 if pages else None,
                   k.stride(0) if pages else None, k.stride(0) if pages else None)
        return kv_shift(k, k, strides, d, block_d or padded_head_dim(d))

    bf = torch.bfloat16
    assert shift(torch.empty(64, 8, 100, dtype=bf), 100) == 8  # skews 0 and 4
    assert shift(torch.empty(64, 8, 111, dtype=bf), 111) == 8  # skews 0-7
    assert shift(torch.empty(64, 8, 201, dtype=bf), 201) == 8
    assert shift(torch.empty(64, 8, 100, dtype=torch.float32), 100) == 0  # 400-byte rows
    assert shift(torch.empty(64, 8, 112, dtype=bf), 112) == 0  # whole already
    assert shift(torch.empty(64, 2, 111, dtype=bf), 111) == 0  # 444-byte tokens
    assert shift(torch.empty(64, 8, 59, dtype=bf), 59) == 0  # a skew of 7 past 64 columns
    assert shift(torch.empty(64, 8, 59, dtype=bf), 59, 128) == 8
    # 8-byte pieces (decode at many programs): D 59's skews are then up to 3, D 63's too.
    for d, piece8 in ((59, 4), (63, 0)):
        k = torch.empty(64, 8, d, dtype=bf)
        st = (*k.stride()[:2], *k.stride()[:2], None, None, None)
        assert kv_shift(k, k, st, d, 64, piece=8) == piece8
    # Decode's tile width (kv_tile): twice the padded dim where the skew does not fit it.
    for d, tile in ((59, (128, 8)), (100, (128, 8)), (64, (64, 0)), (251, (256, 0))):
        k = torch.empty(64, 8, d, dtype=bf)
        assert kv_tile(k, k, (*k.stride()[:2], *k.stride()[:2], None, None, None), d) == tile
    assert shift(torch.empty(64, 8, 60, dtype=bf), 60) == 8  # skews 0 and 4: fits 64
    fp8 = torch.empty(64, 8, 100, dtype=torch.float8_e4m3fn)
    assert shift(fp8, 100) == 16
    assert shift(torch.empty(4, 16, 8, 111, dtype=bf), 111) == 8  # pages, packed
    # The last row's piece ends past the view's extent (2 bytes short of a boundary): read
    # only where the storage holds it, as a server's pages do (rows padded to 16 bytes).
    assert shift(torch.empty(4, 16, 2, 112, dtype=bf)[..., :111], 111) == 8
    flat = torch.empty(4 * 16 * 2 * 112 - 1, dtype=bf)  # the storage ends with the last row
    assert shift(flat.as_strided((4, 16, 2, 111), (16 * 2 * 112, 2 * 112, 112, 1)), 111) == 0
    assert shift(torch.empty(64, 8, 104, dtype=bf)[..., :100], 100) == 8  # its pads: room
    assert shift(torch.empty(64 * 800 + 1, dtype=bf)[1:].view(64, 8, 100), 100) == 0  # base
    # Skewed K/V: the Q and out rows alone set the mark.
    q, k = torch.empty(64, 32, 100, dtype=bf), torch.empty(64, 8, 100, dtype=bf)
    strides = (*k.stride()[:2], *k.stride()[:2], None, None, None)
    assert row_align(q, k, k, None, strides, kv_shifted=True) == 8
    assert row_align(torch.empty(64, 32, 104, dtype=bf), k, k, None, strides,
                     kv_shifted=True) == 16


@pytest.mark.parametrize(("d", "row"), [(111, 112), (64, 68)])
def test_storage_room_keys_the_plan(d: int, row: int) -> None:
    """Two K/V views of one shape and strides (rows of 111 padded to 112; rows of 64, 68
    apart: skewed by 4), one whose storage holds the bytes past its extent, one whose storage
    ends there: the first is read skewed, the second not, each from a plan of its own, both
    against float64."""
    from attention_kernels import decode_kernel

    lens = [5, 3]
    shape, strides = (sum(lens), 8, d), (8 * row, row, 1)
    q, cu = randn(2, 16, d, dtype=torch.bfloat16), cu_seqlens(lens)
    decode_kernel._PLANS.clear()
    for spare in (row - d, 0):  # elements of storage past the last row
        k, v = (randn(sum(lens) * 8 * row - (row - d) + spare, dtype=torch.bfloat16)
                .as_strided(shape, strides) for _ in "kv")
        got = decode(q, k, v, cu)
        assert rel_err(got, decode_ref(q.double(), k.double(), v.double(), cu)) < TOL[
            torch.bfloat16]
    assert [p.launch.kwargs["KV_SHIFT"] for p in decode_kernel._PLANS._plans.values()] == [8, 0]


@pytest.mark.parametrize(("head_dim", "block_n"), [(59, None), (100, None), (111, None), (111, 32)])
def test_skewed_rows(head_dim: int, block_n: int | None) -> None:
    """K/V rows read skewed (``kv_shift``: 8 kv heads packed, rows 2 to 14 bytes past 16-byte
    boundaries; D 59: decode in 128-wide tiles, ``kv_tile``, prefill on copies padded to 64)
    in every kernel against float64, with an inf in kv head 2's keys and a NaN in its values:
    the pieces the neighbouring heads read hold them, and no other head's output may change
    (their sums end NaN, and their keys are read again with K's other columns zeroed; their V
    columns are dropped). Pages too, packed and with rows padded to 16 bytes (a server's, read
    whole with their inf pads: ``kv_room``). ``block_n`` 32: the re-read takes blocks of 16
    keys, the GPU's way (the interpreter's own 16-key blocks are not halved)."""
    dtype = torch.bfloat16
    dec = {} if block_n is None else {"_config": DecodeConfig(block_n, 4, 1)}
    pre = {} if block_n is None else {"_config": PrefillConfig(32, block_n, 4, 1)}
    lens, lens_q = [70, 3, 130], [5, 3, 17]
    ok = [h for h in range(16) if h // 2 != 2]  # query heads not of kv head 2

    def kv(n: int) -> torch.Tensor:
        t = randn(n, 8, head_dim, dtype=dtype)
        t[:, 2] = float("inf")
        return t

    def close(got: torch.Tensor, ref: torch.Tensor) -> None:
        assert not got[:, ok].isnan().any()
        assert rel_err(got[:, ok], ref[:, ok]) < TOL[dtype]

    k, v = kv(sum(lens)), kv(sum(lens))
    v[:, 2] = float("nan")
    q, cu = randn(3, 16, head_dim, dtype=dtype), cu_seqlens(lens)
    close(decode(q, k, v, cu, num_splits=2, **dec),
          decode_ref(q.double(), k.double(), v.double(), cu))
    # A window whose first key sits in the second half of a key block (70 keys: key 29 of
    # 32; 130: 89): the re-read's half blocks must not start wholly below it.
    close(decode(q, k, v, cu, num_splits=2, window_size=(40, -1), **dec),
          decode_ref(q.double(), k.double(), v.double(), cu, window_size=(40, -1)))
    qp, cu_q = randn(sum(lens_q), 16, head_dim, dtype=dtype), cu_seqlens(lens_q)
    prefill_kernel._PLANS.clear()
    close(prefill(qp, k, v, cu_q, cu, causal=True, **pre),
          prefill_ref(qp.double(), k.double(), v.double(), cu_q, cu, causal=True))
    # D 59: skews up to 7 past 64 columns; prefill reads copies padded to 64 instead.
    assert [p.pad_kv for p in prefill_kernel._PLANS._plans.values()] == [head_dim == 59]
    # Pages: packed, and (D 111) rows padded to 16 bytes as a server's; the 32-key tiles
    # only on contiguous keys (the re-read's blocks are the same code on pages).
    for pad in ((0, 1) if head_dim == 111 else (0,)) if block_n is None else ():
        k_pages, v_pages, table, seqlens = _pages([40, 3, 64], head_dim, dtype, heads=8, pad=pad)
        k_pages[:, :, 2], v_pages[:, :, 2] = float("inf"), float("nan")
        close(paged_decode(q, k_pages, v_pages, table, seqlens, max_seqlen_k=64, num_splits=2,
                           **dec),
              paged_decode_ref(q.double(), k_pages.double(), v_pages.double(), table, seqlens))
        qs = randn(sum(lens_q), 16, head_dim, dtype=dtype)
        close(paged_prefill(qs, k_pages, v_pages, table, cu_q, seqlens, causal=True, **pre),
              paged_prefill_ref(qs.double(), k_pages.double(), v_pages.double(), table, cu_q,
                                seqlens, causal=True))


@pytest.mark.parametrize("head_dim", [59, 63])
def test_many_programs_read_8_byte_pieces(monkeypatch: pytest.MonkeyPatch,
                                          head_dim: int) -> None:
    """Rows whose 16-byte skew does not fit the padded tile (D 59, 63) decode, with more
    programs than 3 per SM (a Hopper GPU of 8 SMs stood in for), at the padded width in 8-byte
    pieces (D 59: skews up to 3) against float64, with an inf in kv head 2's keys and a NaN in
    its values that no other head may see; D 63 (skews up to 3 of 4 past 64 columns) and the
    same call at fewer programs keep the 128-wide tiles."""
    from attention_kernels import decode_kernel

    monkeypatch.setattr(decode_kernel, "_shape_rule_sms", lambda device: 8)
    dtype = torch.bfloat16
    ok = [h for h in range(16) if h // 2 != 2]
    decode_kernel._PLANS.clear()
    try:  # the plans made for the stand-in GPU go with it
        for batch in (4, 3):  # 32 programs > 3 x 8; 24 are not
            lens = [70, 3, 130, 33][:batch]
            k, v = (randn(sum(lens), 8, head_dim, dtype=dtype) for _ in "kv")
            k[:, 2], v[:, 2] = float("inf"), float("nan")
            q, cu = randn(batch, 16, head_dim, dtype=dtype), cu_seqlens(lens)
            out = torch.empty_like(q)
            poison_(out)
            decode(q, k, v, cu, out=out)
            ref = decode_ref(q.double(), k.double(), v.double(), cu)
            assert not out[:, ok].isnan().any()
            assert rel_err(out[:, ok], ref[:, ok]) < TOL[dtype]
        tiles = [(p.block_d, p.launch.kwargs["KV_SHIFT"])
                 for p in decode_kernel._PLANS._plans.values()]
    finally:
        decode_kernel._PLANS.clear()
    assert tiles == ([(64, 4), (128, 8)] if head_dim == 59 else [(128, 8), (128, 8)])


def test_skewed_fp8_rows() -> None:
    """FP8 K/V rows of D 100 (100 bytes: skews of 0, 4, 8 and 12 in 16-byte pieces) decoded
    skewed against the reference on the same FP8 values."""
    from attention_kernels import quantize_kv
    from attention_kernels._launch import kv_shift

    lens = [70, 3, 130]
    scale = torch.full((8,), 0.05, device=DEVICE)
    k8, v8 = (quantize_kv(randn(sum(lens), 8, 100, dtype=torch.float32), scale)[0]
              for _ in "kv")
    strides = (*k8.stride()[:2], *k8.stride()[:2], None, None, None)
    assert kv_shift(k8, v8, strides, 100, 128) == 16
    q, cu = randn(3, 16, 100, dtype=torch.bfloat16), cu_seqlens(lens)
    got = decode(q, k8, v8, cu, num_splits=2, k_scale=scale, v_scale=scale)
    ref = decode_ref(q.double(), k8, v8, cu, k_scale=scale, v_scale=scale)
    assert rel_err(got, ref) < TOL[torch.bfloat16]


# Decode (its default tile) and causal prefill (the Hopper table's tile) at head dim D, as
# launched for sm_90a with bf16 rows packed [T, H, D]: the mark, the loads and stores the PTX
# holds, ptxas's spills. One process for both (torch and Triton load once).
_COMPILE_SM90 = r"""
import json, sys
import torch
from attention_kernels._launch import kv_shift, row_align
from attention_kernels.configs import _PREFILL_SM90, DECODE_TILE, padded_head_dim
from attention_kernels.decode_kernel import _decode_split_kernel
from attention_kernels.prefill_kernel import _prefill_kernel
from tests.kernels.sm90_build import build

got = {}
for d, kernels in (arg.split(":") for arg in sys.argv[1:]):
  heads = 32
  d = int(d)
  q = torch.empty(64, heads, d, dtype=torch.bfloat16)
  k = torch.empty(64, 8, d, dtype=torch.bfloat16)
  st = (*k.stride()[:2], *k.stride()[:2], None, None, None)
  shift = kv_shift(k, k, st, d, padded_head_dim(d))
  mark = row_align(q, k, k, None, st, shift > 0)
  rows = dict(stride_kt=8 * d, stride_kh=d, stride_vt=8 * d, stride_vh=d)
  none = ("stride_tb", "stride_kp", "stride_vp", "Table", "win_left", "cap_scale", "cap_log2",
          "Alibi", "stride_ab", "KScale", "VScale", "stride_sb", "Lse")
  common = dict(HEAD_DIM=d, BLOCK_D=padded_head_dim(d), RETURN_LSE=False, DOT_F32=False,
                PAGED=False, PAGE_TOKENS=1, HAS_WINDOW=False, HAS_SOFTCAP=False,
                HAS_ALIBI=False, KV_FP8=False, ROW_ALIGN=mark, KV_SHIFT=shift,
                **dict.fromkeys(none))
  tile = _PREFILL_SM90[(padded_head_dim(d), True)]
  builds = {
      "decode": (_decode_split_kernel, dict(
          common, BLOCK_G=16, BLOCK_N=DECODE_TILE.block_n, DIRECT=False, FUSED_MERGE=False,
          MERGE_G=1, MERGE_S=1, PDL=True, PAGE_SPAN=0),
          dict(rows, stride_qb=heads * d, stride_qh=d, stride_ob=heads * d, stride_oh=d),
          DECODE_TILE.num_warps, DECODE_TILE.num_stages),
      "prefill": (_prefill_kernel, dict(
          common, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_B=64, IS_CAUSAL=True,
          USE_TMA=False, KV_SCALED=False, WARP_SPEC=False, desc_k=None, desc_v=None,
          win_right=None, stride_lh=0, KV_PADDED=False),
          dict(rows, stride_qt=heads * d, stride_qh=d, stride_ot=heads * d, stride_oh=d),
          tile.num_warps, tile.num_stages),
  }
  ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "OutPart": "*fp32",
          "LsePart": "*fp32", "Counter": "*i32", "cu_k": "*i32", "cu_q": "*i32"}
  got[d] = {"row_align": mark, "kv_shift": shift}
  for name in kernels.split(","):
    fn, const, strides, warps, stages = builds[name]
    got[d][name] = build(fn, const, ptrs, strides, warps, stages)
print(json.dumps(got))
"""


@pytest.mark.timeout(300)
def test_d72_compiles_to_async_copies_for_sm90() -> None:
    """Decode and causal prefill at D 72 as launched (sm_90a, any machine: Triton compiles
    without a GPU and ships ptxas): the 16-byte mark gives their K/V blocks 16-byte async
    copies, Q and Out whole-row loads and stores, and no spills. Unmarked, decode compiled to
    144 two-byte loads a block and 280 bytes of spills (64x D 80's time), prefill to 320
    two-byte loads, 64 two-byte stores and 1 KB of spills. Decode at D 111, skewed
    (``kv_shift``): 16-byte async copies too, and no spills; its only element loads are Q's
    (16 a thread, once); unskewed it took 144 element loads a block and spilled 280 bytes."""
    got = sm90_build.run(_COMPILE_SM90, "72:decode,prefill", "111:decode")
    d72, d111 = got["72"], got["111"]
    assert d72["row_align"] == 16 and d72["kv_shift"] == 0, got
    for kernel in ("decode", "prefill"):
        built = d72[kernel]
        assert built["async_copies"] > 0 and built["spill_bytes"] == 0, got
        assert built["element_loads"] == built["element_stores"] == 0, got
    assert d111["kv_shift"] == 8, got
    built = d111["decode"]
    assert built["async_copies"] > 0 and built["spill_bytes"] == 0, got
    assert built["element_loads"] <= 16 and built["element_stores"] == 0, got


def test_odd_head_dims_take_short_key_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Odd head dims (loads of one element, which spilled in longer blocks) take the short key
    blocks on a GPU: decode 32 keys at padded D 128, 16 at 256; prefill 64 keys in 8 warps at
    128. Even ones keep the measured tiles. As for an H100, no GPU needed."""
    from attention_kernels import configs

    monkeypatch.setattr(configs, "_INTERPRETING", False)
    monkeypatch.setattr(configs, "_capability", lambda index: (9, 0))
    gpu = torch.device("cuda", 0)
    decode_cfg, prefill_cfg = configs.decode_config.__wrapped__, configs.prefill_config.__wrapped__
    assert decode_cfg(111, torch.bfloat16, gpu) == configs.DecodeConfig(32, 4, 3)
    assert decode_cfg(111, torch.bfloat16, gpu, True) == configs.DecodeConfig(32, 4, 3)
    assert decode_cfg(201, torch.float16, gpu) == configs.DecodeConfig(16, 4, 3)
    assert decode_cfg(112, torch.bfloat16, gpu) == configs.DECODE_TILE
    assert decode_cfg(59, torch.bfloat16, gpu) == configs.SMALL_HEAD_TILE  # no spill there
    assert decode_cfg(111, torch.float32, gpu) == configs.DecodeConfig(32, 4, 3)
    # Read skewed, in whole 16-byte pieces (``kv_shift``), they take the others' tiles.
    assert decode_cfg(111, torch.bfloat16, gpu, False, True) == configs.DECODE_TILE
    assert decode_cfg(201, torch.bfloat16, gpu, False, True) == configs.DecodeConfig(32, 4, 3)
    for many in (False, True):  # many programs took 128x64 x4 warps, which spilled more
        assert prefill_cfg(111, torch.bfloat16, True, gpu, many=many) == (
            configs.ODD_HEAD_PREFILL_TILE)
        assert prefill_cfg(112, torch.bfloat16, True, gpu, many=many).num_warps == (
            4 if many else 8)


def _fake_h200(monkeypatch: pytest.MonkeyPatch, gbps: float = 4800.0) -> None:
    """decode's plan as on an H200 (132 SMs, 4.8 TB/s): its Hopper shape rules on."""
    from attention_kernels import decode_kernel

    monkeypatch.setattr(decode_kernel, "_shape_rule_sms", lambda device: 132)
    monkeypatch.setattr(decode_kernel, "_dram_gbps", lambda device: gbps)
    decode_kernel._PLANS.clear()


def _plan_of(q: torch.Tensor, k: torch.Tensor, est: int, num_splits: int = 0,
             config: DecodeConfig | None = None, lse: bool = False,
             table: torch.Tensor | None = None, scales: tuple = (None, None)):
    from attention_kernels import decode_kernel

    return decode_kernel._plan(q, k, k, table, est, None, num_splits, lse, config, "fused",
                               (-1, -1), 0.0, None, *scales, None, None)


def _tile(plan) -> tuple[int, DecodeConfig]:
    kw = plan.launch.kwargs
    return plan.launch.grid[0], DecodeConfig(kw["BLOCK_N"], kw["num_warps"], kw["num_stages"])


@pytest.mark.parametrize(("batch", "seqlen", "splits"),
                         [(8, 4096, 8), (1, 16384, 32), (48, 4096, 2), (2, 300, 1)])
def test_wide_skewed_tiles_take_their_own_splits(monkeypatch: pytest.MonkeyPatch, batch: int,
                                                 seqlen: int, splits: int) -> None:
    """Decode tiles twice the padded head dim (D 59's skewed rows, 128 wide) on a Hopper GPU
    (its shape rules stood in for here) take ``wide_skew_split_count``'s splits (about 8
    programs per SM of 132, at least 512 keys each) in ``WIDE_SKEW_TILE``; D 64 keeps the
    usual count, and an explicit count is honoured."""
    from attention_kernels import configs, decode_kernel

    monkeypatch.setattr(decode_kernel, "_shape_rule_sms", lambda device: 132)
    monkeypatch.setattr(decode_kernel, "choose_num_splits", lambda *args: 5)

    def plan(d: int, num_splits: int = 0) -> tuple[int, int, DecodeConfig]:
        q = torch.empty(batch, 32, d, dtype=torch.bfloat16)  # a plan reads no values
        k = torch.empty(batch * seqlen, 8, d, dtype=torch.bfloat16)
        p = _plan_of(q, k, seqlen, num_splits)
        return (p.block_d, *_tile(p))

    assert plan(59) == (128, splits, configs.WIDE_SKEW_TILE)
    assert plan(64)[:2] == (64, 5)
    assert plan(59, 3) == (128, 3, configs.WIDE_SKEW_TILE)


@pytest.mark.parametrize(("batch", "seqlen", "splits"),
                         [(1, 16384, 16), (8, 8192, 8), (16, 8192, 4), (64, 4096, 1)])
def test_fast_dram_tiles_are_planned(monkeypatch: pytest.MonkeyPatch, batch: int, seqlen: int,
                                     splits: int) -> None:
    """On a faked H200 decode's plan takes ``fast_dram_decode``'s tiles and split counts:
    narrow 16-byte rows (D 40, 64) in 64-key tiles of 2 warps up to one (sequence, kv head)
    pair per SM, odd dims' skewed rows (D 111, 8 packed kv heads) in 128-key ones; D 112
    (unskewed, 128 wide), an H100's bandwidth, an explicit config and an explicit split count
    keep theirs."""
    from attention_kernels import configs

    _fake_h200(monkeypatch)

    def plan(d: int, num_splits: int = 0, config: DecodeConfig | None = None):
        q = torch.empty(batch, 32, d, dtype=torch.bfloat16)  # a plan reads no values
        k = torch.empty(batch * seqlen, 8, d, dtype=torch.bfloat16)
        return _tile(_plan_of(q, k, seqlen, num_splits, config))

    narrow = {1: 64, 8: 8, 16: 4}.get(batch)  # ~4 programs per SM, >= 4 blocks a split
    assert plan(111) == (splits, configs.SKEWED_ROWS_TILE)
    assert plan(112)[1] != configs.SKEWED_ROWS_TILE
    assert plan(40, 2, configs.TWO_WARP_TILE) == (2, configs.TWO_WARP_TILE)
    if narrow is None:  # 512 pairs: past one per SM, the older rules
        assert configs.NARROW_ROWS_TILE not in (plan(40)[1], plan(64)[1])
    else:
        assert plan(40) == plan(64) == (narrow, configs.NARROW_ROWS_TILE)
        assert plan(40, 3) == (3, configs.NARROW_ROWS_TILE)
    _fake_h200(monkeypatch, 3352.0)  # an H100 SXM: the older rules
    assert configs.NARROW_ROWS_TILE not in (plan(40)[1], plan(64)[1])
    assert plan(111)[1] != configs.SKEWED_ROWS_TILE


def test_fast_dram_tiles_stay_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the fast-DRAM rule must not take, on a faked H200 at 8 x 8K: rows off 16-byte
    boundaries (D 36: 72-byte rows; D 59 over 2 kv heads), D 59's wide tiles (8 kv heads: its
    own split count, ``wide_skew_split_count``), even dims' skewed rows (D 102: 204-byte rows,
    no span), FP8 K/V and pages."""
    from attention_kernels import configs, fp8

    _fake_h200(monkeypatch)
    rule_tiles = (configs.NARROW_ROWS_TILE, configs.SKEWED_ROWS_TILE)

    def plan(d: int, kv_heads: int = 8, group: int = 4, dtype=torch.bfloat16, **kw):
        q = torch.empty(8, kv_heads * group, d, dtype=torch.bfloat16)
        k = torch.empty(8 * 8192, kv_heads, d, dtype=dtype)
        return _plan_of(q, k, 8192, **kw)

    assert _tile(plan(36))[1] not in rule_tiles
    assert _tile(plan(59, kv_heads=2))[1] not in rule_tiles
    wide = plan(59)
    assert wide.block_d == 128 and _tile(wide) == (
        configs.wide_skew_split_count(64, 8192, 132), configs.WIDE_SKEW_TILE)
    skewed_even = plan(102)
    assert skewed_even.launch.kwargs["KV_SHIFT"] and _tile(skewed_even)[1] not in rule_tiles
    scales = (torch.ones(8), torch.ones(8))
    for d in (40, 111):
        assert _tile(plan(d, dtype=fp8.FP8_DTYPE, scales=scales))[1] not in rule_tiles
        pages = torch.empty(64, 64, 8, d, dtype=torch.bfloat16)
        table = torch.zeros(8, 128, dtype=torch.int32)
        q = torch.empty(8, 32, d, dtype=torch.bfloat16)
        assert _tile(_plan_of(q, pages, 8192, table=table))[1] not in rule_tiles


@pytest.mark.parametrize(("head_dim", "kv_heads"), [(40, 2), (111, 8)])
def test_fast_dram_tiles_match_the_reference(monkeypatch: pytest.MonkeyPatch, head_dim: int,
                                             kv_heads: int) -> None:
    """decode through the rule's automatic tiles and splits on a faked H200 (D 40: narrow
    rows, 8 splits; D 111 over 8 packed kv heads: skewed rows, 2 splits) against float64,
    outputs poisoned first, with an empty sequence and lengths off the key blocks."""
    from attention_kernels import decode_kernel

    _fake_h200(monkeypatch)
    dtype = torch.bfloat16
    lens = [700, 0, 1030]
    q = randn(3, kv_heads * 2, head_dim, dtype=dtype)
    k, v = (randn(sum(lens), kv_heads, head_dim, dtype=dtype) for _ in "kv")
    cu = cu_seqlens(lens)
    out = torch.empty_like(q)
    poison_(out)
    try:
        got = decode(q, k, v, cu, max_seqlen_k=2048, out=out)
        (plan,) = decode_kernel._PLANS._plans.values()
        assert plan.launch.grid[0] == (8 if head_dim == 40 else 2)
        assert plan.launch.kwargs["BLOCK_N"] == (64 if head_dim == 40 else 128)
        assert rel_err(got, decode_ref(q.double(), k.double(), v.double(), cu)) < TOL[dtype]
    finally:
        decode_kernel._PLANS.clear()


@pytest.mark.parametrize(("head_dim", "kv_heads"), [(40, 8), (48, 8), (64, 8), (40, 2),
                                                    (111, 8), (111, 16)])
def test_fast_dram_warmup_makes_the_rule_variants(monkeypatch: pytest.MonkeyPatch,
                                                  head_dim: int, kv_heads: int) -> None:
    """Every variant the rule plans for real calls (groups 1-8, lse or not, 1-16 sequences
    of 300-16K keys) is one the warm-up's calls plan too: the same constexprs and the same
    divisibility by 16 of the integer arguments (Triton specializes on it)."""
    from attention_kernels import configs, kernel_warmup

    _fake_h200(monkeypatch)
    monkeypatch.setattr(kernel_warmup, "fast_dram", lambda device: True)

    def variant(plan) -> tuple:  # the first 8 scalars: the strides Triton specializes on
        ints = tuple((x % 16 == 0, x == 1) for x in plan.scalars[:8])
        return tuple(sorted(plan.launch.kwargs.items())), ints

    warm = set()
    for call in kernel_warmup._fast_dram_decodes(head_dim, torch.bfloat16, torch.device("cpu"),
                                                 (False, True), []):
        q, k, _, cu = call.args
        warm.add(variant(_plan_of(q, k, -(-k.shape[0] // q.shape[0]), call.keywords[
            "num_splits"], call.keywords["_config"], call.keywords["return_lse"])))
    rule_tiles = (configs.NARROW_ROWS_TILE, configs.SKEWED_ROWS_TILE)
    planned = 0
    for group in (1, 2, 4, 8):
        for batch, seqlen in ((1, 16384), (8, 8192), (16, 8192), (1, 300), (2, 100)):
            for lse in (False, True):
                q = torch.empty(batch, kv_heads * group, head_dim, dtype=torch.bfloat16)
                k = torch.empty(batch * seqlen, kv_heads, head_dim, dtype=torch.bfloat16)
                plan = _plan_of(q, k, seqlen, lse=lse)
                if _tile(plan)[1] in rule_tiles:
                    planned += 1
                    assert variant(plan) in warm, (group, batch, seqlen, lse)
    assert planned


def test_fast_dram_rule() -> None:
    """``fast_dram_decode`` at its measured points (132 SMs) and where it does not apply."""
    from attention_kernels.configs import NARROW_ROWS_TILE, SKEWED_ROWS_TILE, fast_dram_decode

    for units, keys, narrow, skewed in ((8, 16384, 64, 16), (64, 8192, 8, 8),
                                        (128, 8192, 4, 4), (132, 8192, 4, 4), (8, 300, 1, 1),
                                        (133, 8192, None, 4), (512, 4096, None, 1),
                                        (1024, 2048, None, 1)):
        got = fast_dram_decode(units, keys, 132, 40, 64, False, True)
        assert got == (None if narrow is None else (NARROW_ROWS_TILE, narrow))
        assert fast_dram_decode(units, keys, 132, 111, 128, True, False) == (
            SKEWED_ROWS_TILE, skewed)
    for d, block_d, skewed, rows16 in ((40, 64, True, True), (40, 64, False, False),
                                       (59, 128, True, False), (100, 128, True, False),
                                       (112, 128, False, True), (201, 256, True, False),
                                       (32, 32, False, True), (24, 64, False, True)):
        assert fast_dram_decode(64, 8192, 132, d, block_d, skewed, rows16) is None


@pytest.mark.skipif(DEVICE != "cuda", reason="the odd-dim tiles are the GPU's (the interpreter "
                    "takes its own small tiles)")
@pytest.mark.parametrize("head_dim", [111, 201])
def test_odd_head_tiles(head_dim: int) -> None:
    """Odd dims in their short-block tiles (``configs.ODD_HEAD_TILES``,
    ``ODD_HEAD_PREFILL_TILE``) against float64: decode with many splits, causal prefill over
    several key blocks."""
    dtype = torch.bfloat16
    lens = [300, 1, 517]
    q, k, v = (randn(3, 8, head_dim, dtype=dtype), randn(sum(lens), 2, head_dim, dtype=dtype),
               randn(sum(lens), 2, head_dim, dtype=dtype))
    cu = cu_seqlens(lens)
    out = torch.empty_like(q)
    poison_(out)
    got = decode(q, k, v, cu, out=out)
    assert rel_err(got, decode_ref(q.double(), k.double(), v.double(), cu)) < TOL[dtype]
    qp = randn(sum(lens), 8, head_dim, dtype=dtype)
    got = prefill(qp, k, v, cu, cu, causal=True)
    ref = prefill_ref(qp.double(), k.double(), v.double(), cu, cu, causal=True)
    assert rel_err(got, ref) < TOL[dtype]
