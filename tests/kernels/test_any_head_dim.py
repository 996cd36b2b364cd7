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
    prefill_ref,
    supported_head_dim,
)
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


def _pages(lens: list[int], head_dim: int, dtype: torch.dtype, page: int = 16
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A NaN-filled pool with each sequence's keys on shuffled pages; the table and lengths."""
    per = [-(-n // page) for n in lens]
    total = sum(per) + 2  # two pages no sequence owns
    k_pages = torch.full((total, page, 2, head_dim), float("nan"), device=DEVICE).to(dtype)
    v_pages = torch.full_like(k_pages, float("nan"))
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
            k_pages[pg, :rows] = randn(rows, 2, head_dim, dtype=dtype)
            v_pages[pg, :rows] = randn(rows, 2, head_dim, dtype=dtype)
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


@pytest.mark.skipif(DEVICE != "cuda", reason="the padding is for the GPU's vector loads")
def test_rows_not_16_aligned_are_padded_for_the_kernels() -> None:
    """``aligned_rows``: [T, H, D] with a head stride that is not a multiple of 16 becomes a
    view of a [T, H, D16] buffer with the same values; aligned ones pass through as they are."""
    from attention_kernels._launch import aligned_rows

    t = randn(5, 2, 72, dtype=torch.bfloat16)
    got = aligned_rows(t)
    assert got.shape == t.shape and got.stride() == (160, 80, 1) and torch.equal(got, t)
    ok = randn(5, 2, 80, dtype=torch.bfloat16)
    assert aligned_rows(ok) is ok
