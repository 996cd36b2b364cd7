"""Repeated calls reuse a checked launch set-up (``_launch``): same answers, same errors.

The reuse key must capture everything the checks and the Triton specialization read; these
tests change one such thing at a time after a call that filled the cache."""

from __future__ import annotations

import pytest
import torch
from triton import knobs

import attention_kernels.decode_kernel as dk
import attention_kernels.prefill_kernel as pk
from attention_kernels import (
    decode,
    decode_ref,
    paged_decode,
    paged_decode_ref,
    paged_prefill,
    paged_prefill_ref,
    prefill,
    prefill_ref,
)
from tests.kernels.conftest import DEVICE, ON_GPU, TOL, cu_seqlens, poison_, randn, rel_err


def _inputs(lens: list[int], dtype: torch.dtype = torch.float16, heads: int = 4,
            kv_heads: int = 2, head_dim: int = 32):
    total = sum(lens)
    return (randn(len(lens), heads, head_dim, dtype=dtype),
            randn(total, kv_heads, head_dim, dtype=dtype),
            randn(total, kv_heads, head_dim, dtype=dtype), cu_seqlens(lens))


def _check(got: torch.Tensor, q, k, v, cu) -> None:
    ref = decode_ref(q.double(), k.double(), v.double(), cu)
    assert rel_err(got, ref) < TOL[q.dtype]


def test_repeated_calls_reuse_one_plan_and_stay_correct() -> None:
    dk._PLANS.clear()
    lens = [70, 3, 0]
    for _ in range(3):  # fresh values, same signature
        q, k, v, cu = _inputs(lens)
        out = torch.empty_like(q)
        poison_(out)
        _check(decode(q, k, v, cu, num_splits=3, out=out), q, k, v, cu)
        _check(out, q, k, v, cu)
    assert len(dk._PLANS) == 1
    q, k, v, cu = _inputs([70, 3, 0])
    _check(decode(q, k, v, cu, num_splits=3), q, k, v, cu)  # no out=: a key of its own
    assert len(dk._PLANS) == 2


def test_a_changed_length_is_read_on_the_device_not_from_the_plan() -> None:
    # cu_seqlens values are not part of the key: two calls of one signature, other lengths.
    dk._PLANS.clear()
    for lens in ([60, 10], [1, 69], [0, 70]):
        q, k, v, cu = _inputs(lens)
        _check(decode(q, k, v, cu, num_splits=2), q, k, v, cu)
    assert len(dk._PLANS) == 1


def test_misaligned_views_get_their_own_specialization() -> None:
    # A view one element into its storage is 2-byte aligned: Triton compiles another variant
    # (no 16-byte alignment assumed), so the key must tell the two apart.
    lens = [40, 9]
    q, k, v, cu = _inputs(lens)
    base_q = randn(q.numel() + 1, dtype=q.dtype)
    base_k = randn(k.numel() + 1, dtype=k.dtype)
    for off in (0, 1, 0, 1):
        qq = base_q[off:off + q.numel()].view_as(q)
        kk = base_k[off:off + k.numel()].view_as(k)
        _check(decode(qq, kk, v, cu, num_splits=2), qq, kk, v, cu)


def test_bad_arguments_still_raise_after_a_good_call() -> None:
    q, k, v, cu = _inputs([20, 5])
    decode(q, k, v, cu, window_size=(1, -1), softcap=0.0)
    with pytest.raises(ValueError, match="window_size"):
        decode(q, k, v, cu, window_size=(True, -1))  # True == 1, but not an int window
    with pytest.raises(ValueError, match="softcap"):
        decode(q, k, v, cu, window_size=(1, -1), softcap=False)
    out = torch.empty_like(q)
    decode(q, k, v, cu, out=out)
    with pytest.raises(ValueError, match="out"):
        decode(q, k, v, cu, out=torch.empty(q.shape[0] + 1, *q.shape[1:], dtype=q.dtype,
                                            device=q.device))
    with pytest.raises(ValueError, match="contiguous"):
        decode(q, k, v, cu, out=torch.empty(q.shape[2], q.shape[1], q.shape[0], dtype=q.dtype,
                                            device=q.device).transpose(0, 2))
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        decode(q, k, v, cu.long())
    with pytest.raises(ValueError, match="num_splits"):
        decode(q, k, v, cu, num_splits=-1)


