"""DeviceArray: an array by address that the kernel wrappers take where they read only its
shape, dtype, device, strides and address (cu_seqlens, copy_segments' table). On a GPU each
call with DeviceArrays must give exactly what the same call with tensors gives; the
interpreter needs real tensors, so those cases run on a GPU only."""

from __future__ import annotations

import pytest
import torch

from attention_kernels import DeviceArray, decode, prefill
from attention_kernels._launch import call_key
from attention_kernels.copy_segments import copy_segments
from tests.kernels.conftest import DEVICE, ON_GPU, cu_seqlens, randn


def _of(t: torch.Tensor) -> DeviceArray:
    return DeviceArray(t.data_ptr(), tuple(t.shape), t.dtype, t.device)


def test_it_reads_as_the_tensor_it_stands_for() -> None:
    t = torch.arange(24, dtype=torch.int64).view(6, 4)
    a = _of(t)
    assert (a.shape, a.dtype, a.device, a.data_ptr()) == (t.shape, t.dtype, t.device,
                                                          t.data_ptr())
    assert a.stride() == t.stride() and a.stride(0) == 4 and a.stride(-1) == 1
    assert a.dim() == 2 and a.numel() == 24 and a.element_size() == 8 and a.is_contiguous()
    for rows in (slice(2, 5), slice(None, 3), slice(4, None), slice(5, 2), slice(-2, None)):
        part = a[rows]
        assert part.shape == t[rows].shape
        if part.shape[0]:
            assert part.data_ptr() == t[rows].data_ptr()
    with pytest.raises(TypeError):
        a[::2]
    with pytest.raises(TypeError):
        a[1]  # type: ignore[index]


def test_a_call_key_is_the_same_for_the_array_and_its_tensor() -> None:
    """A launch set-up checked once for a tensor is reused for the array, and the other way
    round: the key reads the same five facts of both."""
    t = torch.zeros(9, dtype=torch.int32)
    assert call_key((t,), (), (-1, -1)) == call_key((_of(t),), (), (-1, -1))
    assert call_key((t[1:],), (), (-1, -1)) == call_key((_of(t)[1:],), (), (-1, -1))
    assert call_key((t,), (), (-1, -1)) != call_key((_of(t)[1:],), (), (-1, -1))


gpu = pytest.mark.skipif(not ON_GPU, reason="Triton's interpreter takes tensors only")


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_and_decode_take_cu_seqlens_by_address(causal: bool) -> None:
    lens_q, lens_k = [5, 1, 70, 0], [9, 1, 70, 3]
    q = randn(sum(lens_q), 8, 64, dtype=torch.bfloat16)
    k = randn(sum(lens_k), 2, 64, dtype=torch.bfloat16)
    v = randn(sum(lens_k), 2, 64, dtype=torch.bfloat16)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    want = prefill(q, k, v, cu_q, cu_k, max_seqlen_q=70, causal=causal)
    got = torch.full_like(want, float("nan"))
    prefill(q, k, v, _of(cu_q), _of(cu_k), max_seqlen_q=70, causal=causal, out=got)
    assert torch.equal(got, want)
    qd = randn(len(lens_k), 8, 64, dtype=torch.bfloat16)
    want_d = decode(qd, k, v, cu_k)
    got_d = torch.full_like(want_d, float("nan"))
    decode(qd, k, v, _of(cu_k), out=got_d)
    assert torch.equal(got_d, want_d)


@gpu
def test_copy_segments_takes_its_table_by_address() -> None:
    src = torch.randint(0, 256, (4096,), dtype=torch.uint8, device=DEVICE)
    dst = torch.zeros(8192, dtype=torch.uint8, device=DEVICE)
    rows = [[src.data_ptr() + 64 * i, dst.data_ptr() + 256 * i, 8 + i, 0] for i in range(20)]
    table = torch.tensor(rows, dtype=torch.int64, device=DEVICE)
    copy_segments(_of(table)[5:], 8, 8 + 19)
    torch.cuda.synchronize()
    want = torch.zeros_like(dst)
    for i in range(5, 20):
        want[256 * i : 256 * i + 8 * (8 + i)] = src[64 * i : 64 * i + 8 * (8 + i)]
    assert torch.equal(dst, want)  # rows 0-4 left alone