def test_lse_out_is_checked_with_return_lse_only() -> None:
    q, k, v, cu = _inputs([9, 12])
    lse = torch.empty(q.shape[0], q.shape[1], device=q.device)
    got, got_lse = decode(q, k, v, cu, return_lse=True, lse_out=lse)
    assert got_lse.data_ptr() == lse.data_ptr()
    with pytest.raises(ValueError, match="lse_out"):
        decode(q, k, v, cu, return_lse=True, lse_out=lse.double())
    decode(q, k, v, cu, return_lse=False, lse_out=lse.double())  # ignored, as before


def test_paged_reuse_follows_the_block_table() -> None:
    # Same signature, another page order and other lengths: the plan holds neither.
    dk._PLANS.clear()
    page, kv_heads, d = 16, 2, 32
    k_pages = randn(8, page, kv_heads, d, dtype=torch.bfloat16)
    v_pages = randn(8, page, kv_heads, d, dtype=torch.bfloat16)
    q = randn(2, 4, d, dtype=torch.bfloat16)
    for table, lens in (([[0, 1, 2], [3, 4, 5]], [40, 17]), ([[7, 6, 5], [1, 0, 2]], [3, 48])):
        tab = torch.tensor(table, dtype=torch.int32, device=DEVICE)
        sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        got = paged_decode(q, k_pages, v_pages, tab, sl, num_splits=2)
        ref = paged_decode_ref(q.double(), k_pages.double(), v_pages.double(), tab, sl)
        assert rel_err(got, ref) < TOL[torch.bfloat16]
    assert len(dk._PLANS) == 1


def test_unkeyable_arguments_take_the_checked_path_every_time() -> None:
    q, k, v, cu = _inputs([30, 4])
    dk._PLANS.clear()
    want = decode(q, k, v, cu, window_size=(7, -1))
    got = decode(q, k, v, cu, window_size=[7, -1])  # a list: accepted, never a key
    assert torch.equal(got, want) and len(dk._PLANS) == 1
    assert dk.call_key((q, "not a tensor"), (), (-1, -1)) is None


def _prefill_inputs(lens: list[int], dtype: torch.dtype = torch.float16):
    total = sum(lens)
    return (randn(total, 4, 32, dtype=dtype), randn(total, 2, 32, dtype=dtype),
            randn(total, 2, 32, dtype=dtype), cu_seqlens(lens))


@pytest.mark.parametrize("causal", [False, True])
def test_prefill_reuse_reads_lengths_on_the_device(causal: bool) -> None:
    pk._PLANS.clear()
    for lens in ([40, 9, 0], [1, 0, 48], [16, 16, 17]):  # same total, other boundaries
        q, k, v, cu = _prefill_inputs(lens)
        out = torch.empty_like(q)
        poison_(out)
        lse = torch.empty(q.shape[1], q.shape[0], device=q.device)
        poison_(lse)
        got, got_lse = prefill(q, k, v, cu, causal=causal, return_lse=True, out=out,
                               lse_out=lse)
        ref, ref_lse = prefill_ref(q.double(), k.double(), v.double(), cu, causal=causal,
                                   return_lse=True)
        assert rel_err(got, ref) < TOL[q.dtype]
        seen = ~torch.isneginf(ref_lse.cpu())
        assert torch.equal(seen, ~torch.isneginf(got_lse.cpu()))
        assert (got_lse.cpu()[seen] - ref_lse.cpu()[seen]).abs().max() < 2e-3
    assert len(pk._PLANS) == 1


def test_prefill_bad_arguments_still_raise_after_a_good_call() -> None:
    q, k, v, cu = _prefill_inputs([20, 5])
    prefill(q, k, v, cu, window_size=(3, 0), out=torch.empty_like(q))
    with pytest.raises(ValueError, match="window_size"):
        prefill(q, k, v, cu, window_size=(3, False), out=torch.empty_like(q))
    with pytest.raises(ValueError, match="out"):
        prefill(q, k, v, cu, out=torch.empty_like(q).double())
    lse = torch.empty(q.shape[1], q.shape[0], device=q.device)
    prefill(q, k, v, cu, return_lse=True, lse_out=lse)
    with pytest.raises(ValueError, match="lse_out"):
        prefill(q, k, v, cu, return_lse=True, lse_out=lse.t().contiguous())
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        prefill(q, k, v, cu[:-1].contiguous().long())


def test_paged_prefill_reuse_follows_the_block_table() -> None:
    pk._PLANS.clear()
    page = 16
    k_pages = randn(8, page, 2, 32, dtype=torch.bfloat16)
    v_pages = randn(8, page, 2, 32, dtype=torch.bfloat16)
    q = randn(10, 4, 32, dtype=torch.bfloat16)
    cu_q = cu_seqlens([6, 4])
    for table, lens in (([[0, 1, 2], [3, 4, 5]], [40, 17]), ([[7, 6, 5], [1, 0, 2]], [9, 48])):
        tab = torch.tensor(table, dtype=torch.int32, device=DEVICE)
        sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        got = paged_prefill(q, k_pages, v_pages, tab, cu_q, sl, causal=True)
        ref = paged_prefill_ref(q.double(), k_pages.double(), v_pages.double(), tab, cu_q, sl,
                                causal=True)
        assert rel_err(got, ref) < TOL[torch.bfloat16]
    assert len(pk._PLANS) == 1


def test_plan_cache_is_bounded() -> None:
    cache = dk.PlanCache(capacity=3)
    for i in range(7):
        cache.put(i, i)
        assert len(cache) <= 3
    assert cache.get(6) == 6 and cache.get(None) is None


@pytest.mark.skipif(not ON_GPU, reason="the direct launcher is the compiled kernel's")
def test_direct_launch_matches_triton_dispatch_bitwise() -> None:
    dk._PLANS.clear()
    q, k, v, cu = _inputs([4096], torch.bfloat16, 32, 8, 128)
    first = decode(q, k, v, cu)  # through Triton's dispatch: compiles, keeps the kernel
    (plan,) = dk._PLANS._plans.values()
    assert plan.launch.compiled is not None, "the first call keeps the compiled kernel"
    for _ in range(5):
        out = torch.empty_like(q)
        poison_(out)
        assert torch.equal(decode(q, k, v, cu, out=out), first)
    # A side stream: the direct launch goes on the current stream, not the default one.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        got = decode(q, k, v, cu)
    side.synchronize()
    assert torch.equal(got, first)


@pytest.mark.skipif(not ON_GPU, reason="launch hooks of compiled kernels")
def test_launch_hooks_see_every_launch() -> None:
    # A profiler's hook (e.g. proton's) must not be bypassed by the direct path.
    q, k, v, cu = _inputs([300, 20], torch.bfloat16)
    decode(q, k, v, cu)
    decode(q, k, v, cu)
    seen: list[str] = []
    hook = lambda meta: seen.append(meta.get()["name"])  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        decode(q, k, v, cu)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert seen == ["_decode_split_kernel"]


@pytest.mark.skipif(not ON_GPU, reason="the direct launcher is the compiled kernel's")
def test_prefill_direct_launch_matches_and_descriptor_launches_are_kept_per_switch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pk._PLANS.clear()
    lens = [64, 128, 64]
    q, k, v, cu = _prefill_inputs(lens, torch.bfloat16)
    first = prefill(q, k, v, cu, causal=True)
    (plan,) = pk._PLANS._plans.values()
    assert plan.launch.compiled is not None
    for _ in range(3):
        assert torch.equal(prefill(q, k, v, cu, causal=True), first)
    # A launch big enough for descriptor (TMA) loads or the Gluon kernel is kept too (made per
    # call, its host work starved the GPU at N 1K), keyed by the ATTENTION_KERNELS_TMA /
    # ATTENTION_KERNELS_GLUON switches, which it reads each call.
    n = 4096
    qb = randn(n, 16, 128, dtype=torch.bfloat16)
    kb = randn(n, 16, 128, dtype=torch.bfloat16)
    cub = cu_seqlens([n])
    big = prefill(qb, kb, kb, cub)
    assert len(pk._PLANS) == 2
    assert torch.equal(prefill(qb, kb, kb, cub), big)
    assert len(pk._PLANS) == 2
    monkeypatch.setenv("ATTENTION_KERNELS_TMA", "0")
    monkeypatch.setenv("ATTENTION_KERNELS_GLUON", "0")
    other = prefill(qb, kb, kb, cub)
    assert len(pk._PLANS) == 3
    torch.testing.assert_close(other, big, atol=2e-2, rtol=2e-2)
